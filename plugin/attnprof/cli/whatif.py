"""``attnprof whatif`` (and, through :mod:`attnprof.cli._measure`, ``attnprof report
--validate``): measure each what-if the cost report can apply with a flag on real vLLM
servers against fresh baselines of the recorded setup (with an A/A control), and write the
report with predicted beside measured (report.html/.md/.json) plus the run itself
(whatif.json)."""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

from attnprof.cli._common import (
    CliError,
    check_out_dir,
    ensure_writable_dir,
    out_dir_arg,
    price_arg,
    write_atomic,
)
from attnprof.cli._measure import add_measure_flags, check_measure_args, measure, remeasured_report

__all__ = ["add_parser"]


def add_parser(sub: Any) -> None:
    from attnprof.cli.report import add_fleet_flags
    from attnprof.cli.snapshot import add_api_key_flag

    p = sub.add_parser(
        "whatif", help="measure the report's what-ifs on real vLLM servers (predicted vs "
                       "measured)",
        description="Measures each what-if on real vLLM servers: per what-if (and an A/A "
                    "control, a second baseline: the run's noise floor) a fresh baseline "
                    "started with the recorded server's own engine flags and a server with "
                    "the what-if's flag, on --instances fresh pairs, side by side on a CPU or "
                    "taking turns on a GPU; replays the recorded traffic shape in alternating "
                    "paired rounds (sized by --mde when given) and measures throughput "
                    "(log-ratios), per-request TTFT/ITL (paired bootstrap), KV capacity "
                    "(vLLM's own figure), preemptions and, where outputs can change, greedy "
                    "agreement (first divergence per prompt) and KL. Writes whatif.json (with "
                    "this run's own provenance and hardware beside the record's) and the cost "
                    "report with predicted beside measured to --out. Source: FILES "
                    "(snapshot / record / demo.json) or --url.")
    p.add_argument("files", nargs="*", type=Path, metavar="FILE",
                   help="saved snapshot, record or demo JSON files")
    p.add_argument("--url", default=None, help="a live server's base URL (its snapshot)")
    add_api_key_flag(p)
    add_measure_flags(p)
    p.add_argument("--gpu-hour-price", type=price_arg, default=None, metavar="P",
                   help="price of one GPU-hour (money figures; without it: GPU-hours)")
    p.add_argument("--autoscaled", action="store_true",
                   help="rank savings by the autoscaled (fractional) figure instead of whole "
                        "replicas removed at a fixed fleet")
    add_fleet_flags(p)
    p.add_argument("--out", type=out_dir_arg, default=Path("attnprof-out"),
                   help="output directory (default attnprof-out)")
    p.add_argument("--timeout", type=float, default=30.0,
                   help="seconds per HTTP request to --url (default 30)")
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    import json

    from attnprof.analyze.cost import Settings
    from attnprof.cli.report import gather, write_report
    from attnprof.exporters.terminal_whatif import run_lines
    from attnprof.tools import report as rp

    t0 = time.monotonic()
    if bool(args.files) == bool(args.url):
        raise CliError("give one source: --url URL or FILE...")
    if not 0 < args.timeout <= 3600:
        raise CliError("--timeout must be in (0, 3600] seconds")
    check_measure_args(args)
    check_out_dir(args.out)
    g = gather(args)
    settings = Settings(gpu_hour_price=args.gpu_hour_price, autoscaled=args.autoscaled)
    estimate = rp.build_report(g, settings, t0)
    run = measure(g, estimate, args)
    rep = remeasured_report(g, estimate, run, settings, t0)
    ensure_writable_dir(args.out)
    write_atomic(args.out / "whatif.json", json.dumps(run.to_json(), indent=2) + "\n")
    rep.report_seconds = time.monotonic() - t0
    for line in run_lines(run, rep):
        print(line)
    write_report(rep, args.out)
    print(f"  also {args.out / 'whatif.json'} ({run.seconds:.0f} s of measurement)")
    return 0
