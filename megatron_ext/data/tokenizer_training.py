"""Small tokenizers trained locally on a corpus, each with the library that owns the format.

- a byte-level BPE (HuggingFace ``tokenizers``) written twice: as GPT-2's ``vocab.json`` +
  ``merges.txt`` (``--tokenizer-type GPT2BPETokenizer --vocab-file --merge-file``) and as a
  HuggingFace tokenizer directory with ``tokenizer.json`` (``--tokenizer-type
  HuggingFaceTokenizer --tokenizer-model DIR``);
- a SentencePiece BPE model (``--tokenizer-type SentencePieceTokenizer --tokenizer-model
  FILE.model``).

Training is deterministic for a given corpus and library version (single-threaded here).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterable
from pathlib import Path

EOD_TOKEN = "<|endoftext|>"
"""GPT-2's end-of-document token; megatron's HuggingFace wrapper takes it as ``eod``."""


def interruptible[T](train: Callable[..., T], *args) -> T:
    """``train(*args)`` in a helper thread while the main thread waits in short steps: the
    trainers (Rust, C++) release the GIL but never return to Python until they are done, so
    run in the main thread a Ctrl-C or SIGTERM waited for the whole training (issue 41,
    item 12). Here the signal interrupts the wait; the daemon thread ends with the process."""
    import threading

    outcome: dict = {}

    def work() -> None:
        try:
            outcome["value"] = train(*args)
        except BaseException as exc:  # handed to the waiting thread
            outcome["error"] = exc

    worker = threading.Thread(target=work, name="tokenizer-training", daemon=True)
    worker.start()
    while worker.is_alive():
        worker.join(0.1)
    if "error" in outcome:
        raise outcome["error"]
    return outcome["value"]


def train_byte_level_bpe(texts: Iterable[str], vocab_size: int, out_dir: Path) -> dict:
    """A byte-level BPE saved as GPT-2 files and as a HuggingFace tokenizer directory.

    Returns the paths: ``vocab_file``, ``merge_file`` and ``hf_dir``.
    """
    # The Rust trainer's parallelism is deterministic, but one thread keeps a 2-core box calm.
    os.environ.setdefault("RAYON_NUM_THREADS", "1")
    from tokenizers import ByteLevelBPETokenizer
    from transformers import PreTrainedTokenizerFast

    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(
        list(texts),
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=[EOD_TOKEN],
        show_progress=False,
    )
    gpt2_dir = out_dir / "gpt2"
    gpt2_dir.mkdir(parents=True, exist_ok=True)
    vocab_file, merge_file = bpe.save_model(str(gpt2_dir))
    # With this file the GPT-2 pair also loads offline, as --tokenizer-type
    # HuggingFaceTokenizer --tokenizer-model <gpt2 dir> (transformers' GPT2TokenizerFast).
    config = {"tokenizer_class": "GPT2Tokenizer", "add_prefix_space": False}
    config.update({f"{role}_token": EOD_TOKEN for role in ("bos", "eos", "unk")})
    (gpt2_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    hf_dir = out_dir / "huggingface"
    hf_dir.mkdir(parents=True, exist_ok=True)
    bpe.save(str(hf_dir / "tokenizer.json"))
    fast = PreTrainedTokenizerFast(
        tokenizer_file=str(hf_dir / "tokenizer.json"),
        bos_token=EOD_TOKEN,
        eos_token=EOD_TOKEN,
        unk_token=EOD_TOKEN,
    )
    fast.save_pretrained(str(hf_dir))
    return {"vocab_file": Path(vocab_file), "merge_file": Path(merge_file), "hf_dir": hf_dir}


def train_sentencepiece(texts: Iterable[str], vocab_size: int, out_dir: Path) -> Path:
    """A SentencePiece BPE model; returns the ``.model`` path."""
    import sentencepiece as spm

    out_dir.mkdir(parents=True, exist_ok=True)
    prefix = out_dir / "tokenizer"
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(list(texts)),
        model_prefix=str(prefix),
        vocab_size=vocab_size,
        model_type="bpe",
        character_coverage=1.0,
        byte_fallback=True,
        num_threads=1,
        # Docstrings are long; a "sentence" is a whole docstring here.
        max_sentence_length=1 << 16,
        minloglevel=2,
    )
    return prefix.with_suffix(".model")


def read_vocab_size(vocab_file: Path) -> int:
    return len(json.loads(vocab_file.read_text(encoding="utf-8")))
