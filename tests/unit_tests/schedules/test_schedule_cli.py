"""``megatron-ext schedule``: the printed grid and figures, the picture, recipes as input."""

from pathlib import Path

from megatron_ext import cli

RECIPES = Path(__file__).parents[3] / "recipes"


def test_pp2_with_mhc_prints_grid_bubble_in_flight_and_bytes(capsys, tmp_path):
    png = tmp_path / "schedule.png"
    code = cli.main(
        [
            "schedule",
            "--pp",
            "2",
            "--microbatches",
            "4",
            "--mhc-streams",
            "4",
            "--hidden",
            "64",
            "--seq",
            "32",
            "--micro-batch-size",
            "2",
            "--plot",
            str(png),
        ]
    )
    out = capsys.readouterr().out
    assert code == 0
    assert "rank 0 | F0 F1 .  .  B0 ~  F2 B1 ~  F3 B2 ~  .  B3 ~" in out
    assert "bubble: 20.0% of the iteration idle" in out and "(p-1)/(m+p-1) = 20.0%" in out
    assert "rank 0: 2, rank 1: 1" in out
    # 4 activations one way, 4 gradients the other, each [32, 2, 4*64] fp32 = 64 KiB.
    assert "0 -> 1: 4 activation(s), 0 gradient(s) = 256.0 KiB" in out
    assert "each message [32, 2, 4*64] x 4 B = 64.0 KiB" in out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_interleaved_steps_list_the_p2p_calls(capsys):
    assert cli.main(["schedule", "--pp", "2", "--vpp", "2", "--microbatches", "4", "--steps"]) == 0
    out = capsys.readouterr().out
    assert "microbatch_group_size_per_vp_stage=2" in out
    assert "(p-1)/(m+p-1)/v = 10.0%" in out
    assert "send_forward_backward_recv_forward_backward(sF1c1+rB0c1)" in out


def test_multimodule_recipe(capsys):
    code = cli.main(["schedule", "--recipe", str(RECIPES / "multimodule_encoder_llm_mhc_pp2.yaml")])
    out = capsys.readouterr().out
    assert code == 0
    assert "rank 0: vision_encoder, warm-up 2" in out and "rank 3: llm, warm-up 0" in out


def test_bad_plans_name_the_flag(capsys):
    assert cli.main(["schedule", "--pp", "4", "--vpp", "2", "--microbatches", "2"]) == 2
    assert "must lie in [pp=4, microbatches=2]" in capsys.readouterr().err
    assert cli.main(["schedule", "--pp", "2"]) == 2
    assert "give --pp and --microbatches" in capsys.readouterr().err


def test_readme_shows_the_real_output(capsys):
    """docs/schedules.md's example is what the command prints, and its picture is in docs/."""
    readme = (RECIPES.parent / "docs" / "schedules.md").read_text()
    command = "megatron-ext schedule --pp 2 --microbatches 4 --mhc-streams 4 --hidden 64 --seq 32 --micro-batch-size 2"
    assert command in readme
    cli.main(command.split()[1:])
    printed = "\n".join(line.rstrip() for line in capsys.readouterr().out.strip().splitlines())
    assert printed in readme
    assert (RECIPES.parent / "docs" / "schedule_pp4_vpp2_m8.png").is_file()


def test_zb_h1_pp4_m8_beside_1f1b(capsys, tmp_path):
    """The grid shows W steps; the bubble is stated with its F, B, W costs next to 1F1B's for
    the same plan and work and both textbook figures; peak in-flight per rank for both; the
    picture draws W in its own colour."""
    png = tmp_path / "zb.png"
    argv = "schedule --schedule zb-h1 --pp 4 --microbatches 8 --plot".split() + [str(png)]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert "schedule: ZB-H1 (megatron_ext.pipeline.zero_bubble: B = input gradient" in out
    assert "rank 0 | F0 F1 F2 F3 .  .  .  B0 W0 F4 B1 W1 F5" in out
    assert "rank 3 | .  .  .  F0 B0 F1 B1 F2 B2 F3 B3 W0 F4" in out
    assert "bubble: 11.1% of the iteration idle (ZB-H1, F=1, B=1, W=1; communication free)" in out
    assert "1F1B, same plan and work: 27.3% (F=1, B=2, B being the whole backward)" in out
    assert "textbook 1F1B (p-1)/(m+p-1) = 27.3%; ZB-H1 (p-1)/(3m+p-1) = 11.1%" in out
    assert "ZB-H1: rank 0: 4, rank 1: 4, rank 2: 4, rank 3: 4" in out
    assert "1F1B:  rank 0: 4, rank 1: 3, rank 2: 2, rank 3: 1" in out
    from matplotlib.image import imread

    from megatron_ext.schedules.timeline import colour_of

    pixels = {tuple(round(c * 255) for c in px[:3]) for row in imread(png) for px in row}
    for kind in "FBW":
        rgb = colour_of(kind, 0)
        assert tuple(int(rgb[i : i + 2], 16) for i in (1, 3, 5)) in pixels, kind
    assert colour_of("W", 0) not in {colour_of("F", 0), colour_of("B", 0)}


