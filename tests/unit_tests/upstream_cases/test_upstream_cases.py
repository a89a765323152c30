"""Megatron-LM test cases (model_config.yaml) as recipes: each upstream field, test type and
placeholder, the cpu overlay, golden files named upstream's way, and `megatron-ext import`.
The test cases here are written for these tests (never copied from Megatron-LM)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from megatron_ext import cli
from megatron_ext.recipes import RecipeError, load
from megatron_ext.recipes.validate import validate
from megatron_ext.upstream_cases import model_config as upstream

from recipe_texts import BASE_ARGS, MINIMAL, write_case

REPO_ROOT = Path(__file__).resolve().parents[3]
OUR_CASE = (
    REPO_ROOT / "tests/functional_tests/test_cases/gpt/gpt3_mcore_tp2_pp2_cpu/model_config.yaml"
)


def _gpu(tmp_path, model_args=None, **top):
    """The case's own sizes (its GPU platform), where no overlay changed anything."""
    return load(write_case(tmp_path, model_args, **top), "dgx_h100").recipe


# ---- MODEL_ARGS: every managed flag lands in its field, never in extra_args ---------------------
@pytest.mark.parametrize(
    "flag, value, field, expected",
    [
        ("--num-layers", 8, "model.num_layers", 8),
        ("--hidden-size", 128, "model.hidden_size", 128),
        ("--ffn-hidden-size", 256, "model.ffn_hidden_size", 256),
        ("--num-query-groups", 2, "model.num_query_groups", 2),
        ("--position-embedding-type", "rope", "model.position_embedding", "rope"),
        ("--normalization", "RMSNorm", "model.normalization", "RMSNorm"),
        ("--untie-embeddings-and-output-weights", True, "model.untie_embeddings", True),
        ("--transformer-impl", "local", "model.transformer_impl", "local"),
        ("--enable-hyper-connections", True, "model.mhc.enabled", True),  # upstream dev's spelling
        ("--enable-mhc-connections", True, "model.mhc.enabled", True),  # upstream main's spelling
        ("--num-residual-streams", 2, "model.mhc.num_residual_streams", 2),
        ("--mhc-sinkhorn-iterations", 7, "model.mhc.sinkhorn_iterations", 7),
        ("--mhc-h-res-method", "birkhoff", "model.mhc.h_res_method", "birkhoff"),
        ("--sequence-parallel", True, "parallelism.sp", True),
        ("--context-parallel-size", 2, "parallelism.cp", 2),
        ("--lr", 3.0e-4, "training.lr", 3.0e-4),
        ("--min-lr", 1.0e-5, "training.min_lr", 1.0e-5),
        ("--lr-decay-style", "cosine", "training.lr_schedule", "cosine"),
        ("--lr-warmup-fraction", 0.01, "training.lr_warmup_fraction", 0.01),
        ("--lr-decay-iters", 320000, "training.lr_decay_iters", 320000),
        ("--weight-decay", "1e-2", "training.weight_decay", 0.01),
        ("--clip-grad", 0.5, "training.clip_grad", 0.5),
        ("--seed", 42, "training.seed", 42),
        ("--bf16", True, "training.dtype", "bf16"),
        ("--fp16", True, "training.dtype", "fp16"),
        ("--deterministic-mode", True, "training.deterministic", True),
        ("--eval-interval", 4, "training.eval_interval", 4),
        ("--split", "98,1,1", "data.split", "98,1,1"),
        ("--ckpt-format", "torch", "test.ckpt_format", "torch"),
    ],
)
def test_a_managed_flag_goes_to_its_field(tmp_path, flag, value, field, expected):
    args = {**BASE_ARGS, flag: value}
    case = tmp_path / "gpt" / "c"
    case.mkdir(parents=True)
    # Written as upstream writes it: unquoted (1e-2 is a number, as Megatron-LM's files mean it).
    lines = ["MODEL_ARGS:"] + [
        f"  {k}: {v if not isinstance(v, bool) else str(v).lower()}" for k, v in args.items()
    ]
    (case / "model_config.yaml").write_text("\n".join(lines) + "\n")
    recipe = load(case / "model_config.yaml", "dgx_h100").recipe  # the case's own values
    got = recipe
    for part in field.split("."):
        got = getattr(got, part)
    assert got == expected
    assert flag not in recipe.extra_args


