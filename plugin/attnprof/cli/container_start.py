"""``attnprof container-start -- COMMAND...``: a container's entrypoint that empties
``$PROMETHEUS_MULTIPROC_DIR`` (prometheus_client's files only, or it refuses) and then execs
COMMAND in its place, so a container restarted inside the same pod starts with no dead
process's metrics (deploy/README.md)."""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from attnprof.cli._common import CliError

__all__ = ["add_parser"]


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "container-start",
        help="container entrypoint: empty $PROMETHEUS_MULTIPROC_DIR, then exec the server",
        description="Remove every prometheus_client multiprocess file from "
                    "$PROMETHEUS_MULTIPROC_DIR, then replace this process with COMMAND (same "
                    "pid, same environment). Refuses, removing nothing and running nothing, "
                    "when the variable is unset, names / or no directory, or the directory "
                    "holds anything else. Run it as the container's first step, before any "
                    "process writes metrics there.")
    p.add_argument("command", nargs=argparse.REMAINDER, metavar="-- COMMAND ...",
                   help="the server to run, e.g. `-- vllm serve --model ...`")
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    from attnprof.tools.container_start import (
        WipeError,
        check_command,
        exec_command,
        sweep_leftovers,
        wipe_multiproc_dir,
    )

    cmd = list(args.command)
    if cmd[:1] == ["--"]:
        cmd = cmd[1:]
    path = os.environ.get("PROMETHEUS_MULTIPROC_DIR", "")
    try:
        check_command(cmd)  # before the wipe: a typo must not cost the files and then fail
        removed = wipe_multiproc_dir(path)
        if removed:
            print(f"attnprof: removed {len(removed)} multiprocess metric file(s) left in "
                  f"{path} by an earlier start", file=sys.stderr)
        # attnprof's own files of the earlier start (head-statistics deltas of ~25 MB, rate
        # and liveness notes) outlive a crash in the pod's emptyDir too.
        for where, names in sweep_leftovers():
            print(f"attnprof: removed {len(names)} attnprof file(s) left in {where} by an "
                  "earlier start", file=sys.stderr)
        exec_command(cmd)
    except WipeError as err:
        raise CliError(str(err)) from None
