"""The run directory's command.sh, the ckpt-resume phases and the progress lines."""

from megatron_ext.recipes import load
from megatron_ext.recipes.prepare import prepare
from megatron_ext.runs import runner, verdict
from megatron_ext.runs.runner import Progress, command_script, phases, prepare_resume

from recipe_texts import REPO_ROOT

RESUME_RECIPE = REPO_ROOT / "recipes/gpt_mhc_pp2_standalone_embedding_loss.yaml"


def _request(loaded):
    return prepare(loaded, megatron_checks=False, check_pickles=False)


def test_ckpt_resume_has_two_phases_sharing_one_checkpoint_dir(tmp_path):
    train, resume = phases(_request(load(RESUME_RECIPE)), tmp_path)
    assert (train.name, resume.name) == ("train", "resume")
    assert train.log_dir == tmp_path / "logs" and resume.log_dir == tmp_path / "logs" / "resume"
    ckpt = str(tmp_path / "checkpoints")
    assert train.args[train.args.index("--save") + 1] == ckpt
    assert resume.args[resume.args.index("--load") + 1] == ckpt and "--save" not in resume.args


def test_command_sh_is_the_exact_runnable_command(tmp_path):
    script = command_script(_request(load(RESUME_RECIPE, overrides=["training.seed=5"])), tmp_path)
    assert script.startswith("#!/usr/bin/env bash\n")
    assert "overrides: training.seed=5" in script
    assert "export CUDA_VISIBLE_DEVICES='' OMP_NUM_THREADS=1" in script
    assert (
        script.count(
            "-m torch.distributed.run --standalone --nproc_per_node 2 -m megatron_ext.pretrain_gpt"
        )
        == 2
    )
    assert "    --pipeline-model-parallel-layout 'E|tt|tt|L' \\\n" in script
    assert f'rm -rf {tmp_path}/checkpoints/iter_0000010 && echo 5 > ' in script
    assert "    --seed 5 \\\n" in script


def test_prepare_resume_keeps_the_middle_checkpoint_only(tmp_path):
    loaded = load(RESUME_RECIPE)
    for it in (5, 10):
        (tmp_path / "checkpoints" / f"iter_{it:07d}").mkdir(parents=True)
    prepare_resume(_request(loaded), tmp_path)
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == [
        "iter_0000005",
        "latest_checkpointed_iteration.txt",
    ]
    assert (tmp_path / "checkpoints" / "latest_checkpointed_iteration.txt").read_text() == "5"


def test_progress_prints_one_short_line_per_iteration_and_event():
    seen = []
    progress = Progress(seen.append, "train")
    progress("some megatron output")
    progress(
        " [2026] iteration        3/      10 | consumed samples: 24 | elapsed time per iteration (ms):"
        " 308.2 | learning rate: 1.0E-03 | lm loss: 4.593707E+00 | mtp_1 loss: 4.7E+00 | grad norm: 1.866 |"
    )
    progress(
        "  [2026] successfully saved checkpoint from iteration       5 to /ck [ t 1/1, p 1/2 ]"
    )
    progress("  successfully loaded checkpoint from /ck [ t 1/1, p 1/2 ] at iteration 5")
    assert seen[0].startswith("  first iteration ")
    assert seen[1] == runner.LOSS_SOURCES  # which loss is which (issue 25 item 19)
    assert seen[2:] == [
        "  iteration    3/10 | lm loss 4.593707 | mtp_1 loss 4.700000 | grad norm 1.866 | 308 ms/iter | ETA 2s",
        "  checkpoint saved at iteration 5",
        "  checkpoint loaded (iteration 5)",
    ]


def test_the_verdict_says_passed_only_after_a_golden_comparison():
    """Issue 25 item 19: no "PASSED" when nothing was compared."""
    import types

    assert verdict.verdict([]) == "FINISHED (nothing compared with golden values)"
    passed, failed = types.SimpleNamespace(passed=True), types.SimpleNamespace(passed=False)
    assert verdict.verdict([passed]) == "PASSED"
    assert verdict.verdict([passed, failed]) == "FAILED"


def test_trace_is_suggested_only_once_the_training_loop_started(tmp_path):
    """A start-up error (no pipeline step ran) gets no "rerun with --trace" (issue 25 item 19)."""
    import types

    log = tmp_path / "rank-0.log"
    job = types.SimpleNamespace(log_path=lambda rank: log)
    progress = Progress(lambda text: None, "train")
    assert not runner._training_loop_started(job, progress)  # no log at all
    log.write_text("building GPT model ...\nValueError: bad size\n")
    assert not runner._training_loop_started(job, progress)
    log.write_text(f"[{runner.TRAINING_LOOP_MARKER}] datetime: 2026-12-02 01:00:00\n")
    assert runner._training_loop_started(job, progress)
