"""``attnprof diff BASE NEW``: compare two profile.json files or two snapshots/records and
flag regressions.

Exit 0: no regression; 1: at least one finding over its ``--fail-on`` threshold; 2: bad or
incomparable input (one line on stderr, nothing written).

Compares files only: it starts no subprocess and runs no ``git`` (a directory named inside an
input file is never entered: a repository there could run code through its own config). The
revisions were recorded when each file was made. Every string from an input file is printed
with its control characters escaped (the renderers' ``inert``; errors: the CLI's one line).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from attnprof.cli._common import CliError, check_out_file, read_json, write_atomic
from attnprof.contracts.base import ContractError, parse_version
from attnprof.contracts.profile import ProfileReport
from attnprof.contracts.snapshot import Snapshot

__all__ = ["add_parser", "read_document"]

_READERS: dict[str, Any] = {ProfileReport.KIND: ProfileReport, Snapshot.KIND: Snapshot}


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "diff", help="compare two profiles or two snapshots/records; exit 1 on regression",
        description="Compare two profile.json files (attnprof profile) or two snapshots "
                    "(attnprof snapshot --json, attnprof record). Exit 0: no regression; "
                    "1: regression; 2: bad or incomparable input.")
    p.add_argument("base", type=Path, metavar="BASE", help="the baseline file")
    p.add_argument("new", type=Path, metavar="NEW", help="the file to judge")
    p.add_argument("--fail-on", default=None, metavar="CHECKS",
                   help="thresholds, e.g. fused-drop=5%%,time=10%%,oom=10%%,share=10%%,"
                        "memory=10%%,kernel=on,context-shift=0.2,window=5%% ('off' disables "
                        "one; the defaults are those without context-shift and window)")
    p.add_argument("--allow-model-change", action="store_true",
                   help="compare files of two different models (refused otherwise)")
    fmt = p.add_mutually_exclusive_group()
    fmt.add_argument("--json", action="store_true", help="print the attnprof.diff JSON")
    fmt.add_argument("--markdown", action="store_true",
                     help="print Markdown (ready for a pull-request comment)")
    p.add_argument("--write-markdown", type=Path, metavar="FILE",
                   help="also write the Markdown to FILE")
    p.add_argument("--write-json", type=Path, metavar="FILE",
                   help="also write the JSON to FILE")
    p.set_defaults(func=_run)


def read_document(path: Path) -> tuple[ProfileReport | Snapshot, dict[str, Any]]:
    """The profile or snapshot in ``path`` and its raw JSON; :class:`CliError` (one line)
    for an unreadable, truncated or malformed file, another kind, or an unknown version."""
    data = read_json(path)
    if not isinstance(data, dict):
        raise CliError(f"{path}: not an attnprof profile or snapshot (a JSON "
                       f"{type(data).__name__})")
    tag = data.get("schema_version")
    try:
        kind = parse_version(tag)[0]
    except ContractError:
        raise CliError(f"{path}: not an attnprof profile or snapshot (schema_version "
                       f"{str(tag)[:40]!r})") from None
    cls = _READERS.get(kind)
    if cls is None:
        raise CliError(f"{path}: a {kind[:40]} document; attnprof diff compares "
                       f"{' or '.join(_READERS)} files")
    try:
        doc = cls.from_json(data)
    except ContractError as err:
        raise CliError(f"{path}: {err}") from None
    return doc, data


def _run(args: argparse.Namespace) -> int:
    from attnprof.analyze.diff import Incomparable, compare
    from attnprof.analyze.diff_thresholds import parse_fail_on
    from attnprof.exporters.diff_report import render_markdown, render_text

    try:
        thresholds = parse_fail_on(args.fail_on)
    except ValueError as err:
        raise CliError(str(err)) from None
    if args.write_markdown is not None:
        check_out_file(args.write_markdown, "--write-markdown")
    if args.write_json is not None:
        check_out_file(args.write_json, "--write-json")
    base, base_raw = read_document(args.base)
    new, new_raw = read_document(args.new)
    try:
        rep = compare(base, new, base_name=str(args.base), new_name=str(args.new),
                      base_raw=base_raw, new_raw=new_raw, thresholds=thresholds,
                      allow_model_change=args.allow_model_change)
        md = render_markdown(rep)
        text = render_text(rep)
        doc = json.dumps(rep.to_json(), indent=2) + "\n"
    except Incomparable as err:
        raise CliError(str(err)) from None
    except Exception as err:
        # Exit 1 means "regression" to CI: a value the comparison cannot handle must not
        # look like one. Valid documents with odd values end here as a bad input (2).
        raise CliError(f"cannot compare {args.base} and {args.new}: "
                       f"{type(err).__name__}: {str(err)[:120]}") from None
    if args.write_markdown is not None:
        write_atomic(args.write_markdown, md)
    if args.write_json is not None:
        write_atomic(args.write_json, doc)
    print(doc if args.json else md if args.markdown else text, end="")
    return 1 if rep.regression else 0
