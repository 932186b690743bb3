"""``write_checkpoint`` against faults around its output folder: overwriting a folder it did not
write, two writers into one folder, leftovers of killed runs, and data not flushed before the rename."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from fp4moe.checkpoints.errors import CheckpointError
from fp4moe.checkpoints.writer import MARKER_NAME, write_checkpoint


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    from fp4moe.integrations.transformers.e2e import build_model

    path = tmp_path_factory.mktemp("src") / "qwen3_moe"
    build_model("qwen3_moe", "tiny").save_pretrained(path)
    return path


def dead_pid() -> int:
    """The pid of a process that has finished."""
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def hidden(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name.startswith("."))


def test_every_checkpoint_carries_the_marker(source, tmp_path):
    from fp4moe import __version__

    for fmt in ("modelopt", "compressed-tensors"):
        write_checkpoint(source, tmp_path / fmt, fmt, progress=False)
        marker = json.loads((tmp_path / fmt / MARKER_NAME).read_text())
        assert marker == {"producer": "fp4moe", "version": __version__, "format": fmt}
    assert hidden(tmp_path) == []  # no lock, no temporary folder left


def test_overwrite_refuses_a_folder_fp4moe_did_not_write(source, tmp_path):
    other = tmp_path / "other-model"
    other.mkdir()
    (other / "config.json").write_text('{"model_type": "llama"}')
    (other / "model.safetensors").write_bytes(b"precious")
    with pytest.raises(CheckpointError, match=rf"no {MARKER_NAME}, so it is not a checkpoint written by fp4moe.*"
                                              "remove it yourself"):
        write_checkpoint(source, other, overwrite=True, progress=False)
    assert sorted(p.name for p in other.iterdir()) == ["config.json", "model.safetensors"]
    assert (other / "model.safetensors").read_bytes() == b"precious"
    assert hidden(tmp_path) == []
    (other / MARKER_NAME).write_text("not json")  # a marker must be fp4moe's own
    with pytest.raises(CheckpointError, match="not a checkpoint written by fp4moe"):
        write_checkpoint(source, other, overwrite=True, progress=False)
    assert (other / "model.safetensors").read_bytes() == b"precious"


def test_overwrite_replaces_a_checkpoint_fp4moe_wrote(source, tmp_path):
    out = tmp_path / "out"
    write_checkpoint(source, out, progress=False)
    (out / "stale.txt").write_text("from the earlier checkpoint")
    with pytest.raises(CheckpointError, match="exists and is not empty"):
        write_checkpoint(source, out, progress=False)
    write_checkpoint(source, out, "compressed-tensors", overwrite=True, progress=False)
    assert not (out / "stale.txt").exists()
    assert json.loads((out / MARKER_NAME).read_text())["format"] == "compressed-tensors"
    assert hidden(tmp_path) == []


def test_the_source_and_its_parent_are_still_refused(source, tmp_path):
    with pytest.raises(CheckpointError, match="is the source model folder"):
        write_checkpoint(source, source, overwrite=True, progress=False)
    with pytest.raises(CheckpointError, match="contains the source model folder"):
        write_checkpoint(source, source.parent, overwrite=True, progress=False)


def test_a_second_writer_fails_at_once_while_the_lock_is_held(source, tmp_path):
    out = tmp_path / "out"
    lock = tmp_path / ".out.lock"
    lock.write_text(f"{os.getpid()}\n")  # a live writer
    written = []
    with pytest.raises(CheckpointError, match=rf"another fp4moe write into this folder is running \(process "
                                              rf"{os.getpid()} holds the lock .*\.out\.lock\)"):
        write_checkpoint(source, out, progress=False, on_group=written.append)
    assert written == [] and not out.exists()
    assert lock.read_text() == f"{os.getpid()}\n"  # the other writer's lock is left alone
    assert hidden(tmp_path) == [".out.lock"]


def test_a_second_writer_is_refused_while_a_sleeping_process_holds_the_lock(source, tmp_path):
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        (tmp_path / ".out.lock").write_text(f"{sleeper.pid}\n")
        with pytest.raises(CheckpointError, match=rf"process {sleeper.pid} holds the lock"):
            write_checkpoint(source, tmp_path / "out", progress=False)
    finally:
        sleeper.kill()
        sleeper.wait()
    write_checkpoint(source, tmp_path / "out", progress=False)  # its writer is gone: the lock is stale
    assert (tmp_path / "out" / MARKER_NAME).is_file()


def test_a_stale_lock_is_taken_over_and_released(source, tmp_path):
    lock = tmp_path / ".out.lock"
    lock.write_text(f"{dead_pid()}\n")
    write_checkpoint(source, tmp_path / "out", progress=False)
    assert (tmp_path / "out" / MARKER_NAME).is_file()
    assert not lock.exists()


def test_an_empty_lock_is_held_until_it_is_old(source, tmp_path):
    lock = tmp_path / ".out.lock"
    lock.write_text("")  # a writer between creating and filling it
    with pytest.raises(CheckpointError, match="a process that is starting"):
        write_checkpoint(source, tmp_path / "out", progress=False)
    os.utime(lock, (1, 1))  # its writer died long ago
    write_checkpoint(source, tmp_path / "out", progress=False)
    assert not lock.exists()


def test_the_lock_is_released_when_the_write_fails(source, tmp_path):
    def fail(name: str) -> None:
        raise RuntimeError("interrupted")

    with pytest.raises(RuntimeError, match="interrupted"):
        write_checkpoint(source, tmp_path / "out", progress=False, on_group=fail)
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_leftovers_of_killed_runs_are_removed_by_the_next_run(source, tmp_path):
    out = tmp_path / "out"
    write_checkpoint(source, out, progress=False)
    pid = dead_pid()
    for name in (f".out.tmp-{pid}-x", f".out.old-{pid}-x"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "model.safetensors").write_bytes(b"half written")
    live = tmp_path / f".out.tmp-{os.getpid()}-y"  # a live process's: not touched
    live.mkdir()
    other = tmp_path / f".other.tmp-{pid}-x"  # another folder's: not touched
    other.mkdir()
    write_checkpoint(source, out, overwrite=True, progress=False)
    assert hidden(tmp_path) == sorted([live.name, other.name])
    assert (out / MARKER_NAME).is_file()


def test_a_checkpoint_moved_aside_by_a_killed_run_is_put_back(source, tmp_path):
    out = tmp_path / "out"
    write_checkpoint(source, out, progress=False)
    pid = dead_pid()
    os.replace(out, tmp_path / f".out.old-{pid}-x")  # killed between the two renames
    (tmp_path / f".out.tmp-{pid}-x").mkdir()
    with pytest.raises(CheckpointError, match="exists and is not empty"):  # the previous checkpoint is back
        write_checkpoint(source, out, progress=False)
    assert (out / MARKER_NAME).is_file() and hidden(tmp_path) == []


def test_files_and_folders_are_flushed_before_and_after_the_rename(source, tmp_path, monkeypatch):
    import fp4moe.checkpoints.writer as writer

    events: list[str] = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd: int) -> None:
        events.append("fsync " + os.readlink(f"/proc/self/fd/{fd}") if os.path.exists("/proc/self/fd") else "fsync")
        real_fsync(fd)

    def replace(a, b) -> None:
        events.append(f"replace {Path(a).name} -> {Path(b).name}")
        real_replace(a, b)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(writer.os, "replace", replace)
    report = write_checkpoint(source, tmp_path / "out", progress=False)
    files = sorted(p.name for p in (tmp_path / "out").iterdir())
    rename = next(i for i, e in enumerate(events) if e.startswith("replace .out.tmp-"))
    before, after = events[:rename], events[rename + 1:]
    assert len([e for e in before if e.startswith("fsync")]) >= len(files) + 1  # every file, then the folder
    assert after and after[-1].startswith("fsync")  # the parent folder, after the rename
    if os.path.exists("/proc/self/fd"):
        flushed = {Path(e.split(" ", 1)[1]).name for e in before if e.startswith("fsync ")}
        assert set(files) <= flushed and any(name.startswith(".out.tmp-") for name in flushed)
        assert after[-1] == f"fsync {tmp_path}"
    assert set(report.shards) <= set(files)
