"""Quiet by default: upstream warnings that say nothing to the user are counted into one line;
megatron-ext's own warnings, other upstream warnings and errors still show; ``--verbose``
shows everything (megatron_ext/cli/_quiet.py)."""

from __future__ import annotations

import warnings

import pytest

from megatron_ext.cli import _quiet

SITE = "/venv/lib/python3.12/site-packages"
MISSING_TE = "Transformer Engine and Apex are not installed. Falling back to Torch optimizers."


@pytest.mark.parametrize(
    "message, category, filename, hidden",
    [
        (MISSING_TE, UserWarning, f"{SITE}/megatron/core/optimizer/__init__.py", True),
        ("Apex is not installed. Falling back", UserWarning, f"{SITE}/megatron/core/b.py", True),
        (
            "Could not determine rank from torch.distributed, RANK, or SLURM_PROCID.",
            UserWarning,
            f"{SITE}/megatron/core/_rank_utils.py",
            True,
        ),
        ("`all_gather_into_tensor` is deprecated", FutureWarning, f"{SITE}/torch/x.py", True),
        ("old API", DeprecationWarning, f"{SITE}/transformers/y.py", True),
        # An upstream warning about something else is the user's business.
        ("gradient accumulation is off", UserWarning, f"{SITE}/megatron/core/z.py", False),
        # Ours always show, wherever the repository sits (even in a directory named megatron).
        (MISSING_TE, UserWarning, "/home/u/megatron/megatron_ext/runtime/cpu.py", False),
        ("our deprecation", FutureWarning, f"{SITE}/megatron_ext/recipes/schema.py", False),
        # A deprecated upstream call in a user's own script is theirs to see.
        ("old API", DeprecationWarning, "/home/u/train.py", False),
    ],
)
def test_the_rule(message, category, filename, hidden):
    assert _quiet.is_upstream_noise(message, category, filename) is hidden


def _warn_both(shown: list[str]) -> None:
    warnings.simplefilter("always")
    warnings.showwarning = lambda message, *args, **kwargs: shown.append(str(message))
    _quiet.silence_upstream_noise(verbose=False)
    warnings.warn_explicit(MISSING_TE, UserWarning, f"{SITE}/megatron/core/o.py", 25)
    warnings.warn_explicit("ours", UserWarning, f"{SITE}/megatron_ext/cli/run.py", 7)


def test_noise_is_counted_and_ours_is_shown(capsys):
    shown: list[str] = []
    with warnings.catch_warnings():
        _warn_both(shown)
        assert shown == ["ours"] and _quiet.hidden() == 1
        _quiet.report_hidden()
        _quiet.silence_upstream_noise(verbose=True)
        warnings.warn_explicit(MISSING_TE, UserWarning, f"{SITE}/megatron/core/o.py", 25)
        assert shown == ["ours", MISSING_TE] and _quiet.hidden() == 0
    err = capsys.readouterr().err
    assert err == "megatron-ext: 1 upstream warning hidden; --verbose shows them\n"


def test_nothing_hidden_says_nothing(capsys):
    with warnings.catch_warnings():
        _quiet.silence_upstream_noise()
        _quiet.report_hidden()
    assert capsys.readouterr().err == ""


def test_verbose_is_an_option_before_and_after_the_sub_command():
    from megatron_ext import cli

    parser = cli.build_parser()
    assert parser.parse_args(["--verbose", "runs"]).verbose is True
    assert parser.parse_args(["runs", "--verbose"]).verbose is True
    assert parser.parse_args(["runs"]).verbose is False
