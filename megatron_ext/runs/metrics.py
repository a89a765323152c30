"""A run's metrics, in Megatron's golden-value JSON format: from TensorBoard, else log lines.

Like Megatron-LM's functional tests (``python_test_utils/common.py``), metrics are read from
the TensorBoard event files the last rank writes (``--tensorboard-dir``; tags "lm loss",
"num-zeros", "iteration-time", "mem-allocated-bytes", ...): :func:`read_tensorboard`. A run
without event files (tensorboard not installed where the ranks ran, an entry that writes
none) falls back to the log lines.

megatron.training prints one line per logged iteration on the last rank::

     [...] iteration        3/      10 | consumed samples: 24 | elapsed time per iteration (ms):
     308.2 | learning rate: 1.000000E-03 | global batch size: 8 | lm loss: 4.593707E+00 |
     loss scale: 1.0 | grad norm: 1.866 | num zeros: 0.0 | ...

:func:`parse_log` reads those lines into per-step series under the metric names Megatron's
functional tests use ("lm loss", "num-zeros", "iteration-time" in seconds, "mtp_1 loss", ...).
A golden-value file is ``{metric: {start_step, end_step, step_interval, values: {step: v}}}``.

One upstream quirk to know when reading curves: a process does not reset its loss
accumulators after its first logged iteration, so the *second* line a process prints shows
the mean of its first two iterations (in every run, fresh or resumed). TensorBoard gets each
iteration's own loss, so the two sources differ at that step only.
"""

from __future__ import annotations

import glob
import itertools
import json
import logging
import math
import os
import re
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from megatron_ext import files
from megatron_ext.errors import MegatronExtError


class MetricsFormatError(MegatronExtError, ValueError):
    """Golden-value JSON not in Megatron's layout (each metric a block of start_step, end_step,
    step_interval and values); the message names the metric."""


ITERATION_LINE = re.compile(r"\biteration\s+(\d+)/\s*(\d+)\s*\|(.*)$")
VALIDATION_LINE = re.compile(
    r"validation loss at iteration (\d+)(?: on (?:validation|test) set)?\s*\|"
    r"\s*lm loss value: ([0-9.eE+-]+)"
)

# Megatron's label in the log line -> (metric name in golden values, scale)
LOG_FIELDS = {
    "lm loss": ("lm loss", 1.0),
    "num zeros": ("num-zeros", 1.0),
    "elapsed time per iteration (ms)": ("iteration-time", 1e-3),
    "grad norm": ("grad-norm", 1.0),
    "learning rate": ("learning-rate", 1.0),
}
MTP_FIELD = re.compile(r"^mtp_\d+ loss$")

Series = dict[int, float]
Metrics = dict[str, Series]

logger = logging.getLogger(__name__)

TENSORBOARD_SUBDIR = "tensorboard"
"""Where in a run directory the ranks write event files (``resume/`` below it for a
ckpt-resume's second run)."""


def parse_iteration_line(line: str) -> tuple[int, int, dict[str, float]] | None:
    """(iteration, train_iters, {metric: value}) for a Megatron iteration line, else None."""
    match = ITERATION_LINE.search(line)
    if not match:
        return None
    values: dict[str, float] = {}
    for part in match.group(3).split("|"):
        if ":" not in part:
            continue
        label, _, text = part.rpartition(":")
        label = label.strip()
        if label in LOG_FIELDS:
            name, scale = LOG_FIELDS[label]
        elif MTP_FIELD.match(label):
            name, scale = label, 1.0
        else:
            continue
        try:
            value = float(text.strip())
        except ValueError:
            continue
        values[name] = round(value * scale, 9) if scale != 1.0 else value
    return int(match.group(1)), int(match.group(2)), values


VALIDATION_METRIC = "lm loss validation"
"""Megatron's TensorBoard tag of the validation loss (``{key} validation``)."""


TEST_METRIC = "lm loss test"
"""The test-set loss Megatron computes once after training (``data.test_paths`` or a split
with a test share). Megatron prints it as ``validation loss at iteration N on test set`` and
writes it to TensorBoard under "lm loss validation" at step N, beside the in-loop and the
final validation losses of that step; megatron-ext keeps it apart under this name (issue 41,
item 4)."""

