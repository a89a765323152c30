"""Property-based fuzzing of every command that reads user input without training: validate,
import, compare, convert-checkpoint, schedule and submit --dry-run, run in-process through
``megatron_ext.cli.main``. The only outcomes are an exit status (argparse's usage error
included) with at most a one-line message from megatron-ext, never an exception escaping (a
traceback for the user) and never a hang (each call is bounded by SIGALRM). CI runs a few
examples per tool; a soak run raises the count:

    MEGATRON_EXT_FUZZ_EXAMPLES=2000 python -m pytest tests/unit_tests/cli/test_fuzz_tools.py
"""

from __future__ import annotations

import contextlib
import json
import os
import signal

import pytest
import yaml

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings, strategies as st  # noqa: E402

from megatron_ext import cli  # noqa: E402

from recipe_texts import MINIMAL  # noqa: E402

EXAMPLES = int(os.environ.get("MEGATRON_EXT_FUZZ_EXAMPLES", "8"))
FUZZ = settings(
    max_examples=EXAMPLES,
    deadline=None,
    derandomize=not os.environ.get("MEGATRON_EXT_FUZZ_EXAMPLES"),
    suppress_health_check=[
        HealthCheck.function_scoped_fixture,
        HealthCheck.too_slow,
        HealthCheck.data_too_large,
    ],
)
HANG_S = 120  # one call of a tool on one input; a loaded 2-core machine included


class Hang(Exception):
    pass


@contextlib.contextmanager
def _bounded():
    def ring(signum, frame):
        raise Hang(f"a tool ran for more than {HANG_S} s on one input")

    previous = signal.signal(signal.SIGALRM, ring)
    signal.alarm(HANG_S)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def _tool(capsys, argv: list[str]) -> int:
    """Run one command; fail on an escaping exception, a hang, or a multi-line error."""
    with _bounded():
        try:
            status = cli.main(argv)
        except SystemExit as exc:  # argparse's usage error: one usage line and one error line
            status = exc.code if isinstance(exc.code, int) else 2
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    ours = [line for line in err.splitlines() if line.startswith("megatron-ext ")]
    assert len(ours) <= 1, ours
    assert isinstance(status, int), status
    return status


# ---- shared value strategies -----------------------------------------------------------------
text = st.text(max_size=20)
words = st.sampled_from(
    ["", " ", "-1", "0", "1", "2", "4", "1e18", "nan", "inf", ".nan", "x", "[1, 2", "{a: b}",
     "\x00", "é", "UNLIMITED", "00:30:00", "ab:cd", "/nonexistent/x", "~", "a=b", "--flag"]
)  # fmt: skip
numbers = st.one_of(
    st.integers(-(2**40), 2**40),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([0, 1, 2, 3, 4, 8, 10**18, -1]),
)
scalars = st.one_of(st.none(), st.booleans(), numbers, text, words)
json_values = st.recursive(
    scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4), st.dictionaries(st.one_of(text, words), inner, max_size=4)
    ),
    max_leaves=12,
)
int_args = st.one_of(st.integers(-3, 70), st.integers(-(2**40), 2**40), words)


# ---- validate ----------------------------------------------------------------------------------
override_keys = st.sampled_from(
    ["model.hidden_size", "model.num_layers", "model.type", "model.mhc.num_residual_streams",
     "parallelism.pp", "parallelism.tp", "parallelism.vpp", "training.lr", "training.iterations",
     "training.global_batch_size", "data.tokenizer.vocab_size", "launch.slurm.time",
     "launch.env", "launch.env.HF_TOKEN", "test.golden_values", "test.metrics",
     "extra_args.--attention-softmax-in-fp32", "extra_args.--clip-grad", "extra_args",
     "platforms", "nope", "~model.hidden_size", "+extra_args.--foo"]
)  # fmt: skip


def _override(key: str, value) -> str:
    dumped = yaml.safe_dump(value, default_flow_style=True, width=10**6)
    return f"{key}={dumped.strip().removesuffix('...').strip()}"


