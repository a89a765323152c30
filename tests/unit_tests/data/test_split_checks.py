"""A small corpus: validate reads the document and token counts and refuses a split Megatron
could not fill (issue 33, items 1 and 3), before any rank starts."""

from __future__ import annotations

import numpy as np
import pytest

from megatron_ext.data import splits
from megatron_ext.recipes import load
from megatron_ext.recipes.checks import plan_problems
from megatron_ext.recipes.command import megatron_args

RECIPE = """
version: 1
model: {{type: gpt, num_layers: 2, hidden_size: 32, num_attention_heads: 4, seq_length: 16}}
parallelism: {{pp: 1}}
training: {{iterations: 4, micro_batch_size: 2, global_batch_size: 4{training}}}
data:
  type: indexed
  paths: {paths}
  split: "{split}"
{extra}  tokenizer: {{type: NullTokenizer, vocab_size: 64}}
"""


@pytest.fixture(scope="module")
def dozen(tmp_path_factory):
    """data/dozen_text_document: 12 documents of 5 token ids each; data/one_text_document: 1
    (written by megatron-core's IndexedDatasetBuilder, as prepare-data writes them)."""
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    root = tmp_path_factory.mktemp("dozen")
    (root / "data").mkdir()
    (root / "recipes").mkdir()
    for name, count in (("dozen", 12), ("one", 1)):
        prefix = root / "data" / f"{name}_text_document"
        builder = IndexedDatasetBuilder(f"{prefix}.bin", dtype=np.uint16)
        for i in range(count):
            builder.add_document(np.arange(i, i + 5, dtype=np.int64), [5])
        builder.finalize(f"{prefix}.idx")
    return root


def _recipe(root, paths='["../data/dozen_text_document"]', split="98,1,1", training="", extra=""):
    path = root / "recipes" / "r.yaml"
    path.write_text(RECIPE.format(paths=paths, split=split, training=training, extra=extra))
    return load(path)


def _data_problems(loaded) -> list[str]:
    return [str(p) for p in plan_problems(loaded) if str(p).startswith("data.")]


def test_megatron_split_arithmetic_matches_its_builder():
    """The document ranges are the ones megatron-core's builder computes for the same split."""
    from megatron.core.datasets.blended_megatron_dataset_config import (
        convert_split_vector_to_split_matrix,
        parse_and_normalize_split,
    )

    for text in ("98,1,1", "949,50,1", "10,1,1", "1,0,0", "3,1", "90,5,5"):
        ours = splits.split_bounds(splits.split_shares(text))
        theirs = convert_split_vector_to_split_matrix(parse_and_normalize_split(text))
        for n in (1, 2, 12, 74, 1000):
            for a, b in zip(ours, theirs, strict=True):
                assert (a is None) == (b is None), text
                if a is not None:
                    begin, end = (int(round(x * float(n))) for x in b)
                    assert splits.document_range(a, n) == (begin, end), (text, n)


def test_a_dozen_documents_at_98_1_1_is_refused_in_one_line(dozen):
    problems = _data_problems(_recipe(dozen))
    assert len(problems) == 2, problems  # valid and test both get no document
    valid = problems[0]
    assert valid.startswith("data.split: the valid split of data.paths[0]")
    for words in ("0 of 12 documents, 0 tokens", "under split 98,1,1", "needs 0 samples"):
        assert words in valid, valid
    # a fix that works (checked below): 10,1,1 would give valid and test one 5-token document,
    # no sample of 16+1 tokens (tests/unit_tests/data/test_seq_length_checks.py)
    assert "data.split: 4,4,4" in valid
    assert all("\n" not in p for p in problems)


def test_the_suggested_split_passes_and_evaluation_needs_are_counted(dozen):
    assert [str(p) for p in plan_problems(_recipe(dozen, split="4,4,4"))] == []
    with_eval = _recipe(dozen, split="10,1,1", training=", eval_interval: 2, eval_iters: 3")
    assert _data_problems(with_eval) == []  # 5-token documents repeat as epochs: never empty
    args = megatron_args(with_eval)
    assert args[args.index("--split") + 1] == "10,1,1"


def test_evaluation_on_an_empty_split_names_the_samples_it_needs(dozen):
    loaded = _recipe(dozen, split="98,2,0", training=", eval_interval: 2, eval_iters: 3")
    (problem,) = _data_problems(loaded)
    # (4 // 2 + 1) evaluations x 3 iterations x global batch 4
    assert "the run needs 36 samples from it" in problem, problem


def test_a_one_document_corpus_asks_for_more_documents(dozen):
    one = '["../data/one_text_document"]'
    (problem,) = _data_problems(_recipe(dozen, one, split="9,1"))
    assert problem.endswith("set its share to 0 (data.split: 9,0,0)"), problem  # no evaluation
    evaluating = _recipe(dozen, one, split="9,1", training=", eval_interval: 4")
    (problem,) = _data_problems(evaluating)
    assert problem.endswith("add documents to the corpus (one document cannot be split)")


