"""A split Megatron builds with no sample is refused by validate (issue 40 item 13).

Megatron makes a dataset and a data loader for every split with a share, even when the run
evaluates nothing and asks that split for 0 samples; the dataset is then one epoch of the split
(samples of seq_length+1 tokens over its concatenated documents), or, for a weighted blend,
exactly the 0 samples asked, and the loader's sampler stops the ranks at start-up with
``AssertionError: no sample to consume: 0``. Every verdict here is compared with megatron-core's
own builder on the same files."""

from __future__ import annotations

import argparse

import numpy as np
import pytest

from megatron_ext.data import splits
from megatron_ext.recipes import load
from megatron_ext.recipes.checks import plan_problems

RECIPE = """
version: 1
model: {{type: gpt, num_layers: 2, hidden_size: 32, num_attention_heads: 4, seq_length: {seq}}}
parallelism: {{pp: 1}}
training: {{iterations: 4, micro_batch_size: 2, global_batch_size: 4{training}}}
data:
  type: indexed
  paths: {paths}
  split: "{split}"
  tokenizer: {{type: NullTokenizer, vocab_size: 64}}
"""

# 12 documents of 7 tokens: split 10,1,1 gives valid and test one document, 7 tokens each
DOCUMENTS, TOKENS = 12, 7


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    root = tmp_path_factory.mktemp("seq")
    (root / "data").mkdir()
    (root / "recipes").mkdir()
    for name, count in (("twelve", DOCUMENTS), ("three", 3)):
        builder = IndexedDatasetBuilder(str(root / "data" / f"{name}.bin"), dtype=np.uint16)
        for i in range(count):
            builder.add_document(np.arange(i, i + TOKENS, dtype=np.int64), [TOKENS])
        builder.finalize(str(root / "data" / f"{name}.idx"))
    return root


def _problems(root, seq, split="10,1,1", paths='["../data/twelve"]', training="") -> list[str]:
    path = root / "recipes" / "r.yaml"
    path.write_text(RECIPE.format(seq=seq, split=split, paths=paths, training=training))
    return [str(p) for p in plan_problems(load(path))]


def _megatron_lengths(blend, split, sizes, seq, tmp_path) -> list[int | None]:
    """The split lengths megatron-core's builder makes, as the ranks run it."""
    from megatron.core.datasets.blended_megatron_dataset_builder import (
        BlendedMegatronDatasetBuilder,
    )
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig

    from megatron_ext.data.preprocess import build_tokenizer

    tokenizer = build_tokenizer(
        argparse.Namespace(
            tokenizer_type="NullTokenizer",
            tokenizer_model=None,
            vocab_file=None,
            merge_file=None,
            vocab_size=64,
        )
    )
    config = GPTDatasetConfig(
        random_seed=1234,
        sequence_length=seq,
        blend=blend,
        split=split,
        path_to_cache=str(tmp_path / f"cache{seq}"),
        tokenizer=tokenizer,
        reset_position_ids=False,
        reset_attention_mask=False,
        eod_mask_loss=False,
    )
    built = BlendedMegatronDatasetBuilder(GPTDataset, sizes, lambda: True, config).build()
    return [None if d is None else len(d) for d in built]


def test_a_seq_length_no_valid_sample_fits_is_refused_in_one_line(corpus, tmp_path):
    problems = _problems(corpus, seq=TOKENS)
    assert len(problems) == 2, problems  # valid and test: one 7-token document each
    valid = problems[0]
    assert valid.startswith(f"model.seq_length: {TOKENS} is too long for the valid split of "), (
        valid
    )
    for words in (
        "data.paths[0]",
        "/data/twelve)",
        f"1 documents hold {TOKENS} tokens",
        f"seq_length+1 = {TOKENS + 1}",
        "no sample to consume",
        f"set model.seq_length to at most {TOKENS - 1}",
    ):
        assert words in valid, (words, valid)
    assert "\n" not in valid
    data = str(corpus / "data" / "twelve")
    lengths = _megatron_lengths(([data], None), "10,1,1", [16, 0, 0], TOKENS, tmp_path)
    assert lengths[1:] == [0, 0]  # what megatron's sampler then refuses at start-up


def test_the_split_fix_zeroes_that_split_only():
    source = splits.Source("data.paths[0]", "p", None, np.full(DOCUMENTS, TOKENS))
    found = splits.split_problems([source], "10,1,1", (16, 0, 0), TOKENS)
    assert [what.rsplit("data.split: ", 1)[1] for _, what in found] == ["10,0,1)", "10,1,0)"]


def test_a_just_short_enough_seq_length_passes(corpus, tmp_path):
    assert _problems(corpus, seq=TOKENS - 1) == []
    data = str(corpus / "data" / "twelve")
    lengths = _megatron_lengths(([data], None), "10,1,1", [16, 0, 0], TOKENS - 1, tmp_path)
    assert lengths == [16, 1, 1]


def test_evaluation_repeats_epochs_so_a_long_seq_length_still_fills_the_split(corpus):
    assert _problems(corpus, seq=64, training=", eval_interval: 2, eval_iters: 1") == []


def test_the_fixes_it_names_pass(corpus):
    assert _problems(corpus, seq=TOKENS, split="10,0,0") == []


@pytest.mark.parametrize("seq", [6, 7, 13, 14, 20, 21])
@pytest.mark.parametrize("weights", [None, [1.0, 1.0]])
def test_the_verdict_is_megatrons_for_blends(corpus, tmp_path, seq, weights):
    """A blend of a 12- and a 3-document path under 4,1,1: the valid split gets 2 and 1
    documents (14 and 7 tokens). The check refuses exactly when megatron builds it empty."""
    prefixes = [str(corpus / "data" / "twelve"), str(corpus / "data" / "three")]
    blend = [
        splits.Source(
            f"data.paths[{i}]",
            p,
            None if weights is None else weights[i],
            splits.read_lengths(p),
        )
        for i, p in enumerate(prefixes)
    ]
    refused = splits.split_problems(blend, "4,1,1", (4, 0, 0), seq)
    lengths = _megatron_lengths((prefixes, weights), "4,1,1", [4, 0, 0], seq, tmp_path)
    assert [lengths[i] == 0 for i in (1, 2)] == [
        any(f"the {name} split" in what for _, what in refused) for name in ("valid", "test")
    ], (refused, lengths)
