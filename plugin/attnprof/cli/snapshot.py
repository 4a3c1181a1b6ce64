"""``attnprof snapshot``: read a live server's aggregated profile."""

from __future__ import annotations

import argparse
import json
import urllib.error
from typing import Any

from attnprof.cli._common import CliError
from attnprof.contracts.base import ContractError
from attnprof.contracts.snapshot import Snapshot

__all__ = ["add_parser", "fetch_snapshot"]


def add_parser(sub: Any) -> None:
    p = sub.add_parser("snapshot", help="print a live server's attention profile")
    p.add_argument("--url", default="http://127.0.0.1:8000",
                   help="server base URL (default http://127.0.0.1:8000)")
    p.add_argument("--json", action="store_true", help="print the raw versioned JSON")
    p.set_defaults(func=_run)


def fetch_snapshot(url: str, timeout: float = 30.0) -> dict[str, Any]:
    from attnprof.tools.server import http_get

    full = url.rstrip("/") + "/attnprof/snapshot"
    try:
        data = json.loads(http_get(full, timeout=timeout))
    except urllib.error.HTTPError as err:
        hint = " (is attnprof_http in VLLM_PLUGINS? `attnprof serve` sets it)" \
            if err.code == 404 else ""
        raise CliError(f"{full}: HTTP {err.code}{hint}") from None
    except (urllib.error.URLError, OSError) as err:
        reason = getattr(err, "reason", err)
        raise CliError(f"cannot reach {full}: {reason}") from None
    except ValueError:
        raise CliError(f"{full} did not return JSON") from None
    try:
        Snapshot.check_version(data)  # kind and major; the body is read by its consumers
    except ContractError as err:
        raise CliError(f"{full} did not return an attnprof snapshot: {err}") from None
    out: dict[str, Any] = data
    return out


def _run(args: argparse.Namespace) -> int:
    from attnprof.exporters.terminal import render_snapshot

    snap = fetch_snapshot(args.url)
    if args.json:
        print(json.dumps(snap, indent=2))
    else:
        print(render_snapshot(snap), end="")
    return 0
