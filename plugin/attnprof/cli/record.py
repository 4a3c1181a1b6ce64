"""``attnprof record --url URL --duration 60s --out snap.json``: save what a live server did
over a window (its snapshot's counters between two reads) for ``attnprof diff``."""

from __future__ import annotations

import argparse
import json
import signal
import sys
import time
from pathlib import Path
from typing import Any

from attnprof.cli._common import (
    CliError,
    StopSignals,
    check_out_file,
    parse_seconds,
    write_atomic,
)
from attnprof.cli.snapshot import add_api_key_flag, fetch_typed_snapshot

__all__ = ["add_parser"]

def add_parser(sub: Any) -> None:
    p = sub.add_parser("record", help="save a live server's aggregates over a window "
                                      "(for attnprof diff)")
    p.add_argument("--url", default="http://127.0.0.1:8000",
                   help="server base URL (default http://127.0.0.1:8000)")
    add_api_key_flag(p)
    p.add_argument("--duration", default="60s",
                   help="how long to record, e.g. 60s, 5m (default 60s; Ctrl-C ends it "
                        "early and still writes the shorter window)")
    p.add_argument("--out", type=Path, required=True, help="the file to write (JSON)")
    p.set_defaults(func=_run)




def _run(args: argparse.Namespace) -> int:
    from attnprof.analyze.window import window_between

    duration = parse_seconds(args.duration, "--duration")
    check_out_file(args.out)  # creates nothing: an unreachable server leaves no directory
    # An unreachable server or a refused key fails here, before any waiting.
    start = fetch_typed_snapshot(args.url, args.api_key)
    if not start.enabled:
        raise CliError(f"{args.url}: attnprof is not enabled in that server "
                       f"(ATTNPROF_ENABLED=0?): nothing to record")
    t_end = time.monotonic() + duration
    tty = sys.stderr.isatty()
    with StopSignals() as stop:  # SIGTERM, like Ctrl-C, ends early and still writes
        while (left := t_end - time.monotonic()) > 0:
            msg = f"attnprof record: {duration - left:5.0f}/{duration:.0f} s"
            print(f"\r{msg}" if tty else msg, end="" if tty else "\n", file=sys.stderr,
                  flush=True)
            if stop.nap(min(left, 1.0 if tty else 10.0)):
                break
    if tty:
        print(file=sys.stderr)
    end = fetch_typed_snapshot(args.url, args.api_key)
    if end.model != start.model:
        raise CliError(f"{args.url} served {start.model!r} at the start and {end.model!r} at "
                       f"the end (a load balancer in front of several servers?): record one "
                       f"server's own URL")
    rec = window_between(start, end)
    if stop.requested and rec.window is not None:
        how = "Ctrl-C" if stop.received[0] == signal.SIGINT else "SIGTERM"
        rec.window.note = f"stopped early by {how}; {rec.window.note}"
    write_atomic(args.out, json.dumps(rec.to_json(), indent=2) + "\n")
    w = rec.window
    assert w is not None
    print(f"wrote {args.out}: {w.duration_s:.1f} s of {rec.model}, {w.requests} finished "
          f"requests, {sum(x.sampler.sampled for x in rec.workers)} sampled steps")
    return 0
