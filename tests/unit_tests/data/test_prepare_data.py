"""prepare-data: JSONL -> Megatron's indexed format, read back through megatron's reader.

Tokenizers are trained here on a few kB of the stdlib-docstring corpus (seconds); no test
downloads anything. Round trips go through megatron's own ``IndexedDataset`` and compare every
document with megatron's tokenizer (``build_tokenizer``) applied to the same text.
"""

from __future__ import annotations

import argparse

import numpy as np
import pytest

from megatron_ext.cli import main as cli_main
from megatron_ext.data import corpus, tokenizer_training
from megatron_ext.data.preprocess import build_tokenizer

SAMPLE_CHARS = 12_000


@pytest.fixture(scope="module")
def sample(tmp_path_factory):
    """A small corpus (a list-of-sentences document and an empty one among them) and the
    three trained tokenizers."""
    root = tmp_path_factory.mktemp("prepare")
    records = corpus.build(max_chars=SAMPLE_CHARS)
    texts = [r["text"] for r in records]
    records.insert(1, {"text": ["First sentence.", "", "Second one."], "module": "list"})
    records.insert(2, {"text": "", "module": "empty"})
    jsonl = corpus.write_jsonl(records, root / "corpus.jsonl")
    bpe = tokenizer_training.train_byte_level_bpe(texts, 320, root / "tok")
    spm = tokenizer_training.train_sentencepiece(texts, 400, root / "tok" / "sp")
    tokenizers = {
        "HuggingFaceTokenizer": ["--tokenizer-model", str(bpe["hf_dir"])],
        "GPT2 files via HuggingFaceTokenizer": ["--tokenizer-model", str(bpe["vocab_file"].parent)],
        "SentencePieceTokenizer": ["--tokenizer-model", str(spm)],
    }
    return root, jsonl, records, tokenizers


def _prepare(*args) -> int:
    return cli_main(["prepare-data", *map(str, args)])


def _tokenizer(flags: list[str], tokenizer_type: str):
    ns = argparse.Namespace(
        tokenizer_type=tokenizer_type,
        tokenizer_model=None,
        vocab_file=None,
        merge_file=None,
        vocab_size=None,
    )
    ns.tokenizer_model = flags[1]
    return build_tokenizer(ns)


def _read_back(prefix: str) -> list[np.ndarray]:
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    dataset = IndexedDataset(prefix)
    docs = dataset.document_indices
    return [
        np.concatenate([dataset[i] for i in range(docs[d], docs[d + 1])] or [np.array([], int)])
        for d in range(len(docs) - 1)
    ]


@pytest.mark.parametrize("eod", [False, True], ids=["no-eod", "eod"])
@pytest.mark.parametrize(
    "name",
    ["HuggingFaceTokenizer", "GPT2 files via HuggingFaceTokenizer", "SentencePieceTokenizer"],
)
def test_round_trip_equals_megatrons_tokenizer(sample, name, eod, tmp_path):
    root, jsonl, records, tokenizers = sample
    tokenizer_type = name.split()[-1]
    prefix = tmp_path / "out"
    eod_flag = ["--append-eod"] if eod else []
    rc = _prepare(
        "--input",
        jsonl,
        "--output-prefix",
        prefix,
        "--tokenizer-type",
        tokenizer_type,
        *tokenizers[name],
        "--workers",
        1,
        *eod_flag,
    )
    assert rc == 0
    tokenizer = _tokenizer(tokenizers[name], tokenizer_type)
    docs = _read_back(f"{prefix}_text_document")
    assert len(docs) == len(records)
    for record, doc in zip(records, docs, strict=True):
        sentences = record["text"] if isinstance(record["text"], list) else [record["text"]]
        expected = [t for s in sentences for t in tokenizer.tokenize(s)]
        if eod and expected:
            expected.append(tokenizer.eod)
        assert doc.tolist() == expected, record["module"]
    assert docs[2].size == 0  # the empty document stays a document, as upstream's
    # Megatron's dtype choice for a vocabulary under 65500 tokens.
    assert docs[0].dtype == np.uint16


def test_workers_2_write_the_same_files_as_1(sample, tmp_path):
    _, jsonl, _, tokenizers = sample
    flags = ["--tokenizer-type", "SentencePieceTokenizer", *tokenizers["SentencePieceTokenizer"]]
    for workers in (1, 2):
        rc = _prepare(
            "--input",
            jsonl,
            "--output-prefix",
            tmp_path / f"w{workers}",
            *flags,
            "--workers",
            workers,
            "--append-eod",
            "--log-interval",
            10,
        )
        assert rc == 0
    for ext in (".bin", ".idx"):
        one = (tmp_path / f"w1_text_document{ext}").read_bytes()
        assert one == (tmp_path / f"w2_text_document{ext}").read_bytes(), ext


