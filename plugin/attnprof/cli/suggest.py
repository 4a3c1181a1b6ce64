"""``attnprof suggest-window``: sinks + sliding window advice from real traffic."""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any

from attnprof.cli._common import (
    MAX_LENGTH,
    CliError,
    api_key_arg,
    check_lengths,
    check_out_file,
    int_in_range,
    label_arg,
    read_json,
    resolve_model,
    write_json,
)
from attnprof.exporters.terminal_suggest import render

__all__ = ["add_parser", "load_arch", "load_head_stats", "parse_layers", "read_lengths"]


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "suggest-window",
        help="recommend attention sinks + sliding window from the traffic's context lengths",
        description="Context lengths come from a file, a live attnprof server or Prometheus; "
                    "head statistics (coverage per KV head) come from the server's snapshot, "
                    "a file, or are collected offline with --collect-stats. Savings are "
                    "cost-weighted over requests (ratios of expectations).")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--lengths", type=Path, metavar="FILE",
                     help="one integer context length per line, a JSON list, JSON/CSV "
                          "histogram buckets (le,count), a sketch or a snapshot JSON")
    src.add_argument("--url", help="live attnprof server base URL (GET /attnprof/snapshot)")
    p.add_argument("--api-key", metavar="KEY", default=None, type=api_key_arg,
                   help="with --url: bearer token for the server's /attnprof routes (vLLM's "
                        "--api-key; default $ATTNPROF_API_KEY, then $VLLM_API_KEY)")
    src.add_argument("--prometheus", metavar="URL",
                     help="Prometheus base URL: sums attnprof_request_context_tokens over "
                          "every replica (one query for the fleet)")
    p.add_argument("--prometheus-model", metavar="NAME", type=label_arg,
                   help="only series with this model label")
    p.add_argument("--prometheus-range", metavar="DURATION",
                   help="use increase() over this range (e.g. 1d) instead of totals")
    p.add_argument("--model", default="smollm2",
                   help="checkpoint dir or 'smollm2': layers, heads, head dim, dtype, windows")
    p.add_argument("--window", type=int, help="evaluate this window instead of choosing one")
    p.add_argument("--sinks", type=int, default=None,
                   help="sink tokens s (default 4; with --window: evaluated as given)")
    p.add_argument("--layers", help="layers to window, e.g. '2-29' (default: chosen from head "
                                    "statistics, or every full-attention layer)")
    p.add_argument("--head-stats", type=Path, metavar="FILE",
                   help="head statistics JSON (HeadStatsAccumulator.to_dict, or an object "
                        "with a 'head_stats' key such as a snapshot)")
    p.add_argument("--collect-stats", action="store_true",
                   help="compute head statistics offline by running --prompts through --model")
    p.add_argument("--prompts", type=Path, metavar="FILE",
                   help="prompts for --collect-stats and --validate (one per line or JSON "
                        "list; default: built-in demo-shaped documents)")
    p.add_argument("--stats-out", type=Path, metavar="FILE",
                   help="write the head statistics used to this JSON file")
    p.add_argument("--validate", action="store_true",
                   help="replay --prompts with the suggestion vs full attention (see "
                        "validate-window); 'safe' is printed only when the replay meets its "
                        "target")
    p.add_argument("--tau", type=float, default=0.9,
                   help="coverage target (default 0.9); 1 - tau on the statistics' loss "
                        "edges (e.g. 0.9, 0.95, 0.99) is decided exactly, another tau by "
                        "its histogram bin, which can leave heads undecided")
    p.add_argument("--quantile", type=float, default=0.05,
                   help="low quantile of coverage compared with tau (default 0.05)")
    p.add_argument("--min-exact", type=float, default=0.9,
                   help="without head statistics: share of requests that must stay exact "
                        "(default 0.9)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=_run)


def parse_layers(spec: str | None, n: int) -> list[int] | None:
    """``'0-3,7'`` -> [0, 1, 2, 3, 7] for a model of ``n`` layers; :class:`CliError` (one
    line) for bad syntax, a reversed range or a layer outside 0..n-1. Each range is checked
    against ``n`` before it is expanded, so ``0-10000000000`` costs nothing."""
    if spec is None:
        return None
    shown = spec if len(spec) <= 60 else spec[:57] + "..."
    out: set[int] = set()
    for part in spec.split(","):
        part = part.strip()
        if not part:
            continue
        a, sep, b = part.partition("-")
        try:
            lo = int(a)
            hi = int(b) if sep else lo
        except ValueError:
            raise CliError(f"--layers {shown!r}: expected e.g. '0-3,7'") from None
        if lo > hi:
            raise CliError(f"--layers {shown!r}: range {lo}-{hi} goes downwards")
        if lo < 0 or hi >= n:
            raise CliError(f"--layers {shown!r}: layers must be in 0..{n - 1}")
        out.update(range(lo, hi + 1))
    if not out:
        raise CliError(f"--layers {shown!r}: no layers given")
    return sorted(out)


def load_arch(spec: str) -> Any:
    from attnprof.facts.shape import AttentionShape

    path = resolve_model(spec)
    try:
        arch = AttentionShape.from_model_dir(path, name="smollm2" if spec == "smollm2"
                                             else path.name)
    except (OSError, ValueError, KeyError, TypeError, AttributeError, OverflowError,
            RecursionError) as err:
        raise CliError(f"cannot read the architecture from {path}/config.json: "
                       f"{type(err).__name__}: {err}".splitlines()[0]) from None
    if not isinstance(arch.num_layers, int) or not 0 < arch.num_layers <= 100_000:
        raise CliError(f"{path}/config.json: implausible number of layers {arch.num_layers!r}")
    return arch


def read_lengths(path: Path) -> Any:
    """A ``--lengths`` file as a distribution (every format :func:`read_lengths_file` reads);
    :class:`CliError` (one line) when unreadable, malformed or out of bounds (a length above
    :data:`~attnprof.cli._common.MAX_LENGTH`, a count that is not finite)."""
    from attnprof.analyze.sparsity.inputs import InputError, read_lengths_file

    try:
        dist = read_lengths_file(path)
    except InputError as err:
        raise CliError(str(err)) from None
    except (ValueError, OverflowError, TypeError, AttributeError, RecursionError) as err:
        # numpy refuses a length past int64, a sketch of the wrong shape, JSON nested too deep
        raise CliError(f"{path}: unusable lengths ({type(err).__name__}; lengths must be "
                       f"integers in 1..{MAX_LENGTH})") from None
    return check_lengths(dist, str(path))


def load_head_stats(path: Path) -> Any:
    from attnprof.aggregate.head_strata import HeadStatsStrata
    from attnprof.analyze.sparsity.inputs import head_stats_from_snapshot

    obj = read_json(path)
    if not isinstance(obj, dict):
        raise CliError(f"{path}: expected a JSON object with head statistics")
    try:
        if "schema" not in obj:
            acc = head_stats_from_snapshot(obj)
            if acc is None:
                raise CliError(f"{path}: no head statistics in it")
            return acc
        return HeadStatsStrata.load(obj).total("prefill")  # strata or one accumulator
    except (KeyError, TypeError, ValueError, IndexError, AttributeError, OverflowError,
            MemoryError) as err:
        # The accumulator reads arrays and shapes from the file: any of them can be wrong.
        msg = str(err).splitlines()[0][:200] if str(err) else ""
        raise CliError(f"{path}: invalid head statistics ({type(err).__name__}"
                       f"{': ' + msg if msg else ''})") from None


def _distribution(args: argparse.Namespace) -> tuple[Any, Any, Any]:
    """(LengthDistribution, head statistics from the source or None, (strata, per-bucket
    request counts) from a live snapshot or None)."""
    from attnprof.analyze.sparsity.inputs import (
        InputError,
        from_snapshot,
        head_stats_from_snapshot,
        strata_from_snapshot,
    )
    from attnprof.contracts.snapshot import ContextBuckets

    if args.lengths is not None:
        return read_lengths(args.lengths), None, None
    source = args.url if args.url is not None else args.prometheus
    try:
        if args.url is not None:
            from attnprof.cli.snapshot import fetch_snapshot

            snap = fetch_snapshot(args.url, api_key=args.api_key, head_stats=True)
            if snap.get("head_stats") is None and snap.get("truncated"):
                # Never a silent recommendation without the statistics it is asked to use.
                raise CliError(f"{args.url}: the server left the head statistics out "
                               f"({snap['truncated']}); raise ATTNPROF_SNAPSHOT_MAX_BYTES on "
                               "the server")
            dist = from_snapshot(snap, source=args.url)
            strata = strata_from_snapshot(snap)
            # Only the per-bucket counts: a snapshot from before 1.9 has none, and its
            # requests section may lack fields that version did not have yet.
            cb = (snap.get("requests") or {}).get("context_buckets")
            buckets = ContextBuckets.from_json(cb) if isinstance(cb, dict) else None
            return (check_lengths(dist, source), head_stats_from_snapshot(snap),
                    None if strata is None else (strata, buckets))
        from attnprof.tools.prometheus_query import query_prometheus

        dist = query_prometheus(args.prometheus, model=args.prometheus_model,
                                range_=args.prometheus_range)
        return check_lengths(dist, source), None, None
    except InputError as err:
        raise CliError(str(err)) from None
    except (ValueError, OverflowError, TypeError, AttributeError, IndexError) as err:
        raise CliError(f"{source}: bad length distribution ({type(err).__name__})") from None


def _thresholds(args: argparse.Namespace, sinks: int, stats: Any) -> Any:
    from attnprof.analyze.sparsity.classify import Thresholds

    return Thresholds(tau=args.tau, quantile=args.quantile,
                      sinks=sinks if stats is None or sinks in stats.sinks_grid else 4)


def _collect(args: argparse.Namespace, sinks: int) -> tuple[Any, dict[str, Any]]:
    """(head statistics of the prompts, the refinement report): the sampled pass, then the
    KV heads it leaves undecided are decided on every query (their layers rerun exactly)."""
    from attnprof.tools.replay import (
        ReplayError,
        collect_head_stats,
        default_prompts,
        load_model,
        read_prompts,
        refine_head_stats,
    )

    try:
        model, tok, _ = load_model(str(resolve_model(args.model)))
        prompts = read_prompts(args.prompts) if args.prompts else default_prompts(tok)
        print(f"attnprof: collecting head statistics on {len(prompts)} prompts",
              file=sys.stderr)
        acc = collect_head_stats(model, tok, prompts)
        refined = refine_head_stats(model, tok, prompts, acc, _thresholds(args, sinks, acc))
        if refined["layers"]:
            print(f"attnprof: {sum(refined['undecided_before'].values())} undecided KV-head "
                  f"windows decided on every query ({len(refined['layers'])} layers rerun, "
                  f"{refined['seconds']:.1f} s)", file=sys.stderr)
        return acc, refined
    except ReplayError as err:
        raise CliError(str(err)) from None


def _validate(args: argparse.Namespace, out: dict[str, Any]) -> dict[str, Any] | None:
    from attnprof.tools.replay import (
        ReplayError,
        default_prompts,
        load_model,
        read_prompts,
        replay,
    )

    if not out["layers"]:
        return None  # nothing windowed: nothing to replay
    try:
        model, tok, _ = load_model(str(resolve_model(args.model)))
        prompts = read_prompts(args.prompts) if args.prompts else default_prompts(tok)
        print(f"attnprof: replaying {len(prompts)} prompts with the suggestion",
              file=sys.stderr)
        return replay(model, tok, prompts, out["window"], out["sinks"], layers=out["layers"])
    except ReplayError as err:
        raise CliError(str(err)) from None


def _run(args: argparse.Namespace) -> int:
    from attnprof.analyze.sparsity.recommend import evaluate, recommend

    if args.window is not None:
        int_in_range(args.window, "--window", 1, MAX_LENGTH)
    if args.sinks is not None:
        int_in_range(args.sinks, "--sinks", 0, MAX_LENGTH)
    check_thresholds(args.tau, args.quantile, args.min_exact)
    if args.api_key is not None and args.url is None:
        raise CliError("--api-key goes with --url (the attnprof server)")
    if (args.prometheus_range is not None or args.prometheus_model is not None) \
            and args.prometheus is None:
        raise CliError("--prometheus-range and --prometheus-model go with --prometheus")
    _check_source(args)
    if args.prompts is not None:
        _check_prompts(args)
    if args.stats_out is not None:
        check_out_file(args.stats_out, "--stats-out")
    arch = load_arch(args.model)
    layers = parse_layers(args.layers, arch.num_layers)
    dist, stats, live = _distribution(args)
    if args.head_stats is not None:
        stats, live = load_head_stats(args.head_stats), None
    sinks = 4 if args.sinks is None else args.sinks
    refinement = None
    if args.collect_stats:
        stats, refinement = _collect(args, sinks)
        live = None
    if stats is not None and (stats.num_layers, stats.num_q_heads) != (arch.num_layers,
                                                                        arch.num_heads):
        raise CliError(f"head statistics are for {stats.num_layers} layers x "
                       f"{stats.num_q_heads} heads, the model has {arch.num_layers} x "
                       f"{arch.num_heads}")
    th = _thresholds(args, sinks, stats)
    if args.window is not None:
        out = evaluate(dist, arch, args.window, sinks, head_stats=stats, thresholds=th,
                       layers=layers).to_json()
        out["basis"] = "evaluated as given (--window/--sinks)"
    elif live is not None:  # a live server's strata: weighted to its traffic, stable heads
        from attnprof.analyze.sparsity.strata_advice import recommend_strata

        out = recommend_strata(dist, arch, dict(live[0].items()), live[1], thresholds=th,
                               sinks=sinks).recommendation.to_json()
    else:
        out = recommend(dist, arch, stats, sinks=sinks, thresholds=th,
                        min_exact=args.min_exact).to_json()
        if layers is not None:  # user-fixed layers: re-score the chosen window on them
            keep = {k: out[k] for k in ("pareto", "per_layer", "classification",
                                        "head_level_split", "dynamic_sparse_prefill",
                                        "native_windows", "basis", "undecided")}
            out = evaluate(dist, arch, out["window"], sinks, head_stats=stats, thresholds=th,
                           layers=layers).to_json() | keep
    out["refinement"] = refinement
    out["replay"] = _validate(args, out) if args.validate else None
    out["safe"] = bool(out["replay"] and out["replay"]["safe"])
    if args.stats_out is not None and stats is not None:
        write_json(args.stats_out, stats.to_dict())
    if args.json:
        print(json.dumps(out, indent=2, default=_jsonable))
    else:
        print(render(out), end="")
    return 0


def _check_source(args: argparse.Namespace) -> None:
    """The --url / --prometheus flags, before the model is read."""
    from attnprof.analyze.sparsity.inputs import InputError
    from attnprof.tools import http
    from attnprof.tools.prometheus_query import query_url
    from attnprof.tools.report_prometheus import range_seconds
    from attnprof.tools.report_sources import ReportInputError

    try:
        if args.prometheus is not None:
            query_url(args.prometheus, args.prometheus_model, args.prometheus_range)
            if args.prometheus_range is not None:  # 0s, 500ms: Prometheus would refuse it
                range_seconds(args.prometheus_range, "--prometheus-range")
        if args.url is not None:
            http.check_url(args.url)
            http.resolve_api_key(args.api_key)
    except (InputError, http.HttpError, ReportInputError) as err:
        raise CliError(str(err)) from None


def _check_prompts(args: argparse.Namespace) -> None:
    """--prompts: only with what reads it, and read now, not after the model has loaded."""
    from attnprof.tools.replay import ReplayError, read_prompts

    if not (args.collect_stats or args.validate):
        raise CliError("--prompts goes with --collect-stats or --validate")
    try:
        read_prompts(args.prompts)
    except ReplayError as err:
        raise CliError(str(err)) from None


def check_thresholds(tau: float, quantile: float, min_exact: float) -> None:
    """--tau in (0, 1], --quantile in [0, 1), --min-exact in [0, 1]; NaN is refused."""
    ok = (math.isfinite(tau) and 0 < tau <= 1 and math.isfinite(quantile)
          and 0 <= quantile < 1 and math.isfinite(min_exact) and 0 <= min_exact <= 1)
    if not ok:
        raise CliError("--tau must be in (0, 1], --quantile in [0, 1) and --min-exact in "
                       "[0, 1]")


def _jsonable(x: Any) -> Any:
    try:
        return float(x)
    except (TypeError, ValueError):
        return str(x)
