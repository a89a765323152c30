"""Issue 40, items 9-11: a full or read-only disk ends in one line, ``cannot write PATH: No
space left on device`` (or ``Read-only file system``), no traceback, nothing left behind.
The disk is simulated at the write seam (a file object that takes a few bytes, then raises
ENOSPC on every write and on close, as a full disk's buffered flush does); the same runs were
checked by hand on a 64 KiB tmpfs and a read-only one (docs/reliability.md)."""

from __future__ import annotations

import errno
import io
import os
from pathlib import Path

import pytest

from megatron_ext.cli import main as cli_main


class _FullDisk(io.RawIOBase):
    """Writes ``room`` bytes to ``inner``, then fails every write, flush and close."""

    def __init__(self, inner, room: int):
        self.inner, self.room = inner, room

    def writable(self):
        return True

    def write(self, data):
        if len(data) > self.room:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        self.room -= len(data)
        return self.inner.write(data)

    def flush(self):
        self.inner.flush()

    def close(self):
        if not self.inner.closed:
            self.inner.close()
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    def __getattr__(self, name):
        return getattr(self.inner, name)


def _lines(capsys) -> list[str]:
    captured = capsys.readouterr()
    text = (captured.out + captured.err).strip()
    assert "Traceback" not in text and "During handling" not in text, text
    return text.splitlines()


# ---- item 9: prepare-data ------------------------------------------------------------------------
def test_prepare_data_onto_a_full_disk_is_one_line_and_leaves_no_temporary(
    tmp_path, capsys, monkeypatch
):
    from megatron.core.datasets import indexed_dataset

    original = indexed_dataset.IndexedDatasetBuilder.__init__

    def full_disk_builder(self, *args, **kwargs):
        original(self, *args, **kwargs)
        self.data_file = _FullDisk(self.data_file, room=256)

    monkeypatch.setattr(indexed_dataset.IndexedDatasetBuilder, "__init__", full_disk_builder)
    jsonl = tmp_path / "in.jsonl"
    jsonl.write_text("".join(f'{{"text": "{" ".join(["7"] * 50)}"}}\n' for _ in range(200)))
    out = tmp_path / "out"
    code = cli_main(
        ["prepare-data", "--input", str(jsonl), "--tokenizer-type", "NullTokenizer"]
        + ["--vocab-size", "128", "--workers", "1", "--output-prefix", str(out / "data")]
    )
    lines = _lines(capsys)
    assert code == 2, lines
    assert lines[-1] == (
        f"megatron-ext prepare-data: cannot write {out}/data_text_document.bin: "
        "No space left on device"
    ), lines
    assert sorted(p.name for p in out.iterdir()) == []  # no *.bin.tmpNNN


def test_prepare_data_onto_a_read_only_disk_is_one_line(tmp_path, capsys, monkeypatch):
    from megatron.core.datasets import indexed_dataset

    def read_only(self, path, *args, **kwargs):
        raise OSError(errno.EROFS, os.strerror(errno.EROFS), path)

    monkeypatch.setattr(indexed_dataset.IndexedDatasetBuilder, "__init__", read_only)
    jsonl = tmp_path / "in.jsonl"
    jsonl.write_text('{"text": "1 2 3"}\n')
    code = cli_main(
        ["prepare-data", "--input", str(jsonl), "--tokenizer-type", "NullTokenizer"]
        + ["--vocab-size", "128", "--output-prefix", str(tmp_path / "data")]
    )
    lines = _lines(capsys)
    assert code == 2 and lines[-1].endswith(
        f"cannot write {tmp_path}/data_text_document.bin: Read-only file system"
    ), lines


