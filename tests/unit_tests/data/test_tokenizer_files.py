"""A plain ``tokenizer.json`` (the ``tokenizers`` library's own file, no eos entry), a corrupt
one, and the hub switched off for local tokenizers (issue 33, item 2)."""

from __future__ import annotations

import argparse
import json
import os

import pytest

from megatron_ext.cli import main as cli_main
from megatron_ext.data import preprocess, tokenizer_files
from megatron_ext.recipes import load
from megatron_ext.recipes.checks import plan_problems
from megatron_ext.recipes.command import run_environment

TEXTS = [f"plain tokenizer document number {i} about hyper connections" for i in range(12)]

RECIPE = """
version: 1
model: {{type: gpt, num_layers: 2, hidden_size: 32, num_attention_heads: 4, seq_length: 16}}
training: {{iterations: 2, micro_batch_size: 2, global_batch_size: 4}}
data:
  tokenizer: {{type: HuggingFaceTokenizer, model: {model}, vocab_size: null}}
"""


@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    """A byte-level BPE trained and saved by the tokenizers library alone, and a corpus."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    root = tmp_path_factory.mktemp("plain")
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tokenizer.train_from_iterator(TEXTS, trainer)
    (root / "plain").mkdir()
    tokenizer.save(str(root / "plain" / "tokenizer.json"))
    (root / "corpus.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS))
    return root


def _prepare(root, model, *extra) -> int:
    return cli_main(
        [
            "prepare-data",
            "--input",
            str(root / "corpus.jsonl"),
            "--output-prefix",
            str(root / "out" / model.name),
            "--tokenizer-type",
            "HuggingFaceTokenizer",
            "--tokenizer-model",
            str(model),
            *extra,
        ]
    )


def test_append_eod_without_an_eos_token_is_one_line_before_tokenizing(plain, capsys):
    assert _prepare(plain, plain / "plain", "--append-eod") == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err, err
    for words in ("--append-eod", "eos_token", "tokenizer_config.json", str(plain / "plain")):
        assert words in err, err
    assert not (plain / "out" / "plain_text_document.bin").exists()


def test_without_append_eod_the_plain_tokenizer_prepares_data(plain):
    assert _prepare(plain, plain / "plain") == 0
    assert (plain / "out" / "plain_text_document.idx").exists()


def test_naming_an_eos_token_is_the_fix(plain, tmp_path):
    fixed = tmp_path / "fixed"
    fixed.mkdir()
    (fixed / "tokenizer.json").write_bytes((plain / "plain" / "tokenizer.json").read_bytes())
    (fixed / "tokenizer_config.json").write_text(json.dumps({"eos_token": "not-a-token"}))
    assert tokenizer_files.directory_problems(str(fixed)) == [
        f"{fixed}: its eos_token 'not-a-token' is not in tokenizer.json's vocabulary; name one "
        "of its tokens (or train it with that special token)"
    ]
    (fixed / "tokenizer_config.json").write_text(json.dumps({"eos_token": "Ġdocument"}))
    assert tokenizer_files.directory_problems(str(fixed)) == []
    assert _prepare(plain, fixed, "--append-eod") == 0


def _recipe_problems(tmp_path, model) -> list[str]:
    path = tmp_path / "r.yaml"
    path.write_text(RECIPE.format(model=model))
    return [str(p) for p in plan_problems(load(path))]


def test_validate_refuses_a_tokenizer_without_eos_in_one_line(plain, tmp_path):
    (problem,) = _recipe_problems(tmp_path, plain / "plain")
    assert problem.startswith(f"data.tokenizer.model: {plain / 'plain'} names no end-of-document")
    assert "eos_token" in problem and "\n" not in problem


def test_validate_refuses_a_corrupt_tokenizer_json_in_one_line(tmp_path):
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "tokenizer.json").write_text('{"model": {"type": "BPE", "vocab": ')
    (problem,) = _recipe_problems(tmp_path, broken)
    assert problem.startswith(
        f"data.tokenizer.model: {broken}/tokenizer.json cannot be read by the tokenizers library"
    ), problem
    assert "\n" not in problem


def test_a_local_tokenizer_is_built_with_the_hub_off(plain, monkeypatch):
    """The build sees the hub's offline switch (environment and imported client), and the
    switch is put back afterwards; the ranks get it in their environment."""
    import huggingface_hub.constants as hub

    import megatron.core.tokenizers.utils.build_tokenizer as megatron_build

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(hub, "HF_HUB_OFFLINE", False)
    seen = {}

    def build(namespace):
        seen.update(env=os.environ.get("HF_HUB_OFFLINE"), client=hub.HF_HUB_OFFLINE)
        return type("Tokenizer", (), {"eod": 0})()

    monkeypatch.setattr(megatron_build, "build_tokenizer", build)
    args = argparse.Namespace(
        tokenizer_type="HuggingFaceTokenizer",
        tokenizer_model=str(plain / "plain"),
        vocab_file=None,
        merge_file=None,
        vocab_size=None,
    )
    preprocess.build_tokenizer(args)
    assert seen == {"env": "1", "client": True}
    assert hub.HF_HUB_OFFLINE is False and "HF_HUB_OFFLINE" not in os.environ


def test_ranks_get_the_hub_off_for_a_local_tokenizer(plain, tmp_path):
    path = tmp_path / "r.yaml"
    path.write_text(RECIPE.format(model=plain / "plain"))
    env = run_environment(load(path))
    assert env["HF_HUB_OFFLINE"] == "1" and env["TRANSFORMERS_OFFLINE"] == "1"
    path.write_text(RECIPE.format(model="some-org/some-hub-name"))
    assert "HF_HUB_OFFLINE" not in run_environment(load(path))