FINAL_EVALUATIONS = {"on validation set": None, "on test set": TEST_METRIC}
"""The after-training evaluations' line endings -> their metric (None: the final validation,
not recorded: the in-loop validation of the same step is the curve's point)."""


def with_validation(names: list[str], metrics: Metrics) -> list[str]:
    """metrics.json's names: the recipe's, plus the validation and test losses when the run
    evaluated (a run's validation curve is what a reader of its metrics looks for first)."""
    extra = [m for m in (VALIDATION_METRIC, TEST_METRIC) if metrics.get(m) and m not in names]
    return [*names, *extra]


def final_losses(metrics: Metrics) -> dict[str, dict[str, float | int]]:
    """summary.json's "losses": the last step and value of the training, validation and test
    losses the run logged."""
    out: dict[str, dict[str, float | int]] = {}
    for name in ("lm loss", VALIDATION_METRIC, TEST_METRIC):
        series = metrics.get(name)
        if series:
            step = max(series)
            out[name] = {"step": step, "value": series[step]}
    return out


def _final_evaluation(line: str) -> str | None:
    """The FINAL_EVALUATIONS key a validation line ends with, else None (in-loop)."""
    return next((key for key in FINAL_EVALUATIONS if key in line), None)


def parse_lines(lines: Iterable[str]) -> Metrics:
    metrics: Metrics = {}
    for line in lines:
        match = VALIDATION_LINE.search(line)
        if match:
            final = _final_evaluation(line)
            name = VALIDATION_METRIC if final is None else FINAL_EVALUATIONS[final]
            if name is not None:
                metrics.setdefault(name, {})[int(match.group(1))] = float(match.group(2))
            continue
        parsed = parse_iteration_line(line)
        if parsed is None:
            continue
        step, _, values = parsed
        for name, value in values.items():
            metrics.setdefault(name, {})[step] = value
    return metrics


# A golden-value or metrics JSON of a million steps is ~40 MB; a log line is far below 1 MiB.
MAX_METRICS_JSON_BYTES = 256 << 20
MAX_LOG_LINE_CHARS = 1 << 20


def _log_lines(stream: Any) -> Iterator[str]:
    """The lines of a log, each read with a bound (a line without end is cut, not held)."""
    while line := stream.readline(MAX_LOG_LINE_CHARS):
        yield line


def parse_log(path: str | Path) -> Metrics:
    with files.open_regular(path, "r", errors="replace") as f:
        return parse_lines(_log_lines(f))


def parse_run_logs(log_dir: str | Path) -> Metrics:
    """The metrics of one run's per-rank logs: the rank that printed iteration lines (the last
    pipeline stage's last rank, Megatron's print_rank_last)."""
    logs = sorted(Path(log_dir).glob("rank-*.log"), key=lambda p: -_rank_of(p))
    for log in logs:
        metrics = parse_log(log)
        if metrics:
            return metrics
    return {}


def _rank_of(path: Path) -> int:
    match = re.search(r"rank-(\d+)", path.name)
    return int(match.group(1)) if match else -1


def to_golden(metrics: Metrics, names: Iterable[str] | None = None) -> dict:
    """Megatron's golden-value layout for ``names`` (all metrics when None)."""
    out = {}
    for name in names if names is not None else sorted(metrics):
        series = metrics.get(name)
        if not series:
            continue
        steps = sorted(series)
        interval = min((b - a for a, b in itertools.pairwise(steps)), default=1)
        out[name] = {
            "start_step": steps[0],
            "end_step": steps[-1],
            "step_interval": interval,
            "values": {str(s): series[s] for s in steps},
        }
    return out


def from_golden(data: dict) -> Metrics:
    """Series from golden-value JSON ("nan" strings become NaN)."""
    metrics: Metrics = {}
    for name, block in data.items():
        if not isinstance(block, dict) or "values" not in block:
            raise MetricsFormatError(
                f"metric {name!r}: expected {{start_step, end_step, step_interval, values}}"
            )
        metrics[name] = {
            int(k): (math.nan if isinstance(v, str) else float(v))
            for k, v in block["values"].items()
        }
    return metrics