def test_other_flags_go_to_extra_args_and_lists_are_split(tmp_path):
    recipe = _gpu(
        tmp_path,
        {
            "--attention-softmax-in-fp32": True,
            "--cuda-graph-modules": "[attn moe_router]",
            "--no-gradient-accumulation-fusion": True,
        },
    )
    assert recipe.extra_args == {
        "--attention-softmax-in-fp32": True,
        "--cuda-graph-modules": ["attn", "moe_router"],
        "--no-gradient-accumulation-fusion": True,
    }


@pytest.mark.parametrize(
    "args, mhc_recompute, extra",
    [
        ({"--recompute-granularity": "selective", "--recompute-modules": "[mhc]"}, True, {}),
        ({"--recompute-hyper-connections": True, "--recompute-granularity": "selective"}, True, {}),
        (
            {"--recompute-granularity": "full", "--recompute-method": "uniform"},
            False,
            {"--recompute-granularity": "full", "--recompute-method": "uniform"},
        ),
    ],
)
def test_recompute_flags(tmp_path, args, mhc_recompute, extra):
    recipe = _gpu(tmp_path, {"--enable-hyper-connections": True, **args})
    assert recipe.model.mhc.recompute is mhc_recompute
    assert recipe.extra_args == extra


def test_layers_per_virtual_stage_become_vpp_and_data_paths_their_entries(tmp_path, monkeypatch):
    monkeypatch.setenv("DATA_PATH", str(tmp_path))
    for ext in (".bin", ".idx"):
        (tmp_path / f"doc{ext}").write_text("")
    recipe = _gpu(
        tmp_path,
        {
            "--num-layers": 8,
            "--num-layers-per-virtual-pipeline-stage": 2,
            "--mock-data": None,
            "--data-path": "${DATA_PATH}/doc",
        },
    )
    assert recipe.parallelism.vpp == 2
    assert recipe.data.type == "indexed" and recipe.data.paths == [f"{tmp_path}/doc"]


# ---- placeholders --------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "flag, value, where, expected",
    [
        ("--data-cache-path", "${DATA_CACHE_PATH}", "extra_args", "@RUN_DIR@/data_cache"),
        ("--ckpt-assume-constant-structure", "${OUTPUT_PATH}/x", "extra_args", "@RUN_DIR@/x"),
    ],
)
def test_ci_paths_become_run_directory_paths(tmp_path, flag, value, where, expected):
    recipe = _gpu(tmp_path, {flag: value})
    assert recipe.extra_args[flag] == expected


def test_runner_owned_flags_and_their_placeholders_are_left_to_the_runner(tmp_path):
    path = write_case(
        tmp_path,
        {
            "--save": "${CHECKPOINT_SAVE_PATH}",
            "--load": "${CHECKPOINT_LOAD_PATH}",
            "--tensorboard-dir": "${TENSORBOARD_PATH}",
            "--log-interval": 1,
            "--distributed-backend": "nccl",
        },
    )
    loaded = load(path)
    assert loaded.recipe.extra_args == {}
    assert any("left to the runner: --save, --load, --tensorboard-dir" in n for n in loaded.notes)


def test_an_unset_environment_placeholder_is_named_with_the_fix(tmp_path, monkeypatch):
    monkeypatch.delenv("DATA_PATH", raising=False)
    path = write_case(tmp_path, {"--mock-data": None, "--data-path": "${DATA_PATH}/doc"})
    assert load(path).recipe.data.type == "mock"  # the cpu overlay needs no data set
    with pytest.raises(RecipeError) as error:
        load(path, "dgx_h100")
    assert "MODEL_ARGS.--data-path: ${DATA_PATH} is not set; export DATA_PATH" in str(error.value)


