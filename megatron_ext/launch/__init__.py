"""Launching Megatron training: entry points and local/Slurm launchers.

- :mod:`megatron_ext.launch.training`: what every training entry point shares. It picks the
  runtime (the CPU runtime when no GPU exists, otherwise ``megatron_ext.install()``). It
  parses Megatron's own flags plus extra groups, with defaults that the machine needs. Then
  it hands the parsed arguments to ``megatron.training.pretrain``.
- the canonical CPU demo, a tiny PP=2 GPT on mock data. ``CPU_DEMO_ARGS`` (below) holds its
  flags. ``python -m megatron_ext.launch.demo`` runs it with torchrun, and
  ``python -m megatron_ext.launch.demo --print-args`` prints the flags for Makefiles and
  shell scripts (see :mod:`megatron_ext.launch.demo`).

The entry points themselves are modules such as :mod:`megatron_ext.pretrain_gpt`.

Importing this package does not import megatron or torch, so an entry point can quiet the
other ranks before megatron's imports start warning.
"""

import os
import warnings

__all__ = ["CPU_DEMO_ARGS", "CPU_DEMO_NPROC", "silence_warnings_off_rank_zero"]

CPU_DEMO_NPROC = 2
"""Ranks for the demo: one per pipeline stage."""

# fmt: off
CPU_DEMO_ARGS: tuple[str, ...] = (
    # A 4-layer GPT split over 2 pipeline stages. It is small enough for 2 cores.
    "--pipeline-model-parallel-size", "2",
    "--num-layers", "4",
    "--hidden-size", "64",
    "--num-attention-heads", "4",
    "--seq-length", "32",
    "--max-position-embeddings", "32",
    # 4 micro-batches per iteration, so the 1F1B schedule has a steady state.
    "--micro-batch-size", "2",
    "--global-batch-size", "8",
    "--train-iters", "10",
    "--lr", "1e-3",
    "--lr-decay-style", "constant",
    "--mock-data",
    "--tokenizer-type", "NullTokenizer",
    "--vocab-size", "128",
    # On CPU, megatron_ext.pretrain_gpt already defaults to these. They are listed so that
    # the command also says what it runs with when someone reads it.
    "--transformer-impl", "local",
    "--distributed-backend", "gloo",
    "--no-gradient-accumulation-fusion",
    "--no-persist-layer-norm",
    "--no-masked-softmax-fusion",
    "--no-bias-gelu-fusion",
    "--no-bias-dropout-fusion",
    "--no-rope-fusion",
    "--log-interval", "1",
    "--eval-iters", "1",
    "--eval-interval", "5",
)
# fmt: on

_NOISY_CATEGORIES = (UserWarning, FutureWarning, DeprecationWarning)


def silence_warnings_off_rank_zero() -> None:
    """Show megatron's many user, future and deprecation warnings on rank 0 only.

    Every rank imports and configures megatron in the same way, so the other ranks would
    only repeat rank 0's warnings. Errors and other warning categories still show everywhere.
    """
    if int(os.environ.get("RANK", "0")) == 0:
        return
    for category in _NOISY_CATEGORIES:
        warnings.filterwarnings("ignore", category=category)
