"""Upstream cases that validated and then failed at start-up, or were refused for the wrong
reason (issue 33, items 6 and 7): the parts fixed here."""

from __future__ import annotations

import yaml

from megatron_ext.recipes import Recipe, load
from megatron_ext.recipes.checks import plan_problems
from megatron_ext.recipes.command import run_environment
from megatron_ext.recipes.validate import argv_problems
from megatron_ext.upstream_cases import model_config as upstream

from recipe_texts import write_case


def _convert(path):
    return upstream.convert(
        yaml.safe_load(path.read_text()), path.parent, defaults=Recipe().to_dict()
    )


def test_keys_upstreams_ci_reads_are_not_called_unknown(tmp_path):
    same = write_case(tmp_path, name="same", TEST_EVALUATION=True)
    raw = yaml.safe_load(same.read_text())
    raw["MODEL_ARGS_2"] = dict(raw["MODEL_ARGS"])
    same.write_text(yaml.safe_dump(raw, sort_keys=False))
    conversion = _convert(same)
    assert conversion.problems == []
    notes = conversion.notes["mapping"]
    assert any(n.startswith("TEST_EVALUATION: read by Megatron-LM's CI") for n in notes)
    assert any(n.startswith("MODEL_ARGS_2: Megatron-LM's CI runs run 2") for n in notes)
    raw["MODEL_ARGS_3"] = {**raw["MODEL_ARGS"], "--train-iters": 4}
    same.write_text(yaml.safe_dump(raw, sort_keys=False))
    (problem,) = _convert(same).problems
    assert problem.where == "MODEL_ARGS_3" and "not a Megatron-LM test-case key" not in str(problem)
    assert "runs every phase with MODEL_ARGS" in problem.what


def test_a_vocab_file_that_is_not_json_is_one_line(tmp_path, write_recipe):
    (tmp_path / "vocab.txt").write_text("hello 0\nworld 1\n")
    (tmp_path / "merges.txt").write_text("#version: 0.2\n")
    path = write_recipe(
        "version: 1\n"
        "model: {type: gpt, num_layers: 2, hidden_size: 32, num_attention_heads: 4, "
        "seq_length: 16}\n"
        "data: {tokenizer: {type: GPT2BPETokenizer, vocab_file: vocab.txt, "
        "merge_file: merges.txt, vocab_size: null}}\n"
    )
    problems = [str(p) for p in plan_problems(load(path))]
    assert any(
        p.startswith(f"data.tokenizer.vocab_file: {tmp_path}/vocab.txt is not JSON")
        for p in problems
    ), problems


FSDP = {"--use-megatron-fsdp": True, "--ckpt-format": "fsdp_dtensor"}


def test_fsdp_runs_do_not_get_the_connection_limit_megatron_forbids(write_recipe):
    text = (
        "version: 1\n"
        "model: {type: gpt, num_layers: 2, hidden_size: 32, num_attention_heads: 4, "
        "seq_length: 16}\n"
        "launch: {device: gpu}\n"
        "extra_args: {--use-megatron-fsdp: true}\n"
    )
    assert "CUDA_DEVICE_MAX_CONNECTIONS" not in run_environment(load(write_recipe(text)))
    plain = text.replace("extra_args: {--use-megatron-fsdp: true}\n", "")
    assert run_environment(load(write_recipe(plain)))["CUDA_DEVICE_MAX_CONNECTIONS"] == "1"
    cpu = load(write_recipe(text.replace("device: gpu", "device: cpu")))
    assert run_environment(cpu)["CUDA_DEVICE_MAX_CONNECTIONS"] != "1"


