"""Issue 40, item 15: every input is read with a bound on the bytes read, not on the size a
file claims. ``/dev/zero`` (size 0, no end) given to validate, import, compare or
schedule --recipe is refused in one line at once (it used to be read until the kernel killed
the process at ~23 GB); a regular file that claims 0 bytes but holds more than the limit
(``/proc``) is refused by what was read."""

from __future__ import annotations

import os
import resource
import signal
import subprocess
import sys

import pytest

from megatron_ext import cli, files
from megatron_ext.testing import timing


class ReadWithoutBound(BaseException):
    """Raised by the alarm: not an OSError (a TimeoutError would be taken by a reader's own
    ``except OSError`` as a failed read, and the next read would block unwatched)."""


@pytest.fixture(autouse=True)
def _bounded_time():
    def _alarm(*_):
        raise ReadWithoutBound("the input was read without a bound, or blocked")

    previous = signal.signal(signal.SIGALRM, _alarm)
    signal.alarm(10)
    yield
    signal.alarm(0)
    signal.signal(signal.SIGALRM, previous)


@pytest.fixture(autouse=True)
def _memory_capped():
    """An unbounded read of /dev/zero in this process fails as a MemoryError within a few GiB
    (the regression these tests guard against), instead of taking the machine's memory."""
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    resource.setrlimit(resource.RLIMIT_AS, (_address_space() + IN_PROCESS_HEADROOM, hard))
    yield
    resource.setrlimit(resource.RLIMIT_AS, (soft, hard))


IN_PROCESS_HEADROOM = 4 << 30


def _address_space() -> int:
    with open("/proc/self/status") as status:
        size_kib = next(int(line.split()[1]) for line in status if line.startswith("VmSize:"))
    return size_kib << 10


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


# ---- every way a path reaches a reader: the recipe's platforms, corpora, tokenizer files,
# ---- schedule texts, golden values and run records (a FIFO blocks, a device never ends)
AS_CAP = 12 << 30
"""Address space of the commands below: an unbounded read of /dev/zero fails there (as a
MemoryError traceback) instead of taking the machine's memory."""


def _command(argv: list[str], cwd) -> subprocess.CompletedProcess:
    def cap_memory():
        resource.setrlimit(resource.RLIMIT_AS, (AS_CAP, AS_CAP))

    return subprocess.run(
        [sys.executable, "-m", "megatron_ext.cli", *argv],
        capture_output=True,
        text=True,
        cwd=cwd,
        timeout=timing.bound(120),
        preexec_fn=cap_memory,
    )


def _refusal(result: subprocess.CompletedProcess) -> str:
    lines = [
        line
        for line in (result.stdout + result.stderr).splitlines()
        if line.strip() and "upstream warning" not in line
    ]
    text = "\n".join(lines)
    assert result.returncode == 2, (result.returncode, text)
    assert "Traceback" not in text, text
    assert len(lines) == 1, text
    return text


@pytest.fixture
def fifo(tmp_path):
    path = tmp_path / "named-pipe"
    os.mkfifo(path)
    return path


@pytest.mark.parametrize("kind", ["device", "fifo"])
@pytest.mark.parametrize(
    "argv",
    [
        ["validate", "{path}"],  # every platform: the platforms are read from the file first
        ["train-tokenizer", "--input", "{path}", "--output", "tok", "--vocab-size", "300"],
        [
            "prepare-data",
            "--input",
            "{path}",
            "--output-prefix",
            "out/data",
            "--tokenizer-type",
            "NullTokenizer",
            "--vocab-size",
            "300",
        ],
    ],
    ids=["validate", "train-tokenizer", "prepare-data"],
)
def test_a_device_or_fifo_as_a_commands_input_is_refused_in_one_line(argv, kind, request, tmp_path):
    path = "/dev/zero" if kind == "device" else str(request.getfixturevalue("fifo"))
    text = _refusal(_command([a.format(path=path) for a in argv], tmp_path))
    words = "a device" if kind == "device" else "a FIFO"
    assert path in text and f"{words}, not a regular file" in text, text


