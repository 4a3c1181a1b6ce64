"""How a worker's head-statistics delta reaches the API server without the engine carrying it.

A delta is megabytes (13 MB for an 80-layer, 64-head model). Returned inside the poll's
answer, vLLM would pickle and copy it on the worker's main thread, between two model steps.
Instead, when the API server runs on the same machine (it says which machine it is in the
poll), the worker's drain thread writes the delta to a private file (mode 0600, in
``ATTNPROF_RUN_DIR`` or the temporary directory) and the answer carries only its name; the
API server reads it in a thread and removes it. On another machine the bytes travel in the
answer, as before. A file the API server never collected is removed at the worker's next
poll and at exit, so at most a few exist per worker.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import socket
import tempfile
import threading
from pathlib import Path
from typing import Any

from attnprof._private_files import DELTA_FILE, delta_prefix, sweep

__all__ = ["DeltaFiles", "host_id", "read_delta"]


def host_id() -> str:
    """This machine's identity: host name and boot id (equal for processes on one host)."""
    boot = ""
    with contextlib.suppress(OSError):
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    return f"{socket.gethostname()}/{boot}"


class DeltaFiles:
    """The worker's side: ``finish_for(api_host)`` is the drain's ``finish`` callback."""

    def __init__(self, where: Path | None = None) -> None:
        self.where = where
        self.here = host_id()
        self._lock = threading.Lock()
        self._written: set[str] = set()  # every file not known to be gone
        self._handed: list[str] = []  # files handed out by earlier answers
        self._swept = False  # crashed workers' deltas removed (at the first delta)
        atexit.register(self.forget_all)

    def finish_for(self, api_host: str | None) -> Any:
        """A file when the API server shares this machine, else the bytes themselves."""
        if api_host and api_host == self.here:
            return self._to_file
        return _inline

    def _to_file(self, chunks: list[Any]) -> dict[str, Any]:
        """The delta's buffers written one by one (each write leaves the GIL; they are never
        joined into one copy first)."""
        if not self._swept:
            # A worker that crashed (OOM kill) never ran its atexit: its deltas, megabytes
            # each, are removed by the next worker here (only dead writers' files). On the
            # drain thread, at its first delta: never on the engine's thread.
            self._swept = True
            sweep(self.where or Path(tempfile.gettempdir()), kinds=(DELTA_FILE,))
        fd, path = tempfile.mkstemp(prefix=delta_prefix(), suffix=".npz",
                                    dir=str(self.where) if self.where else None)
        size = 0
        try:
            with os.fdopen(fd, "wb") as f:
                for c in chunks:
                    size += f.write(c)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(path)
            raise
        with self._lock:
            self._written.add(path)
        return {"path": path, "size": size}

    def hand(self, handles: list[Any]) -> None:
        """Note the files an answer hands out (the API server reads and removes them)."""
        with self._lock:
            self._handed += [h["path"] for h in handles if isinstance(h, dict) and "path" in h]

    def forget_handed(self) -> None:
        """Remove files handed out by earlier answers that the API server left behind
        (normally none: it removes each as soon as it has read it)."""
        with self._lock:
            old, self._handed = self._handed, []
            self._written.difference_update(old)
        for path in old:
            with contextlib.suppress(OSError):
                os.unlink(path)

    def forget_all(self) -> None:
        """At exit: every file this worker wrote and nobody removed."""
        with self._lock:
            old, self._written, self._handed = list(self._written), set(), []
        for path in old:
            with contextlib.suppress(OSError):
                os.unlink(path)


def _inline(chunks: list[Any]) -> dict[str, Any]:
    data = b"".join(chunks)  # the answer carries bytes (to another machine): one copy
    return {"data": data, "size": len(data)}


def read_delta(handle: Any) -> bytes:
    """The delta bytes a worker handed out (API server side, in a thread): inline, or a file
    it wrote, which is read and removed. Raises ``ValueError`` for anything else (a path that
    is not one of ours is never opened)."""
    if not isinstance(handle, dict):
        raise ValueError("not a head-statistics delta handle")
    data = handle.get("data")
    if isinstance(data, (bytes, bytearray)):
        return bytes(data)
    path = handle.get("path")
    if not isinstance(path, str) or not DELTA_FILE.fullmatch(os.path.basename(path)):
        raise ValueError("not a head-statistics delta handle")
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError as exc:
        raise ValueError(f"head-statistics delta file unreadable: {exc.strerror}") from None
    with os.fdopen(fd, "rb") as f:
        if os.fstat(f.fileno()).st_uid != os.getuid():
            raise ValueError("head-statistics delta file not written by this user")
        out = f.read()
    with contextlib.suppress(OSError):
        os.unlink(path)  # read once: the worker's copy is ours to remove
    return out
