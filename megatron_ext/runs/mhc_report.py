"""The mHC statistics of a recipe run (``model.mhc.log_stats: true``): their place in
metrics.json, their plot (``mhc.png`` beside ``loss.png``) and the console summary.

The names are :mod:`megatron_ext.mhc.stats`'s (kept here as text so the runner does not import
torch). To hold golden values for them, list them in ``test.metrics``.
"""

from __future__ import annotations

from pathlib import Path

from megatron_ext.runs.plot import write_png_plot

# megatron_ext.mhc.stats.GAIN_NAMES + MTP_GAIN_NAMES (the MTP path's: Hybrid MTP runs only)
GAIN_NAMES = (
    "mhc/forward_gain",
    "mhc/backward_gain",
    "mhc/mtp_forward_gain",
    "mhc/mtp_backward_gain",
)
PLOT_NAME = "mhc.png"


def logs_stats(recipe) -> bool:
    """Whether the run logs mHC stats: ``model.mhc.log_stats``, or a multi-module recipe's
    ``model.modules.<name>.mhc.log_stats``."""
    modules = getattr(recipe.model, "modules", None) or {}
    return bool(recipe.model.mhc.log_stats) or any(m.mhc.log_stats for m in modules.values())


def recorded_names(recipe, names: list[str]) -> list[str]:
    """metrics.json's metrics: the recipe's, plus the gains when the run logs mHC stats (a
    gain the run did not log, e.g. the MTP path's without MTP, is left out)."""
    if not logs_stats(recipe):
        return names
    return names + [name for name in GAIN_NAMES if name not in names]


def write_plot(run_dir: Path, run_metrics: dict, title: str) -> Path | None:
    """The gains per logged step in ``mhc.png`` (None when the run logged none)."""
    series = {name: run_metrics[name] for name in GAIN_NAMES if run_metrics.get(name)}
    if not series:
        return None
    return write_png_plot(run_dir / PLOT_NAME, series, title=f"{title}: mHC composite gains")


def summary_lines(run_metrics: dict) -> list[str]:
    """One console line per gain: first and last logged value."""
    lines = []
    for name in GAIN_NAMES:
        series = run_metrics.get(name)
        if series:
            first, last = min(series), max(series)
            lines.append(
                f"{name} {series[first]:.6f} (step {first}) -> {series[last]:.6f} (step {last})"
            )
    return lines


__all__ = ["GAIN_NAMES", "PLOT_NAME", "logs_stats", "recorded_names", "summary_lines", "write_plot"]
