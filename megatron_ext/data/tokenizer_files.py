"""A local HuggingFace tokenizer directory, read as data before any tokenizer is built.

What ``validate`` and ``prepare-data`` need to know about it, each in one line: whether its
``tokenizer.json`` and ``tokenizer_config.json`` parse (a corrupt file is otherwise a traceback
from the ``tokenizers`` library), and whether it names an end-of-document token. Megatron's
HuggingFace tokenizer takes its ``eod`` from the tokenizer's ``eos_token``
(``megatron.core.tokenizers``' HuggingFace library wrapper: ``eod`` is ``eos_token_id``); a
plain ``tokenizer.json`` written by the ``tokenizers`` library has none, so ``--append-eod``
would append ``None`` and training fails at start-up.

A local directory also never needs the HuggingFace hub: :func:`offline` sets the hub's offline
switch around the build (and :func:`run_environment` for the ranks), so that a machine without
network does not wait through the hub client's retries.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from megatron_ext import files

OFFLINE_VARIABLES = ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")
CONFIG_FILES = ("tokenizer_config.json", "special_tokens_map.json")
EOS_FIX = (
    "names no end-of-document token (eos_token), which --append-eod appends and training "
    'reads; add "eos_token": "<a token of its vocabulary>" to {dir}/tokenizer_config.json '
    "(or train it with the tokenizers library's special_tokens=[...] and name one)"
)


def is_local(model: str | None) -> bool:
    return bool(model) and Path(str(model)).exists()


def hub_cached(name: str) -> bool:
    """Whether the HuggingFace cache has ``name``'s tokenizer configuration."""
    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError:
        return False
    for filename in ("tokenizer_config.json", "config.json"):
        if isinstance(try_to_load_from_cache(name, filename), str):
            return True
    return False


def gpt2_files_local(tokenizer_type: str, vocab_file: str | None, merge_file: str | None) -> bool:
    """GPT2BPETokenizer with both files local and ``gpt2``'s configuration in the HuggingFace
    cache: megatron's MegatronHFTokenizer reads only that configuration from the hub, so the
    hub can stay off (its offline retries took 50-60 s; issue 34, item 12)."""
    return (
        tokenizer_type == "GPT2BPETokenizer"
        and is_local(vocab_file)
        and is_local(merge_file)
        and hub_cached("gpt2")
    )


@contextlib.contextmanager
def offline(
    model: str | None,
    tokenizer_type: str = "",
    vocab_file: str | None = None,
    merge_file: str | None = None,
) -> Iterator[None]:
    """The HuggingFace hub switched off while a local tokenizer is built (it reads the switch
    from the environment at import, so an imported hub client is switched too)."""
    if not (is_local(model) or gpt2_files_local(tokenizer_type, vocab_file, merge_file)):
        yield
        return
    saved = {name: os.environ.get(name) for name in OFFLINE_VARIABLES}
    constants = sys.modules.get("huggingface_hub.constants")
    saved_constant = getattr(constants, "HF_HUB_OFFLINE", None)
    os.environ.update(dict.fromkeys(OFFLINE_VARIABLES, "1"))
    if constants is not None:  # (a ModuleType to mypy: it declares no attributes)
        constants.HF_HUB_OFFLINE = True  # type: ignore[attr-defined]
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        if constants is not None:
            constants.HF_HUB_OFFLINE = saved_constant  # type: ignore[attr-defined]


def run_environment(
    tokenizer_type: str,
    model: str | None,
    vocab_file: str | None = None,
    merge_file: str | None = None,
) -> dict[str, str]:
    """Variables the ranks get: the hub off for a local HuggingFace tokenizer, and for
    GPT2BPETokenizer's local files when the hub's ``gpt2`` configuration is cached."""
    if (tokenizer_type == "HuggingFaceTokenizer" and is_local(model)) or gpt2_files_local(
        tokenizer_type, vocab_file, merge_file
    ):
        return dict.fromkeys(OFFLINE_VARIABLES, "1")
    return {}


MAX_FILE_BYTES = 1 << 30
"""A tokenizer's files are read whole (by us and by the tokenizer libraries); the largest
vocabularies' ``tokenizer.json`` hold tens of MiB."""


def read_json(path: str | os.PathLike, what: str) -> Any:
    """A tokenizer's JSON file, a regular file read within :data:`MAX_FILE_BYTES` (OSError,
    UnicodeDecodeError or ValueError otherwise)."""
    return json.loads(files.read_text_bounded(path, MAX_FILE_BYTES, what))


def _read_json(path: Path) -> tuple[Any, str | None]:
    try:
        return read_json(path, "tokenizer configuration"), None
    except (OSError, UnicodeDecodeError, ValueError, RecursionError) as e:
        return None, f"{path} is not readable JSON ({' '.join(str(e).split())})"


def irregular_entries(directory: Path) -> list[str]:
    """One line for each entry of a tokenizer directory that is neither a regular file nor a
    directory (a FIFO would block the tokenizer library's read, a device never end)."""
    # (a dangling link is skipped: the library reports a missing file itself)
    return [
        f"{entry} is {kind}, not a regular file; replace or remove it"
        for entry in sorted(directory.iterdir())
        if (kind := files.irregular_kind(entry, directory_ok=True))
    ]


def _token_text(value: Any) -> str | None:
    """An ``eos_token`` entry: a string, or an AddedToken written as ``{"content": ...}``."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) and value else None


def eos_token(directory: Path) -> tuple[str | None, str | None]:
    """(the eos token the directory's configuration names, a problem reading it)."""
    for name in CONFIG_FILES:
        path = directory / name
        if not path.is_file():
            continue
        config, problem = _read_json(path)
        if problem:
            return None, problem
        if isinstance(config, dict) and _token_text(config.get("eos_token")):
            return _token_text(config.get("eos_token")), None
    return None, None


def directory_problems(model: str, need_eos: bool = True) -> list[str]:
    """One line per problem of a local HuggingFace tokenizer directory (none for a file or a
    hub name: those are the tokenizer library's to read); ``need_eos``: its end-of-document
    token is used (training reads it for every sample, ``--append-eod`` writes it)."""
    directory = Path(model)
    if not directory.is_dir():
        return []
    if irregular := irregular_entries(directory):
        return irregular
    tokenizer_json = directory / "tokenizer.json"
    vocabulary = None
    if tokenizer_json.is_file():
        from tokenizers import Tokenizer

        try:
            vocabulary = Tokenizer.from_file(str(tokenizer_json))
        except Exception as e:  # the library raises its own Exception for any bad file
            message = " ".join(str(e).split())
            return [
                f"{tokenizer_json} cannot be read by the tokenizers library ({message}); "
                "save it again (Tokenizer.save) or point to another directory"
            ]
    eos, problem = eos_token(directory)
    if problem:
        return [problem + "; fix or remove the file"]
    if eos is None and need_eos:
        return [f"{directory} {EOS_FIX.format(dir=directory)}"]
    if eos is not None and vocabulary is not None and vocabulary.token_to_id(eos) is None:
        return [
            f"{directory}: its eos_token {eos!r} is not in tokenizer.json's vocabulary; name one "
            "of its tokens (or train it with that special token)"
        ]
    return []