def test_validate_checks_fsdp_with_the_runs_environment():
    """Megatron's own check, as validate runs it: the FSDP assertion on the connection limit
    is not what stops an FSDP command line."""
    argv = [
        "--num-layers",
        "2",
        "--hidden-size",
        "32",
        "--num-attention-heads",
        "4",
        "--seq-length",
        "16",
        "--max-position-embeddings",
        "16",
        "--micro-batch-size",
        "1",
        "--global-batch-size",
        "2",
        "--train-iters",
        "2",
        "--mock-data",
        "--tokenizer-type",
        "NullTokenizer",
        "--vocab-size",
        "64",
        "--use-megatron-fsdp",
        "--ckpt-format",
        "fsdp_dtensor",
        "--use-distributed-optimizer",
        "--untie-embeddings-and-output-weights",
    ]
    problems = argv_problems(argv, "megatron_ext.pretrain_gpt", 2)
    assert not any("CUDA_DEVICE_MAX_CONNECTIONS" in p.what for p in problems), problems


def test_muon_without_emerging_optimizers_is_refused_by_validate(write_recipe, monkeypatch):
    from megatron_ext.recipes import validate as validation

    path = write_recipe(
        "version: 1\n"
        "model: {type: gpt, num_layers: 2, hidden_size: 32, num_attention_heads: 4, "
        "seq_length: 16}\n"
        "extra_args: {--optimizer: muon}\n"
    )
    monkeypatch.setattr(
        validation,
        "_module_importable",
        lambda name: name != validation.EMERGING_OPTIMIZERS_PACKAGE,
    )
    result = validation.validate(load(path), megatron_checks=False)
    assert [str(p) for p in result.problems] == [
        "extra_args.--optimizer: muon is built by the emerging-optimizers package, which is not "
        "importable here (every rank would fail building the optimizer); pip install "
        "emerging-optimizers, or use adam"
    ]
    monkeypatch.setattr(validation, "_module_importable", lambda name: True)
    assert validation.validate(load(path), megatron_checks=False).problems == []


def test_the_cpu_overlay_drops_what_only_dropped_flags_needed(tmp_path):
    """Grouped GEMM left out takes the moe_act recompute with it; TE's fused permutation is a
    GPU flag too (issue 33, item 6)."""
    args = {
        "--num-experts": 4,
        "--moe-grouped-gemm": True,
        "--moe-permute-fusion": True,
        "--recompute-granularity": "selective",
        "--recompute-modules": "moe_act layernorm",
    }
    loaded = load(write_case(tmp_path, args))
    extra = loaded.recipe.extra_args
    assert extra.get("--recompute-modules") == ["layernorm"], extra
    assert "--moe-grouped-gemm" not in extra and "--moe-permute-fusion" not in extra
    assert any("left out moe_act" in n for n in loaded.notes)
    gpu = load(write_case(tmp_path, args), "dgx_h100").recipe.extra_args
    assert "moe_act" in gpu["--recompute-modules"] and gpu["--moe-grouped-gemm"] is True


# ---- attention variants (issue 33, items 6 and 7) ----------------------------------------------
def _variant_recipe(write_recipe, variant, device="cpu"):
    return load(
        write_recipe(
            "version: 1\n"
            "model: {type: gpt, num_layers: 2, hidden_size: 32, num_attention_heads: 4, "
            "seq_length: 16}\n"
            f"launch: {{device: {device}}}\n"
            f"extra_args: {{--experimental-attention-variant: {variant}}}\n"
        )
    )


def test_te_only_attention_variants_are_refused_on_cpu(write_recipe):
    for variant in ("gated_delta_net", "dsa"):
        problems = [str(p) for p in plan_problems(_variant_recipe(write_recipe, variant))]
        assert any(
            p.startswith(f"extra_args.--experimental-attention-variant: {variant!r}")
            and "need Transformer Engine" in p
            and "do not run on CPU" in p
            for p in problems
        ), problems