def write_golden(path: str | Path, metrics: Metrics, names: Iterable[str] | None = None) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(to_golden(metrics, names), indent=2) + "\n")
    return path


def read_golden(path: str | Path) -> Metrics:
    """Golden-value JSON, read with a bound on the bytes read (issue 40, item 15)."""
    return from_golden(json.loads(files.read_bounded(path, MAX_METRICS_JSON_BYTES, "metrics JSON")))


def read_validation_losses(path: str | Path) -> Series:
    out: Series = {}
    with files.open_regular(path, "r", errors="replace") as f:
        for line in _log_lines(f):
            match = VALIDATION_LINE.search(line)
            if match and "on validation set" not in line and "on test set" not in line:
                out[int(match.group(1))] = float(match.group(2))
    return out


# ---- TensorBoard ---------------------------------------------------------------------------------
def event_files(directory: str | Path) -> list[str]:
    """The event files directly in ``directory``, oldest first (Megatron-LM's order)."""
    files = glob.glob(os.path.join(str(directory), "events*tfevents*"))
    return sorted(files, key=os.path.getmtime)


def read_tensorboard(directory: str | Path) -> Metrics:
    """Every scalar series of the event files in ``directory`` ({} when there are none).

    Several files (a restarted writer) merge step by step, the first file's value winning,
    as Megatron-LM's ``read_tb_logs_as_list`` does. Values are TensorBoard's float32s; tags
    such as "lm loss vs samples" (indexed by samples, not steps) are left out.
    """
    files = event_files(directory)
    if not files:
        return {}
    from tensorboard.backend.event_processing import event_accumulator

    guidance = {event_accumulator.SCALARS: 0, event_accumulator.TENSORS: 0}
    metrics: Metrics = {}
    for path in files:
        accumulator = event_accumulator.EventAccumulator(path, size_guidance=guidance)
        accumulator.Reload()
        for tag in accumulator.Tags()["scalars"]:
            if tag.endswith(" vs samples"):
                continue
            series = metrics.setdefault(tag, {})
            for event in accumulator.Scalars(tag):
                series.setdefault(int(event.step), float(event.value))
    return metrics


def read_run_metrics(run_dir: str | Path, phase: str = "") -> tuple[Metrics, str]:
    """(metrics, source) of one phase of a run: TensorBoard when the phase wrote event files,
    else its log lines. ``phase``: "" (the first run) or "resume"."""
    run_dir = Path(run_dir)
    tb_dir = run_dir / TENSORBOARD_SUBDIR / phase if phase else run_dir / TENSORBOARD_SUBDIR
    try:
        metrics = read_tensorboard(tb_dir)
    except ImportError:
        logger.warning("tensorboard is not installed here; reading metrics from the logs")
        metrics = {}
    logs = run_dir / "logs" / phase if phase else run_dir / "logs"
    if metrics:
        return with_test_loss_from_logs(metrics, parse_run_logs(logs)), "tensorboard"
    return parse_run_logs(logs), "logs"


def with_test_loss_from_logs(tensorboard: Metrics, logged: Metrics) -> Metrics:
    """TensorBoard's scalars with the test loss taken from the log lines: in TensorBoard it
    shares the "lm loss validation" tag, where the first value of a step is kept (the in-loop
    or the final validation, both written before it). A run that did not validate at that step
    has the test loss there: a point equal to it (to the 7 digits printed) that no in-loop
    validation line backs is removed from the validation curve."""
    test = logged.get(TEST_METRIC)
    if not test:
        return tensorboard
    out = dict(tensorboard)
    out[TEST_METRIC] = dict(test)
    validation = dict(out.get(VALIDATION_METRIC, {}))
    for step, value in test.items():
        shown = validation.get(step)
        in_loop = step in logged.get(VALIDATION_METRIC, {})
        if shown is not None and not in_loop and math.isclose(shown, value, rel_tol=1e-6):
            del validation[step]
    if validation:
        out[VALIDATION_METRIC] = validation
    else:
        out.pop(VALIDATION_METRIC, None)
    return out
