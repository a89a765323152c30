"""Upstream cases that validated and then failed at start-up, or were refused for the wrong
reason (issue 33, items 6 and 7): the parts fixed here."""

from __future__ import annotations

import yaml
from test_upstream_cases import write_case

from megatron_ext.recipes import load, upstream
from megatron_ext.recipes.checks import plan_problems
from megatron_ext.recipes.command import run_environment
from megatron_ext.recipes.validate import argv_problems


def _convert(path):
    return upstream.convert(yaml.safe_load(path.read_text()), path.parent)


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
