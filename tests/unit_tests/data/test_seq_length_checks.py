"""A split Megatron builds without a sample is refused by validate (issue 40 item 13).

Megatron builds a dataset and a data loader for every split with a share, even when the run
evaluates nothing and asks that split for 0 samples; a split that then holds no sample (a
``model.seq_length`` longer than its one epoch, a path of an unweighted blend too short for one
sample, a blend sized by the 0 samples asked) stops the ranks at start-up. Each recipe here is
judged twice: by validate's check, and by megatron-core's own code on the same files (the
sample counts of ``get_train_valid_test_num_samples``, the blend of
``get_blend_and_blend_per_split``, ``BlendedMegatronDatasetBuilder`` and the pretraining
sampler's start-up assertions), and the two verdicts must agree, both ways."""

from __future__ import annotations

import argparse
import itertools
import re

import numpy as np
import pytest

from megatron_ext.cli import main as cli_main
from megatron_ext.recipes import load
from megatron_ext.recipes.checks import plan_problems
from megatron_ext.recipes.command import megatron_args

RECIPE = """
version: 1
model: {{type: gpt, num_layers: 2, hidden_size: 32, num_attention_heads: 4, seq_length: {seq}}}
parallelism: {{pp: 1}}
training: {{iterations: 1, micro_batch_size: 1, global_batch_size: 2{training}}}
data:
  type: indexed
  paths: {paths}
  split: "{split}"
{extra}  tokenizer: {{type: NullTokenizer, vocab_size: 64}}
"""

# name: (documents, tokens each)
CORPUS = {"hundred": (100, 50), "few": (10, 5), "dozen": (12, 7)}
EVAL = ", eval_interval: 1, eval_iters: 1"
_cache = itertools.count()


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    root = tmp_path_factory.mktemp("seq")
    (root / "data").mkdir()
    (root / "recipes").mkdir()
    for name, (documents, tokens) in CORPUS.items():
        builder = IndexedDatasetBuilder(str(root / "data" / f"{name}.bin"), dtype=np.uint16)
        for i in range(documents):
            builder.add_document((np.arange(tokens, dtype=np.int64) + i) % 60, [tokens])
        builder.finalize(str(root / "data" / f"{name}.idx"))
    return root


def _recipe(root, seq, paths, split="98,1,1", training="", extra=""):
    listed = "[" + ", ".join(f'"{_entry(p)}"' for p in paths) + "]"
    path = root / "recipes" / f"r{next(_cache)}.yaml"
    path.write_text(
        RECIPE.format(seq=seq, paths=listed, split=split, training=training, extra=extra)
    )
    return load(path)


def _entry(path: str) -> str:
    """'few' -> '../data/few'; '1 few' -> '1 ../data/few'."""
    *weight, name = path.split()
    return " ".join([*weight, f"../data/{name}"])


def _per_split(name: str, paths: list[str]) -> str:
    return f"  {name}: [" + ", ".join(f'"{_entry(p)}"' for p in paths) + "]\n"


def _ours(loaded) -> list[str]:
    """validate's lines about the splits (the plan's other checks are not this test's), each
    short enough to be printed whole."""
    from megatron_ext.errors import MAX_PROBLEM_CHARS

    lines = [
        f"{p.where}: {p.what}"
        for p in plan_problems(loaded)
        if p.where.startswith(("data.", "model.seq_length"))
    ]
    assert all(len(line) <= MAX_PROBLEM_CHARS for line in lines), lines
    return lines


def _flags(argv: list[str]) -> dict[str, list[str]]:
    flags: dict[str, list[str]] = {}
    for word in argv:
        if word.startswith("--"):
            current = flags.setdefault(word, [])
        else:
            current.append(word)
    return flags