# ---- TEST_TYPE, METRICS, ENV_VARS, unknown keys --------------------------------------------------
@pytest.mark.parametrize(
    "test_type, outcome",
    [
        ("regular", "regular"),
        ("ckpt-resume", "ckpt-resume"),
        (
            "frozen-start",
            "TEST_TYPE: 'frozen-start' is not supported: trains from a frozen checkpoint",
        ),
        (
            "frozen-resume",
            "TEST_TYPE: 'frozen-resume' is not supported: resumes a frozen checkpoint",
        ),
        ("release", "TEST_TYPE: 'release' is not supported: a full-size release run"),
        ("checkpoint-consistency", "TEST_TYPE: 'checkpoint-consistency' is not supported"),
        (
            "resume-ckpt",
            "TEST_TYPE: unknown test type 'resume-ckpt'; megatron-ext runs regular, ckpt-resume",
        ),
    ],
)
def test_test_types(tmp_path, test_type, outcome):
    path = write_case(tmp_path, TEST_TYPE=test_type)
    if outcome in upstream.SUPPORTED_TEST_TYPES:
        assert load(path).recipe.test.type == outcome
        return
    with pytest.raises(RecipeError) as error:
        load(path)
    assert len(error.value.problems) == 1 and outcome in str(error.value.problems[0])


def test_metrics_env_vars_and_unknown_keys(tmp_path):
    recipe = load(write_case(tmp_path)).recipe
    assert recipe.test.metrics == ["lm loss", "num-zeros"]  # upstream's default
    assert recipe.launch.env == {"CUDA_DEVICE_MAX_CONNECTIONS": 1}
    recipe = load(write_case(tmp_path, METRICS=["lm loss"], ENV_VARS={"LIGHT": True})).recipe
    assert recipe.test.metrics == ["lm loss"] and recipe.launch.env == {"LIGHT": "true"}
    with pytest.raises(RecipeError) as error:
        load(write_case(tmp_path, METRIC=["lm loss"]))
    assert "METRIC: not a Megatron-LM test-case key (did you mean 'METRICS'?)" in str(error.value)


def test_world_size_comes_from_the_parallel_sizes(tmp_path):
    recipe = load(
        write_case(tmp_path, {"--num-experts": 4, "--expert-model-parallel-size": 4})
    ).recipe
    # The expert grid etp(=tp 2) * ep 4 * pp 2 = 16 ranks: dp 4 (issue 33 item 5; dp 2 was
    # megatron's "world_size (8) is not divisible by expert_tensor_model_pipeline_parallel size")
    assert (recipe.parallelism.dp, recipe.world_size) == (4, 16)


# ---- the cpu overlay -----------------------------------------------------------------------------
def test_the_cpu_overlay_shrinks_and_says_what_it_changed(tmp_path):
    big = {
        "--num-layers": 12,
        "--hidden-size": 512,
        "--num-attention-heads": 8,
        "--seq-length": 1024,
        "--max-position-embeddings": 1024,
        "--micro-batch-size": 4,
        "--global-batch-size": 32,
        "--train-iters": 50,
        "--bf16": True,
        "--transformer-impl": "transformer_engine",
        "--vocab-size": 50257,
        "--cuda-graph-impl": "transformer_engine",
    }
    path = write_case(tmp_path, big)
    cpu = load(path)
    r = cpu.recipe
    assert (
        r.model.num_layers,
        r.model.hidden_size,
        r.model.num_attention_heads,
        r.model.seq_length,
    ) == (4, 64, 4, 32)
    assert (r.training.iterations, r.training.micro_batch_size, r.training.global_batch_size) == (
        8,
        2,
        8,
    )
    assert (r.training.dtype, r.model.transformer_impl, r.launch.device) == ("fp32", "local", "cpu")
    assert "--cuda-graph-impl" not in r.extra_args
    assert "cpu overlay: model.hidden_size: 512 -> 64 (CPU size)" in cpu.notes
    assert any(
        n.startswith("cpu overlay: extra_args: left out --cuda-graph-impl") for n in cpu.notes
    )
    gpu = load(path, "dgx_h100").recipe  # the case's own sizes are untouched on its platform
    assert (gpu.model.hidden_size, gpu.training.dtype, gpu.launch.device) == (512, "bf16", "gpu")
    assert gpu.extra_args["--cuda-graph-impl"] == "transformer_engine"


