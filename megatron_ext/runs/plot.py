"""A run's curves as a PNG, drawn with matplotlib.

    write_run_plot("loss.png", run_metrics, golden=golden_metrics, resumed=resumed_metrics,
                   resume_step=5, title="gpt_tp2_pp2 (cpu)")

One panel per kind of curve, sharing the step axis: every logged loss (``lm loss`` and each
MTP depth's ``mtp_N loss``), the gradient norm and the learning rate. Golden values are
overlaid dashed in the same colour; a ckpt-resume run's resumed curves are dotted and its
resume step is marked with a vertical line in every panel. Panels with nothing to show are
left out.

``write_png_plot(path, {"run": series, "golden": series}, title)`` draws named series of one
quantity in one panel (the older interface, kept for callers that have only losses).
"""

from __future__ import annotations

from pathlib import Path

Series = dict[int, float]
Metrics = dict[str, Series]

# Metric name in golden values -> the panel it belongs to.
PANELS = {"loss": "loss", "grad-norm": "gradient norm", "learning-rate": "learning rate"}


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")  # files only; no display needed
    import matplotlib.pyplot as plt

    return plt


def _panel_of(metric: str) -> str | None:
    if metric.endswith(("loss", "loss validation", "loss test")):  # Megatron's eval tags
        return "loss"
    return PANELS.get(metric)


def _draw(ax, series: Series, **style) -> None:
    steps = sorted(series)
    if steps:
        ax.plot(steps, [series[s] for s in steps], **style)


def write_run_plot(
    path: str | Path,
    run: Metrics,
    golden: Metrics | None = None,
    resumed: Metrics | None = None,
    resume_step: int | None = None,
    title: str = "",
) -> Path:
    """Losses, gradient norm and learning rate of a run (see the module docstring)."""
    plt = _pyplot()
    golden, resumed = golden or {}, resumed or {}
    metrics = sorted(
        {m for source in (run, golden, resumed) for m, s in source.items() if s and _panel_of(m)},
        key=lambda m: (m != "lm loss", m),
    )
    panels = [
        p
        for p in ("loss", "gradient norm", "learning rate")
        if any(_panel_of(m) == p for m in metrics)
    ]
    if not panels:
        panels = ["loss"]
    fig, axes = plt.subplots(
        len(panels), 1, sharex=True, squeeze=False, figsize=(8, 2.2 + 2.0 * len(panels))
    )
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for ax, panel in zip(axes[:, 0], panels, strict=True):
        for i, metric in enumerate(m for m in metrics if _panel_of(m) == panel):
            colour = colours[i % len(colours)]
            _draw(
                ax,
                run.get(metric, {}),
                color=colour,
                linewidth=1.8,
                marker="o",
                markersize=3,
                label=metric,
            )
            _draw(
                ax,
                golden.get(metric, {}),
                color=colour,
                linewidth=1.2,
                linestyle="--",
                label=f"{metric} (golden)",
            )
            _draw(
                ax,
                resumed.get(metric, {}),
                color=colour,
                linewidth=1.2,
                linestyle=":",
                marker="x",
                markersize=4,
                label=f"{metric} (resumed)",
            )
        if resume_step is not None:
            ax.axvline(
                resume_step,
                color="grey",
                linewidth=1,
                linestyle="-.",
                label=f"resumed from step {resume_step}",
            )
        ax.set_ylabel(panel)
        ax.grid(True, alpha=0.3)
        if ax.has_data():
            ax.legend(fontsize=8, loc="best")
        else:
            ax.text(0.5, 0.5, "no data", transform=ax.transAxes, ha="center", va="center")
    axes[-1, 0].set_xlabel("iteration")
    axes[-1, 0].xaxis.get_major_locator().set_params(integer=True)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    path = Path(path)
    from megatron_ext import files

    files.save_figure(fig, path, dpi=100)
    plt.close(fig)
    return path


def write_png_plot(path: str | Path, series: dict[str, Series], title: str = "") -> Path:
    """Named series of one quantity (e.g. ``{"run": ..., "golden": ...}``) in one panel;
    series named "golden" are dashed."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(8, 4.4))
    for name, data in series.items():
        _draw(
            ax,
            data,
            linestyle="--" if name == "golden" else "-",
            marker="o",
            markersize=3,
            label=name,
        )
    if ax.has_data():
        ax.legend(fontsize=8)
    else:
        ax.text(0.5, 0.5, "no data", transform=ax.transAxes, ha="center", va="center")
    ax.set_xlabel("iteration")
    ax.grid(True, alpha=0.3)
    if title:
        ax.set_title(title)
    fig.tight_layout()
    path = Path(path)
    from megatron_ext import files

    files.save_figure(fig, path, dpi=100)
    plt.close(fig)
    return path