def _megatrons(loaded, tmp_path) -> str | None:
    """What megatron-core does with the recipe's command line at start-up: None when every
    split it builds has a sample, else the assertion that stops the ranks."""
    from megatron.core.datasets.blended_megatron_dataset_builder import (
        BlendedMegatronDatasetBuilder,
    )
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig
    from megatron.training import global_vars
    from megatron.training.datasets.data_samplers import MegatronPretrainingSampler
    from megatron.training.training import get_train_valid_test_num_samples
    from megatron.training.utils import get_blend_and_blend_per_split

    from megatron_ext.data.preprocess import build_tokenizer
    from megatron_ext.launch.training import run_defaults

    flags = _flags(megatron_args(loaded))
    one = lambda flag, default=None: int(flags[flag][0]) if flag in flags else default  # noqa: E731
    args = argparse.Namespace(
        data_path=flags.get("--data-path"),
        data_args_path=None,
        train_data_path=flags.get("--train-data-path"),
        valid_data_path=flags.get("--valid-data-path"),
        test_data_path=flags.get("--test-data-path"),
        per_split_data_args_path=None,
        train_samples=None,
        train_iters=one("--train-iters"),
        global_batch_size=one("--global-batch-size"),
        full_validation=False,
        skip_train=False,
        eval_interval=one("--eval-interval", run_defaults()["eval_interval"]),
        start_eval_at_iter=None,
        eval_iters=one("--eval-iters"),
        phase_transition_iterations=None,
    )
    before = global_vars._GLOBAL_ARGS
    global_vars.set_args(args)
    try:
        sizes = list(get_train_valid_test_num_samples())
    finally:
        global_vars.set_args(before)
    blend, blend_per_split = get_blend_and_blend_per_split(args)
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
        sequence_length=one("--seq-length"),
        blend=blend,
        blend_per_split=blend_per_split,
        split=flags["--split"][0] if blend is not None else None,
        path_to_cache=str(tmp_path / f"cache{next(_cache)}"),
        tokenizer=tokenizer,
        reset_position_ids=False,
        reset_attention_mask=False,
        eod_mask_loss=False,
    )
    try:
        built = BlendedMegatronDatasetBuilder(GPTDataset, sizes, lambda: True, config).build()
        for dataset in built:
            if dataset is not None:  # what build_pretraining_data_loader makes of each split
                MegatronPretrainingSampler(
                    total_samples=len(dataset),
                    consumed_samples=0,
                    micro_batch_size=1,
                    data_parallel_rank=0,
                    data_parallel_size=1,
                )
    except AssertionError as e:
        return f"AssertionError: {e}".strip()
    return None


# (paths, split, training, per-split lines, seq_length, the field validate names or None)
SHAPES = {
    # one path: valid and test get one 50-token document each
    "single path fits": (["hundred"], "98,1,1", "", "", 49, None),
    "single path too short": (["hundred"], "98,1,1", "", "", 50, "model.seq_length"),
    "single path, evaluating": (["hundred"], "98,1,1", EVAL, "", 500, None),
    "eval_iters 0": (["hundred"], "98,1,1", ", eval_interval: 1, eval_iters: 0", "", 50, "m"),
    "eval_iters 0 fits": (["hundred"], "98,1,1", ", eval_interval: 1, eval_iters: 0", "", 49, None),
    "valid/test share zeroed": (["hundred"], "98,0,0", "", "", 500, None),
    # one weighted path, shared: a BlendedDataset, sized by the 0 samples asked
    "one weighted path": (["1 hundred"], "98,1,1", "", "", 8, "data.split"),
    "one weighted path, evaluating": (["1 hundred"], "98,1,1", EVAL, "", 500, None),
    # 8,1,1 of few: 5 tokens in valid and in test
    "weighted blend": (["1 hundred", "1 few"], "8,1,1", "", "", 4, "data.split"),
    "weighted blend, evaluating": (["1 hundred", "1 few"], "8,1,1", EVAL, "", 64, None),
    "unweighted blend": (["hundred", "few"], "8,1,1", "", "", 4, "data.split"),
    "unweighted blend, evaluating": (["hundred", "few"], "8,1,1", EVAL, "", 4, None),
    "unweighted blend, one short path": (["hundred", "few"], "8,1,1", EVAL, "", 5, "m"),
    "unweighted blend, short in train": (["hundred", "few"], "1,0,0", "", "", 50, "m"),
    "unweighted blend, train fits": (["hundred", "few"], "1,0,0", "", "", 49, None),
    # per-split paths: each read whole; one path is a lone dataset whatever its weight
    "valid path": (["hundred"], "", "", _per_split("valid_paths", ["few"]), 49, None),
    "valid path too short": (["hundred"], "", "", _per_split("valid_paths", ["few"]), 50, "m"),
    "weighted valid path": (["hundred"], "", "", _per_split("valid_paths", ["1 few"]), 49, None),
    "valid blend": (
        ["hundred"],
        "",
        "",
        _per_split("valid_paths", ["1 few", "1 dozen"]),
        8,
        "data.valid_paths",
    ),
    "valid blend, evaluating": (
        ["hundred"],
        "",
        EVAL,
        _per_split("valid_paths", ["1 few", "1 dozen"]),
        64,
        None,
    ),
    "test path too short": (["hundred"], "", "", _per_split("test_paths", ["dozen"]), 84, "m"),
}