def test_golden_files_named_upstreams_way_are_found(tmp_path):
    path = write_case(tmp_path)
    for name in (
        "golden_values_lts_dgx_a100.json",
        "golden_values_dev_dgx_a100.json",
        "golden_values_lts_cpu.json",
    ):
        (path.parent / name).write_text("{}")
    assert load(path).golden_path() == path.parent / "golden_values_lts_cpu.json"
    assert load(path, "dgx_a100").golden_path() == path.parent / "golden_values_dev_dgx_a100.json"
    assert (
        upstream.golden_file(path.parent, "dgx_h100") == "golden_values_dev_dgx_h100.json"
    )  # to write


# ---- conflicts, our own case, the import command ------------------------------------------------
@pytest.mark.parametrize(
    "flag, value, field",
    [
        ("--pipeline-model-parallel-size", 1, "parallelism.pp"),
        ("--num-layers", 8, "model.num_layers"),
        ("--bf16", True, "training.dtype"),
        ("--mock-data", True, "data.type"),
    ],
)
def test_extra_args_that_a_field_manages_are_errors_naming_the_field(
    write_recipe, flag, value, field
):
    loaded = load(write_recipe(MINIMAL), overrides=[f"extra_args.{flag}={value}"])
    problems = [str(p) for p in validate(loaded, megatron_checks=False).problems]
    assert problems == [
        f"extra_args.{flag}: is set by {field}; set that field instead (the flag would override it)"
    ]


def test_runner_flags_in_extra_args_are_errors(write_recipe):
    loaded = load(write_recipe(MINIMAL), overrides=["extra_args.--save=/tmp/x"])
    assert [str(p) for p in validate(loaded, megatron_checks=False).problems] == [
        "extra_args.--save: is managed by megatron-ext: test.type ckpt-resume saves into RUN_DIR/checkpoints; remove it"
    ]


def test_our_upstream_format_case_is_the_gpt_tp2_pp2_model_on_cpu():
    ours = load(OUR_CASE).recipe
    recipe = load(REPO_ROOT / "recipes/gpt_tp2_pp2.yaml").recipe
    # 'auto' is 'local' on a machine without Transformer Engine, where the overlay says it outright
    assert dataclasses.replace(ours.model, transformer_impl="auto") == recipe.model
    assert ours.parallelism == recipe.parallelism
    assert ours.training.eval_interval is None  # so eval_iters is unused (--eval-iters 0)
    assert (
        dataclasses.replace(ours.training, eval_iters=1) == recipe.training
        and ours.data == recipe.data
    )
    assert load(OUR_CASE).golden_path().name == "golden_values_dev_cpu.json"


def test_import_writes_a_recipe_that_loads_the_same(tmp_path, capsys):
    out = tmp_path / "imported.yaml"
    assert cli.main(["import", str(OUR_CASE), "-o", str(out)]) == 0
    text = out.read_text()
    assert text.startswith(f"# Imported by megatron-ext from {OUR_CASE}")
    imported = load(out)
    assert imported.recipe.model == load(OUR_CASE).recipe.model
    assert imported.golden_path().resolve() == load(OUR_CASE).golden_path().resolve()
    assert cli.main(["import", str(tmp_path / "none.yaml")]) == 2


