"""The files attnprof writes while serving (issue 30, point 8): liveness notes are never written
through a planted link, and head-statistics deltas, rate files and notes left by a crash are
swept (by the next worker, by ``attnprof container-start``), never a live process's file, never
a link, never another user's file."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from attnprof._private_files import (
    UnsafeDirectory,
    read_private,
    sweep,
    write_private,
)
from attnprof.capture.vllm.deltas import DeltaFiles, read_delta
from attnprof.config import Config
from attnprof.host.vllm import runtime


def _dead_pid() -> int:
    """A pid whose process has exited (and been reaped)."""
    p = subprocess.Popen(["true"])
    p.wait()
    return p.pid


def test_a_liveness_note_is_never_written_through_a_planted_link(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    run_dir.mkdir(mode=0o700)
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    pid = os.getpid()
    # Both names the old code wrote: its fixed temporary name and the note itself.
    (run_dir / f".worker-{pid}.json.tmp").symlink_to(victim)
    (run_dir / f"api_server-{pid}.json").symlink_to(victim)
    st = runtime.State()
    st.config = Config(run_dir=run_dir)
    st.add_role("worker")
    st.add_role("api_server")
    assert victim.read_text() == "precious"
    for role in ("worker", "api_server"):
        note = run_dir / f"{role}-{pid}.json"
        assert not note.is_symlink() and stat.S_IMODE(note.stat().st_mode) == 0o600
        assert f'"pid": {pid}' in note.read_text()
    assert st.errors.by_place.get("run_dir", 0) == 0
    # The reading side does not follow a link either (nor read a huge file).
    (run_dir / "worker-1.json").symlink_to(victim)
    valid = (run_dir / f"worker-{pid}.json").read_bytes()  # a note JSON reads whole...
    (run_dir / "worker-2.json").write_bytes(valid + b" " * runtime.NOTE_MAX_BYTES)  # ...padded
    notes = runtime.processes_from_run_dir(st.config)
    assert sorted(n.role for n in notes) == ["api_server", "worker"]


def test_read_private_reads_at_most_max_bytes_and_never_through_a_link(tmp_path: Path
                                                                       ) -> None:
    f = tmp_path / "note.json"
    f.write_bytes(b"x" * 10)
    assert read_private(f, 10) == b"x" * 10
    with pytest.raises(ValueError):
        read_private(f, 9)
    link = tmp_path / "link.json"
    link.symlink_to(f)
    with pytest.raises(OSError):
        read_private(link, 10)


def test_write_private_refuses_a_linked_or_open_directory(tmp_path: Path) -> None:
    real = tmp_path / "real"
    real.mkdir()
    link = tmp_path / "link"
    link.symlink_to(real)
    with pytest.raises(OSError):
        write_private(link, "worker-1.json", b"{}")
    opened = tmp_path / "open"
    opened.mkdir()
    opened.chmod(0o777)  # anyone may plant a name here, and nothing stops them renaming ours
    with pytest.raises(UnsafeDirectory):
        write_private(opened, "worker-1.json", b"{}")
    opened.chmod(0o1777)  # sticky, as /tmp: others cannot replace our files
    write_private(opened, "worker-1.json", b"{}")
    assert list(real.iterdir()) == [] and read_private(opened / "worker-1.json", 10) == b"{}"
    with pytest.raises(ValueError):
        write_private(real, "../escape", b"x")


def test_sweep_removes_only_dead_writers_regular_files_named_as_ours(tmp_path: Path) -> None:
    dead, live = _dead_pid(), os.getpid()
    victim = tmp_path / "victim.npz"
    victim.write_bytes(b"keep")
    d = tmp_path / "tmp"
    d.mkdir()
    d.chmod(0o777)  # a Kubernetes emptyDir's mode: still swept (unlink never follows a link)
    names = {
        f"attnprof-hs-{dead}-abc_1.npz": True,  # a crashed worker's delta
        f"attnprof-hs-{live}-abc_2.npz": False,  # a live worker's: still to be read
        f"worker-{dead}.json": True, f".worker-{dead}.json.0a1b.tmp": True,
        f"api_server-{live}.json": False,
        "attnprof-rate-0123456789abcdef.bin": False,  # no pid: only a fresh container's
        "attnprof-hs-old.npz": False,  # before pids in names: no pid, kept
        "notes.txt": False, f"attnprof-hs-{dead}-x.npz.bak": False,
    }
    for n in names:
        (d / n).write_bytes(b"x")
    (d / f"attnprof-hs-{dead}-link.npz").symlink_to(victim)  # never a link
    removed = sweep(d)
    assert removed == sorted(n for n, gone in names.items() if gone)
    assert victim.read_bytes() == b"keep" and (d / f"attnprof-hs-{dead}-link.npz").is_symlink()
    assert sorted(p.name for p in d.iterdir()) == sorted(
        [n for n, gone in names.items() if not gone] + [f"attnprof-hs-{dead}-link.npz"])
    # A fresh container: rate files too; the pid test is the caller's.
    assert sweep(d, without_pid=True, alive=lambda pid: pid == live) == sorted(
        ["attnprof-hs-old.npz", "attnprof-rate-0123456789abcdef.bin"])
    assert sweep(tmp_path / "missing") == []


@pytest.mark.skipif(os.geteuid() != 0, reason="chown to another user needs root")
def test_sweep_never_removes_another_users_file(tmp_path: Path) -> None:
    f = tmp_path / f"attnprof-hs-{_dead_pid()}-abc.npz"
    f.write_bytes(b"x")
    os.chown(f, 54321, -1)
    assert sweep(tmp_path) == [] and f.exists()


def test_a_new_worker_sweeps_a_crashed_workers_deltas_and_reads_its_own(tmp_path: Path) -> None:
    dead = _dead_pid()
    left = tmp_path / f"attnprof-hs-{dead}-crash.npz"
    left.write_bytes(b"x" * 1000)
    files = DeltaFiles(tmp_path)  # on the engine's thread, at a sampled step: no scan there
    assert left.exists()
    handle = files.finish_for(files.here)([b"delta"])  # the drain thread's first delta
    assert not left.exists()
    name = Path(handle["path"]).name
    assert name.startswith(f"attnprof-hs-{os.getpid()}-")
    files_again = DeltaFiles(tmp_path)  # another worker starting beside a live one
    assert Path(handle["path"]).exists()
    assert read_delta(handle) == b"delta" and not Path(handle["path"]).exists()
    files.forget_all()
    files_again.forget_all()


@pytest.mark.slow
def test_container_start_sweeps_attnprof_leftovers_before_exec(tmp_path: Path) -> None:
    mp, run, tmp = tmp_path / "mp", tmp_path / "run", tmp_path / "tmp"
    for d in (mp, run, tmp):
        d.mkdir(mode=0o700)
    dead = _dead_pid()
    (tmp / f"attnprof-hs-{dead}-a.npz").write_bytes(b"x" * 4096)
    (run / f"attnprof-hs-{dead}-b.npz").write_bytes(b"x")
    (run / f"worker-{dead}.json").write_text("{}")
    (tmp / "unrelated.txt").write_text("keep")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ATTNPROF_", "PROMETHEUS_"))}
    env.update(PROMETHEUS_MULTIPROC_DIR=str(mp), ATTNPROF_RUN_DIR=str(run), TMPDIR=str(tmp))
    show = "import os; print(sorted(os.listdir(os.environ['TMPDIR'])))"
    r = subprocess.run([sys.executable, "-m", "attnprof.cli", "container-start", "--",
                        sys.executable, "-c", show], env=env, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "['unrelated.txt']"
    assert sorted(os.listdir(run)) == []
    assert r.stderr.count("attnprof file(s) left in") == 2, r.stderr


def test_as_a_containers_first_process_every_earlier_file_is_swept(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """pid 1 of a fresh pid namespace: every earlier process is gone, even one whose pid a
    new process reuses (here: this test's own pid, alive), and rate files (no pid) go too;
    elsewhere only dead writers' files do."""
    from attnprof.tools.container_start import sweep_leftovers

    run, tmp = tmp_path / "run", tmp_path / "tmp"
    run.mkdir()
    tmp.mkdir()
    monkeypatch.setenv("TMPDIR", str(tmp))
    monkeypatch.setattr(tempfile, "tempdir", None)  # gettempdir() reads TMPDIR again
    reused = os.getpid()
    names = [f"attnprof-hs-{reused}-a.npz", f"worker-{reused}.json",
             "attnprof-rate-0123456789abcdef.bin"]
    for n in names:
        (run / n).write_bytes(b"x")
    assert sweep_leftovers(str(run)) == []  # not pid 1: a live pid's files and rates stay
    monkeypatch.setattr(os, "getpid", lambda: 1)
    assert sweep_leftovers(str(run)) == [(str(run), sorted(names))]
    assert list(run.iterdir()) == []