def test_null_tokenizer_round_trip(tmp_path):
    jsonl = tmp_path / "ids.jsonl"
    jsonl.write_text('{"text": "3 1 4 1 5"}\n{"text": "9 2 6"}\n')
    rc = _prepare(
        "--input",
        jsonl,
        "--output-prefix",
        tmp_path / "n",
        "--tokenizer-type",
        "NullTokenizer",
        "--vocab-size",
        16,
        "--workers",
        1,
        "--append-eod",
    )
    assert rc == 0
    # NullTokenizer's EOD: one id, the same after every document.
    docs = [d.tolist() for d in _read_back(str(tmp_path / "n_text_document"))]
    assert [d[:-1] for d in docs] == [[3, 1, 4, 1, 5], [9, 2, 6]]
    assert docs[0][-1] == docs[1][-1]


@pytest.mark.parametrize(
    "lines, message",
    [
        (['{"text": "fine"}', '{"text": "fine"}', '{"text": oops}'], ":3: not a JSON object"),
        (['{"text": "fine"}', '{"body": "no text"}'], ":2: no key 'text' (keys: body)"),
        (['{"text": "fine"}', '{"text": 7}'], ":2: 'text' must be a string or a list"),
        (['{"text": "fine"}', "[1, 2]"], ":2: not a JSON object (got list)"),
    ],
    ids=["malformed", "missing-key", "not-text", "not-an-object"],
)
def test_bad_lines_are_one_line_errors_naming_the_line(sample, tmp_path, capsys, lines, message):
    _, _, _, tokenizers = sample
    jsonl = tmp_path / "bad.jsonl"
    jsonl.write_text("\n".join(lines) + "\n")
    prefix = tmp_path / "out"
    rc = _prepare(
        "--input",
        jsonl,
        "--output-prefix",
        prefix,
        "--tokenizer-type",
        "SentencePieceTokenizer",
        *tokenizers["SentencePieceTokenizer"],
        "--workers",
        2,
    )
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2
    assert err[-1].startswith("megatron-ext prepare-data: ") and f"bad.jsonl{message}" in err[-1]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.jsonl"]  # nothing half-written


def test_a_tokenizer_failure_names_the_line(tmp_path, capsys):
    # Upstream's script hangs here (its pool worker dies); ours stops with the line.
    jsonl = tmp_path / "ids.jsonl"
    jsonl.write_text('{"text": "1 2"}\n{"text": "1 two"}\n')
    rc = _prepare(
        "--input",
        jsonl,
        "--output-prefix",
        tmp_path / "n",
        "--tokenizer-type",
        "NullTokenizer",
        "--vocab-size",
        16,
        "--workers",
        2,
    )
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and "ids.jsonl:2: 'text': the tokenizer failed (ValueError" in err[-1], err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ids.jsonl"]


def test_invalid_utf8_names_the_line(sample, tmp_path, capsys):
    _, _, _, tokenizers = sample
    jsonl = tmp_path / "bin.jsonl"
    jsonl.write_bytes(b'{"text": "ok"}\n{"text": "\xff\xfe"}\n')
    rc = _prepare(
        "--input",
        jsonl,
        "--output-prefix",
        tmp_path / "o",
        "--tokenizer-type",
        "HuggingFaceTokenizer",
        *tokenizers["HuggingFaceTokenizer"],
        "--workers",
        1,
    )
    assert rc == 2 and "bin.jsonl:2: not UTF-8 text" in capsys.readouterr().err


@pytest.mark.parametrize(
    "args, message",
    [
        (["--input", "missing.jsonl"], "--input missing.jsonl: no such file"),
        (
            ["--input", "{jsonl}", "--tokenizer-model", "nowhere.model"],
            "--tokenizer-model: nowhere.model does not exist",
        ),
        (["--input", "{jsonl}", "--workers", "0"], "--workers must be a positive number"),
    ],
    ids=["input", "tokenizer-file", "workers"],
)
def test_missing_files_are_one_line_errors(sample, tmp_path, capsys, monkeypatch, args, message):
    _, jsonl, _, tokenizers = sample
    monkeypatch.chdir(tmp_path)
    base = {"--workers": "1", "--tokenizer-model": tokenizers["SentencePieceTokenizer"][1]}
    given = dict(
        zip(args[::2], [a.replace("{jsonl}", str(jsonl)) for a in args[1::2]], strict=True)
    )
    flags = [x for k, v in {**base, **given}.items() for x in (k, v)]
    rc = _prepare("--tokenizer-type", "SentencePieceTokenizer", "--output-prefix", "o", *flags)
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and err[0].startswith(f"megatron-ext prepare-data: {message}")