def test_moe_with_mhc_validates(tmp_path):
    """Upstream's gpt3_mcore_te_tp2_pp2_ep4_mhc_* combination (MoE + mHC) is no longer refused:
    pretrain_gpt's MoE block spec gives every layer the n streams."""
    loaded = load(write_case(tmp_path, {"--num-experts": 4, "--enable-hyper-connections": True}))
    assert [str(p) for p in validate(loaded, megatron_checks=False).problems] == []


# Megatron-LM dev's gpt3_mcore_te_tp2_pp2_ep4_mhc_overlap_attn_cudagraph, in our words: TP2 PP2
# (VPP) EP4 ETP1 MoE with SP, dev's mHC spellings and 'mhc' recompute, the overlapped EP
# schedule and TE CUDA graphs of the attention.
MHC_MOE_OVERLAP_CASE = {
    "--num-layers": 12,
    "--num-layers-per-virtual-pipeline-stage": 3,
    "--transformer-impl": "transformer_engine",
    "--expert-model-parallel-size": 4,
    "--expert-tensor-parallel-size": 1,
    "--sequence-parallel": True,
    "--num-experts": 8,
    "--moe-router-topk": 2,
    "--moe-aux-loss-coeff": 1e-2,
    "--moe-token-dispatcher-type": "alltoall",
    "--moe-grouped-gemm": True,
    "--overlap-moe-expert-parallel-comm": True,
    "--enable-hyper-connections": True,
    "--num-residual-streams": 4,
    "--recompute-granularity": "selective",
    "--recompute-modules": "[mhc]",
    "--mhc-recompute-layer-num": 2,
    "--cuda-graph-impl": "transformer_engine",
    "--cuda-graph-modules": "[attn]",
    "--te-rng-tracker": True,
}


def test_upstream_mhc_moe_overlap_case_is_refused_for_the_overlap_and_cuda_graphs(tmp_path):
    """On its own (GPU) platform: refused for exactly what the guards reject, each with its
    reason, before Megatron's checks (which need a GPU) or any process."""
    name = "gpt3_mcore_te_tp2_pp2_ep4_mhc_overlap_attn_cudagraph"
    loaded = load(write_case(tmp_path, MHC_MOE_OVERLAP_CASE, name=name), "dgx_h100")
    assert [str(p) for p in validate(loaded, megatron_checks=False).problems] == [
        "extra_args.--overlap-moe-expert-parallel-comm: is not supported with mHC and pp=2: its "
        "overlapped schedule does not carry the n-stream residual; remove it (or set pp=1)",
        "extra_args.--cuda-graph-impl: mHC layers are not qualified with CUDA graphs (their "
        "static inputs would be single-stream); remove it",
    ]


def test_upstream_mhc_moe_overlap_case_validates_without_overlap_under_the_cpu_overlay(tmp_path):
    """The cpu overlay leaves out the GPU-only flags (the overlap, CUDA graphs, grouped GEMM):
    what remains, MoE + EP + mHC + recompute under TP/SP/PP/VPP, passes Megatron's own checks
    and the guards."""
    name = "gpt3_mcore_te_tp2_pp2_ep4_mhc_overlap_attn_cudagraph"
    loaded = load(write_case(tmp_path, MHC_MOE_OVERLAP_CASE, name=name))
    extra = loaded.recipe.extra_args
    assert "--overlap-moe-expert-parallel-comm" not in extra and "--cuda-graph-impl" not in extra
    assert loaded.recipe.model.mhc.enabled and loaded.recipe.parallelism.ep == 4
    assert [str(p) for p in validate(loaded).problems] == []


