"""``prepare-data --example DIR``: real text to train on, made offline in one step.

Writes under ``DIR``:

- ``corpus/stdlib_a_m.jsonl``, ``corpus/stdlib_n_z.jsonl``: the installed standard library's
  docstrings (:mod:`.corpus`), split by module name into two sources for a weighted blend;
- ``tokenizers/gpt2/`` (``vocab.json``, ``merges.txt``), ``tokenizers/huggingface/``
  (``tokenizer.json``) and ``tokenizers/sentencepiece/tokenizer.model``, trained on the corpus
  (:mod:`.tokenizer_training`);
- ``data/<tokenizer>/stdlib_{a_m,n_z}_text_document.bin/.idx`` for the HuggingFace and the
  SentencePiece tokenizer, EOD appended (:mod:`.preprocess`, the same path as ``prepare-data``);
- ``example.json``: the Python version, the corpus digest and every path.

The GPT-2 files tokenize exactly as the HuggingFace directory (the same BPE); they are written
for ``--tokenizer-type GPT2BPETokenizer``, which megatron can only build with access to the
HuggingFace hub (see :mod:`.checks`).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import sys
from importlib import metadata
from pathlib import Path

from megatron_ext import files
from megatron_ext.data import corpus, tokenizer_training
from megatron_ext.data.preprocess import preprocess

VOCAB_SIZE = 1024
SOURCES = {"stdlib_a_m": ("a", "m"), "stdlib_n_z": ("n", "z")}
"""Blend sources: modules whose name starts in the letter range (``_private`` ones go last)."""


def _source_of(module: str) -> str:
    first = module.lstrip("_")[:1].lower()
    return "stdlib_a_m" if "a" <= first <= "m" else "stdlib_n_z"


def _say(message: str) -> None:
    print(f"prepare-data --example: {message}", file=sys.stderr, flush=True)


def _relative(path: str, root: Path) -> str:
    return str(Path(path).relative_to(root))


def tokenizer_flags(root: Path) -> dict[str, dict]:
    """Tokenizer name -> the prepare-data/pretrain fields for the example's tokenizers."""
    tok = root / "tokenizers"
    return {
        "huggingface": {
            "tokenizer_type": "HuggingFaceTokenizer",
            "tokenizer_model": str(tok / "huggingface"),
        },
        "sentencepiece": {
            "tokenizer_type": "SentencePieceTokenizer",
            "tokenizer_model": str(tok / "sentencepiece" / "tokenizer.model"),
        },
        "gpt2": {
            "tokenizer_type": "GPT2BPETokenizer",
            "vocab_file": str(tok / "gpt2" / "vocab.json"),
            "merge_file": str(tok / "gpt2" / "merges.txt"),
        },
    }


def builder_key() -> str:
    """What the example's bytes depend on: the Python (its docstrings), the tokenizer libraries
    and this package's code. Equal keys make equal files."""
    h = hashlib.sha256(corpus.python_version().encode())
    for package in ("tokenizers", "sentencepiece", "transformers"):
        h.update(f"{package}=={metadata.version(package)}".encode())
    for module in ("corpus", "tokenizer_training", "preprocess", "example"):
        h.update((Path(__file__).parent / f"{module}.py").read_bytes())
    return h.hexdigest()[:16]


def _built_by(manifest: Path, key: str) -> bool:
    try:
        return json.loads(files.read_record(manifest, "manifest")).get("builder") == key
    except (OSError, ValueError, AttributeError):
        return False


def ensure_example(directory: str) -> Path:
    """The example under ``directory``, built unless one with the same :func:`builder_key` is
    there. Built beside it and renamed, so concurrent callers never see half an example."""
    root = Path(directory).resolve()
    key = builder_key()
    manifest = root / "example.json"
    if _built_by(manifest, key):
        return root
    remove_stale_staging(root)
    staging = root.with_name(f"{root.name}.tmp{os.getpid()}")
    shutil.rmtree(staging, ignore_errors=True)
    _build_in(staging)
    if _built_by(manifest, key):  # another process finished first: it may be reading it now
        shutil.rmtree(staging, ignore_errors=True)
        return root
    if root.exists():
        shutil.rmtree(root, ignore_errors=True)
    try:
        os.replace(staging, root)
    except OSError:  # another process put its identical copy there first
        shutil.rmtree(staging, ignore_errors=True)
    return root


