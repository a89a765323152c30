"""Issue 40, item 12: a ``.bin`` paired with another dataset's ``.idx`` (or a cut, empty, junk
or FIFO index) is refused by validate in one line before any rank starts, and megatron's
``IndexedDataset.__del__`` prints no traceback first (the index is read without its reader)."""

from __future__ import annotations

import os
import shutil
import signal

import numpy as np
import pytest

from megatron_ext.data import checks
from megatron_ext.recipes import load
from megatron_ext.recipes.checks import plan_problems

RECIPE = """
version: 1
model: {type: gpt, num_layers: 2, hidden_size: 32, num_attention_heads: 4, seq_length: 8}
parallelism: {pp: 1}
training: {iterations: 2, micro_batch_size: 1, global_batch_size: 1}
data:
  type: indexed
  paths: ["../data/mixed_text_document"]
  split: "1,0,0"
  tokenizer: {type: NullTokenizer, vocab_size: 64}
"""


def _dataset(prefix, documents: int, tokens: int, dtype=np.uint16) -> None:
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    builder = IndexedDatasetBuilder(f"{prefix}.bin", dtype=dtype)
    for i in range(documents):
        builder.add_document(np.arange(i, i + tokens, dtype=np.int64) % 60, [tokens])
    builder.finalize(f"{prefix}.idx")


@pytest.fixture
def root(tmp_path):
    (tmp_path / "data").mkdir()
    (tmp_path / "recipes").mkdir()
    (tmp_path / "recipes" / "r.yaml").write_text(RECIPE)
    _dataset(tmp_path / "data" / "mixed_text_document", 12, 20)
    return tmp_path


def _problems(root) -> list[str]:
    loaded = load(root / "recipes" / "r.yaml")
    return [str(p) for p in plan_problems(loaded) if str(p).startswith("data.")]


def test_a_consistent_pair_passes_and_is_read_as_megatron_reads_it(root):
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    prefix = str(root / "data" / "mixed_text_document")
    ours = checks.read_index(prefix)
    theirs = IndexedDataset(prefix, mmap=True)
    assert ours.dtype == theirs.index.dtype and ours.documents == 12
    assert ours.lengths.tolist() == theirs.sequence_lengths.tolist()
    assert _problems(root) == []


@pytest.mark.parametrize(
    "other",
    [
        dict(documents=12, tokens=21),  # same document count, other sizes
        dict(documents=13, tokens=20),  # one more document
        dict(documents=12, tokens=20, dtype=np.int32),  # another dtype, same counts
    ],
)
def test_a_bin_with_another_datasets_idx_is_refused_in_one_line(root, tmp_path, other, capfd):
    _dataset(tmp_path / "other", **other)
    shutil.copy(tmp_path / "other.idx", root / "data" / "mixed_text_document.idx")
    problems = _problems(root)
    assert len(problems) == 1 and "\n" not in problems[0], problems
    assert "mixed_text_document" in problems[0]
    assert "not one dataset" in problems[0] or "not this dataset's index" in problems[0]
    assert "Exception ignored" not in capfd.readouterr().err


@pytest.mark.parametrize("content", [b"", b"MMIDIDX\x00\x00", b"junk" * 100, "cut"])
def test_a_cut_empty_or_junk_idx_is_refused_with_no_del_traceback(root, content, capfd):
    idx = root / "data" / "mixed_text_document.idx"
    data = idx.read_bytes()[:-8] if content == "cut" else content
    idx.write_bytes(data)
    problems = _problems(root)
    assert len(problems) == 1 and "mixed_text_document.idx" in problems[0], problems
    err = capfd.readouterr().err
    assert "Exception ignored" not in err and "Traceback" not in err, err


def _blocked(*_):
    raise TimeoutError("a FIFO blocked the check")


def test_a_fifo_bin_is_refused_without_blocking(root):
    path = root / "data" / "mixed_text_document.bin"
    path.unlink()
    os.mkfifo(path)
    previous = signal.signal(signal.SIGALRM, _blocked)
    signal.alarm(20)
    try:
        problems = _problems(root)
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
    assert len(problems) == 1 and "is a FIFO, not a regular file" in problems[0], problems
