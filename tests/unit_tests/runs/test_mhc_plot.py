"""mhc.png shows what moves (issue 33, item 10): H_pre/H_post ranges, H_res's distance from
the identity and from uniform mixing, and the gains on a fixed axis, where a projected H_res's
1 ± 1e-7 would otherwise autoscale into spikes."""

from __future__ import annotations

from megatron_ext.runs import mhc_report

STEPS = (1, 2, 3)


def _metrics(gain_noise: float = 1e-7) -> dict:
    metrics = {
        "mhc/forward_gain": {s: 1.0 + gain_noise * (-1) ** s for s in STEPS},
        "mhc/backward_gain": {s: 1.0 - gain_noise * (-1) ** s for s in STEPS},
    }
    for layer, shift in (("layer01.self_attention", 0.0), ("layer02.mlp", 0.1)):
        name = f"mhc/{layer}"
        metrics[f"{name}/h_pre_min"] = {s: 0.1 + shift for s in STEPS}
        metrics[f"{name}/h_pre_max"] = {s: 0.6 + shift for s in STEPS}
        metrics[f"{name}/h_post_min"] = {s: 0.2 + shift for s in STEPS}
        metrics[f"{name}/h_post_max"] = {s: 1.8 - shift for s in STEPS}
        metrics[f"{name}/h_res_identity_dist"] = {s: 0.5 + 0.1 * s + shift for s in STEPS}
        metrics[f"{name}/h_res_uniform_dist"] = {s: 1.2 - 0.1 * s for s in STEPS}
        metrics[f"{name}/stream_rms_min"] = {s: 0.5 - shift for s in STEPS}
        metrics[f"{name}/stream_rms_max"] = {s: 1.0 + s + shift for s in STEPS}
        metrics[f"{name}/h_pre_sum_max"] = {s: 2.0 + shift for s in STEPS}
        metrics[f"{name}/h_post_sum_max"] = {s: 4.0 + shift * s for s in STEPS}
        metrics[f"{name}/h_res_row_err"] = {s: 10.0 ** (-s) + shift for s in STEPS}
        metrics[f"{name}/h_res_col_err"] = {s: 1e-7 for s in STEPS}
    return metrics


def _lines(ax) -> dict[str, list[float]]:
    return {line.get_label(): list(line.get_ydata()) for line in ax.get_lines()}


def test_the_panels_show_ranges_distances_and_gains_on_a_fixed_axis(tmp_path):
    fig = mhc_report.figure(_metrics(), "gpt")
    pre, post, distances, gains, streams, amplitudes, sinkhorn = fig.axes
    assert _lines(pre) == {"min": [0.1] * 3, "max": [0.7] * 3}  # over both sub-layers
    assert _lines(post) == {"min": [0.2] * 3, "max": [1.8] * 3}
    worst = _lines(distances)
    assert [round(v, 9) for v in worst["from the identity (no mixing)"]] == [0.7, 0.8, 0.9]
    assert [round(v, 9) for v in worst["from uniform mixing (J/n)"]] == [1.1, 1.0, 0.9]
    assert gains.get_ylim() == mhc_report.GAIN_AXIS  # 1 ± 1e-7 stays a flat line at 1
    # What moves while the gains stay at 1 (issue 42): the streams, the amplitudes, Sinkhorn.
    assert _lines(streams) == {"smallest stream": [0.4] * 3, "largest stream": [2.1, 3.1, 4.1]}
    assert _lines(amplitudes) == {
        "Σ H_pre (read)": [2.1] * 3,
        "Σ H_post (write-back)": [4.1, 4.2, 4.3],
    }
    lines = _lines(sinkhorn)
    assert [round(v, 9) for v in lines["max |row sum − 1|"]] == [0.2, 0.11, 0.101]
    assert lines["max |column sum − 1|"] == [1e-7] * 3 and sinkhorn.get_yscale() == "log"
    path = mhc_report.write_plot(tmp_path, _metrics(), "gpt")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_gains_that_grow_widen_the_axis_and_no_gains_no_plot(tmp_path):
    fig = mhc_report.figure(_metrics(gain_noise=2.0), "gpt")  # 3.0 at odd steps
    assert fig.axes[3].get_ylim() == (0.0, 3.3000000000000003)
    assert mhc_report.write_plot(tmp_path, {"lm loss": {1: 4.0}}, "gpt") is None