def test_te_only_attention_variants_without_te_are_refused_on_gpu(write_recipe, monkeypatch):
    from megatron_ext.recipes import checks

    real = checks.importlib.util.find_spec
    monkeypatch.setattr(
        checks.importlib.util,
        "find_spec",
        lambda name, *a: None if name == "transformer_engine" else real(name, *a),
    )
    recipe = _variant_recipe(write_recipe, "gated_delta_net", device="gpu")
    problems = [str(p) for p in plan_problems(recipe)]
    assert any("need Transformer Engine, which this machine lacks" in p for p in problems)
    monkeypatch.setattr(checks.importlib.util, "find_spec", lambda name, *a: object())
    problems = [str(p) for p in plan_problems(recipe)]
    assert not any("--experimental-attention-variant" in p for p in problems), problems


def test_an_attention_variant_megatron_core_lacks_is_named(tmp_path):
    """A DeepSeek-V4-style hybrid case (written here: pattern, spec and variant flags)."""
    case = tmp_path / "hybrid" / "hybrid_v4_like"
    case.mkdir(parents=True)
    args = {
        "--hidden-size": 64,
        "--num-attention-heads": 4,
        "--hybrid-layer-pattern": "*-*-",
        "--experimental-attention-variant": "dsv4_hybrid",
        "--seq-length": 32,
        "--max-position-embeddings": 32,
        "--micro-batch-size": 2,
        "--global-batch-size": 8,
        "--train-iters": 8,
        "--mock-data": True,
        "--tokenizer-type": "NullTokenizer",
        "--vocab-size": 128,
    }
    path = case / "model_config.yaml"
    path.write_text(yaml.safe_dump({"MODEL_ARGS": args, "TEST_TYPE": "regular"}))
    problems = [str(p) for p in plan_problems(load(path))]
    assert (
        "extra_args.--experimental-attention-variant: 'dsv4_hybrid' does not exist in "
        "megatron-core 0.19.2 (it has gated_delta_net, dsa): the case needs a newer Megatron-LM"
    ) in problems, problems


# ---- hybrid cases with the deprecated pattern flag (issue 33, item 7) --------------------------
def test_a_case_with_the_override_pattern_imports_as_hybrid(tmp_path):
    case = tmp_path / "hybrid" / "hybrid_flex_like"
    case.mkdir(parents=True)
    args = {
        "--num-layers": 4,
        "--hidden-size": 64,
        "--num-attention-heads": 4,
        "--hybrid-override-pattern": "*-*-",
        "--is-hybrid-model": True,
        "--seq-length": 32,
        "--max-position-embeddings": 32,
        "--micro-batch-size": 2,
        "--global-batch-size": 8,
        "--train-iters": 8,
        "--mock-data": True,
        "--tokenizer-type": "NullTokenizer",
        "--vocab-size": 128,
    }
    path = case / "model_config.yaml"
    path.write_text(yaml.safe_dump({"MODEL_ARGS": args, "TEST_TYPE": "regular"}))
    conversion = _convert(path)
    assert conversion.problems == []
    model = conversion.recipe["model"]
    assert model["type"] == "hybrid" and model["hybrid_layer_pattern"] == "*-*-", model
    extra = conversion.recipe["extra_args"]
    assert "--hybrid-override-pattern" not in extra and "--is-hybrid-model" not in extra
    assert plan_problems(load(path)) == []


# ---- per-layer MoE lists under the cpu overlay (issue 33, item 6) ------------------------------
def test_the_cpu_overlay_shrinks_a_per_layer_moe_list_with_the_layers(tmp_path):
    args = {"--num-layers": 12, "--num-experts": 4, "--moe-layer-freq": "([0]*1+[1]*11)"}
    loaded = load(write_case(tmp_path, args))
    assert loaded.recipe.model.num_layers == 4
    assert loaded.recipe.extra_args["--moe-layer-freq"] == "([0]*1+[1]*3)"
    assert plan_problems(loaded) == []
    gpu = load(write_case(tmp_path, args), "dgx_h100").recipe
    assert gpu.extra_args["--moe-layer-freq"] == "([0]*1+[1]*11)"


