"""What several commands share: recipe targets and overrides, and loading a recipe."""

from __future__ import annotations

import argparse


def split_targets(tokens: list[str]) -> tuple[list[str], list[str]]:
    """Positional tokens: KEY=VALUE / ~KEY are overrides, the rest are recipe files."""
    overrides = [t for t in tokens if "=" in t or t.startswith("~")]
    return [t for t in tokens if t not in overrides], overrides


def load(
    recipe: str,
    platform: str,
    overrides: list[str],
    device: str | None,
    allow_env: list[str] | None = None,
):
    """Load a recipe; ``--device`` becomes a launch.device override only when it changes it;
    ``allow_env``: what the command line granted (``--allow-env`` keys, ``--trust-remote-code``)."""
    from megatron_ext.recipes import load as load_recipe

    loaded = load_recipe(recipe, platform, overrides)
    if device and device != loaded.recipe.launch.device:
        loaded = load_recipe(recipe, platform, [*overrides, f"launch.device={device}"])
    loaded.allowed_env = tuple(allow_env or ())
    return loaded


def add_allow_env(parser: argparse.ArgumentParser) -> None:
    """``--allow-env KEY`` (repeatable) and ``--trust-remote-code``: what the command line
    grants a recipe, gathered in ``args.allow_env`` (see :mod:`megatron_ext.launch.env_policy`)."""
    from megatron_ext.launch.env_policy import REMOTE_CODE_FLAG

    parser.add_argument(
        "--allow-env",
        action="append",
        default=[],
        metavar="KEY",
        help="let the recipe's launch.env set KEY although it is not a known tuning knob "
        "(PYTHONPATH, LD_PRELOAD, HOME, NCCL_NET_PLUGIN, ...: they can make the ranks load "
        "code); refused otherwise; repeat for each key",
    )
    parser.add_argument(
        REMOTE_CODE_FLAG,
        dest="allow_env",
        action="append_const",
        const=REMOTE_CODE_FLAG,
        help="let the recipe's extra_args turn on Megatron's --trust-remote-code (the ranks "
        "import the Python of the tokenizer's directory); refused otherwise",
    )


def add_recipe_args(
    parser: argparse.ArgumentParser, default_platform: str | None = "cpu", required: bool = True
) -> None:
    parser.add_argument(
        "targets",
        nargs="+" if required else "*",
        metavar="RECIPE [KEY=VALUE ...]",
        help="recipe YAML, then overrides such as parallelism.pp=4 training.iterations=20",
    )
    parser.add_argument(
        "--platform",
        default=default_platform,
        help="platform overlay of the recipe (default: %(default)s)",
    )
    parser.add_argument(
        "--device",
        choices=("cpu", "gpu"),
        help="override launch.device (cpu: gloo and the CPU runtime, GPUs hidden)",
    )
    add_allow_env(parser)


def add_trust_pickle(parser: argparse.ArgumentParser, what: str = "the run reads") -> None:
    """``--trust-pickle``: skip the pickle check of the checkpoints a recipe names
    (:func:`megatron_ext.checkpoint.preload.pickle_problem`)."""
    parser.add_argument(
        "--trust-pickle",
        action="store_true",
        help=f"load the checkpoints {what} (run --resume, checkpoint.load, "
        "--pretrained-checkpoint) without checking their pickles; unpickling can run any code "
        "in them, so only for checkpoints you made or trust (default: checked, refused)",
    )
