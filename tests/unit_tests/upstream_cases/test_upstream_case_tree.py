"""Every test case in Megatron-LM's layout through ``import``, ``validate --platform cpu`` and
``run --dry-run``, in this process (issue 33, item 6): each ends in a valid dry run or a
refusal of one line per problem, never a traceback or a hang, and ``validate`` and
``run --dry-run`` agree (and agree with ``validate`` of the imported recipe).

The cases are ours, under ``tests/functional_tests/test_cases`` (written for these tests in
upstream's format, never copied), each with the outcome it must have (:data:`EXPECTED`).

``MEGATRON_LM_CASES=/path/to/Megatron-LM/tests/functional_tests/test_cases`` adds every
readable case of a Megatron-LM checkout, held to the same shape (``make test-upstream-cases``
sets it). Without the variable those cases are not collected at all: nothing is skipped, and
nothing is counted as passing that did not run.
"""

from __future__ import annotations

import os
import signal
from contextlib import contextmanager
from pathlib import Path

import pytest

from megatron_ext import cli

REPO_ROOT = Path(__file__).resolve().parents[3]
OUR_CASES = REPO_ROOT / "tests/functional_tests/test_cases"
UPSTREAM_CASES_ENV = "MEGATRON_LM_CASES"
CASE_FILE = "model_config.yaml"
# One case has no reason to take longer than this even on a loaded 2-core machine (idle: about
# 1 s for all three commands); more is a hang.
CASE_TIMEOUT_S = 300

VALID = "valid"
EXPECTED = {
    "gpt/gpt3_mcore_tp2_pp2_cpu": VALID,
    # The cpu overlay's own contradictions, fixed: FIM over the overlay's mock data, the
    # deferred embedding gradient without the CUDA-only fused accumulation.
    "gpt/gpt3_fim_dataset_cpu": VALID,
    "gpt/gpt3_deferred_embedding_wgrad_cpu": VALID,
    # Keys and placeholders upstream's CI reads are notes, not problems.
    "gpt/gpt3_anchored_args_cpu": VALID,
    # Cases megatron-ext does not train: one line, the reason, nothing else of the case.
    "gpt/gpt3_checkpoint_consistency_cpu": "TEST_TYPE: 'checkpoint-consistency' is not supported",
    "gpt/gpt_inference_cpu": "MODE: 'inference' is not supported",
    "gpt-nemo/nemo_trainer_keys_cpu": "test case: not a GPT/Hybrid case (gpt-nemo",
    "common/no_model_args_cpu": "MODEL_ARGS: empty: the case gives no Megatron flags",
}


def _cases(root: Path) -> list[Path]:
    return sorted(path.parent for path in root.rglob(CASE_FILE))


def _upstream_params(root: str) -> list:
    """Megatron-LM's cases under ``root`` (a root without any: one case that fails)."""
    return [
        pytest.param(case, id=f"upstream/{case.relative_to(root)}") for case in _cases(Path(root))
    ] or [pytest.param(Path(root), id="upstream/no-cases")]


@contextmanager
def _deadline(seconds: int):
    """A hang fails the test instead of stopping the session (SIGALRM, main thread)."""

    def expired(signum, frame):
        raise TimeoutError(f"no outcome within {seconds} s: a hang")

    previous = signal.signal(signal.SIGALRM, expired)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def _command(capsys, argv: list[str]) -> tuple[int, list[str]]:
    """The CLI in this process: (exit status, the lines it wrote). A traceback is an
    exception here, so it fails the test with its own text."""
    status = cli.main(argv)
    out, err = capsys.readouterr()
    return status, [line for line in (out + err).splitlines() if line.strip()]


def _problems(lines: list[str], label: str) -> list[str]:
    """validate's problem lines ('RECIPE [cpu]: where: what'), notes and OK left out."""
    return [
        line[len(label) + 2 :]
        for line in lines
        if line.startswith(f"{label}: ")
        and not line.startswith(f"{label}: note: ")
        and not line.startswith(f"{label}: OK (")
    ]


def outcome(case: Path, tmp_path: Path, capsys) -> list[str]:
    """import, validate and run --dry-run of one case: its problem lines (none: a valid dry
    run), after checking that the three agree and that a refusal is one line per problem."""
    source = case / CASE_FILE
    recipe = tmp_path / "recipe.yaml"
    with _deadline(CASE_TIMEOUT_S):
        imported, import_lines = _command(capsys, ["import", str(source), "-o", str(recipe)])
        valid, lines = _command(capsys, ["validate", str(source), "--platform", "cpu"])
        dry, dry_lines = _command(
            capsys,
            ["run", "--dry-run", str(source), "--platform", "cpu", "--runs-root", str(tmp_path)],
        )
        checked = None
        if imported == 0:
            checked, _ = _command(capsys, ["validate", str(recipe), "--platform", "cpu"])
    assert imported in (0, 2) and valid in (0, 2) and dry in (0, 2), (imported, valid, dry)
    assert (valid == 0) == (dry == 0), (lines, dry_lines)
    if imported == 0:
        assert checked == valid, f"the imported recipe validates otherwise: {checked} vs {valid}"
    else:
        assert import_lines and all(line.startswith(f"{source}: ") for line in import_lines)
    if valid == 0:
        assert any(line.strip() == "command.sh:" for line in dry_lines), dry_lines
        return []
    problems = _problems(lines, f"{source} [cpu]")
    assert problems, lines
    assert all(": " in problem and "Traceback" not in problem for problem in problems), problems
    # Refused while loading: the same problem lines; by a later check: one "cannot run:".
    assert dry_lines[-1].startswith("cannot run: ") or all(
        line.startswith(f"{source}: ") for line in dry_lines
    ), dry_lines
    return problems


@pytest.mark.parametrize(
    "name", sorted(str(case.relative_to(OUR_CASES)) for case in _cases(OUR_CASES))
)
def test_our_cases_end_as_they_should(name, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("DATA_PATH", str(tmp_path / "data"))  # where upstream's CI mounts data
    assert name in EXPECTED, f"{name}: give it an outcome in EXPECTED"
    problems = outcome(OUR_CASES / name, tmp_path, capsys)
    if EXPECTED[name] == VALID:
        assert problems == []
    else:  # a case megatron-ext does not train: its reason, alone
        assert len(problems) == 1 and problems[0].startswith(EXPECTED[name]), problems


# Defined only when the variable names a checkout: otherwise there is no such test (not a
# skipped one).
if os.environ.get(UPSTREAM_CASES_ENV):

    @pytest.mark.parametrize("case", _upstream_params(os.environ[UPSTREAM_CASES_ENV]))
    def test_an_upstream_case_is_a_dry_run_or_a_refusal(case, tmp_path, capsys, monkeypatch):
        assert (case / CASE_FILE).is_file(), f"{UPSTREAM_CASES_ENV}={case}: no {CASE_FILE}"
        if not os.environ.get("DATA_PATH"):
            monkeypatch.setenv("DATA_PATH", str(tmp_path / "data"))
        outcome(case, tmp_path, capsys)
