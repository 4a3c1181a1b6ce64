"""The files attnprof leaves while serving: written without following links, swept after a crash.

While serving, attnprof writes three kinds of small files: liveness notes in
``ATTNPROF_RUN_DIR`` (``{role}-{pid}.json``), head-statistics deltas on their way from a
worker to the API server (``attnprof-hs-{pid}-*.npz``, up to ~25 MB each on 80 layers) and
the tensor-parallel rate announcements (``attnprof-rate-*.bin``), the last two in
``ATTNPROF_RUN_DIR`` or the temporary directory. In a shared or attacker-writable directory a
planted symbolic link must not turn one of these writes into a write elsewhere, and after a
crash (an OOM kill, a container restart in the same pod, whose ``emptyDir`` outlives the
container) none of them may pile up.

- :func:`write_private` (the liveness notes) creates a file exclusively (``O_EXCL |
  O_NOFOLLOW``, mode 0600) in a directory opened once and checked (a real directory, ours,
  not writable by others unless sticky), then renames it into place relative to that
  directory (a rename replaces a link, never follows it). Deltas are created by ``mkstemp``
  and the rate file with ``O_EXCL | O_NOFOLLOW`` of its own: exclusive, 0600, never through a
  link either.
- :func:`sweep` removes attnprof's own leftovers from a directory: only regular files (never
  a link), owned by this user, named like ours, whose writer is gone (a container start, pid 1
  of a fresh pid namespace, also removes the rate files, which carry no pid).

Standard library only: ``attnprof container-start`` calls :func:`sweep` before vLLM starts.
"""

from __future__ import annotations

import contextlib
import os
import re
import secrets
import stat
import tempfile
from collections.abc import Callable, Iterable
from pathlib import Path

__all__ = ["DELTA_FILE", "RATE_FILE", "RUN_NOTE", "UnsafeDirectory", "delta_prefix",
           "leftover_dirs", "read_private", "sweep", "write_private"]

DELTA_FILE = re.compile(r"attnprof-hs-(?:(?P<pid>[0-9]+)-)?[A-Za-z0-9_]+\.npz")
"""A head-statistics delta (``mkstemp`` names; the writer's pid first since issue 30)."""
RATE_FILE = re.compile(r"attnprof-rate-[0-9a-f]{16}\.bin")
"""A tensor-parallel group's rate announcements (:mod:`attnprof.capture.vllm.rank_sync`)."""
RUN_NOTE = re.compile(r"\.?(?:api_server|engine_core|worker)-(?P<pid>[0-9]+)\.json(?:\.[0-9a-f]+)?"
                      r"(?:\.tmp)?")
"""A liveness note in ``ATTNPROF_RUN_DIR`` (and its temporary name while being written)."""


class UnsafeDirectory(OSError):
    """A directory attnprof will not write its files in (a link, another user's, or open to
    every local user without the sticky bit)."""


def delta_prefix() -> str:
    """The name prefix of this process's delta files (its pid, for :func:`sweep`)."""
    return f"attnprof-hs-{os.getpid()}-"


def _open_dir(path: Path, create: bool) -> int:
    """``path`` opened as a directory (never through a final symbolic link); when ``create``
    (to write in it), created with mode 0700 if missing and checked to be one we may trust."""
    if create:
        try:
            os.mkdir(path, 0o700)
        except FileExistsError:
            pass
        except FileNotFoundError:
            path.parent.mkdir(parents=True, exist_ok=True)
            with contextlib.suppress(FileExistsError):
                os.mkdir(path, 0o700)
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW
                 | getattr(os, "O_CLOEXEC", 0))
    if not create:  # unlinking never follows a link: any directory is safe to sweep
        return fd
    try:
        st = os.fstat(fd)
        mine = st.st_uid == os.getuid()
        open_to_all = st.st_mode & stat.S_IWOTH and not st.st_mode & stat.S_ISVTX
        if open_to_all or (not mine and st.st_mode & (stat.S_IWGRP | stat.S_IWOTH)
                           and not st.st_mode & stat.S_ISVTX):
            raise UnsafeDirectory(f"{path} is writable by other users (no sticky bit)")
    except BaseException:
        os.close(fd)
        raise
    return fd


def write_private(directory: Path, name: str, data: bytes) -> Path:
    """Write ``data`` to ``directory/name`` (mode 0600) atomically, never through a link.

    Raises ``OSError`` (:class:`UnsafeDirectory` for a directory not to write in); the
    caller counts it. A half-written file is never left behind."""
    if "/" in name or name in ("", ".", ".."):
        raise ValueError(f"not a file name: {name!r}")
    dfd = _open_dir(directory, create=True)
    tmp = f".{name}.{secrets.token_hex(6)}.tmp"
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW
                     | getattr(os, "O_CLOEXEC", 0), 0o600, dir_fd=dfd)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            os.replace(tmp, name, src_dir_fd=dfd, dst_dir_fd=dfd)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp, dir_fd=dfd)
            raise
    finally:
        os.close(dfd)
    return directory / name


def read_private(path: Path, max_bytes: int) -> bytes:
    """A small file's bytes, never through a link and never more than ``max_bytes``
    (``ValueError`` beyond; ``OSError`` for a link, an unreadable file or anything but a
    regular file: a FIFO planted under a note's name would block the reader for good, so
    the open never waits and the type is checked before the read)."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK
                 | getattr(os, "O_CLOEXEC", 0))
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(f"{path.name} is not a regular file")
        data = f.read(max_bytes + 1)
    if len(data) > max_bytes:
        raise ValueError(f"{path.name} is larger than {max_bytes} bytes")
    return data


def leftover_dirs(run_dir: str | None = None) -> list[Path]:
    """Where attnprof's serving files live: ``ATTNPROF_RUN_DIR`` (when set) and the
    temporary directory (deltas and rate files go there without a run dir)."""
    raw = os.environ.get("ATTNPROF_RUN_DIR") if run_dir is None else run_dir
    dirs = [Path(raw)] if raw else []
    dirs.append(Path(tempfile.gettempdir()))
    return list(dict.fromkeys(dirs))


def _alive(pid: int) -> bool:
    from attnprof._safety import pid_alive

    return pid_alive(pid)


def sweep(directory: Path, without_pid: bool = False,
          alive: Callable[[int], bool] = _alive,
          kinds: Iterable[re.Pattern[str]] = (DELTA_FILE, RATE_FILE, RUN_NOTE)) -> list[str]:
    """Remove attnprof's leftovers from ``directory``; returns the removed names (sorted).

    Only regular files owned by this user and named by ``kinds`` are touched, never a link
    or anything else. A file whose name carries a pid is removed once ``alive`` says that
    process is gone; one without a pid (a rate file) only with ``without_pid``. Never
    raises: a directory that is missing or unsafe sweeps nothing."""
    kinds = tuple(kinds)
    try:
        dfd = _open_dir(directory, create=False)
    except OSError:
        return []
    removed: list[str] = []
    try:
        with os.scandir(dfd) as entries:
            for e in entries:
                m = next((m for k in kinds if (m := k.fullmatch(e.name))), None)
                if m is None:
                    continue
                try:
                    st = e.stat(follow_symlinks=False)
                except OSError:
                    continue
                if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid():
                    continue
                pid = m.groupdict().get("pid")
                if (not without_pid) if pid is None else alive(int(pid)):
                    continue
                try:
                    os.unlink(e.name, dir_fd=dfd)
                except OSError:  # gone already, or not ours to remove after all
                    continue
                removed.append(e.name)
    except OSError:
        pass
    finally:
        os.close(dfd)
    return sorted(removed)
