"""``attnprof trace``: the next N sampled steps of a live server as a Chrome/Perfetto trace."""

from __future__ import annotations

import argparse
import urllib.parse
from pathlib import Path
from typing import Any

from attnprof.cli._common import CliError, check_out_file, int_in_range, write_atomic
from attnprof.cli.snapshot import add_api_key_flag

__all__ = ["add_parser", "fetch_trace"]

MAX_STEPS = 1000  # what the route accepts (attnprof.aggregate.trace.MAX_STEPS)


def add_parser(sub: Any) -> None:
    p = sub.add_parser("trace", help="record a live server's next sampled steps as a "
                                     "Chrome/Perfetto trace")
    p.add_argument("--url", default="http://127.0.0.1:8000",
                   help="server base URL (default http://127.0.0.1:8000)")
    add_api_key_flag(p)
    p.add_argument("--steps", type=int, default=8,
                   help=f"sampled steps to record per worker, 1..{MAX_STEPS} (default 8)")
    p.add_argument("--timeout", type=float, default=30.0,
                   help="seconds the server waits for them, at most 300 (default 30); a "
                        "trace cut short by it says so in otherData.attnprof.timed_out")
    p.add_argument("--out", type=Path, default=Path("trace.json"),
                   help="where to write the trace (default trace.json); open it in "
                        "https://ui.perfetto.dev or chrome://tracing")
    p.set_defaults(func=_run)


def fetch_trace(url: str, steps: int, timeout: float, api_key: str | None = None) -> bytes:
    """The trace body from ``GET /attnprof/trace`` (checked to be a trace document);
    :class:`CliError` (one line) for an unreachable server, a refused key, a busy server
    (409), bad bounds or an answer that is not a trace."""
    from attnprof.tools import http

    full = (url.rstrip("/") + "/attnprof/trace?"
            + urllib.parse.urlencode({"steps": steps, "timeout": f"{timeout:g}"}))
    try:
        http.check_url(url)
        key = http.resolve_api_key(api_key)
        # The server waits up to `timeout` for the steps, then takes the records.
        body = http.get(full, timeout=timeout + 60, api_key=key, auth=True)
        doc = http.parse_json(body, full)
    except http.HttpError as err:
        hint = " (is attnprof_http in VLLM_PLUGINS? `attnprof serve` sets it)" \
            if err.status == 404 else ""
        raise CliError(f"{err}{hint}") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("traceEvents"), list):
        raise CliError(f"{full} did not return a trace (no traceEvents list)")
    return body


def _run(args: argparse.Namespace) -> int:
    int_in_range(args.steps, "--steps", 1, MAX_STEPS)
    if not 0 < args.timeout <= 300:
        raise CliError(f"--timeout must be seconds in (0, 300], got {args.timeout:g}")
    out = check_out_file(args.out)
    body = fetch_trace(args.url, args.steps, args.timeout, api_key=args.api_key)
    write_atomic(out, body)
    import json

    info = (json.loads(body).get("otherData") or {}).get("attnprof") or {}
    per = info.get("steps_per_worker") or {}
    note = " (timed out before every worker had them)" if info.get("timed_out") else ""
    if info.get("enabled") is False:
        note = " (attnprof is disabled on that server: empty trace)"
    print(f"wrote {out}: {sum(per.values())} steps from {len(per)} worker(s){note}")
    return 0
