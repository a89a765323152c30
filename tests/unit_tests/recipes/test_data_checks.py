"""validate's data checks: one line per problem, before any rank starts."""

from __future__ import annotations

import pytest

from megatron_ext.cli import main as cli_main
from megatron_ext.recipes import load
from megatron_ext.recipes.checks import plan_problems
from megatron_ext.recipes.command import megatron_args

RECIPE = """
version: 1
model: {{type: gpt, num_layers: 2, hidden_size: 32, num_attention_heads: 4, seq_length: 16}}
parallelism: {{pp: 1}}
training: {{iterations: 2, micro_batch_size: 2, global_batch_size: 4}}
data:
  type: indexed
  paths: {paths}
  split: "1,0,0"  # two documents: no valid or test split (Megatron would loop on an empty one)
  tokenizer: {tokenizer}
"""


@pytest.fixture(scope="module")
def ids_dataset(tmp_path_factory):
    """data/ids_text_document: token ids up to 40, made with NullTokenizer."""
    root = tmp_path_factory.mktemp("checks")
    (root / "ids.jsonl").write_text('{"text": "1 2 40"}\n{"text": "7 8"}\n')
    rc = cli_main(
        [
            "prepare-data",
            "--input",
            str(root / "ids.jsonl"),
            "--output-prefix",
            str(root / "data" / "ids"),
            "--tokenizer-type",
            "NullTokenizer",
            "--vocab-size",
            "64",
            "--workers",
            "1",
        ]
    )
    assert rc == 0
    return root


def _problems(root, paths, tokenizer="{type: NullTokenizer, vocab_size: 64}") -> list[str]:
    recipe = root / "recipes" / "r.yaml"
    recipe.parent.mkdir(exist_ok=True)
    recipe.write_text(RECIPE.format(paths=paths, tokenizer=tokenizer))
    return [str(p) for p in plan_problems(load(recipe)) if str(p).startswith("data.")]


def test_paths_are_relative_to_the_recipe_and_fill_placeholders(ids_dataset, monkeypatch):
    monkeypatch.setenv("IDS_ROOT", str(ids_dataset / "data"))
    paths = (
        '["0.5 ../data/ids_text_document", "0.5 ${IDS_ROOT}/ids_text_document", '
        '"1 ${NOT_SET_ANYWHERE:-../data}/ids_text_document"]'
    )
    assert _problems(ids_dataset, paths) == []
    args = megatron_args(load(ids_dataset / "recipes" / "r.yaml"))
    data_path = args[args.index("--data-path") + 1 : args.index("--split")]
    expected = str(ids_dataset / "recipes" / ".." / "data" / "ids_text_document")
    assert data_path == [
        "0.5",
        expected,
        "0.5",
        f"{ids_dataset}/data/ids_text_document",
        "1",
        expected,
    ]


@pytest.mark.parametrize(
    "paths, tokenizer, message",
    [
        (
            '["../data/none_text_document"]',
            None,
            "data.paths[0]: {root}/recipes/../data/none_text_document.bin and "
            "{root}/recipes/../data/none_text_document.idx not found",
        ),
        (
            '["heavy ../data/ids_text_document"]',
            None,
            "data.paths[0]: 'heavy ../data/ids_text_document': the weight 'heavy' is not a number",
        ),
        (
            '["${UNSET_FOR_THIS_TEST}/ids_text_document"]',
            None,
            "data.paths[0]: '${UNSET_FOR_THIS_TEST}/ids_text_document': ${UNSET_FOR_THIS_TEST} is "
            "not set in the environment",
        ),
        (
            '["../data/ids_text_document"]',
            "{type: NullTokenizer, vocab_size: 32}",
            "data.paths[0]: {root}/recipes/../data/ids_text_document.bin holds token id 40 but the "
            "tokenizer has 32 tokens",
        ),
        (
            '["../data/ids_text_document"]',
            "{type: SentencePieceTokenizer, model: nowhere.model}",
            "data.tokenizer.model: {root}/recipes/nowhere.model does not exist",
        ),
        (
            '["../data/ids_text_document"]',
            "{type: HuggingFaceTokenizer}",
            "data.tokenizer.model: HuggingFaceTokenizer needs --tokenizer-model",
        ),
    ],
    ids=[
        "missing-bin-idx",
        "weight",
        "unset-variable",
        "vocab-too-small",
        "tokenizer-file",
        "tokenizer-model-unset",
    ],
)
def test_each_data_problem_is_one_line(ids_dataset, monkeypatch, paths, tokenizer, message):
    monkeypatch.delenv("UNSET_FOR_THIS_TEST", raising=False)
    kwargs = {"tokenizer": tokenizer} if tokenizer else {}
    problems = _problems(ids_dataset, paths, **kwargs)
    expected = message.replace("{root}", str(ids_dataset))
    assert any(p.startswith(expected) for p in problems), problems
    assert all("\n" not in p for p in problems)
