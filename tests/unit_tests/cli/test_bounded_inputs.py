"""Issue 40, item 15: every input is read with a bound on the bytes read, not on the size a
file claims. ``/dev/zero`` (size 0, no end) given to validate, import, compare or
schedule --recipe is refused in one line at once (it used to be read until the kernel killed
the process at ~23 GB); a regular file that claims 0 bytes but holds more than the limit
(``/proc``) is refused by what was read."""

from __future__ import annotations

import os
import signal

import pytest

from megatron_ext import cli, files


@pytest.fixture(autouse=True)
def _bounded_time():
    def _alarm(*_):
        raise TimeoutError("the input was read without a bound")

    previous = signal.signal(signal.SIGALRM, _alarm)
    signal.alarm(10)
    yield
    signal.alarm(0)
    signal.signal(signal.SIGALRM, previous)


def _one_line(capsys) -> str:
    captured = capsys.readouterr()
    text = (captured.out + captured.err).strip()
    assert "Traceback" not in text, text
    return text


@pytest.mark.parametrize(
    "argv",
    [
        ["validate", "/dev/zero", "--platform", "cpu"],
        ["import", "/dev/zero"],
        ["compare", "/dev/zero", "/dev/zero"],
        ["schedule", "--recipe", "/dev/zero"],
        ["submit", "/dev/zero", "--slurm", "--dry-run"],
    ],
)
def test_a_device_is_refused_in_one_line(argv, capsys):
    code = cli.main(argv)
    text = _one_line(capsys)
    assert code == 2, (code, text)
    assert "/dev/zero" in text and "a device, not a regular file" in text, text
    assert len(text.splitlines()) == 1, text


def test_a_fifo_recipe_is_refused_without_blocking(tmp_path, capsys):
    fifo = tmp_path / "recipe.yaml"
    os.mkfifo(fifo)
    assert cli.main(["validate", str(fifo), "--platform", "cpu"]) == 2
    assert "a FIFO, not a regular file" in _one_line(capsys)


def test_the_bound_is_on_bytes_read_not_on_the_size_claimed(monkeypatch):
    claims_nothing = "/proc/self/maps"  # a regular file whose st_size is 0
    assert os.stat(claims_nothing).st_size == 0
    assert files.read_bounded(claims_nothing, 1 << 20)  # within the bound: read
    with pytest.raises(files.InputTooLarge, match="holds more than 16 bytes"):
        files.read_bounded(claims_nothing, 16, "recipe")
    from megatron_ext.recipes import RecipeError, loader

    monkeypatch.setattr(loader, "MAX_RECIPE_BYTES", 16)
    with pytest.raises(RecipeError, match="more than a recipe's limit"):
        loader.load(claims_nothing)
