"""`compare` of run directories and the run plots' titles (issue 41, item 7): titles carry the
overrides, panels constant in every run are left out, throughput has its unit, more than two
runs compare against the first, and long lists of metric names are wrapped."""

from __future__ import annotations

from pathlib import Path

from megatron_ext.cli import main as cli_main
from megatron_ext.recipes import load
from megatron_ext.recipes.prepare import prepare
from megatron_ext.runs import resume as rsm, side_by_side as sbs, verdict

from recipe_texts import REPO_ROOT


def _run_dir(path: Path, lines: dict[int, str]) -> Path:
    """A run directory whose last rank logged ``lines`` (step -> the fields after the step)."""
    path.mkdir(parents=True)
    (path / "recipe.yaml").write_text("training: {iterations: 10}\n")
    rsm.write_run_record(path, {"recipe": "r.yaml", "platform": "cpu", "resumable": True})
    (path / "logs").mkdir()
    text = "".join(f" iteration {s:8d}/      10 | {f} |\n" for s, f in lines.items())
    (path / "logs" / "rank-1.log").write_text(text)
    return path


def _fields(loss: float, lr: float = 1e-3, zeros: float = 0.0) -> str:
    return f"learning rate: {lr:.6E} | lm loss: {loss:.6E} | num zeros: {zeros:.1f}"


def test_plot_titles_carry_the_overrides():
    recipe = REPO_ROOT / "recipes/gpt_mhc_pp2_real_data.yaml"
    plain = prepare(load(recipe, "cpu"), megatron_checks=False, check_pickles=False)
    v4 = prepare(
        load(recipe, "cpu", ["model.mhc.variant=deepseek-v4"]),
        megatron_checks=False,
        check_pickles=False,
    )
    assert verdict.plot_title(plain.display) == "gpt_mhc_pp2_real_data (cpu)"
    title = verdict.plot_title(v4.display)
    assert title.splitlines()[0] == "gpt_mhc_pp2_real_data (cpu)"
    assert "model.mhc.variant=deepseek-v4" in title
    assert title != verdict.plot_title(plain.display)


def test_constant_panels_are_left_out_of_the_plot(tmp_path, capsys):
    a = _run_dir(tmp_path / "a", {s: _fields(5.0 - s) for s in (1, 2, 3)})
    b = _run_dir(tmp_path / "b", {s: _fields(5.5 - s) for s in (1, 2, 3)})
    curves = [sbs.read(a), sbs.read(b)]
    drawn, flat = sbs.plotted(curves, sbs.metric_sets(*curves).common)
    assert drawn == ["lm loss"]
    assert flat == ["learning-rate", "num-zeros"]
    # a constant that differs between the runs, or a series that varies in one, is drawn
    c = _run_dir(tmp_path / "c", {s: _fields(5.0 - s, lr=2e-3, zeros=s) for s in (1, 2, 3)})
    drawn, flat = sbs.plotted([curves[0], sbs.read(c)], ["learning-rate", "num-zeros"])
    assert drawn == ["learning-rate", "num-zeros"] and flat == []
    png = tmp_path / "cmp.png"
    assert cli_main(["compare", str(a), str(b), "--plot", str(png)]) == 0
    out = capsys.readouterr().out
    assert "constant in every run (not plotted): learning-rate, num-zeros" in out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_throughput_is_shown_with_its_unit():
    assert sbs.with_unit("throughput") == "throughput (TFLOP/s/GPU)"
    assert sbs.with_unit("iteration-time") == "iteration-time (s)"
    assert sbs.with_unit("lm loss") == "lm loss"
    a = sbs.RunCurves("a", {"throughput": {1: 10.0, 2: 12.0}}, [])
    b = sbs.RunCurves("b", {"throughput": {1: 11.0, 2: 12.0}}, [])
    rows = sbs.differences([a, b], ["throughput"])
    assert any(line.startswith("throughput (TFLOP/s/GPU)") for line in sbs.table([a, b], rows))


def test_compare_takes_three_runs_each_against_the_first(tmp_path, capsys):
    runs = [
        _run_dir(tmp_path / name, {s: _fields(base - s) for s in (1, 2)})
        for name, base in (("a", 5.0), ("b", 5.5), ("c", 7.0))
    ]
    png = tmp_path / "three.png"
    assert cli_main(["compare", *map(str, runs), "--plot", str(png)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[:3] == ["A = a", "B = b", "C = c"]
    rows = [line.split() for line in out if line.startswith("lm loss")]
    # metric (two words), vs, steps, max |A-X|
    assert [r[2:5] for r in rows] == [["B", "2", "0.5"], ["C", "2", "2"]], rows
    assert png.exists()


def test_three_inputs_need_runs(tmp_path, capsys):
    a = _run_dir(tmp_path / "a", {1: _fields(4.0)})
    golden = tmp_path / "g.json"
    golden.write_text("{}")
    assert cli_main(["compare", str(a), str(golden), str(a)]) == 2
    assert "more than two inputs compare runs" in capsys.readouterr().err


def test_long_metric_lists_are_wrapped():
    names = [f"mhc/layer_{i}/h_res_distance" for i in range(64)]
    a = sbs.RunCurves("mhc", {"lm loss": {1: 1.0}, **{n: {1: 0.0} for n in names}}, [])
    b = sbs.RunCurves("plain", {"lm loss": {1: 1.0}}, [])
    lines = sbs.only_in_one_run([a, b], sbs.metric_sets(a, b))
    assert lines[0] == "present in mhc only (not compared): 64 metrics"
    assert len(lines) > 10 and all(len(line) <= 100 for line in lines)
    assert " ".join(line.strip() for line in lines[1:]) == ", ".join(sorted(names))
    short = sbs.wrapped("present in x only (not compared):", ["grad-norm"])
    assert short == ["present in x only (not compared): grad-norm"]
