"""``attnprof report``: the cost-optimization report (report.html, report.md, report.json)
from a live server (``--url``), a fleet's Prometheus (``--prometheus``) or saved snapshot,
record, demo or profile files."""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path
from typing import Any

from attnprof.cli._common import (
    CliError,
    check_out_dir,
    ensure_writable_dir,
    int_arg,
    label_arg,
    out_dir_arg,
    price_arg,
)

__all__ = ["add_fleet_flags", "add_parser", "gather", "mean_replicas_arg", "print_savings",
           "write_report"]


def _positive_float(text: str) -> float:
    try:
        x = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text[:40]!r} is not a number") from None
    if not math.isfinite(x) or not 0 < x <= 4096:
        raise argparse.ArgumentTypeError(f"{text[:40]!r} is not in (0, 4096]") from None
    return x


def mean_replicas_arg(text: str) -> float:
    """argparse type of ``--mean-replicas`` and ``--replica-max-tokens-per-s``: a finite
    number > 0 (a usage error otherwise)."""
    try:
        x = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text[:40]!r} is not a number (e.g. 3.2)") from None
    if not math.isfinite(x) or x <= 0:
        raise argparse.ArgumentTypeError(f"{text[:40]!r}: must be a finite number > 0"
                                         ) from None
    return x


def add_fleet_flags(p: argparse.ArgumentParser) -> None:
    """``--mean-replicas`` and ``--replica-max-tokens-per-s`` (report and whatif): the
    autoscaled figures' base and the compute ceiling of a KV saving."""
    p.add_argument("--mean-replicas", type=mean_replicas_arg, default=None, metavar="X",
                   help="the fleet's mean replicas over the period (e.g. 3.2 of 8 at 40%% "
                        "average load): the base of the autoscaled savings (default: the "
                        "mean of Prometheus' replica count over --range; without either the "
                        "autoscaled figure is per replica-month only)")
    p.add_argument("--replica-max-tokens-per-s", type=mean_replicas_arg, default=None,
                   metavar="R", help="one replica's tokens/s at saturation (measured): a KV "
                   "saving never leaves fewer replicas than the fleet's tokens/s / R "
                   "(default: the observed rate per replica, so a KV saving removes none)")


def add_parser(sub: Any) -> None:
    from attnprof.cli._measure import add_measure_flags
    from attnprof.cli.snapshot import add_api_key_flag

    p = sub.add_parser(
        "report", help="cost-optimization report (HTML, Markdown, JSON) from a server, a "
                       "fleet's Prometheus or saved files",
        description="Writes report.html (self-contained), report.md and report.json to --out. "
                    "Sources: --url (a live server), --prometheus (every replica it scrapes), "
                    "or FILES (snapshot / record / demo.json files, plus at most one "
                    "profile.json whose measured fallback gains and replayed window advice "
                    "are used).")
    p.add_argument("files", nargs="*", type=Path, metavar="FILE",
                   help="saved snapshot, record, demo or profile JSON files")
    p.add_argument("--url", default=None, help="a live server's base URL")
    add_api_key_flag(p)
    p.add_argument("--prometheus", default=None, metavar="URL",
                   help="a Prometheus that scrapes the servers (a fleet)")
    p.add_argument("--model", default=None, type=label_arg,
                   help="with --prometheus: only this model label (default: every model)")
    p.add_argument("--range", default=None, dest="range_",
                   help="with --prometheus: the window, e.g. 24h, 30m (default: all data, at "
                        "most 24h); longer than the data is an error")
    p.add_argument("--gpu-hour-price", type=price_arg, default=None, metavar="P",
                   help="price of one GPU-hour (money figures; without it: GPU-hours)")
    p.add_argument("--replicas", type=int_arg(1, 100_000), default=None,
                   help="replicas serving the model (default: counted from Prometheus, or 1)")
    p.add_argument("--autoscaled", action="store_true",
                   help="rank the savings by what an autoscaled fleet saves (fractional "
                        "replicas) instead of the whole replicas a fixed fleet removes; "
                        "both figures are printed either way")
    add_fleet_flags(p)
    p.add_argument("--gpus-per-replica", type=_positive_float, default=None,
                   help="GPUs per replica (default: the workers the source reports)")
    p.add_argument("--out", type=out_dir_arg, default=Path("attnprof-out"),
                   help="output directory (default attnprof-out)")
    p.add_argument("--timeout", type=float, default=30.0,
                   help="seconds per HTTP request (default 30)")
    p.add_argument("--validate", action="store_true",
                   help="measure each what-if a flag can apply on real vLLM servers and "
                        "print predicted beside measured (as attnprof whatif; minutes)")
    add_measure_flags(p)
    p.set_defaults(func=_run)