@FUZZ
@given(st.lists(st.tuples(override_keys, scalars), max_size=4))
def test_validate(tmp_path_factory, capsys, pairs):
    from megatron_ext.recipes import RecipeError, command, load

    path = tmp_path_factory.mktemp("fuzz") / "r.yaml"
    path.write_text(MINIMAL)
    overrides = [_override(k, v) for k, v in pairs]
    _tool(capsys, ["validate", str(path), *overrides, "--skip-megatron-checks"])
    with _bounded():  # the argv Megatron's checks would parse: built without an exception
        try:
            command.megatron_args(load(path, overrides=overrides))
        except RecipeError:
            pass


# ---- import ------------------------------------------------------------------------------------
model_args = st.dictionaries(
    st.one_of(
        st.sampled_from(
            ["--num-layers", "--hidden-size", "--num-attention-heads", "--seq-length",
             "--pipeline-model-parallel-size", "--tensor-model-parallel-size",
             "--num-layers-per-virtual-pipeline-stage", "--micro-batch-size",
             "--global-batch-size", "--train-iters", "--lr", "--bf16", "--mock-data",
             "--data-path", "--recompute-modules", "--recompute-granularity",
             "--hybrid-layer-pattern", "--enable-hyper-connections", "--num-residual-streams",
             "--ckpt-format", "--save", "--load", "--tokenizer-type", "--vocab-size"]
        ),
        text,
    ),
    json_values,
    max_size=8,
)  # fmt: skip
test_case = st.fixed_dictionaries(
    {"MODEL_ARGS": st.one_of(model_args, json_values)},
    optional={
        "ENV_VARS": st.one_of(st.dictionaries(text, scalars, max_size=3), json_values),
        "TEST_TYPE": st.one_of(
            st.sampled_from(["regular", "ckpt-resume", "frozen-start"]), scalars
        ),
        "MODE": st.one_of(st.sampled_from(["pretraining", "inference", "rl"]), scalars),
        "LAUNCHER": st.one_of(st.sampled_from(["ft_launcher", "torchrun"]), scalars),
        "METRICS": json_values,
        "SPEC": json_values,
    },
)
outputs = st.sampled_from(["out.yaml", "missing/out.yaml", ".", "model_config.yaml", None])


@FUZZ
@given(test_case, outputs, st.booleans())
def test_import(tmp_path_factory, capsys, case, output, break_syntax):
    directory = tmp_path_factory.mktemp("case")
    text_ = yaml.safe_dump(case, allow_unicode=True)
    if break_syntax:
        text_ = text_.replace(":", "", 1)
    (directory / "model_config.yaml").write_text(text_)
    argv = ["import", str(directory / "model_config.yaml")]
    if output is not None:
        argv += ["-o", str(directory / output)]
    _tool(capsys, argv)


# ---- compare -----------------------------------------------------------------------------------
golden_like = st.dictionaries(
    st.one_of(st.sampled_from(["lm loss", "num-zeros", "iteration-time", "mem"]), text),
    st.one_of(
        st.fixed_dictionaries(
            {
                "start_step": json_values,
                "end_step": json_values,
                "step_interval": json_values,
                "values": st.one_of(st.dictionaries(st.one_of(text, words), scalars), json_values),
            }
        ),
        json_values,
    ),
    max_size=3,
)
files = st.one_of(
    golden_like.map(json.dumps),
    json_values.map(json.dumps),
    st.integers(1, 50_000).map(lambda depth: "[" * depth + "]" * depth),
    st.binary(max_size=64).map(lambda b: b.decode("latin-1")),
)


@FUZZ
@given(files, files, st.lists(st.one_of(words, text), max_size=3), st.one_of(st.none(), words))
def test_compare(tmp_path_factory, capsys, run, golden, metrics, rtol):
    directory = tmp_path_factory.mktemp("cmp")
    (directory / "run.json").write_text(run)
    (directory / "golden.json").write_text(golden)
    argv = ["compare", str(directory / "run.json"), str(directory / "golden.json")]
    if metrics:
        chosen = [m for m in metrics if not m.startswith("-")] or ["lm loss"]
        argv += ["--metrics", *chosen]
    if rtol is not None:
        argv.append(f"--rtol={rtol}")
    _tool(capsys, argv)


