"""Issue 40, item 13 (part): a garbage SentencePiece ``.model`` is refused by validate in one
line, not only when the ranks load it; a real one passes."""

from __future__ import annotations

import os

import pytest

from megatron_ext.data import checks


@pytest.mark.parametrize("content", [b"", b"garbage" * 50, b"\x00" * 4096])
def test_a_garbage_sentencepiece_model_is_refused(tmp_path, content):
    model = tmp_path / "tokenizer.model"
    model.write_bytes(content)
    problems = checks.tokenizer_problems("SentencePieceTokenizer", str(model), None, None, "t.")
    assert len(problems) == 1 and problems[0].startswith("t.model: "), problems
    assert "is not a SentencePiece model" in problems[0] and "\n" not in problems[0]


def test_a_fifo_model_is_refused_without_blocking(tmp_path):
    model = tmp_path / "tokenizer.model"
    os.mkfifo(model)
    problems = checks.tokenizer_problems("Llama2Tokenizer", str(model), None, None)
    assert len(problems) == 1 and "a FIFO, not a regular file" in problems[0], problems


def test_a_trained_sentencepiece_model_passes(tmp_path):
    import sentencepiece

    corpus = tmp_path / "corpus.txt"
    corpus.write_text(
        "\n".join(f"the quick brown fox {i} jumps over the lazy dog" for i in range(200))
    )
    sentencepiece.SentencePieceTrainer.train(
        input=str(corpus), model_prefix=str(tmp_path / "sp"), vocab_size=40, minloglevel=2
    )
    assert (
        checks.tokenizer_problems("SentencePieceTokenizer", str(tmp_path / "sp.model"), None, None)
        == []
    )
