"""What a finished run records and `runs` shows (issue 33, item 9): the validation loss in
metrics.json and loss.png, "finished, not compared" for a run that compared nothing, and the
overrides that change the model beside the recipe's name."""

from __future__ import annotations

import json

from megatron_ext.cli import main as cli_main
from megatron_ext.recipes import load
from megatron_ext.recipes.prepare import prepare
from megatron_ext.runs import plot, runner

RECIPE = """
version: 1
name: evaluating
model: {type: gpt, num_layers: 2, hidden_size: 32, num_attention_heads: 4, seq_length: 16}
training: {iterations: 4, micro_batch_size: 2, global_batch_size: 2, eval_interval: 2}
test: {metrics: [lm loss], golden_values: null}
"""


def _finished_run(tmp_path, overrides=()):
    """A run directory whose rank log holds Megatron's iteration and validation lines, through
    the runner's last step (finalize, which every local and Slurm run ends with)."""
    recipe = tmp_path / "evaluating.yaml"
    recipe.write_text(RECIPE)
    run_dir = tmp_path / "runs" / "evaluating-cpu"
    (run_dir / "logs").mkdir(parents=True)
    lines = []
    for step, loss in ((1, 4.0), (2, 3.5), (3, 3.2), (4, 3.0)):
        lines.append(f" iteration {step:8d}/       4 | lm loss: {loss:.6E} |")
        if step % 2 == 0:
            lines.append(
                f" validation loss at iteration {step} | lm loss value: {loss + 0.25:.6E} |"
            )
    (run_dir / "logs" / "rank-1.log").write_text("\n".join(lines) + "\n")
    loaded = load(recipe, overrides=list(overrides))
    (run_dir / "recipe.yaml").write_text(RECIPE)
    out: list[str] = []
    outcome = runner.finalize(
        prepare(loaded, megatron_checks=False, check_pickles=False),
        run_dir,
        [],
        started=0.0,
        echo=out.append,
    )
    return run_dir, outcome


def test_the_validation_loss_is_recorded_and_plotted(tmp_path, monkeypatch):
    drawn = []
    original = plot._draw
    monkeypatch.setattr(
        plot,
        "_draw",
        lambda ax, series, **style: (
            drawn.append(style.get("label")),
            original(ax, series, **style),
        ),
    )
    run_dir, outcome = _finished_run(tmp_path)
    assert outcome.exit_code == 0
    recorded = json.loads((run_dir / "metrics.json").read_text())
    assert recorded["lm loss validation"]["values"] == {"2": 3.75, "4": 3.25}
    assert "lm loss validation" in drawn and (run_dir / "loss.png").exists()


def test_runs_says_finished_not_compared_and_shows_model_overrides(tmp_path, capsys):
    run_dir, _ = _finished_run(tmp_path, ["model.hidden_size=64", "training.seed=7"])
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["reports"] == []
    assert cli_main(["runs", "--runs-root", str(tmp_path / "runs")]) == 0
    row = capsys.readouterr().out.splitlines()[1]
    assert "evaluating [model.hidden_size=64]" in row, row
    assert "finished, not compared" in row and "passed" not in row, row
    assert cli_main(["runs", "show", str(run_dir)]) == 0
    assert "status     finished, not compared" in capsys.readouterr().out
