"""``attnprof tensorboard --url URL --logdir DIR``: poll a live server's snapshot and write
TensorBoard event files (scalars, the kernel map as text, the activation-map image) until
``--count`` snapshots, ``--duration`` or Ctrl-C; the files are flushed after every poll."""

from __future__ import annotations

import argparse
import contextlib
import math
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from attnprof.cli._common import (
    CliError,
    StopSignals,
    int_in_range,
    out_dir_arg,
    parse_seconds,
    require_module,
)
from attnprof.cli.snapshot import add_api_key_flag, fetch_typed_snapshot
from attnprof.contracts.snapshot import Snapshot

__all__ = ["add_parser", "check_logdir"]

def check_logdir(path: Path, flag: str) -> Path:
    """Refuse a TensorBoard log directory that cannot be written (a file, a directory that
    cannot be created or written) before any work starts. It tries for real (``os.access``
    says yes to root on a read-only file system) and removes what the try created."""
    if path.exists() and not path.is_dir():
        raise CliError(f"{flag} {str(path)!r} is a file; {flag} names a directory")
    created = []
    p = path
    while not p.exists() and p != p.parent:
        created.append(p)
        p = p.parent
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as err:
        raise CliError(f"{flag} {str(path)!r} cannot be written: {err.strerror}") from None
    finally:
        for d in created:  # deepest first; only directories this check made, still empty
            with contextlib.suppress(OSError):
                d.rmdir()
    return path


def add_parser(sub: Any) -> None:
    p = sub.add_parser("tensorboard", help="write a live server's attention profile as "
                                           "TensorBoard event files, polling its snapshot")
    p.add_argument("--url", default="http://127.0.0.1:8000",
                   help="server base URL (default http://127.0.0.1:8000)")
    add_api_key_flag(p)
    p.add_argument("--logdir", type=out_dir_arg, required=True,
                   help="TensorBoard log directory (created; one new event file per run)")
    p.add_argument("--interval", default="10s",
                   help="time between snapshots (default 10s; 500ms, 2m, ...)")
    p.add_argument("--count", type=int, default=None,
                   help="stop after this many snapshots (default: until Ctrl-C)")
    p.add_argument("--duration", default=None,
                   help="stop after this long (e.g. 10m; default: until Ctrl-C)")
    p.set_defaults(func=_run)




class _Logger:
    """The event file and what was last written to it (the map is re-drawn only on change)."""

    def __init__(self, logdir: Path) -> None:
        from attnprof.exporters.tensorboard import EventWriter

        self.writer = EventWriter(logdir)
        self.written = 0
        self._last_map: str | None = None
        self._prev: Snapshot | None = None

    def write(self, snap: Snapshot) -> None:
        from attnprof.analyze.window import window_between
        from attnprof.exporters import activation_map as amap
        from attnprof.exporters import tensorboard as tb

        step = self.written
        # Step 0: since the server started; then each interval on its own (a running
        # average since start would flatten exactly the change the curve is for).
        view = snap if self._prev is None else window_between(self._prev, snap)
        self._prev = snap
        self.writer.add_scalars(tb.snapshot_scalars(view, step), snap.time)
        grid = amap.grid_from_snapshot(snap)
        text = amap.markdown(grid)
        if text != self._last_map:
            self.writer.add_text(tb.TEXT_KERNEL_MAP, text, step, snap.time)
            self.writer.add_image(tb.IMAGE_ACTIVATION_MAP, amap.render(grid), step, snap.time)
            self._last_map = text
        self.writer.flush()
        self.written += 1


def _run(args: argparse.Namespace) -> int:
    interval = parse_seconds(args.interval, "--interval")
    duration = None if args.duration is None else parse_seconds(args.duration, "--duration")
    if args.count is not None:
        int_in_range(args.count, "--count", 1, 10**9)
    check_logdir(args.logdir, "--logdir")
    require_module("tensorboard", "attnprof tensorboard", "tensorboard")
    require_module("matplotlib", "attnprof tensorboard (the activation-map image)", "report")
    # The first snapshot before anything is created: a wrong URL or key leaves no file.
    first = fetch_typed_snapshot(args.url, args.api_key)

    log: _Logger | None = None
    t0 = time.monotonic()
    # SIGTERM stops like Ctrl-C: files flushed, exit 0.
    with StopSignals() as stop:
        try:
            args.logdir.mkdir(parents=True, exist_ok=True)
            log = _Logger(args.logdir)
            snap: Snapshot | None = first
            tick = 0
            while True:
                if snap is not None:
                    log.write(snap)
                if stop.requested or (args.count is not None and log.written >= args.count):
                    break
                # The next tick still ahead (a slow poll skips ticks rather than bunching).
                tick = max(tick + 1, math.floor((time.monotonic() - t0) / interval) + 1)
                wake = t0 + tick * interval
                if duration is not None and wake - t0 > duration:
                    break
                if stop.nap(wake - time.monotonic()):
                    break
                try:
                    snap = fetch_typed_snapshot(args.url, args.api_key)
                except CliError as err:  # a restart or a blip: say so, keep polling
                    print(f"attnprof: warning: snapshot {tick} skipped: {err}",
                          file=sys.stderr)
                    snap = None
        except OSError as err:
            raise CliError(f"cannot write to --logdir {str(args.logdir)!r}: "
                           f"{err.strerror}") from None
        finally:
            if log is not None:
                log.writer.close()
    where = log.writer.path if log is not None else args.logdir
    n = log.written if log is not None else 0
    print(f"attnprof tensorboard: {n} snapshot{'s' if n != 1 else ''} written to {where}",
          file=sys.stderr)
    return 0
