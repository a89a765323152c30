"""Comparing a run's metrics with golden values, by Megatron's functional-test rules.

Megatron-LM's CI (``tests/functional_tests/python_test_utils/common.py``) checks each metric
with one or two tests:

- **deterministic**: every golden step equal (rtol = atol = 0);
- **approximate**: ``isclose(actual, golden, rtol, atol)`` per step, where
  ``min(max(steps // 100, 1), 50)`` steps may fail; ``iteration-time`` compares the median
  of a steady window (steps 5-20, or 30-45 when the run is longer than 25 steps).

Its thresholds (:data:`MEGATRON_RULES`, the ``CHECK_THRESHOLDS`` of Megatron-LM's
``test_pretraining_regular_pipeline.py``, dev branch, August 2026) are: lm loss and mtp losses
deterministic plus rtol 0.05; num-zeros deterministic plus rtol 0.20; iteration-time,
mem-allocated-bytes and mem-max-allocated-bytes rtol 0.05. They are the defaults on GPU
platforms, for the metrics a recipe lists (upstream's default list is lm loss and num-zeros).

On CPU (:data:`CPU_RULES`, megatron-ext's own, stricter rules), golden values generated on one machine are checked on another
whose CPU, and so torch's kernels, may differ. There the loss is compared with a tight
**rtol of 1e-4 and no failing step allowed** instead of bit for bit. Iteration time is
recorded, never checked (it measures the machine). Within one machine and one run,
comparisons stay exact: the ckpt-resume check (:func:`compare_resume`) demands identical values.

A recipe replaces any of these per metric with ``test.tolerances``.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy

from megatron_ext.recipes.schema import TOLERANCE_FIELDS
from megatron_ext.runs.metrics import Metrics


@dataclass(frozen=True)
class Rule:
    """How one metric is checked (see the module docstring)."""

    deterministic: bool = False
    rtol: float | None = None
    atol: float = 0.0
    max_failing_steps: int | None = None

    @property
    def checked(self) -> bool:
        return self.deterministic or self.rtol is not None

    def describe(self) -> str:
        parts = []
        if self.deterministic:
            parts.append("exact")
        if self.rtol is not None:
            text = f"rtol={self.rtol:g}" + (f" atol={self.atol:g}" if self.atol else "")
            if self.max_failing_steps is not None:
                text += f" failing steps allowed={self.max_failing_steps}"
            parts.append(text)
        return " + ".join(parts) or "recorded only"


MEGATRON_RULES: dict[str, Rule] = {
    "lm loss": Rule(deterministic=True, rtol=0.05),
    "lm loss validation": Rule(deterministic=True, rtol=0.05),
    "lm loss test": Rule(deterministic=True, rtol=0.05),
    "mtp loss": Rule(deterministic=True, rtol=0.05),
    "num-zeros": Rule(deterministic=True, rtol=0.20),
    "iteration-time": Rule(rtol=0.05),
    "mem-allocated-bytes": Rule(rtol=0.05),
    "mem-max-allocated-bytes": Rule(rtol=0.05),
}
"""Megatron-LM's thresholds (see the module docstring); the GPU platforms' defaults."""
CPU_RULES: dict[str, Rule] = {
    "lm loss": Rule(rtol=1e-4, max_failing_steps=0),
    "lm loss validation": Rule(rtol=1e-4, max_failing_steps=0),
    "lm loss test": Rule(rtol=1e-4, max_failing_steps=0),
    "mtp loss": Rule(rtol=1e-4, max_failing_steps=0),
    # Counts of exactly-zero gradient elements: a different CPU may round one element to zero
    # differently, so a few elements of slack on top of Megatron's 5 %.
    "num-zeros": Rule(rtol=0.05, atol=4, max_failing_steps=0),
    "iteration-time": Rule(),
    "mem-allocated-bytes": Rule(),
    "mem-max-allocated-bytes": Rule(),
}
"""megatron-ext's own rules for the cpu platform (not Megatron-LM's): see the module docstring."""

RULE_SOURCES = {"cpu": "megatron-ext's CPU rules", "gpu": "Megatron-LM's thresholds"}


def _rule_key(metric: str) -> str:
    return "mtp loss" if metric.startswith("mtp_") and metric.endswith(" loss") else metric


def default_rule(metric: str, device: str) -> Rule:
    table = CPU_RULES if device == "cpu" else MEGATRON_RULES
    return table.get(_rule_key(metric), Rule())


def rules_for(
    metrics: list[str], device: str, overrides: Mapping[str, Mapping[str, Any]]
) -> dict[str, Rule]:
    """The rule of each metric: the device's default with the recipe's fields on top."""
    rules = {}
    for metric in metrics:
        rule = default_rule(metric, device)
        changes = {k: v for k, v in (overrides.get(metric) or {}).items() if k in TOLERANCE_FIELDS}
        rules[metric] = dataclasses.replace(rule, **changes)
    return rules


@dataclass
class Worst:
    step: int
    actual: float
    golden: float

    @property
    def abs_diff(self) -> float:
        return abs(self.actual - self.golden)

    @property
    def rel_diff(self) -> float:
        if self.golden == 0:
            return 0.0 if self.actual == 0 else math.inf
        return self.abs_diff / abs(self.golden)


@dataclass
class CheckResult:
    metric: str
    check: str  # "exact" | "approximate" | "missing"
    passed: bool
    steps: int
    failing: list[int] = field(default_factory=list)
    allowed: int = 0
    worst: Worst | None = None
    detail: str = ""
    reference: str = "golden"

    def line(self) -> str:
        status = "PASSED" if self.passed else "FAILED"
        text = f"{self.metric:<15} {self.check:<28} {status}"
        if self.check == "missing":
            return f"{text}  {self.detail}"
        ok = self.steps - len(self.failing)
        text += f"  {ok}/{self.steps} steps {'equal' if self.check == 'exact' else 'within'}"
        if self.allowed and self.check != "exact":
            text += f" ({self.allowed} may fail)"
        if self.worst is not None:
            w = self.worst
            text += (
                f"; worst step {w.step}: {w.actual:.7g} vs {self.reference} {w.golden:.7g} "
                f"(abs {w.abs_diff:.3g}, rel {w.rel_diff:.3g})"
            )
        if self.failing and self.check == "exact":
            text += f"; first difference at step {self.failing[0]}"
        if self.detail:
            text += f"; {self.detail}"
        return text


@dataclass
class Report:
    title: str
    results: list[CheckResult] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return all(r.passed for r in self.results)

    def lines(self) -> list[str]:
        verdict = "PASSED" if self.passed else "FAILED"
        return [f"{self.title}: {verdict}"] + [f"  {r.line()}" for r in self.results]

    def to_dict(self) -> dict:
        return {
            "title": self.title,
            "passed": self.passed,
            "results": [
                {
                    **{k: v for k, v in dataclasses.asdict(r).items() if k != "worst"},
                    "worst": None
                    if r.worst is None
                    else {**dataclasses.asdict(r.worst), "rel_diff": r.worst.rel_diff},
                }
                for r in self.results
            ],
        }


def _value(series: dict[int, float], step: int) -> float:
    return series.get(step, math.inf)


def _steady_median(series: dict[int, float], steps: list[int]) -> tuple[float, list[int]]:
    window = range(5, 21) if (max(steps) if steps else 0) <= 25 else range(30, 46)
    chosen = [s for s in steps if s in window] or steps
    values = [_value(series, s) for s in chosen]
    return (statistics.median(values) if values else math.inf), chosen


def check_metric(
    metric: str,
    actual: dict[int, float],
    golden: dict[int, float],
    rule: Rule,
    approximate_only: bool = False,
) -> list[CheckResult]:
    steps = sorted(golden)
    results = []
    if rule.deterministic and not approximate_only:
        failing = [s for s in steps if not _finite_and_equal(_value(actual, s), golden[s])]
        worst = _worst(actual, golden, steps)
        results.append(
            CheckResult(
                metric,
                "exact",
                not failing,
                len(steps),
                failing,
                0,
                worst,
                _not_logged(actual, steps),
            )
        )
    if rule.rtol is not None:
        check = f"approximate {Rule(rtol=rule.rtol, atol=rule.atol).describe()}"
        if metric == "iteration-time":
            a, chosen = _steady_median(actual, steps)
            g, _ = _steady_median(golden, steps)
            # numpy.isclose: asymmetric, the tolerance scales with the golden value; NaN fails.
            ok = bool(numpy.isclose(a, g, rtol=rule.rtol, atol=rule.atol))
            ok = ok and math.isfinite(a) and math.isfinite(g)  # no steps: inf vs inf
            results.append(
                CheckResult(
                    metric,
                    check + " median",
                    ok,
                    1,
                    [] if ok else [chosen[0]],
                    0,
                    Worst(chosen[0] if chosen else 0, a, g),
                    f"median of steps {chosen[0]}-{chosen[-1]}" if chosen else "",
                )
            )
        else:
            close = numpy.isclose(
                [_value(actual, s) for s in steps],
                [golden[s] for s in steps],
                rtol=rule.rtol,
                atol=rule.atol,
            )
            # inf matches inf in numpy.isclose; a run that logged inf never passes
            failing = [
                s
                for s, ok in zip(steps, close, strict=True)
                if not ok or math.isinf(_value(actual, s)) or math.isinf(golden[s])
            ]
            allowed = (
                rule.max_failing_steps
                if rule.max_failing_steps is not None
                else min(max(len(steps) // 100, 1), 50)
            )
            if len(steps) == 1:
                allowed = 0
            results.append(
                CheckResult(
                    metric,
                    check,
                    len(failing) <= allowed,
                    len(steps),
                    failing,
                    allowed,
                    _worst(actual, golden, steps),
                    _not_logged(actual, steps),
                )
            )
    return results


def _finite_and_equal(actual: float, golden: float) -> bool:
    """Exactly equal and not infinite: ``inf == inf`` is no pass (a step missing from the run
    reads as inf, and an overflowed loss is inf), issue 34, item 14."""
    return actual == golden and not math.isinf(golden)


def _not_logged(actual: dict[int, float], steps: list[int]) -> str:
    """The golden steps the run never logged, said in words (issue 41, item 2: such a step
    was printed as ``inf vs golden``)."""
    missing = [s for s in steps if s not in actual]
    if not missing:
        return ""
    shown = ", ".join(map(str, missing[:5])) + (", ..." if len(missing) > 5 else "")
    return f"{len(missing)} golden step(s) not logged by the run: {shown}"


def _worst(actual: dict[int, float], golden: dict[int, float], steps: list[int]) -> Worst | None:
    """The largest difference among the steps the run logged (a step it never logged is
    named by :func:`_not_logged`, not shown as an infinite difference)."""
    candidates = [Worst(s, actual[s], golden[s]) for s in steps if s in actual]
    if not candidates:
        return None
    return max(
        candidates,
        key=lambda w: (w.rel_diff if not math.isnan(w.rel_diff) else math.inf, w.abs_diff),
    )


def compare(
    actual: Metrics,
    golden: Metrics,
    rules: dict[str, Rule],
    title: str = "golden values",
    approximate_only: bool = False,
) -> Report:
    """Check every metric that has a rule that checks something (Megatron's ``pipeline``)."""
    report = Report(title)
    for metric, rule in rules.items():
        if not rule.checked:
            continue
        if metric not in golden:
            report.results.append(
                CheckResult(
                    metric, "missing", False, 0, detail="not in the golden values (regenerate them)"
                )
            )
            continue
        if metric not in actual:
            report.results.append(
                CheckResult(metric, "missing", False, 0, detail="not logged by this run")
            )
            continue
        report.results += check_metric(
            metric, actual[metric], golden[metric], rule, approximate_only
        )
    return report


# ---- ckpt-resume -------------------------------------------------------------------------------
PRINT_RTOL = 1e-6
"""Megatron prints losses with 7 significant digits; a mean rebuilt from two printed values
agrees with the printed mean to this relative tolerance."""


def compare_resume(
    continuous: Metrics, resumed: Metrics, half: int, metrics: list[str], logged_means: bool = True
) -> Report:
    """The resumed run's steps after ``half`` against the uninterrupted run's: identical.

    Megatron's second logged line of a process averages its first two iterations; when the
    metrics come from those lines (``logged_means``), for loss metrics the resumed run's step
    ``half + 2`` is checked against the mean of the uninterrupted run's steps ``half + 1`` and
    ``half + 2`` (to print precision, 1e-6), and every other step exactly. TensorBoard
    scalars carry each step's own value: every step is compared exactly.
    """
    report = Report(f"ckpt-resume: steps {half + 1}+ of the resumed run vs the uninterrupted run")
    for metric in metrics:
        if metric == "iteration-time":
            continue
        cont, res = continuous.get(metric, {}), resumed.get(metric, {})
        steps = sorted(s for s in cont if s > half)
        if not steps or not res:
            report.results.append(
                CheckResult(metric, "missing", False, 0, detail="not logged after the checkpoint")
            )
            continue
        expected = dict(cont)
        quirk = logged_means and metric.endswith("loss") and half + 2 in cont and half + 1 in cont
        failing = []
        for s in steps:
            if quirk and s == half + 2:
                mean = (cont[half + 1] + cont[half + 2]) / 2
                expected[s] = mean
                if not numpy.isclose(_value(res, s), mean, rtol=PRINT_RTOL, atol=0.0):
                    failing.append(s)
            elif _value(res, s) != cont[s]:
                failing.append(s)
        worst = _worst(res, {s: expected[s] for s in steps}, steps)
        detail = (
            f"step {half + 2} is Megatron's 2-iteration mean (print precision)" if quirk else ""
        )
        report.results.append(
            CheckResult(
                metric,
                "exact",
                not failing,
                len(steps),
                failing,
                0,
                worst,
                detail,
                reference="uninterrupted",
            )
        )
    return report