# ---- convert-checkpoint ------------------------------------------------------------------------
state_keys = st.one_of(
    st.sampled_from(
        ["decoder.layers.0.mlp.linear_fc1.weight", "decoder.layers.0.mixer.in_proj.weight",
         "decoder.layers.0.mlp_hyper_connection.alpha", "decoder.layers.1.hyper_connection.b",
         "decoder.layers.1.inner_layer.mlp.w", "model", "model0", "args", "decoder.layers.x"]
    ),
    text,
    st.integers(-3, 3),
)  # fmt: skip


@FUZZ
@given(
    st.one_of(
        st.dictionaries(state_keys, st.one_of(scalars, st.just("tensor")), max_size=6),
        json_values,
        st.binary(max_size=200),
    ),
    st.sampled_from(["gpt", "hybrid"]),
    st.sampled_from(["upstream", "megatron-ext"]),
    st.sampled_from(["out.pt", "missing/out.pt", ".", "in.pt"]),
)
def test_convert_checkpoint(tmp_path_factory, capsys, content, model, to, output):
    import torch

    directory = tmp_path_factory.mktemp("ckpt")
    source = directory / "in.pt"
    if isinstance(content, bytes):
        source.write_bytes(content)
    else:
        if isinstance(content, dict):
            content = {k: torch.zeros(2) if v == "tensor" else v for k, v in content.items()}
        torch.save(content, source)
    argv = ["convert-checkpoint", str(source), str(directory / output), "--model", model]
    _tool(capsys, [*argv, "--to", to])


# ---- schedule ----------------------------------------------------------------------------------
@FUZZ
@given(
    st.dictionaries(
        st.sampled_from(
            ["--pp", "--vpp", "--microbatches", "--microbatch-group-size", "--mhc-streams",
             "--hidden", "--seq", "--micro-batch-size", "--dtype-bytes"]
        ),
        int_args,
        max_size=9,
    ),
    st.one_of(st.none(), st.sampled_from(["t.png", "/nonexistent/x.png", "x.txt", "."])),
    st.booleans(),
)  # fmt: skip
def test_schedule(tmp_path_factory, capsys, options, plot, steps):
    argv = ["schedule"]
    for flag, value in options.items():
        argv.append(f"{flag}={value}")
    if plot is not None:
        argv += ["--plot", str(tmp_path_factory.mktemp("plot") / plot)]
    if steps:
        argv.append("--steps")
    _tool(capsys, argv)


@FUZZ
@given(
    st.sampled_from(["1f1b", "zb-h1", "zb-h2", ""]),
    st.dictionaries(
        st.sampled_from(["--forward-time", "--backward-time", "--weight-time"]),
        st.one_of(st.floats().map(repr), st.integers(-3, 10**6).map(str), words),
        max_size=3,
    ),
    st.integers(-1, 70),
    st.integers(-1, 400),
)  # fmt: skip
def test_schedule_zero_bubble_and_costs(capsys, schedule, times, pp, microbatches):
    argv = ["schedule", f"--schedule={schedule}", f"--pp={pp}", f"--microbatches={microbatches}"]
    for flag, value in times.items():
        argv.append(f"{flag}={value}")
    _tool(capsys, argv)


# ---- submit --dry-run --------------------------------------------------------------------------
@FUZZ
@given(
    st.dictionaries(
        st.sampled_from(
            ["--nodes", "--gpus-per-node", "--partition", "--account", "--time",
             "--container-image", "--container-mounts", "--python", "--platform", "--device"]
        ),
        st.one_of(words, text.filter(lambda t: not t.startswith("-"))),
        max_size=6,
    ),
    st.lists(st.tuples(override_keys, scalars), max_size=2),
)  # fmt: skip
def test_submit_dry_run(tmp_path_factory, capsys, options, pairs):
    path = tmp_path_factory.mktemp("fuzz") / "r.yaml"
    path.write_text(MINIMAL)
    argv = ["submit", str(path), *[_override(k, v) for k, v in pairs], "--slurm", "--dry-run"]
    argv.append("--skip-megatron-checks")
    for flag, value in options.items():
        argv.append(f"{flag}={value}")
    _tool(capsys, argv)
