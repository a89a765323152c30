"""The canonical CPU demo: a tiny GPT trained with PP=2 by megatron.training on 2 CPU ranks.

``megatron_ext.launch.CPU_DEMO_ARGS`` is the one list of its flags. Makefiles, CI and the
docs take the flags from there instead of keeping their own copies::

    python -m megatron_ext.launch.demo                      # run it (torchrun, 2 ranks)
    python -m megatron_ext.launch.demo --save /tmp/ck       # extra flags are passed to Megatron
    python -m megatron_ext.launch.demo --print-args         # the flags, shell-quoted, one line
    python -m megatron_ext.launch.demo --print-command      # the full torchrun command line

For example, a Makefile can run the demo with
``$(PYTHON) -m megatron_ext.launch.demo $(EXTRA)``, or build its own command from
``$(shell $(PYTHON) -m megatron_ext.launch.demo --print-args)``.

Flags given on the command line are appended after the demo's own flags. Megatron's parser
keeps the last value it sees, so a later ``--train-iters 20`` overrides the demo's value.
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys

from megatron_ext.launch import CPU_DEMO_ARGS, CPU_DEMO_NPROC

ENTRY_MODULE = "megatron_ext.pretrain_gpt"


def _torchrun() -> list[str]:
    """torchrun from this interpreter's environment, so the venv's torch is the one that runs."""
    return [sys.executable, "-m", "torch.distributed.run"]


def cpu_demo_command(
    extra_args: list[str] | tuple[str, ...] = (), nproc: int = CPU_DEMO_NPROC
) -> list[str]:
    """The full command line that runs the demo, with ``extra_args`` appended."""
    return [
        *_torchrun(),
        "--standalone",  # a free rendezvous port: two demos (or a demo and a test) can overlap
        "--nproc_per_node",
        str(nproc),
        "-m",
        ENTRY_MODULE,
        *CPU_DEMO_ARGS,
        *extra_args,
    ]


def _demo_environment() -> dict[str, str]:
    # Two ranks on two cores: more intra-op threads per rank only makes them compete.
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--print-args"]:
        print(shlex.join(CPU_DEMO_ARGS))
        return 0
    if argv[:1] == ["--print-command"]:
        print(shlex.join(cpu_demo_command(argv[1:])))
        return 0
    if argv[:1] in (["-h"], ["--help"]):
        print(__doc__)
        return 0
    return subprocess.call(cpu_demo_command(argv), env=_demo_environment())


if __name__ == "__main__":
    sys.exit(main())
