"""The Megatron-LM pretrain_gpt.py patch is a well-formed git patch of that one file."""

import subprocess

from conftest import REPO_ROOT

PATCH = REPO_ROOT / "patches" / "megatron-lm-core_v0.19.0-pretrain_gpt.patch"
UPSTREAM_BLOB = "47c1935"  # pretrain_gpt.py at Megatron-LM core_v0.19.0 (patches/README.md)


def test_patch_touches_only_pretrain_gpt_and_activates_the_plugin():
    stat = subprocess.run(["git", "apply", "--numstat", str(PATCH)], capture_output=True, text=True,
                          cwd=REPO_ROOT)
    assert stat.returncode == 0, stat.stderr
    assert [line.split("\t")[2] for line in stat.stdout.splitlines()] == ["pretrain_gpt.py"]
    text = PATCH.read_text()
    assert f"index {UPSTREAM_BLOB}" in text, "the base blob named in patches/README.md"
    added = "\n".join(line[1:] for line in text.splitlines() if line.startswith("+") and not line.startswith("+++"))
    for needed in ("select_runtime()", "add_megatron_ext_args", "machine_defaults(",
                   "megatron_ext_gpt.model_provider", "MHCTransformerConfig", "args.enable_mhc_connections"):
        assert needed in added, needed
    assert "patches/README.md" in added, "the patched file says where it comes from"
