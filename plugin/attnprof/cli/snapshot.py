"""``attnprof snapshot``: read a live server's aggregated profile (``--png FILE``: and draw its
kernel activation map, as PNG and as SVG next to it)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from attnprof._text import inert
from attnprof.cli._common import (
    CliError,
    api_key_arg,
    check_out_file,
    require_module,
    write_atomic,
)
from attnprof.contracts.base import ContractError
from attnprof.contracts.snapshot import Snapshot

__all__ = ["add_api_key_flag", "add_parser", "fetch_snapshot", "fetch_typed_snapshot",
           "parse_snapshot"]


def add_parser(sub: Any) -> None:
    p = sub.add_parser("snapshot", help="print a live server's attention profile")
    p.add_argument("--url", default="http://127.0.0.1:8000",
                   help="server base URL (default http://127.0.0.1:8000)")
    add_api_key_flag(p)
    p.add_argument("--json", action="store_true", help="print the raw versioned JSON")
    p.add_argument("--head-stats", action="store_true",
                   help="with --json: include the merged per-head attention statistics "
                        "(megabytes for a large model; what suggest-window --url reads)")
    p.add_argument("--png", type=Path, metavar="FILE", default=None,
                   help="also draw the kernel activation map (layers x phases, coloured by "
                        "backend and fused/fallback) to FILE, and as SVG next to it")
    p.add_argument("--roofline", type=Path, metavar="FILE", default=None,
                   help="also draw each phase's attention on the roofline of the workers' "
                        "probed peaks (needs ATTNPROF_PROBE=1 on the server) to FILE (PNG), "
                        "and as SVG next to it")
    p.set_defaults(func=_run)


def add_api_key_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument("--api-key", metavar="KEY", default=None, type=api_key_arg,
                   help="bearer token for the server's /attnprof routes (vLLM's --api-key; "
                        "default $ATTNPROF_API_KEY, then $VLLM_API_KEY)")


def parse_snapshot(data: Any, source: str, *, complete: bool = False) -> dict[str, Any]:
    """``data`` if it is an ``attnprof.snapshot`` document of this major version;
    :class:`CliError` (one line) otherwise. ``complete``: every required field must be there
    with the right type too (what the table needs); without it the body is left to its
    readers, which take what they need with defaults (suggest-window: the sketch and head
    statistics)."""
    try:
        if complete:
            Snapshot.from_json(data)
        else:
            Snapshot.check_version(data)
    except ContractError as err:
        raise CliError(f"{source} did not return an attnprof snapshot: {err}") from None
    out: dict[str, Any] = data
    return out


def fetch_snapshot(url: str, timeout: float = 30.0, api_key: str | None = None,
                   head_stats: bool = False) -> dict[str, Any]:
    """The server's snapshot (its kind and major version checked); :class:`CliError` (one line)
    for an unreachable server, a refused or missing API key, an answer that is not HTTP,
    cut short, not JSON or not a snapshot. ``api_key``: ``--api-key``; None reads
    ``$ATTNPROF_API_KEY`` then ``$VLLM_API_KEY``. ``head_stats``: also the merged head
    statistics (``?head_stats=1``; megabytes for a large model, so only when needed)."""
    from attnprof.tools import http

    full = url.rstrip("/") + "/attnprof/snapshot" + ("?head_stats=1" if head_stats else "")
    try:
        http.check_url(url)
        key = http.resolve_api_key(api_key)
        data = http.get_json(full, timeout=timeout, api_key=key, auth=True)
    except http.HttpError as err:
        hint = " (is attnprof_http in VLLM_PLUGINS? `attnprof serve` sets it)" \
            if err.status == 404 else ""
        raise CliError(f"{err}{hint}") from None
    return parse_snapshot(data, full)


def _svg_path(png: Path) -> Path:
    return png.with_suffix(".svg") if png.suffix.lower() == ".png" else Path(f"{png}.svg")


def _write_map(snap: dict[str, Any], png: Path, source: str) -> None:
    """Both pictures rendered before either is written (one never comes without the other)."""
    from attnprof.exporters import activation_map as amap

    try:
        grid = amap.grid_from_snapshot(Snapshot.from_json(snap))
    except ContractError as err:
        raise CliError(f"{source} returned a snapshot the map cannot read: {err}") from None
    png_bytes, svg_bytes = amap.render(grid, "png"), amap.render(grid, "svg")
    try:
        write_atomic(png, png_bytes)
        write_atomic(_svg_path(png), svg_bytes)
    except OSError as err:
        raise CliError(f"cannot write --png {str(png)!r}: {err.strerror}") from None
    print(f"attnprof: wrote {png} and {_svg_path(png)}", file=sys.stderr)


def _write_roofline(snap: dict[str, Any], png: Path, source: str) -> None:
    """The roofline as PNG and SVG (both rendered before either is written); one line when
    no worker has probed."""
    from attnprof.analyze.roofline import from_snapshot
    from attnprof.exporters.roofline_plot import render, summary_lines

    try:
        typed = Snapshot.from_json(snap)
    except ContractError as err:
        raise CliError(f"{source} returned a snapshot the roofline cannot read: {err}") from None
    rl = typed.roofline or from_snapshot(typed.workers)
    if rl is None:
        raise CliError(f"{source}: no worker has probed its peaks yet (start the server with "
                       "ATTNPROF_PROBE=1; the probe runs a few seconds after the model loads)")
    title = f"{typed.model}: live attention roofline"
    png_bytes, svg_bytes = render(rl, "png", title), render(rl, "svg", title)
    try:
        write_atomic(png, png_bytes)
        write_atomic(_svg_path(png), svg_bytes)
    except OSError as err:
        raise CliError(f"cannot write --roofline {str(png)!r}: {err.strerror}") from None
    for line in summary_lines(rl):
        print(f"attnprof: {line}", file=sys.stderr)
    print(f"attnprof: wrote {png} and {_svg_path(png)}", file=sys.stderr)


def fetch_typed_snapshot(url: str, api_key: str | None = None) -> Snapshot:
    """:func:`fetch_snapshot` decoded into the typed :class:`Snapshot` (every field checked);
    :class:`CliError` (one line) for anything fetch_snapshot refuses or a field of the
    wrong type."""
    data = fetch_snapshot(url, api_key=api_key)
    try:
        return Snapshot.from_json(data)
    except ContractError as err:
        raise CliError(f"{url} returned a snapshot attnprof cannot read: {err}") from None


def _run(args: argparse.Namespace) -> int:
    from attnprof.exporters.terminal import render_snapshot

    if args.png is not None:  # before the request: a bad path is one line, nothing fetched
        check_out_file(args.png, "--png")
        check_out_file(_svg_path(args.png), "--png (its SVG)")
        require_module("matplotlib", "attnprof snapshot --png", "report")
    if args.roofline is not None:
        check_out_file(args.roofline, "--roofline")
        check_out_file(_svg_path(args.roofline), "--roofline (its SVG)")
        require_module("matplotlib", "attnprof snapshot --roofline", "report")
    snap = fetch_snapshot(args.url, api_key=args.api_key, head_stats=args.head_stats)
    if isinstance(snap.get("restricted"), str):  # a server with no key: say what is missing
        note = inert(snap["restricted"][:400])
        print(f"attnprof: {args.url}: {note}", file=sys.stderr)
    if args.png is not None:
        _write_map(snap, args.png, args.url)
    if args.roofline is not None:
        _write_roofline(snap, args.roofline, args.url)
    if args.json:
        print(json.dumps(snap, indent=2))
        return 0
    parse_snapshot(snap, args.url, complete=True)  # a missing field: one line, not KeyError
    try:
        text = render_snapshot(snap)
    except (KeyError, TypeError, ValueError, AttributeError) as err:
        # The contract allows what the table cannot show (a null where it formats a number).
        raise CliError(f"cannot show this snapshot as a table ({type(err).__name__}: {err}); "
                       "use --json") from None
    print(text, end="")
    return 0
