"""A container's first step: empty the Prometheus multiprocess directory, then become the server.

prometheus_client's multiprocess files (``PROMETHEUS_MULTIPROC_DIR``) are named by pid. A
Kubernetes ``emptyDir`` lives as long as the pod, not the container: after a restart in the
same pod (crash, OOM kill, failed liveness probe) the dead processes' files are still there,
so their gauges stay on ``/metrics``, and the new main process, which gets the same pid (1,
or whatever the runtime gives the entrypoint), reopens its predecessor's files and counts on
from their totals. Emptying the directory before the server starts makes every container
start begin from nothing, as a new pod does. Standard library only: it runs before vLLM, from
attnprof's ``--target`` install, and never in the serving path.
"""

from __future__ import annotations

import os
import re
import shutil
import sys
from collections.abc import Sequence
from typing import NoReturn

__all__ = ["MULTIPROC_FILE", "WipeError", "check_command", "exec_command",
           "sweep_leftovers", "wipe_multiproc_dir"]

MULTIPROC_FILE = re.compile(r"(?:counter|histogram|summary|gauge_[a-z]+)_[0-9]+\.db")
"""The names prometheus_client gives its files: ``{type}_{pid}.db``, gauges as
``gauge_{multiprocess_mode}_{pid}.db`` (``gauge_livesum_1.db``)."""


class WipeError(Exception):
    """The directory is not one to empty (or the command cannot run); nothing was removed."""


def wipe_multiproc_dir(path: str) -> list[str]:
    """Remove every prometheus_client multiprocess file directly in ``path`` and return the
    removed names (sorted; empty when there were none).

    Raises :class:`WipeError`, removing nothing, when ``path`` is empty, resolves to ``/``,
    does not exist, is not a directory, is not writable, or holds anything but regular files
    named like prometheus_client's (a subdirectory, a symbolic link, any other file): then the
    directory is not prometheus_client's alone, and emptying it could destroy something else.
    Meant for a container's start, before any process writes there: it does not ask whether
    the files' processes are alive (after a restart their pids may belong to new ones)."""
    if not path:
        raise WipeError("PROMETHEUS_MULTIPROC_DIR is not set: no multiprocess directory to "
                        "empty")
    real = os.path.realpath(path)
    if real == os.path.sep:
        raise WipeError(f"refusing to empty {path!r}: it is the root directory")
    try:
        # The resolved path, opened once: every later step works on this directory, even if
        # a path component is swapped meanwhile.
        fd = os.open(real, os.O_RDONLY | os.O_DIRECTORY)
    except FileNotFoundError:
        raise WipeError(f"multiprocess directory {path!r} does not exist") from None
    except NotADirectoryError:
        raise WipeError(f"multiprocess directory {path!r} is not a directory") from None
    except OSError as exc:
        raise WipeError(f"cannot open multiprocess directory {path!r}: {exc.strerror}") from None
    try:
        names: list[str] = []
        strangers: list[str] = []
        with os.scandir(fd) as entries:
            for e in entries:
                ours = MULTIPROC_FILE.fullmatch(e.name) and e.is_file(follow_symlinks=False)
                (names if ours else strangers).append(e.name)
        if strangers:
            strangers.sort()
            more = f" and {len(strangers) - 1} more" if len(strangers) > 1 else ""
            raise WipeError(f"refusing to empty {path!r}: it holds {strangers[0]!r}{more}, not "
                            "only prometheus_client multiprocess files (*.db)")
        if names and not os.access(real, os.W_OK | os.X_OK):
            raise WipeError(f"multiprocess directory {path!r} is not writable")
        for name in sorted(names):
            try:
                os.unlink(name, dir_fd=fd)
            except FileNotFoundError:
                pass  # gone already: that is what was wanted
            except OSError as exc:
                raise WipeError(f"cannot remove {name!r} from {path!r}: {exc.strerror}") \
                    from None
        return sorted(names)
    finally:
        os.close(fd)


def sweep_leftovers(run_dir: str | None = None) -> list[tuple[str, list[str]]]:
    """Remove attnprof's own files left by the container's earlier start from
    ``ATTNPROF_RUN_DIR`` and the temporary directory (head-statistics deltas, rate files,
    liveness notes: only regular files of this user named as attnprof names them, and of
    those only the ones whose process is gone: in a restarted container every earlier pid is,
    even one the new processes reuse, so any pid but this one's counts as gone when this is
    pid 1; elsewhere, a live process's files stay). Rate files carry no pid: removed only as
    pid 1. Returns ``(directory, removed names)`` for each directory that had some; never
    raises."""
    from pathlib import Path

    from attnprof._private_files import leftover_dirs, sweep
    from attnprof._safety import pid_alive

    me = os.getpid()
    fresh = me == 1  # the container's first process: nothing before it is still running

    def alive(pid: int) -> bool:
        return pid == me or (not fresh and pid_alive(pid))

    out = []
    for d in leftover_dirs(run_dir):
        names = sweep(Path(d), without_pid=fresh, alive=alive)
        if names:
            out.append((str(d), names))
    return out


def check_command(argv: Sequence[str]) -> None:
    """Raise :class:`WipeError` unless ``argv[0]`` names an executable (on ``PATH`` or as a
    path), so a typo fails before anything is removed."""
    if not argv:
        raise WipeError("no command to run (give it after `--`)")
    if shutil.which(argv[0]) is None:
        raise WipeError(f"command {argv[0]!r} not found or not executable")


def exec_command(argv: Sequence[str]) -> NoReturn:
    """Replace this process with ``argv`` (same pid and environment), so the server is the
    container's main process and receives its signals directly. Raises :class:`WipeError`
    if the exec itself fails."""
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        os.execvp(argv[0], list(argv))
    except OSError as exc:
        raise WipeError(f"cannot run {argv[0]!r}: {exc.strerror}") from None
