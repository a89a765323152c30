"""Property-based fuzzing of ``pretrain_gpt`` command lines with mHC, at the argument level
(Megatron's parser and validate_args, the MHCTransformerConfig built from the flags, the model
guards; nothing is trained): the only outcomes are success or a one-line problem, never an
exception escaping (a traceback for the user). CI runs a few dozen examples; a soak run:

    MEGATRON_EXT_FUZZ_EXAMPLES=2000 python -m pytest tests/unit_tests/recipes/test_fuzz_pretrain_flags.py
"""

from __future__ import annotations

import collections
import os

import pytest

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings, strategies as st  # noqa: E402

from megatron_ext.recipes.validate import argv_problems  # noqa: E402

EXAMPLES = int(os.environ.get("MEGATRON_EXT_FUZZ_EXAMPLES", "12"))
FUZZ = settings(
    max_examples=EXAMPLES,
    deadline=None,
    derandomize=not os.environ.get("MEGATRON_EXT_FUZZ_EXAMPLES"),
    suppress_health_check=[HealthCheck.too_slow],
)

# fmt: off
BASE = ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
        "--max-position-embeddings", "32", "--micro-batch-size", "2", "--global-batch-size", "8",
        "--train-iters", "2", "--lr", "1e-3", "--mock-data", "--tokenizer-type", "NullTokenizer",
        "--vocab-size", "128"]
# fmt: on
sizes = st.sampled_from(["-1", "0", "1", "2", "3", "4", "8", "x", "1.5", "1e9"])
flags = st.one_of(
    st.tuples(st.just("--enable-mhc-connections")),
    st.tuples(
        st.sampled_from(
            [
                "--mhc-num-residual-streams",
                "--num-residual-streams",
                "--mhc-sinkhorn-iterations",
                "--mhc-recompute-layer-num",
                "--pipeline-model-parallel-size",
                "--tensor-model-parallel-size",
                "--num-layers",
                "--hidden-size",
                "--num-attention-heads",
                "--mtp-num-layers",
                "--micro-batch-size",
                "--virtual-pipeline-model-parallel-size",
                "--num-layers-per-virtual-pipeline-stage",
                "--context-parallel-size",
                "--seq-length",
            ]
        ),
        sizes,
    ),
    st.tuples(
        st.just("--mhc-init-gating-factor"), st.sampled_from(["0.01", "0", "-1", "nan", "inf", "x"])
    ),
    st.tuples(st.just("--recompute-granularity"), st.sampled_from(["selective", "full", "bogus"])),
    st.tuples(
        st.just("--recompute-modules"), st.sampled_from(["mhc", "mlp", "core_attn", "mhc mlp"])
    ),
    st.tuples(
        st.sampled_from(
            [
                "--sequence-parallel",
                "--mhc-learned-output-contract",
                "--bf16",
                "--fp16",
                "--untie-embeddings-and-output-weights",
                "--enable-hyper-connections",
            ]
        )
    ),
    st.tuples(
        st.just("--pipeline-model-parallel-layout"), st.sampled_from(["E|tt|tt|L", "Ett|ttL", "x|"])
    ),
)
outcomes: collections.Counter = collections.Counter()


@FUZZ
@given(st.lists(flags, min_size=1, max_size=5), st.sampled_from([1, 2, 4]))
def test_pretrain_gpt_flags_give_success_or_one_line_problem(chosen, world_size):
    argv = list(BASE)
    for flag in chosen:
        argv += [
            part
            for word in flag
            for part in (word.split() if word.startswith(("mhc ",)) else [word])
        ]
    problems = argv_problems(
        argv, "megatron_ext.pretrain_gpt", world_size
    )  # any exception fails the test
    assert len(problems) <= 1 and all("\n" not in str(p) and str(p).strip() for p in problems), (
        problems
    )
    outcomes["problem" if problems else "ok"] += 1


def test_report_cases_run():
    print(f"\npretrain_gpt flag fuzzing: {sum(outcomes.values())} cases, {dict(outcomes)}")


def test_the_entry_reports_megatrons_failed_check_in_one_line():
    """What `python -m megatron_ext.pretrain_gpt` prints when validate_args asserts."""
    from megatron_ext import pretrain_gpt
    from megatron_ext.launch import training
    from megatron_ext.recipes.validate import _as_rank_zero_of, _device_architecture_without_gpu

    argv = BASE + ["--hidden-size", "66"]  # not divisible by 4 heads
    with (
        _as_rank_zero_of(1, argv),
        _device_architecture_without_gpu(),
        pytest.raises(SystemExit) as raised,
    ):
        training.parse_megatron_args(
            extra_args_providers=(pretrain_gpt.add_megatron_ext_args,),
            parser_defaults=training.machine_defaults(on_cpu=True),
        )
    message = str(raised.value.code)
    assert message.startswith("error: Megatron's argument checks: ") and "\n" not in message, (
        message
    )