def test_zb_h1_with_stated_costs(capsys):
    """PP=2, m=2, F=1, a backward of 3 of which W=1 (B=2). ZB-H1: rank 1 runs F0 1-2, B0 2-4,
    F1 4-5, B1 5-7, W0 7-8, W1 8-9; rank 0's B1 waits for it (7-9), then W1 9-10: 10 units, 8
    busy per rank, bubble 20%. 1F1B: rank 0's B1 runs 9-12: 12 units, bubble 1/3."""
    argv = "schedule --schedule zb-h1 --pp 2 --microbatches 2 --forward-time 1 --backward-time 3 --weight-time 1"
    assert cli.main(argv.split()) == 0
    out = capsys.readouterr().out
    assert "rank 1 | .  F0 B0 ~  F1 B1 ~  W0 W1 ." in out
    assert "F (forward) takes 1 column, B (input gradient) 2, W (weight gradient) 1" in out
    assert "bubble: 20.0% of the iteration idle (ZB-H1, F=1, B=2, W=1" in out
    assert "1F1B, same plan and work: 33.3% (F=1, B=3," in out


def test_zb_h1_refusals_are_one_line(capsys):
    cases = [
        ("--schedule zb-h1 --pp 4 --vpp 2 --microbatches 8", "schedule zb-h1 with --vpp"),
        ("--schedule zb-h2 --pp 4 --microbatches 8", "--schedule zb-h2: use one of 1f1b, zb-h1"),
        ("--schedule zb-h1 --pp 4 --microbatches 8 --weight-time 2", "--weight-time 2"),
        ("--schedule zb-h1 --pp 4 --microbatches 8 --forward-time 0", "--forward-time 0"),
        ("--schedule zb-h1 --pp 4 --microbatches 8 --backward-time nan", "--backward-time nan"),
        ("--schedule zb-h1 --pp 10000 --microbatches 10000000", "fewer micro-batches"),
        ("--schedule zb-h1 --pp 2000 --microbatches 1", "cells"),
        ("--schedule zb-h1 --pp 4 --microbatches 8 --weight-time 0.001", "small whole ratios"),
    ]
    for argv, words in cases:
        assert cli.main(["schedule", *argv.split()]) == 2, argv
        err = capsys.readouterr().err
        assert len(err.strip().splitlines()) == 1 and words in err, (argv, err)


def test_zb_h1_at_the_size_bound_answers_quickly(capsys):
    """64 stages x 312 micro-batches (just under the 20,000-step bound): ZB-H1 and the 1F1B
    it is compared with, built, simulated and printed within the bound."""
    import time

    from megatron_ext.testing import timing

    limit = timing.bound(10)  # about 2.5 s on the idle 2-core machine
    start = time.monotonic()
    assert cli.main("schedule --schedule zb-h1 --pp 64 --microbatches 312".split()) == 0
    took = time.monotonic() - start
    assert took < limit, limit.explain(took)
    assert "1F1B, same plan and work" in capsys.readouterr().out


def test_the_recipe_field_picks_the_schedule():
    """parallelism.schedule reaches the plan; a recipe without it trains with 1F1B."""
    from types import SimpleNamespace

    from megatron_ext.recipes import load
    from megatron_ext.recipes.schedule import plan_from_loaded

    loaded = load(RECIPES / "gpt_tp2_pp2.yaml", "cpu", [])
    plan, _ = plan_from_loaded(loaded)
    assert plan.schedule == getattr(loaded.recipe.parallelism, "schedule", "1f1b") == "1f1b"
    parallelism = SimpleNamespace(**{**vars(loaded.recipe.parallelism), "schedule": "zb-h1"})
    recipe = SimpleNamespace(**{**vars(loaded.recipe), "parallelism": parallelism})
    plan, _ = plan_from_loaded(SimpleNamespace(recipe=recipe))
    assert plan.schedule == "zb-h1" and plan.pp == 2 and plan.problems() == []


def test_readme_shows_the_real_zb_h1_output(capsys):
    """docs/schedules.md's ZB-H1 example is what the command prints, and its picture is in docs/."""
    readme = (RECIPES.parent / "docs" / "schedules.md").read_text()
    assert "megatron-ext schedule --schedule zb-h1 --pp 4 --microbatches 8" in readme
    assert cli.main("schedule --schedule zb-h1 --pp 4 --microbatches 8".split()) == 0
    printed = "\n".join(line.rstrip() for line in capsys.readouterr().out.strip().splitlines())
    assert printed in readme
    assert (RECIPES.parent / "docs" / "schedule_zb_h1_pp4_m8.png").is_file()


def test_extreme_step_times_are_one_short_line(capsys):
    """1e308 printed a 309-digit column count; 1e-308 was an OverflowError (issue 34 item 17)."""
    for argv in (
        "--pp 2 --microbatches 4 --forward-time 1e308",
        "--pp 2 --microbatches 4 --forward-time 1e-308",
        "--pp 2 --microbatches 4 --forward-time 1e-308 --backward-time 1e308",
        "--schedule zb-h1 --pp 2 --microbatches 4 --weight-time 1e-308",
    ):
        assert cli.main(["schedule", *argv.split()]) == 2, argv
        err = capsys.readouterr().err
        assert len(err.strip().splitlines()) == 1 and "small whole ratios" in err, (argv, err)
        assert len(err) < 300, (argv, err)