# ---- upstream's cases as its CI reads them (issue 25 item 7) -------------------------------------
def test_launcher_is_read_with_a_note_and_only_pretraining_modes_run(tmp_path):
    """330 of 333 cases on Megatron-LM main carry LAUNCHER; MODE is inference, rl or
    pretraining."""
    loaded = load(write_case(tmp_path, LAUNCHER="ft_launcher", MODE="pretraining"))
    assert any(n.startswith("LAUNCHER ft_launcher: upstream starts") for n in loaded.notes)
    for mode, reason in (("inference", "examples/inference/"), ("rl", "train_rl.py")):
        with pytest.raises(RecipeError) as error:
            load(write_case(tmp_path, LAUNCHER="ft_launcher", MODE=mode))
        assert [str(p) for p in error.value.problems] == [
            f"MODE: {mode!r} is not supported: {upstream.REFUSED_MODES[mode]}"
        ] and reason in str(error.value)
    with pytest.raises(RecipeError, match="BEFORE_SCRIPT: not supported: shell"):
        load(write_case(tmp_path, BEFORE_SCRIPT="rm -rf /"))


def test_a_key_given_twice_keeps_the_last_value_as_upstream_does(tmp_path):
    path = write_case(tmp_path)
    text = path.read_text().replace(
        "  --hidden-size: 64\n", "  --hidden-size: 32\n  --hidden-size: 64\n"
    )
    path.write_text(text)
    loaded = load(path)
    assert loaded.recipe.model.hidden_size == 64
    assert any(n.startswith("--hidden-size (line ") and "given twice" in n for n in loaded.notes)
    recipe = tmp_path / "recipe.yaml"  # in a recipe it stays an error
    recipe.write_text("version: 1\nname: a\nname: b\n")
    with pytest.raises(RecipeError, match="duplicate key 'name'"):
        load(recipe)


@pytest.mark.parametrize(
    "family, args, entry",
    [
        ("multimodal-llava", {}, "pretrain_vlm.py"),
        ("bert", {}, "pretrain_bert.py"),
        ("gpt", {"--img-h": 336, "--img-w": 336}, "pretrain_vlm.py"),
    ],
)
def test_other_model_families_are_refused_naming_their_entry(tmp_path, family, args, entry):
    path = write_case(tmp_path, args)
    case = tmp_path / family / "a_case"
    case.parent.mkdir(exist_ok=True)
    path.parent.rename(case)
    with pytest.raises(RecipeError) as error:
        load(case / "model_config.yaml")
    message = str(error.value.problems[0])
    assert message.startswith("test case: not a GPT/Hybrid case (") and entry in message


def test_the_gpu_platform_keeps_upstreams_tokenizer(tmp_path, monkeypatch):
    """No --tokenizer-type but GPT-2 BPE files: the cpu overlay's NullTokenizer and vocab size
    128 must not leak into the GPU run."""
    from megatron_ext.recipes import command

    monkeypatch.setenv("DATA_PATH", str(tmp_path))
    files = {"--vocab-file": "${DATA_PATH}/vocab.json", "--merge-file": "${DATA_PATH}/merges.txt"}
    path = write_case(tmp_path, {"--tokenizer-type": None, "--vocab-size": None, **files})
    gpu = load(path, "dgx_h100")
    argv = command.megatron_args(gpu)
    assert argv[argv.index("--tokenizer-type") + 1] == "GPT2BPETokenizer"
    assert "--vocab-size" not in argv and "NullTokenizer" not in argv
    assert argv[argv.index("--vocab-file") + 1] == f"{tmp_path}/vocab.json"
    cpu = load(path).recipe.data.tokenizer
    assert (cpu.type, cpu.vocab_size, cpu.vocab_file) == ("NullTokenizer", 128, None)