def test_an_unweighted_blend_builds_one_epoch_and_is_refused_when_short(dozen):
    paths = '["../data/dozen_text_document", "../data/dozen_text_document"]'
    (problem,) = _data_problems(_recipe(dozen, paths, split="1,0,0"))
    # 2 x 12 x 5 tokens: 2 x (60 - 1) // 16 = 6 samples; the run asks 4 x 4
    assert "6 samples of 16+1 tokens, but the run needs 16" in problem, problem
    # a path too short for one sample stops megatron-core before that (every weight > 0)
    with_one = '["../data/dozen_text_document", "../data/one_text_document"]'
    (problem,) = [str(p) for p in plan_problems(_recipe(dozen, with_one, split="1,0,0"))]
    assert problem.startswith(
        "model.seq_length: 16 is too long for the train split of data.paths[1] (one_text_document)"
    ), problem
    weighted = '["1 ../data/dozen_text_document", "1 ../data/one_text_document"]'
    assert _data_problems(_recipe(dozen, weighted, split="1,0,0")) == []
    mixed = '["1 ../data/dozen_text_document", "../data/one_text_document"]'
    assert _data_problems(_recipe(dozen, mixed, split="1,0,0")) == [
        "data.paths: give every entry a weight ('WEIGHT PREFIX') or none"
    ]


def test_per_split_paths_become_megatrons_per_split_flags(dozen):
    extra = (
        '  valid_paths: ["0.5 ../data/one_text_document", "0.5 ../data/dozen_text_document"]\n'
        '  test_paths: ["../data/one_text_document"]\n'
    )
    # evaluating: a blend asked for no sample would be built empty (issue 40 item 13)
    loaded = _recipe(dozen, split="98,1,1", training=", eval_interval: 2", extra=extra)
    assert _data_problems(loaded) == []  # each split reads its prefixes whole
    args = megatron_args(loaded)
    assert "--data-path" not in args and "--split" not in args
    data = str(dozen / "recipes" / ".." / "data")
    train = args.index("--train-data-path")
    assert args[train + 1] == f"{data}/dozen_text_document"
    valid = args.index("--valid-data-path")
    assert args[valid + 1 : valid + 5] == [
        "0.5",
        f"{data}/one_text_document",
        "0.5",
        f"{data}/dozen_text_document",
    ]
    assert args[args.index("--test-data-path") + 1] == f"{data}/one_text_document"


def test_validate_says_when_data_split_is_not_used(dozen):
    """Issue 41, item 6: data.split beside valid_paths said OK without saying it is ignored."""
    from megatron_ext.recipes.validate import unused_split_note

    extra = '  valid_paths: ["../data/dozen_text_document"]\n'
    (note,) = unused_split_note(_recipe(dozen, split="98,1,1", extra=extra))
    assert "data.split '98,1,1' is not used" in note and "data.valid_paths" in note
    assert unused_split_note(_recipe(dozen, split="98,1,1")) == []  # split is used
    assert unused_split_note(_recipe(dozen, split="949,50,1", extra=extra)) == []  # not set


def test_per_split_paths_are_checked_like_paths(dozen):
    extra = '  valid_paths: ["../data/none_text_document"]\n'
    problems = _data_problems(_recipe(dozen, extra=extra))
    assert problems == [
        f"data.valid_paths[0]: {dozen}/recipes/../data/none_text_document.bin and "
        f"{dozen}/recipes/../data/none_text_document.idx not found (relative paths are relative "
        "to the recipe's directory; `megatron-ext prepare-data` makes them)"
    ]


def test_per_split_paths_go_through_megatrons_parser(dozen):
    """Megatron's own argument checks accept the per-split flags the plan writes."""
    from megatron_ext.recipes.validate import validate

    extra = '  valid_paths: ["../data/dozen_text_document"]\n'
    result = validate(_recipe(dozen, training=", eval_interval: 2", extra=extra))
    assert result.ok, result.problems


def test_empty_lengths_are_refused_without_reading_files():
    source = splits.Source("data.paths[0]", "p", None, np.zeros(4, dtype=np.int64))
    ((where, what),) = splits.split_problems([source], "1,0,0", (8, 0, 0), 16)
    assert where == "data.split" and "0 tokens" in what


def _megatron_builds(blend, split, sizes, tmp_path, blend_per_split=None) -> list:
    """megatron-core's BlendedMegatronDatasetBuilder, in this process, as the ranks run it."""
    import argparse

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
        sequence_length=16,
        blend=blend,
        blend_per_split=blend_per_split,
        split=split,
        path_to_cache=str(tmp_path / "cache"),
        tokenizer=tokenizer,
        reset_position_ids=False,
        reset_attention_mask=False,
        eod_mask_loss=False,
    )
    return BlendedMegatronDatasetBuilder(GPTDataset, sizes, lambda: True, config).build()


def test_what_the_check_accepts_megatron_builds_with_the_samples(dozen, tmp_path):
    """The accepted small-corpus plans build in megatron-core with every sample the run asks
    for (the refused ones would not return: an empty split's epoch loop never ends)."""
    data = str(dozen / "data")
    loaded = _recipe(dozen, split="10,1,1", training=", eval_interval: 2, eval_iters: 3")
    assert _data_problems(loaded) == []
    sizes = list(splits.samples_needed(4, 4, 2, 3))
    built = _megatron_builds(([f"{data}/dozen_text_document"], None), "10,1,1", sizes, tmp_path)
    assert [len(d) >= n for d, n in zip(built, sizes, strict=True)] == [True] * 3
    per_split = [
        ([f"{data}/dozen_text_document"], None),
        ([f"{data}/one_text_document", f"{data}/dozen_text_document"], [0.5, 0.5]),
        ([f"{data}/one_text_document"], None),
    ]
    built = _megatron_builds(None, None, sizes, tmp_path, blend_per_split=per_split)
    assert [len(d) >= n for d, n in zip(built, sizes, strict=True)] == [True] * 3