def _build_in(staging: Path) -> None:
    """:func:`make_example` into ``staging``, removed again if the build does not finish: an
    error, Ctrl-C, SIGTERM or SIGHUP (issue 41, item 12: a signal left ``<dir>.tmp<pid>``
    behind, and one was committed)."""
    from megatron_ext.launch.local import stop_signals_interrupt

    try:
        with stop_signals_interrupt():
            make_example(str(staging))
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def remove_stale_staging(root: Path) -> list[Path]:
    """Remove ``<root>.tmp<pid>`` directories whose process is gone (killed with SIGKILL,
    where nothing can clean up); a live process's staging is left alone."""
    removed = []
    for candidate in root.parent.glob(f"{root.name}.tmp*"):
        pid = candidate.name[len(root.name) + 4 :]
        if not pid.isdigit() or not candidate.is_dir() or _alive(int(pid)):
            continue
        shutil.rmtree(candidate, ignore_errors=True)
        removed.append(candidate)
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # another user's process: alive
        return True
    return True


def make_example(directory: str, workers: int = 1) -> dict:
    from megatron_ext.data.preprocess import PrepareDataError

    for package in ("tokenizers", "sentencepiece", "transformers"):
        try:
            metadata.version(package)
        except metadata.PackageNotFoundError:
            raise PrepareDataError(
                f"--example needs {package}: pip install 'megatron-ext[data]'"
            ) from None
    root = Path(directory).resolve()
    _say(f"corpus from the docstrings of {corpus.stdlib_dir()}")
    records = corpus.build()
    jsonl = {}
    for name in SOURCES:
        part = [r for r in records if _source_of(r["module"]) == name]
        jsonl[name] = corpus.write_jsonl(part, root / "corpus" / f"{name}.jsonl")
        _say(f"{jsonl[name]}: {len(part)} documents")
    texts = [r["text"] for r in records]
    _say(f"training a byte-level BPE and a SentencePiece model ({VOCAB_SIZE} tokens)")
    tokenizer_training.interruptible(
        tokenizer_training.train_byte_level_bpe, texts, VOCAB_SIZE, root / "tokenizers"
    )
    tokenizer_training.interruptible(
        tokenizer_training.train_sentencepiece,
        texts,
        VOCAB_SIZE,
        root / "tokenizers" / "sentencepiece",
    )
    flags = tokenizer_flags(root)
    datasets: dict[str, dict[str, str]] = {}
    for tok in ("huggingface", "sentencepiece"):
        for name, path in jsonl.items():
            fields = {"tokenizer_model": None, "vocab_file": None, "merge_file": None}
            args = argparse.Namespace(
                **{**fields, **flags[tok]},
                vocab_size=None,
                input=str(path),
                json_keys=["text"],
                append_eod=True,
                output_prefix=str(root / "data" / tok / name),
                workers=workers,
                log_interval=1000,
            )
            datasets.setdefault(tok, {})[name] = preprocess(args)["text"]
    manifest = {
        "builder": builder_key(),
        "python": corpus.python_version(),
        "corpus_sha256": corpus.digest(records),
        "documents": len(records),
        "vocab_size": VOCAB_SIZE,
        # Paths relative to the example's directory: it can move.
        "corpus": {name: str(path.relative_to(root)) for name, path in jsonl.items()},
        "tokenizers": {
            tok: {k: (_relative(v, root) if k != "tokenizer_type" else v) for k, v in f.items()}
            for tok, f in flags.items()
        },
        "datasets": {
            tok: {name: _relative(p, root) for name, p in d.items()} for tok, d in datasets.items()
        },
    }
    (root / "example.json").write_text(json.dumps(manifest, indent=2) + "\n")
    _say(f"done: {root / 'example.json'}")
    return manifest