def test_the_cpu_overlay_drops_gpu_spec_and_async_save_and_shortens_the_warmup(tmp_path):
    args = {
        "--spec": "[megatron.core.models.gpt.gpt_layer_specs get_gpt_layer_with_transformer_engine_spec]",
        "--async-save": True,
        "--use-persistent-ckpt-worker": True,
        "--lr-warmup-fraction": 0.01,
        "--lr-decay-iters": 320000,
    }
    loaded = load(write_case(tmp_path, args))
    extra = loaded.recipe.extra_args
    assert not {"--spec", "--async-save", "--use-persistent-ckpt-worker"} & set(extra)
    assert loaded.recipe.training.lr_decay_iters is None  # the decay spans the 8 CPU iterations
    notes = "\n".join(loaded.notes)
    assert "left out --spec" in notes and "nvidia-resiliency-ext" in notes
    assert "warm-up (3200 iterations) for the whole run" in notes


def test_async_save_without_its_package_is_refused_before_start(tmp_path, monkeypatch):
    monkeypatch.setattr(upstream, "ASYNC_SAVE_PACKAGE", "megatron_ext_no_such_package")
    path = write_case(tmp_path, {"--async-save": True, "--use-persistent-ckpt-worker": True})
    with pytest.raises(RecipeError) as error:
        load(path, "dgx_h100")
    assert "extra_args.--async-save: needs nvidia-resiliency-ext" in str(error.value)
    assert load(path, "dgx_h100", ["extra_args.--async-save=false"]).recipe


@pytest.mark.parametrize("value", ["null", "3", "[a]"])
def test_extra_args_that_is_not_a_mapping_is_a_problem_not_a_traceback(value):
    # Found by MEGATRON_EXT_FUZZ_EXAMPLES=2000: the --async-save check read .get of None.
    recipe = Path(__file__).resolve().parents[3] / "recipes" / "gpt_tp2_pp2.yaml"
    with pytest.raises(RecipeError) as error:
        load(recipe, "cpu", [f"extra_args={value}"])
    assert "extra_args: must be" in str(error.value) and "\n" not in str(error.value)


def test_a_regular_cases_checkpoint_format_is_passed(tmp_path):
    from megatron_ext.recipes import command

    argv = command.megatron_args(load(write_case(tmp_path, {"--ckpt-format": "torch"})))
    assert argv[argv.index("--ckpt-format") + 1] == "torch"


def test_a_guard_rejection_is_not_taken_for_a_missing_gpu_library(tmp_path):
    """mHC with CUDA graphs (upstream's gpt3_mcore_te_tp2_pp2_mhc_attn_cudagraph): the guard's
    message names CUDA, yet it is the recipe's fault, so validate must not print OK."""
    args = {
        "--enable-hyper-connections": True,
        "--cuda-graph-impl": "transformer_engine",
        "--cuda-graph-modules": "[attn]",
    }
    result = validate(load(write_case(tmp_path, args), "dgx_h100"))
    assert any("not qualified with CUDA graphs" in str(p) for p in result.problems), result


def test_import_needs_every_placeholder_and_writes_golden_paths_the_recipe_can_find(
    tmp_path, monkeypatch, capsys
):
    monkeypatch.delenv("DATA_PATH", raising=False)
    path = write_case(tmp_path, {"--mock-data": None, "--data-path": "${DATA_PATH}/doc"})
    assert cli.main(["import", str(path), "-o", str(tmp_path / "x.yaml")]) == 2
    assert "MODEL_ARGS.--data-path: ${DATA_PATH} is not set; export DATA_PATH" in (
        capsys.readouterr().err
    )
    assert not (tmp_path / "x.yaml").exists()
    capsys.readouterr()
    monkeypatch.chdir(tmp_path)  # printed, then saved elsewhere: the path must still resolve
    assert cli.main(["import", str(OUR_CASE)]) == 0
    saved = tmp_path / "elsewhere" / "recipe.yaml"
    saved.parent.mkdir()
    saved.write_text(capsys.readouterr().out)
    assert load(saved).golden_path().resolve() == load(OUR_CASE).golden_path().resolve()
