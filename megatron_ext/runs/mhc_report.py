"""The mHC statistics of a recipe run (``model.mhc.log_stats: true``): their place in
metrics.json, their plot (``mhc.png`` beside ``loss.png``) and the console summary.

The names are :mod:`megatron_ext.mhc.stats`'s (kept here as text so the runner does not import
torch). To hold golden values for them, list them in ``test.metrics``.
"""

from __future__ import annotations

from pathlib import Path

# megatron_ext.mhc.stats.GAIN_NAMES + MTP_GAIN_NAMES (the MTP path's: Hybrid MTP runs only)
GAIN_NAMES = (
    "mhc/forward_gain",
    "mhc/backward_gain",
    "mhc/mtp_forward_gain",
    "mhc/mtp_backward_gain",
)
PLOT_NAME = "mhc.png"


def recorded_names(logs_stats: bool, names: list[str]) -> list[str]:
    """metrics.json's metrics: the recipe's, plus the gains when the run logs mHC stats
    (``logs_stats``: the request's ``verdict.logs_mhc_stats``; a gain the run did not log, e.g.
    the MTP path's without MTP, is left out)."""
    if not logs_stats:
        return names
    return names + [name for name in GAIN_NAMES if name not in names]


RANGE_PANELS = (("h_pre", "H_pre range"), ("h_post", "H_post range"))
DISTANCES = (
    ("h_res_identity_dist", "from the identity (no mixing)"),
    ("h_res_uniform_dist", "from uniform mixing (J/n)"),
)
AMPLITUDES = (
    ("h_pre_sum_max", "Σ H_pre (read)"),
    ("h_post_sum_max", "Σ H_post (write-back)"),
)
SINKHORN_RESIDUALS = (
    ("h_res_row_err", "max |row sum − 1|"),
    ("h_res_col_err", "max |column sum − 1|"),
)
GAIN_AXIS = (0.0, 2.0)
"""The gains' fixed axis: a projected H_res keeps them at 1 up to float rounding (1 ± 1e-7),
which an autoscaled axis would draw as spikes; growth past 2 widens it."""


def _per_step(run_metrics: dict, suffix: str, pick) -> dict[int, float]:
    """``pick`` (min or max) over the sub-layers of ``mhc/.../<suffix>``, per logged step."""
    series = [s for name, s in run_metrics.items() if name.endswith(f"/{suffix}") and s]
    steps = sorted({step for s in series for step in s})
    return {step: pick(s[step] for s in series if step in s) for step in steps}


def _draw_worst(ax, run_metrics: dict, keys, title: str, pick=max) -> None:
    """One line per ``(suffix, label)``: ``pick`` over the sub-layers, per logged step."""
    for key, label in keys:
        worst = _per_step(run_metrics, key, pick)
        ax.plot(
            sorted(worst), [worst[s] for s in sorted(worst)], marker="o", markersize=3, label=label
        )
    ax.set_title(title, fontsize=9)


def _draw_streams(axes, run_metrics: dict) -> None:
    """What moves while the gains stay at 1: the streams' RMS range, the H_pre/H_post
    amplitudes and Sinkhorn's residual (log axis: 1e-7 to 1e-1 all show)."""
    _draw_worst(
        axes[0],
        run_metrics,
        (("stream_rms_min", "smallest stream"),),
        "residual streams' RMS (over streams and sub-layers)",
        pick=min,
    )
    _draw_worst(axes[0], run_metrics, (("stream_rms_max", "largest stream"),), axes[0].get_title())
    _draw_worst(axes[1], run_metrics, AMPLITUDES, "H_pre / H_post amplitudes (largest)")
    _draw_worst(axes[2], run_metrics, SINKHORN_RESIDUALS, "H_res: Sinkhorn residual (largest)")
    if axes[2].has_data() and all(
        min(line.get_ydata(), default=0) > 0 for line in axes[2].get_lines()
    ):
        axes[2].set_yscale("log")


def _draw_panels(axes, run_metrics: dict) -> None:
    for ax, (key, title) in zip(axes[:2], RANGE_PANELS, strict=True):
        low, high = (
            _per_step(run_metrics, f"{key}_min", min),
            _per_step(run_metrics, f"{key}_max", max),
        )
        steps = sorted(set(low) & set(high))
        ax.fill_between(steps, [low[s] for s in steps], [high[s] for s in steps], alpha=0.3)
        ax.plot(steps, [low[s] for s in steps], marker="o", markersize=3, label="min")
        ax.plot(steps, [high[s] for s in steps], marker="o", markersize=3, label="max")
        ax.set_title(f"{title} (over the sub-layers)", fontsize=9)
    for key, label in DISTANCES:
        worst = _per_step(run_metrics, key, max)
        axes[2].plot(
            sorted(worst), [worst[s] for s in sorted(worst)], marker="o", markersize=3, label=label
        )
    axes[2].set_title("H_res: largest Frobenius distance", fontsize=9)
    highest = GAIN_AXIS[1]
    for name in GAIN_NAMES:
        series = run_metrics.get(name)
        if series:
            axes[3].plot(
                sorted(series),
                [series[s] for s in sorted(series)],
                marker="o",
                markersize=3,
                label=name,
            )
            highest = max(highest, 1.1 * max(series.values()))
    axes[3].set_ylim(GAIN_AXIS[0], highest)
    axes[3].set_title("composite gains (fixed axis)", fontsize=9)
    _draw_streams(axes[4:], run_metrics)
    for ax in axes:
        if ax.has_data():
            ax.legend(fontsize=7)
        ax.set_xlabel("iteration", fontsize=8)
        ax.grid(True, alpha=0.3)


def figure(run_metrics: dict, title: str):
    """mhc.png's figure: H_pre and H_post ranges, H_res's distances from the identity and from
    uniform mixing, the gains on :data:`GAIN_AXIS`, then what moves while the gains stay at 1:
    the residual streams' RMS range, the H_pre/H_post amplitudes and Sinkhorn's residual (None
    when the run logged no gain)."""
    if not any(run_metrics.get(name) for name in GAIN_NAMES):
        return None
    from megatron_ext.runs.plot import _pyplot

    plt = _pyplot()
    fig, axes = plt.subplots(2, 4, figsize=(20, 7), squeeze=False)
    panels = list(axes.flat)
    panels.pop().remove()  # seven panels on a 2 x 4 grid
    _draw_panels(panels, run_metrics)
    fig.suptitle(f"mHC: {title}", fontsize=10)
    fig.tight_layout()
    return fig


def write_plot(run_dir: Path, run_metrics: dict, title: str) -> Path | None:
    """:func:`figure` in ``mhc.png`` (None when the run logged no gain)."""
    fig = figure(run_metrics, title)
    if fig is None:
        return None
    from megatron_ext.runs.plot import _pyplot

    path = Path(run_dir) / PLOT_NAME
    from megatron_ext import files

    files.save_figure(fig, path, dpi=90)
    _pyplot().close(fig)
    return path


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


__all__ = [
    "GAIN_NAMES",
    "PLOT_NAME",
    "figure",
    "recorded_names",
    "summary_lines",
    "write_plot",
]