def test_a_per_layer_list_of_another_length_is_refused(write_recipe):
    path = write_recipe(
        "version: 1\n"
        "model: {type: gpt, num_layers: 4, hidden_size: 32, num_attention_heads: 4, "
        "seq_length: 16, num_experts: 4}\n"
        "extra_args: {--moe-layer-freq: '([1]*6)'}\n"
    )
    assert [str(p) for p in plan_problems(load(path))] == [
        "extra_args.--moe-layer-freq: lists 6 layers but model.num_layers is 4: give one "
        "entry per layer"
    ]


def test_layer_lists_are_read_never_evaluated():
    assert upstream.layer_list("([1]*3+[0]*1)*2") == [1, 1, 1, 0] * 2
    assert upstream.layer_list("[0,1,1]") == [0, 1, 1]
    assert upstream.layer_list("2") is None
    assert upstream.layer_list("[__import__('os').getpid()]") is None
    assert upstream.layer_list("[1]*10**9") is None
    assert upstream.layer_list_text([0, 1, 1, 0]) == "([0]*1+[1]*2+[0]*1)"


# ---- the embedding/loss counted in the pipeline split (issue 33, item 7) -----------------------
SPLIT = {
    "--num-layers": 14,
    "--tensor-model-parallel-size": 1,
    "--pipeline-model-parallel-size": 4,
    "--account-for-embedding-in-pipeline-split": True,
    "--account-for-loss-in-pipeline-split": True,
}


def test_layers_split_with_the_embedding_and_loss_counted(tmp_path):
    """14 layers + embedding + loss = 16 over pp 4, as megatron-core 0.19.2 counts them."""
    gpu = load(write_case(tmp_path, SPLIT), "dgx_h100")
    assert not any(p.where == "model.num_layers" for p in plan_problems(gpu)), plan_problems(gpu)
    cpu = load(write_case(tmp_path, SPLIT))
    assert cpu.recipe.model.num_layers == 6  # + 2 counted = 8: two per stage
    assert not any(p.where == "model.num_layers" for p in plan_problems(cpu))


def test_a_split_that_does_not_count_out_names_the_flags(tmp_path):
    args = {**SPLIT, "--account-for-loss-in-pipeline-split": False}
    problems = [str(p) for p in plan_problems(load(write_case(tmp_path, args), "dgx_h100"))]
    assert (
        "model.num_layers: 14 layers + 1 for the embedding "
        "(--account-for-embedding-in-pipeline-split) = 15 do not split over pp(4) * vpp(1) = 4 "
        "model chunks (megatron counts them as layers): make num_layers + 1 a multiple of 4"
    ) in problems, problems


# ---- what the sweep of every upstream case found (issue 33, item 6) -----------------------------
def test_fsdp_is_refused_on_cpu_and_megatron_fsdp_without_einops(write_recipe, monkeypatch):
    """Both FSDP flavours validated, then every rank failed wrapping its model on CPU:
    upstream's deepseek_proxy_fsdp_ep2_fsdp2 (Megatron-FSDP: einops, CUDA meshes) and
    gpt3_mcore_te_tp2_pp1_fsdp2_resume_torch_dist (torch FSDP2: a CUDA mesh)."""
    from megatron_ext.recipes import validate as validation

    text = (
        "version: 1\n"
        "model: {type: gpt, num_layers: 2, hidden_size: 32, num_attention_heads: 4, "
        "seq_length: 16}\n"
        "launch: {device: cpu}\n"
        "extra_args: {FLAG: true}\n"
    )
    for flag, name in (
        ("--use-megatron-fsdp", "Megatron-FSDP"),
        ("--use-torch-fsdp2", "torch FSDP2"),
    ):
        (cpu,) = validation.fsdp_problems(load(write_recipe(text.replace("FLAG", flag))))
        assert cpu.where == f"extra_args.{flag}"
        assert cpu.what.startswith(f"{name} builds its device mesh for CUDA")
        assert "it does not run on CPU" in cpu.what
    gpu = text.replace("device: cpu", "device: gpu")
    megatron_fsdp = load(write_recipe(gpu.replace("FLAG", "--use-megatron-fsdp")))
    torch_fsdp2 = load(write_recipe(gpu.replace("FLAG", "--use-torch-fsdp2")))
    monkeypatch.setattr(validation, "_module_importable", lambda name: name != "einops")
    (missing,) = validation.fsdp_problems(megatron_fsdp)
    assert "einops, which is not importable here" in missing.what
    assert validation.fsdp_problems(torch_fsdp2) == []
    monkeypatch.setattr(validation, "_module_importable", lambda name: True)
    assert validation.fsdp_problems(megatron_fsdp) == []
    plain = load(write_recipe(text.replace("FLAG", "--use-distributed-optimizer")))
    assert validation.fsdp_problems(plain) == []