def write_report(rep: Any, out: Path) -> None:
    """Render and write the three files into ``out``, then print the path and the biggest
    savings; :class:`CliError` (one line) when they cannot be written."""
    from attnprof.tools import report as rp

    texts = rp.render_all(rep)
    ensure_writable_dir(out)
    try:
        rp.write_all(out, texts)
    except OSError as err:
        raise CliError(f"cannot write the report into {str(out)!r}: "
                       f"{err.strerror or err}") from None
    print_savings(rep, out)


def print_savings(rep: Any, out: Path, n: int = 3) -> None:
    """The report's path and its ``n`` biggest savings (over every model), each with both
    money figures and the basis that ranked them; alternatives say so in their line and are
    never added up. Then, per model with coverage, what the window advice stands on."""
    print(f"Cost report: {out / 'report.html'} (also report.md, report.json)")
    lines = [(m.model, s) for m in rep.models for s in m.savings]
    if not lines:
        print("  no what-if saves anything on this traffic")
    else:
        bases = {m.ranked_by for m in rep.models if m.savings}
        print("  ranked by " + ("what an autoscaled fleet saves" if bases == {"autoscaled"}
                                else "what a fixed fleet saves (whole replicas removed)")
              + "; the savings are not additive")
        for i, (model, line) in enumerate(lines[:n], 1):
            print(f"  {i}. [{model}] {line}")
    # what the window advice (and its money) stands on, beside the savings
    for m in rep.models:
        if m.advice_basis is not None and m.advice_basis.available:
            print(f"  [{m.model}] {m.advice_basis.stands_on}")


def gather(args: argparse.Namespace) -> Any:
    """The report source the arguments name (``--url``, ``--prometheus`` or FILES), read;
    :class:`CliError` (one line) when it cannot be."""
    from attnprof.tools import report_prometheus
    from attnprof.tools import report_sources as rs

    try:
        if args.url:
            from attnprof.cli.snapshot import fetch_snapshot

            raw = fetch_snapshot(args.url, timeout=args.timeout, api_key=args.api_key)
            g = rs.from_live(raw, args.url, replicas=getattr(args, "replicas", None),
                             gpus_per_replica=getattr(args, "gpus_per_replica", None))
        elif getattr(args, "prometheus", None):
            g = report_prometheus.from_prometheus(
                args.prometheus, args.model, args.range_, args.replicas,
                args.gpus_per_replica, timeout=args.timeout)
        else:
            g = rs.from_files(args.files, getattr(args, "replicas", None),
                              getattr(args, "gpus_per_replica", None))
    except rs.ReportInputError as err:
        raise CliError(str(err)) from None
    mean = getattr(args, "mean_replicas", None)
    max_tps = getattr(args, "replica_max_tokens_per_s", None)
    for inp in g.inputs:
        if mean is not None:  # the flag over Prometheus' mean
            inp.mean_replicas, inp.mean_replicas_basis = mean, "--mean-replicas"
        if max_tps is not None:
            inp.replica_max_tokens_per_s = max_tps
    return g


def _run(args: argparse.Namespace) -> int:
    import json

    from attnprof.analyze.cost import Settings
    from attnprof.cli._common import write_atomic
    from attnprof.tools import report as rp

    t0 = time.monotonic()
    chosen = [n for n, v in (("FILE", args.files), ("--url", args.url),
                             ("--prometheus", args.prometheus)) if v]
    if len(chosen) != 1:
        raise CliError("give one source: --url URL, --prometheus URL, or FILE..."
                       + (f" (got {', '.join(chosen)})" if chosen else ""))
    if (args.model or args.range_) and not args.prometheus:
        raise CliError("--model and --range go with --prometheus")
    if not 0 < args.timeout <= 3600:
        raise CliError("--timeout must be in (0, 3600] seconds")
    from attnprof.cli._measure import check_measure_args, measure_flags_given

    if args.validate:
        check_measure_args(args)
    elif measure_flags_given(args):
        raise CliError(f"{', '.join(measure_flags_given(args))} go with --validate")
    check_out_dir(args.out)
    g = gather(args)
    settings = Settings(gpu_hour_price=args.gpu_hour_price, autoscaled=args.autoscaled)
    rep = rp.build_report(g, settings, t0)
    run = None
    if args.validate:
        from attnprof.cli._measure import measure, remeasured_report
        from attnprof.exporters.terminal_whatif import run_lines

        run = measure(g, rep, args)
        rep = remeasured_report(g, rep, run, settings, t0)
        rep.report_seconds = time.monotonic() - t0
        for line in run_lines(run, rep):
            print(line)
    write_report(rep, args.out)
    if run is not None:
        write_atomic(args.out / "whatif.json", json.dumps(run.to_json(), indent=2) + "\n")
        print(f"  also {args.out / 'whatif.json'} ({run.seconds:.0f} s of measurement)")
    print(f"  ({rep.report_seconds:.1f} s)", file=sys.stderr)
    return 0