@pytest.mark.parametrize("kind", ["device", "fifo"])
@pytest.mark.parametrize("field", ["vocab_file", "merge_file"])
def test_a_gpt2_tokenizer_file_that_is_no_regular_file_is_refused(field, kind, request, tmp_path):
    from megatron_ext.data.checks import tokenizer_problems

    regular = {"vocab_file": tmp_path / "vocab.json", "merge_file": tmp_path / "merges.txt"}
    regular["vocab_file"].write_text('{"a": 0}')
    regular["merge_file"].write_text("#version: 0.2\n")
    given = "/dev/zero" if kind == "device" else str(request.getfixturevalue("fifo"))
    paths = {name: str(p) for name, p in regular.items()} | {field: given}
    problems = tokenizer_problems("GPT2BPETokenizer", None, **paths, where="data.tokenizer.")
    words = "a device" if kind == "device" else "a FIFO"
    assert problems == [
        f"data.tokenizer.{field}: {given} is {words}, not a regular file; give the tokenizer's file"
    ]


@pytest.mark.parametrize("name", ["tokenizer.json", "tokenizer_config.json", "vocab.json"])
def test_a_fifo_or_device_inside_a_tokenizer_directory_is_named(name, tmp_path):
    from megatron_ext.data.checks import tokenizer_problems

    directory = tmp_path / "hf"
    directory.mkdir()
    (directory / "tokenizer_config.json").write_text('{"eos_token": "<eos>"}')
    (directory / "tokenizer.json").unlink(missing_ok=True)
    if name == "tokenizer_config.json":
        (directory / name).unlink()
    os.mkfifo(directory / name)
    (directory / "merges.txt").symlink_to("/dev/zero")
    problems = tokenizer_problems("HuggingFaceTokenizer", str(directory), None, None)
    assert problems == [
        f"--tokenizer-model: {directory / 'merges.txt'} is a device, not a regular file; "
        "replace or remove it",
        f"--tokenizer-model: {directory / name} is a FIFO, not a regular file; replace or "
        "remove it",
    ]


@pytest.mark.parametrize("kind", ["device", "fifo"])
def test_a_schedule_text_that_is_no_regular_file_is_refused(kind, request):
    from megatron_ext.schedules.text import ScheduleTextError, read_text

    path = "/dev/zero" if kind == "device" else str(request.getfixturevalue("fifo"))
    words = "a device" if kind == "device" else "a FIFO"
    with pytest.raises(ScheduleTextError, match=f"is {words}, not a regular file"):
        read_text(path)


@pytest.mark.parametrize("kind", ["device", "fifo"])
def test_golden_values_that_are_no_regular_file_are_refused_before_the_run(kind, tmp_path):
    from megatron_ext.recipes import loader
    from megatron_ext.recipes.golden_paths import golden_values_problem

    (tmp_path / "golden").mkdir()
    golden = tmp_path / "golden" / "values.json"
    if kind == "device":
        golden.symlink_to("/dev/zero")
    else:
        os.mkfifo(golden)
    recipe = tmp_path / "r.yaml"
    recipe.write_text("version: 1\nmodel: {type: gpt}\ntest: {golden_values: golden/values.json}\n")
    problem = golden_values_problem(loader.load(recipe))
    words = "a device" if kind == "device" else "a FIFO"
    assert problem is not None and problem.where == "test.golden_values", problem
    assert f"is {words}, not a regular file" in problem.what, problem


@pytest.mark.parametrize("record", ["run.json", "summary.json", "recipe.yaml", "tracker"])
def test_a_run_record_that_is_a_fifo_never_blocks_its_reader(record, tmp_path):
    from megatron_ext.runs import listing, resume as rsm

    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    (run / "recipe.yaml").write_text("training: {iterations: 4}\n")
    (run / "run.json").write_text('{"resumable": true}')
    (run / "summary.json").write_text('{"status": "stopped"}')
    (run / "checkpoints" / rsm.TRACKER).write_text("2")
    path = run / "checkpoints" / rsm.TRACKER if record == "tracker" else run / record
    path.unlink()
    os.mkfifo(path)
    assert rsm.latest_complete(run / "checkpoints") == (None if record == "tracker" else 2)
    assert "already holds" in rsm.existing_run_problem(run)
    for found in listing.find(tmp_path):  # reads every record it finds
        assert found.path == run
