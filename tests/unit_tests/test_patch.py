"""The Megatron-LM patches are well-formed git patches of one entry script each, and wire the
plugin in: runtime, flags, model provider, and the two refusals (upstream's own mHC,
ModelOpt with mHC). Whether they apply to Megatron-LM refs is recorded in patches/README.md."""

import subprocess

import pytest

from recipe_texts import REPO_ROOT

PATCHES = {
    # script: (patch file, its base blob at Megatron-LM core_v0.19.0 (patches/README.md), model provider)
    "pretrain_gpt.py": (
        "megatron-lm-core_v0.19.0-pretrain_gpt.patch",
        "47c1935",
        "megatron_ext_gpt.model_provider",
    ),
    "pretrain_hybrid.py": (
        "megatron-lm-core_v0.19.0-pretrain_hybrid.patch",
        "39bc7f3",
        "megatron_ext_hybrid.model_provider",
    ),
}


@pytest.mark.parametrize("script", sorted(PATCHES))
def test_patch_touches_only_its_script_and_activates_the_plugin(script):
    name, blob, provider = PATCHES[script]
    patch = REPO_ROOT / "patches" / name
    stat = subprocess.run(
        ["git", "apply", "--numstat", str(patch)], capture_output=True, text=True, cwd=REPO_ROOT
    )
    assert stat.returncode == 0, stat.stderr
    assert [line.split("\t")[2] for line in stat.stdout.splitlines()] == [script]
    text = patch.read_text()
    assert f"index {blob}" in text, "the base blob named in patches/README.md"
    added = "\n".join(
        line[1:]
        for line in text.splitlines()
        if line.startswith("+") and not line.startswith("+++")
    )
    for needed in (
        "select_runtime()",
        "add_megatron_ext_args",
        "machine_defaults(",
        provider,
        "MHCTransformerConfig",
        "args.enable_mhc_connections",
        'args.pipeline_schedule != "1f1b"',  # ZB-H1 needs megatron-ext's layers too
        "refuse_upstream_mhc(",
        "refuse_modelopt_with_mhc(args)",
    ):
        assert needed in added, needed
    assert added.index("refuse_upstream_mhc(") < added.index("import pretrain_gpt"), (
        "refuse before megatron-ext's model modules load (they may not import on another Megatron-LM)"
    )
    assert added.index("refuse_modelopt_with_mhc(args)") < added.index(
        "if args.enable_mhc_connections"
    )
    assert "if args.enable_mhc_connections or args.pipeline_schedule" in added
    assert "patches/README.md" in added, "the patched file says where it comes from"
    assert str(patch.name) in (REPO_ROOT / "patches" / "README.md").read_text()
