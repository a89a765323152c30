"""The ``megatron-ext`` command: one module per sub-command, each with ``NAME``, ``HELP``,
``add_arguments(parser)`` and ``main(args) -> exit status``; ``COMMANDS`` lists them in the
order ``--help`` shows them. A new command is a new module and one line in ``COMMANDS``.
The text below ``--help`` shows is ``DESCRIPTION``.
"""

from __future__ import annotations

import argparse
import re
import sys

from megatron_ext.cli import (
    _quiet,
    compare,
    convert,
    doctor,
    import_case,
    prepare_data,
    recipes,
    run,
    runs,
    schedule,
    submit,
    train_tokenizer,
    validate,
)
from megatron_ext.launch.startup import exit_now, torch_compile_deferred

COMMANDS = (
    doctor,
    recipes,
    run,
    runs,
    validate,
    compare,
    import_case,
    submit,
    convert,
    schedule,
    train_tokenizer,
    prepare_data,
)

DESCRIPTION = """\
- ``megatron-ext --version`` and ``megatron-ext doctor``: versions, devices, active patches;
- ``megatron-ext recipes [--copy NAME [DIR]]``: the shipped recipes, or one copied out to edit;
- ``megatron-ext run RECIPE [KEY=VALUE ...]``: validate and train a recipe locally (SIGTERM or
  SIGUSR1: save and stop, exit 75; ``run --resume RUN_DIR`` continues);
- ``megatron-ext runs [show RUN]``: the run directories, or one of them;
- ``megatron-ext validate RECIPE [KEY=VALUE ...]``: every check, no process started;
- ``megatron-ext compare RUN_DIR GOLDEN.json``: Megatron's golden-value rules (exit 1: a
  comparison failed, 2: an input cannot be read); ``compare RUN_A RUN_B [--plot FILE.png]``:
  two runs' difference table and overlaid curves;
- ``megatron-ext import PATH/model_config.yaml [-o RECIPE.yaml]``: a Megatron-LM test case as
  a recipe (``run`` and ``validate`` also take such a file directly);
- ``megatron-ext submit RECIPE --slurm [...]``: the recipe as a Slurm job;
- ``megatron-ext convert-checkpoint IN OUT --model M --to T``: mHC keys upstream <-> megatron-ext.
- ``megatron-ext schedule --pp P [--vpp V] --microbatches M [...]`` or ``--recipe RECIPE``:
  megatron-core's pipeline schedule as a grid, its bubble, peak in-flight micro-batches and
  bytes per pipeline edge, without starting anything.
- ``megatron-ext train-tokenizer --input F.jsonl --output DIR --vocab-size N``: a BPE (or
  ``--type sentencepiece``) tokenizer with an end-of-document token, trained on your corpus;
- ``megatron-ext prepare-data --input F.jsonl --output-prefix P --tokenizer-type T ...``:
  JSONL into Megatron's indexed format (Megatron-LM's tools/preprocess_data.py's flags and
  files); ``--example DIR``: a corpus, tokenizers and datasets to train on, made offline.

Recipes and their schema: recipes/README.md (``megatron-ext recipes`` lists those shipped);
the guide: docs/. Upstream start-up warnings that say nothing about your command (no
Transformer Engine or Apex here, deprecations inside pinned packages) are counted into one line
at the end of a successful command; ``--verbose`` (before or after the sub-command) shows them.
"""

VERBOSE_HELP = "show upstream warnings (missing TE/Apex, deprecations) instead of counting them"


_ROLE = re.compile(r":(?:func|class|mod|meth|data|attr):`~?([^`]+)`")


def plain(text: str | None) -> str:
    """reStructuredText as a terminal shows it: ``code`` and :func:`name` become their text."""
    return _ROLE.sub(r"\1", text or "").replace("``", "")


def build_parser() -> argparse.ArgumentParser:
    import megatron_ext

    parser = argparse.ArgumentParser(
        prog="megatron-ext",
        description=plain(DESCRIPTION),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--version", action="version", version=f"megatron-ext {megatron_ext.__version__}"
    )
    parser.add_argument("--verbose", action="store_true", help=VERBOSE_HELP)
    commands = parser.add_subparsers(dest="command")
    for command in COMMANDS:
        sub = commands.add_parser(
            command.NAME,
            help=command.HELP,
            description=plain(command.__doc__),
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        command.add_arguments(sub)
        # SUPPRESS: a sub-command's own default must not undo `megatron-ext --verbose CMD`.
        sub.add_argument(
            "--verbose", action="store_true", default=argparse.SUPPRESS, help=VERBOSE_HELP
        )
        sub.set_defaults(handler=command.main)
    return parser


def main(argv: list[str] | None = None) -> int:
    words = sys.argv[1:] if argv is None else argv
    # Before anything imports megatron or torch; the parsed --verbose agrees with this look.
    _quiet.silence_upstream_noise(verbose="--verbose" in words)
    status = _run_command(argv)
    if status == 0:  # a failure's own message stays the last line
        _quiet.report_hidden()
    return status


def _run_command(argv: list[str] | None) -> int:
    parser = build_parser()
    # Overrides may follow options (`run R --platform cpu parallelism.pp=4`): argparse leaves
    # such late positionals unparsed, so they join the targets here.
    args, rest = parser.parse_known_args(argv)
    late = [token for token in rest if not token.startswith("-")]
    if len(late) != len(rest) or (late and not hasattr(args, "targets")):
        parser.error(
            f"unrecognized arguments: {' '.join(t for t in rest if t not in late) or ' '.join(rest)}"
        )
    if late:
        args.targets += late
    handler = getattr(args, "handler", None)
    if handler is None:
        parser.print_help()
        return 0
    if handler is doctor.main:
        return handler(args)
    try:
        with torch_compile_deferred():  # the commands import megatron but never compile
            return handler(args)
    except KeyboardInterrupt as exc:  # the launchers have stopped their ranks / left the job
        signum = getattr(exc, "signum", None)  # SIGTERM/SIGHUP (launch.local.Interrupted)
        print(f"megatron-ext: {exc or 'interrupted'}", file=sys.stderr)
        return 128 + signum if signum else 130


def console_main() -> None:
    """The ``megatron-ext`` program (console script and ``python -m megatron_ext.cli``):
    :func:`main`, then :func:`exit_now`. An exception still ends the normal way, with its
    traceback."""
    exit_now(main())


if __name__ == "__main__":
    console_main()