@pytest.mark.parametrize("shape", list(SHAPES))
def test_the_verdict_is_megatrons(corpus, tmp_path, shape):
    paths, split, training, extra, seq, field = SHAPES[shape]
    loaded = _recipe(corpus, seq, paths, split or "98,1,1", training, extra)
    ours = _ours(loaded)
    assert not any(" 0 tokens" in line for line in ours), ours  # (megatron would hang there)
    theirs = _megatrons(loaded, tmp_path)
    assert bool(ours) == (theirs is not None), (ours, theirs)
    if field is None:
        return
    field = "model.seq_length" if field == "m" else field
    assert all(line.startswith(f"{field}: ") for line in ours), ours
    assert all("\n" not in line and "at start-up" in line for line in ours), ours
    for line in ours:  # every fix named is one megatron accepts
        for fixed in _fixed(line, paths, split, training, extra, seq):
            again = _recipe(corpus, *fixed)
            assert _megatrons(again, tmp_path) is None, (line, fixed)
            assert _ours(again) == [], (line, fixed)


def _fixed(line: str, paths, split, training, extra, seq) -> list[tuple]:
    """The recipes the fixes in ``line`` make (those the test can apply by itself)."""
    fixed = []
    if m := re.search(r"set model\.seq_length to at most (\d+)", line):
        fixed.append((int(m.group(1)), paths, split or "98,1,1", training, extra))
    if m := re.search(r"data\.split: ([0-9.,]+)\)", line):
        fixed.append((seq, paths, m.group(1), training, extra))
    if "give every path a weight" in line:
        fixed.append((seq, [f"1 {p}" for p in paths], split or "98,1,1", training, extra))
    if "evaluate (training.eval_interval)" in line:
        fixed.append((seq, paths, split or "98,1,1", EVAL, extra))
    if m := re.search(r"leave out data\.(valid|test)_paths( and set data\.split: 1,0,0)?", line):
        left = "\n".join(x for x in extra.splitlines() if not x.startswith(f"  {m[1]}_paths"))
        fixed.append((seq, paths, "1,0,0" if m[2] else "98,1,1", training, left and left + "\n"))
    assert fixed, line
    return fixed


def test_the_line_names_the_path_its_tokens_and_the_longest_seq_length(corpus):
    (valid, test) = _ours(_recipe(corpus, 50, ["hundred"]))
    assert valid.startswith("model.seq_length: 50 is too long for the valid split of "), valid
    for words in (
        "data.paths[0] (hundred)",
        "under split 98,1,1",
        "1 documents, 50 tokens",
        "seq_length+1 = 51",
        "(no sample to consume: 0)",
        "set model.seq_length to at most 49",
        "set its share to 0 (data.split: 98,0,0)",  # both at once: each widens the other
        "evaluate (training.eval_interval)",
    ):
        assert words in valid, (words, valid)
    assert test.startswith("model.seq_length: 50 is too long for the test split of "), test