# ---- item 10: compare --plot ---------------------------------------------------------------------
def _run_dir(path: Path, losses: dict[int, float]) -> Path:
    from megatron_ext.runs import resume as rsm

    path.mkdir(parents=True)
    (path / "recipe.yaml").write_text("training: {iterations: 10}\n")
    rsm.write_run_record(path, {"recipe": "r.yaml", "platform": "cpu", "resumable": True})
    (path / "logs").mkdir()
    lines = [f" iteration {s:8d}/      10 | lm loss: {v:.6E} |" for s, v in losses.items()]
    (path / "logs" / "rank-0.log").write_text("\n".join(lines) + "\n")
    return path


@pytest.mark.parametrize("disk", ["full", "read-only"])
def test_compare_plot_onto_a_failing_disk_is_one_line_after_the_table(
    tmp_path, capsys, monkeypatch, disk
):
    from megatron_ext import files

    a = _run_dir(tmp_path / "a", {1: 4.0, 2: 3.5})
    b = _run_dir(tmp_path / "b", {1: 4.0, 2: 3.0})
    plots = tmp_path / "plots"
    plots.mkdir()
    if disk == "full":
        real_fdopen = os.fdopen

        def full_when_writing(fd, mode="r", *args, **kwargs):
            stream = real_fdopen(fd, mode, *args, **kwargs)
            return _FullDisk(stream, 64) if "w" in mode else stream

        monkeypatch.setattr(files.os, "fdopen", full_when_writing)
        reason = "No space left on device"
    else:

        def read_only(*args, dir=None, **kwargs):
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(dir))

        monkeypatch.setattr(files.tempfile, "mkstemp", read_only)
        reason = "Read-only file system"
    png = plots / "cmp.png"
    code = cli_main(["compare", str(a), str(b), "--plot", str(png)])
    monkeypatch.undo()
    lines = _lines(capsys)
    assert code == 2, lines
    assert any(line.startswith("lm loss") for line in lines)  # the table came first
    assert lines[-1] == f"megatron-ext compare: --plot cannot write {png}: {reason}", lines
    assert list(plots.iterdir()) == []


# ---- item 11: a checkpoint save on a full disk ---------------------------------------------------
class CheckpointException(Exception):
    """Stands in for torch DCP's (same name, ``failures`` per rank); no errno inside."""

    def __init__(self, failures):
        super().__init__("CheckpointException rank")
        self.failures = failures


@pytest.mark.parametrize("free_bytes, readonly", [(0, False), (4096, False), (10**9, True)])
def test_a_save_that_fails_on_a_full_disk_is_named_as_the_disk(
    tmp_path, monkeypatch, free_bytes, readonly
):
    from megatron_ext.launch import faults

    monkeypatch.setattr(faults, "_save_dir", lambda: str(tmp_path / "checkpoints"))

    class _Disk:
        f_bavail, f_frsize = free_bytes, 1
        f_flag = os.ST_RDONLY if readonly else 0

    monkeypatch.setattr(faults.os, "statvfs", lambda path: _Disk())
    exc = CheckpointException({0: (RuntimeError("[enforce fail] unexpected pos 64 vs 0"), None)})
    reason = "Read-only file system" if readonly else "No space left on device"
    assert faults.describe_error(exc) == f"cannot write {tmp_path}/checkpoints: {reason}"
    # an errno in the chain names itself, whatever the disk says
    try:
        try:
            raise OSError(
                errno.ENOSPC, os.strerror(errno.ENOSPC), "/ckpt/iter_0000006/__0_0.distcp"
            )
        except OSError as inner:
            raise RuntimeError("writer failed") from inner
    except RuntimeError as outer:
        assert faults.describe_error(outer) == (
            "cannot write /ckpt/iter_0000006/__0_0.distcp: No space left on device"
        )


def test_a_save_failure_on_a_disk_with_room_keeps_its_own_error(tmp_path, monkeypatch):
    from megatron_ext.launch import faults

    monkeypatch.setattr(faults, "_save_dir", lambda: str(tmp_path))
    exc = CheckpointException({1: (ValueError("Size mismatch for key w"), None)})
    assert faults.describe_error(exc) == (
        "CheckpointException (checkpoint rank 1): ValueError: Size mismatch for key w"
    )
