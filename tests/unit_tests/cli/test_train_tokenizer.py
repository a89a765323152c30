"""Issue 41, item 5: ``megatron-ext train-tokenizer`` trains a tokenizer with an eos token from
the JSONL prepare-data reads (before, only a Python function did)."""

from __future__ import annotations

import json

import pytest

from megatron_ext import cli


@pytest.fixture
def corpus(tmp_path):
    from megatron_ext.data import corpus as stdlib

    path = tmp_path / "corpus.jsonl"
    stdlib.write_jsonl(stdlib.build(max_chars=40_000), path)
    return path


def test_a_bpe_with_eos_is_trained_and_prepare_data_uses_it(corpus, tmp_path, capsys):
    from transformers import AutoTokenizer

    out = tmp_path / "tok"
    assert (
        cli.main(
            ["train-tokenizer", "--input", str(corpus), "--output", str(out), "--vocab-size", "300"]
        )
        == 0
    )
    printed = capsys.readouterr().out
    assert f"--tokenizer-type HuggingFaceTokenizer --tokenizer-model {out}/huggingface" in printed
    tokenizer = AutoTokenizer.from_pretrained(str(out / "huggingface"))
    assert tokenizer.eos_token == "<|endoftext|>" and len(tokenizer) <= 300
    prefix = tmp_path / "data" / "c"
    assert (
        cli.main(
            [
                "prepare-data",
                "--input",
                str(corpus),
                "--output-prefix",
                str(prefix),
                "--tokenizer-type",
                "HuggingFaceTokenizer",
                "--tokenizer-model",
                str(out / "huggingface"),
                "--append-eod",
                "--workers",
                "1",
            ]
        )
        == 0
    )
    assert (tmp_path / "data" / "c_text_document.idx").is_file()


def test_a_sentencepiece_model_has_an_eos(corpus, tmp_path):
    import sentencepiece

    out = tmp_path / "sp"
    assert (
        cli.main(
            [
                "train-tokenizer",
                "--input",
                str(corpus),
                "--output",
                str(out),
                "--vocab-size",
                "600",
                "--type",
                "sentencepiece",
            ]
        )
        == 0
    )
    model = sentencepiece.SentencePieceProcessor(
        model_file=str(out / "sentencepiece" / "tokenizer.model")
    )
    assert model.eos_id() >= 0 and model.get_piece_size() == 600


@pytest.mark.parametrize(
    ("lines", "flags", "says"),
    [
        (["not json"], [], "corpus.jsonl:1: not a JSON line"),
        ([json.dumps({"body": "x"})], [], "no string field 'text'; name the field with --json-key"),
        ([], [], "no documents"),
        ([json.dumps({"text": "x"})], ["--vocab-size", "10"], "--vocab-size 10: give 260"),
    ],
)
def test_bad_input_is_one_line(tmp_path, capsys, lines, flags, says):
    path = tmp_path / "corpus.jsonl"
    path.write_text("".join(line + "\n" for line in lines))
    argv = ["train-tokenizer", "--input", str(path), "--output", str(tmp_path / "o"), *flags]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert says in err and len(err.splitlines()) == 1, err