def test_an_unweighted_blends_short_path_is_named(corpus):
    (line,) = _ours(_recipe(corpus, 50, ["hundred", "few"], "1,0,0"))
    assert "the train split of data.paths[1] (few)" in line, line
    assert "10 documents, 50 tokens" in line and "every weight > 0" in line, line
    assert "set model.seq_length to at most 49" in line
    assert "give every path a weight" in line


def test_validate_prints_one_line_and_fails_before_any_rank(corpus, capsys):
    loaded = _recipe(corpus, 50, ["hundred"])
    assert cli_main(["validate", str(loaded.source)]) != 0
    out = capsys.readouterr()
    text = out.out + out.err
    lines = [ln for ln in text.splitlines() if "model.seq_length" in ln]
    assert len(lines) == 2 and "Traceback" not in text, text  # valid and test


def test_a_suggested_split_must_fill_every_split(corpus):
    """An empty split under a run that evaluates nothing: the documents alternative is a split
    whose every part holds a sample (a dozen 7-token documents, seq_length 8: 2 each)."""
    (valid, _) = _ours(_recipe(corpus, 8, ["dozen"]))
    assert "0 tokens" in valid and valid.endswith("(e.g. data.split: 8,2,2)"), valid
    assert _ours(_recipe(corpus, 8, ["dozen"], "8,2,2")) == []


def test_a_long_data_path_leaves_the_line_whole(tmp_path):
    """The line names the path by its data.paths entry and file name: a deep directory does not
    push the fix past the length a problem line is cut at."""
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    from megatron_ext.errors import MAX_PROBLEM_CHARS

    deep = tmp_path.joinpath(*["a_rather_long_directory_name"] * 12)
    deep.mkdir(parents=True)
    builder = IndexedDatasetBuilder(str(deep / "corpus.bin"), dtype=np.uint16)
    for i in range(12):
        builder.add_document(np.arange(7, dtype=np.int64) + i, [7])
    builder.finalize(str(deep / "corpus.idx"))
    recipe = tmp_path / "r.yaml"
    for seq in (7, 8):  # the valid split: one 7-token document, then none (98,1,1)
        recipe.write_text(
            RECIPE.format(
                seq=seq,
                paths=f'["{deep}/corpus"]',
                split="10,1,1" if seq == 7 else "98,1,1",
                training="",
                extra="",
            )
        )
        lines = [str(p) for p in plan_problems(load(recipe)) if "split" in str(p)]
        assert lines and all(len(line) < MAX_PROBLEM_CHARS for line in lines), lines
        assert all(line.endswith(")") for line in lines), lines  # the fix, not "... (N chars)"


def test_flags_that_change_the_sample_counts_leave_the_verdict_to_megatron(corpus):
    extra = "extra_args: {'--full-validation': true}\n"
    loaded = _recipe(corpus, 50, ["hundred"])
    loaded.source.write_text(loaded.source.read_text() + extra)
    assert _ours(load(loaded.source)) == []


def test_mock_data_splits_hold_a_sample_for_any_practical_seq_length(tmp_path):
    """Mock data (no verdict needed): megatron-core splits its 100000 documents 1,1,1 whatever
    data.split says, about 68 million tokens a split."""
    from megatron.core.datasets.blended_megatron_dataset_builder import (
        BlendedMegatronDatasetBuilder,
    )
    from megatron.core.datasets.gpt_dataset import GPTDatasetConfig, MockGPTDataset

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
        sequence_length=1 << 20,
        path_to_cache=str(tmp_path / "mock"),
        tokenizer=tokenizer,
        reset_position_ids=False,
        reset_attention_mask=False,
        eod_mask_loss=False,
    )
    built = BlendedMegatronDatasetBuilder(MockGPTDataset, [2, 0, 0], lambda: True, config).build()
    assert all(len(d) > 0 for d in built)
