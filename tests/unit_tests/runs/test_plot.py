"""Run plots drawn with matplotlib: one panel per kind of curve, golden and resumed overlays."""

import matplotlib

matplotlib.use("Agg")
import matplotlib.figure  # noqa: E402
import matplotlib.image as mpimg  # noqa: E402

from megatron_ext.runs import plot  # noqa: E402

PNG = b"\x89PNG\r\n\x1a\n"


def test_run_plot_has_a_panel_per_quantity_and_every_overlay(tmp_path, monkeypatch):
    run = {
        "lm loss": {1: 4.85, 2: 4.8, 3: 4.6, 4: 4.4},
        "mtp_1 loss": {1: 4.9, 2: 4.85, 3: 4.7, 4: 4.5},
        "grad-norm": {1: 2.0, 2: 1.5, 3: 1.2, 4: 1.1},
        "learning-rate": {1: 1e-3, 2: 1e-3, 3: 1e-3, 4: 1e-3},
        "num-zeros": {1: 0.0},
    }
    golden = {"lm loss": {1: 4.85, 2: 4.81, 3: 4.61, 4: 4.41}}
    resumed = {"lm loss": {3: 4.6, 4: 4.4}}
    drawn = {}
    savefig = matplotlib.figure.Figure.savefig

    def spy(fig, *args, **kwargs):
        drawn["panels"] = [
            (ax.get_ylabel(), [line.get_label() for line in ax.get_lines()]) for ax in fig.axes
        ]
        drawn["title"] = fig._suptitle.get_text()
        return savefig(fig, *args, **kwargs)

    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", spy)
    path = plot.write_run_plot(
        tmp_path / "loss.png", run, golden, resumed, resume_step=2, title="gpt_tp2_pp2 (cpu)"
    )
    assert path.read_bytes()[:8] == PNG
    assert drawn["title"] == "gpt_tp2_pp2 (cpu)"
    panels = dict(drawn["panels"])
    assert list(panels) == ["loss", "gradient norm", "learning rate"]  # num-zeros has no panel
    assert panels["loss"] == [
        "lm loss",
        "lm loss (golden)",
        "lm loss (resumed)",
        "mtp_1 loss",
        "resumed from step 2",
    ]
    assert panels["gradient norm"] == ["grad-norm", "resumed from step 2"]
    height, width, _ = mpimg.imread(path).shape
    assert width == 800 and height > 600


def test_empty_and_single_point_series_still_render(tmp_path):
    assert plot.write_run_plot(tmp_path / "a.png", {}).read_bytes()[:8] == PNG
    assert plot.write_png_plot(tmp_path / "b.png", {"run": {1: 2.0}}).read_bytes()[:8] == PNG