def test_the_cpu_overlay_leaves_out_the_deferred_weight_gradients(tmp_path):
    """The embedding's deferred wgrad needs the CUDA fused accumulation, the layers' TE:
    megatron-core refused the cpu overlay's own command line before."""
    args = {
        "--defer-embedding-wgrad-compute": True,
        "--wgrad-deferral-limit": 2,
        "--delay-wgrad-compute": True,
    }
    loaded = load(write_case(tmp_path, args))
    assert not set(args) & set(loaded.recipe.extra_args)
    assert any("left out --defer-embedding-wgrad-compute" in n for n in loaded.notes)
    gpu = load(write_case(tmp_path, args), "dgx_h100").recipe.extra_args
    assert {flag: gpu[flag] for flag in args} == args


def test_the_cpu_overlay_leaves_out_fim_with_the_corpus(tmp_path, monkeypatch):
    monkeypatch.setenv("DATA_PATH", str(tmp_path))
    args = {
        "--mock-data": None,
        "--data-path": "${DATA_PATH}/corpus",
        "--fim-data": True,
        "--fim-rate": 0.5,
    }
    loaded = load(write_case(tmp_path, args))
    assert loaded.recipe.data.type == "mock"
    assert "--fim-data" not in loaded.recipe.extra_args
    assert "--fim-rate" not in loaded.recipe.extra_args
    assert any("left out --fim-data, --fim-rate (the fill-in-the-middle" in n for n in loaded.notes)
    gpu = load(write_case(tmp_path, args), "dgx_h100").recipe.extra_args
    assert gpu["--fim-data"] is True and gpu["--fim-rate"] == 0.5


def test_a_refused_case_is_its_reason_alone(tmp_path):
    """An inference case's flags (an inference-only --transformer-impl, yarn) and NeMo's dotted
    keys were each a problem line of their own beside the real reason."""
    path = write_case(
        tmp_path, {"--transformer-impl": "inference_optimized"}, MODE="inference", MAGIC=1
    )
    conversion = _convert(path)
    assert conversion.refused and [p.where for p in conversion.problems] == ["MODE"]


def test_keys_and_placeholders_of_upstreams_ci_are_read(tmp_path):
    path = write_case(tmp_path, {"--seed": "${REPEAT}"}, MODEL_ENV_VARS={"MODEL_ARGS": {}})
    text = path.read_text().replace(
        "MODEL_ARGS:\n", "BASE: &BASE\n  --hidden-size: 64\nMODEL_ARGS:\n  <<: *BASE\n", 1
    )
    path.write_text(text)
    conversion = _convert(path)
    assert conversion.problems == [], conversion.problems
    assert any(
        n.startswith("BASE: its flags are merged into MODEL_ARGS")
        for n in conversion.notes["mapping"]
    )
    assert any(n.startswith("MODEL_ENV_VARS: the GPU count") for n in conversion.notes["mapping"])
    assert load(path).recipe.training.seed == 1  # the CI's first repeat