def test_gpt2_bpe_offline_names_the_alternative(sample, tmp_path, capsys, monkeypatch):
    from megatron_ext.data import checks

    _, jsonl, _, _ = sample
    if checks.hub_cached("gpt2"):
        pytest.skip("gpt2's tokenizer files are in this machine's HuggingFace cache")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    rc = _prepare(
        "--input",
        jsonl,
        "--output-prefix",
        tmp_path / "o",
        "--tokenizer-type",
        "GPT2BPETokenizer",
        "--vocab-file",
        jsonl,
        "--merge-file",
        jsonl,
        "--workers",
        1,
    )
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1, err
    assert "HuggingFace hub" in err[0] and "offline: HuggingFaceTokenizer" in err[0]


def test_workers_default_to_one(tmp_path, capsys):
    """Without --workers prepare-data tokenizes in this process, as --help says (issue 33)."""
    from megatron_ext.cli import build_parser

    (tmp_path / "ids.jsonl").write_text('{"text": "1 2 3"}\n')
    rc = _prepare(
        "--input",
        tmp_path / "ids.jsonl",
        "--output-prefix",
        tmp_path / "ids",
        "--tokenizer-type",
        "NullTokenizer",
        "--vocab-size",
        16,
    )
    assert rc == 0, capsys.readouterr().err
    assert (tmp_path / "ids_text_document.idx").exists()
    help_text = build_parser()._subparsers._group_actions[0].choices["prepare-data"].format_help()
    assert "default 1" in " ".join(help_text.split())


def test_gpt2_bpe_local_files_load_with_the_hub_off(tmp_path, monkeypatch):
    """GPT2BPETokenizer with local vocab/merges and gpt2's configuration cached: built with the
    hub off, no network connection is attempted (offline it spent 50-60 s on retries; issue 34
    item 12); the ranks get the same switch."""
    import argparse
    import json
    import socket

    from megatron_ext.data import preprocess, tokenizer_files

    snapshot = tmp_path / "hub" / "models--gpt2" / "snapshots" / ("0" * 40)
    snapshot.mkdir(parents=True)
    (tmp_path / "hub" / "models--gpt2" / "refs").mkdir()
    (tmp_path / "hub" / "models--gpt2" / "refs" / "main").write_text("0" * 40)
    (snapshot / "tokenizer_config.json").write_text('{"tokenizer_class": "GPT2Tokenizer"}')
    (snapshot / "config.json").write_text('{"model_type": "gpt2"}')
    vocab, merges = tmp_path / "vocab.json", tmp_path / "merges.txt"
    vocab.write_text(
        json.dumps({t: i for i, t in enumerate(["<|endoftext|>", "a", "b", "Ġ", "ab"])})
    )
    merges.write_text("#version: 0.2\na b\n")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    for name in tokenizer_files.OFFLINE_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    constants = pytest.importorskip("huggingface_hub.constants")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    attempts = []

    def no_network(sock, address):
        attempts.append(address)
        raise OSError("the test allows no network")

    monkeypatch.setattr(socket.socket, "connect", no_network)
    # a machine without network fails at the name lookup, before any connect
    monkeypatch.setattr(socket, "getaddrinfo", lambda host, *a, **k: no_network(None, host))
    args = argparse.Namespace(
        tokenizer_type="GPT2BPETokenizer",
        tokenizer_model=None,
        vocab_file=str(vocab),
        merge_file=str(merges),
        append_eod=True,
        vocab_size=None,
    )
    tokenizer = preprocess.build_tokenizer(args)
    assert tokenizer.tokenize("ab a") == [4, 3, 1] and tokenizer.eod == 0
    assert attempts == [], f"network attempted: {attempts}"
    env = tokenizer_files.run_environment("GPT2BPETokenizer", None, str(vocab), str(merges))
    assert env == dict.fromkeys(tokenizer_files.OFFLINE_VARIABLES, "1")


def test_progress_is_shown_from_the_first_document_and_when_quiet(monkeypatch):
    """Issue 41, item 11: nothing was printed until --log-interval documents were done."""
    import io

    from megatron_ext.data import preprocess

    now = [0.0]
    monkeypatch.setattr(preprocess.time, "time", lambda: now[0])
    stream = io.StringIO()
    progress = preprocess._Progress(1000, stream)  # starts at 0 s
    for count, at in enumerate([1.0, 2.0, 3.0, 14.0, 15.0], start=1):
        now[0] = at
        progress.update(count, 100 * count)
    lines = stream.getvalue().splitlines()
    assert [line.split()[1] for line in lines] == ["1", "4"], lines
