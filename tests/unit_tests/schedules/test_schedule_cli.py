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
    """README.md's example is what the command prints, and its picture is in docs/."""
    readme = (RECIPES.parent / "README.md").read_text()
    command = "megatron-ext schedule --pp 2 --microbatches 4 --mhc-streams 4 --hidden 64 --seq 32 --micro-batch-size 2"
    assert command in readme
    cli.main(command.split()[1:])
    printed = "\n".join(line.rstrip() for line in capsys.readouterr().out.strip().splitlines())
    assert printed in readme
    assert (RECIPES.parent / "docs" / "schedule_pp4_vpp2_m8.png").is_file()
