"""What ``attnprof whatif`` and ``attnprof report --validate`` share: the measured-run flags
(checked before any work), the run on real vLLM servers, and the report again with each
measured what-if's money from the run and its predictions beside the measurements."""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path
from typing import Any

from attnprof.cli._common import (
    CliError,
    StopSignals,
    check_out_dir,
    int_arg,
    int_in_range,
    out_dir_arg,
    parse_seconds,
    progress_bar,
    resolve_model,
)

__all__ = ["MEASURABLE", "add_measure_flags", "check_measure_args", "measure",
           "measure_flags_given", "remeasured_report"]

DEFAULT_ROUNDS = 4
DEFAULT_DURATION = "8s"
MEASURABLE = ("window", "fp8_kv", "max_model_len")
"""The what-ifs a flag can apply (head-level windows and fused-kernel fallbacks need a change
no flag gives)."""
_CHANGES = ("fp8_kv", "window", "custom")
"""What-ifs whose outputs can differ from the baseline's: agreement is measured for them."""


def add_measure_flags(p: argparse.ArgumentParser) -> None:
    """The flags of a measured run (shared by ``whatif`` and ``report --validate``)."""
    p.add_argument("--checkpoint", default=None, metavar="DIR",
                   help="the served checkpoint: a directory or 'smollm2' (default: the "
                        "record's model path when it is a local directory)")
    p.add_argument("--only", action="append", default=[], choices=MEASURABLE,
                   help="measure only this what-if; repeatable (default: every one the "
                        "report can apply with a flag)")
    p.add_argument("--variant", action="append", default=[], metavar="FLAGS",
                   help="also measure these vLLM flags (e.g. \"--kv-cache-dtype fp8_e5m2\"); "
                        "repeatable")
    p.add_argument("--baseline-args", default="", metavar="ARGS",
                   help="extra vLLM flags of both servers, as the recorded server ran "
                        "(default: only its --max-model-len)")
    p.add_argument("--rounds", type=int_arg(1, 50), default=DEFAULT_ROUNDS,
                   help=f"paired rounds per what-if (default {DEFAULT_ROUNDS})")
    p.add_argument("--duration", default=DEFAULT_DURATION,
                   help=f"traffic per arm per round, e.g. 8s, 1m (default {DEFAULT_DURATION})")
    p.add_argument("--concurrency", type=int_arg(1, 256), default=None,
                   help="requests in flight (default: the record's mean running requests)")
    p.add_argument("--seed", type=int, default=0, help="traffic seed (default 0)")
    p.add_argument("--keep-logs", type=out_dir_arg, default=None, metavar="DIR",
                   help="keep each vLLM server's log here (default: a temporary directory, "
                        "removed; vLLM's logs echo its arguments, secrets included)")


def measure_flags_given(args: argparse.Namespace) -> list[str]:
    """The measured-run flags set to something other than their default (the defaults as
    :func:`add_measure_flags` declares them)."""
    p = argparse.ArgumentParser(add_help=False)
    add_measure_flags(p)
    return ["--" + k.replace("_", "-") for k, v in vars(p.parse_args([])).items()
            if getattr(args, k) != v]


def check_measure_args(args: argparse.Namespace) -> None:
    """Every measured-run flag, before anything is read or started: sets ``duration_s``,
    ``base_args`` and ``ckpt`` (None: from the record) on ``args``; :class:`CliError`."""
    from attnprof.tools.whatif import variant_args

    args.duration_s = parse_seconds(args.duration, "--duration")
    int_in_range(args.seed, "--seed", 0, 2**32 - 1)
    try:
        args.base_args = variant_args([args.baseline_args]) if args.baseline_args.strip() \
            else []
    except ValueError as err:
        raise CliError(f"--baseline-args: {err}") from None
    for flags in args.variant:
        try:
            variant_args([flags])
        except ValueError as err:
            raise CliError(f"--variant: {err}") from None
    args.ckpt = resolve_model(args.checkpoint) if args.checkpoint is not None else None
    if args.keep_logs is not None:
        check_out_dir(args.keep_logs, "--keep-logs")


def _variants(m: Any, only: list[str], extra: list[str]) -> list[Any]:
    from attnprof.tools.whatif import Variant

    out = []
    known = {w.id for w in m.what_ifs}
    missing = [o for o in only if o not in known]
    if missing:
        raise CliError(f"--only {missing[0]}: this report has no such what-if on this traffic "
                       f"(it has: {', '.join(sorted(known)) or 'none'})")
    for w in m.what_ifs:
        if only and w.id not in only:
            continue
        if not w.apply.flags or w.apply.supported is False \
                or any("..." in f for f in w.apply.flags):
            continue
        out.append(Variant(w.id, list(w.apply.flags), w.id in _CHANGES))
    for i, flags in enumerate(extra):
        out.append(Variant("custom" if i == 0 else f"custom-{i + 1}", [flags], True))
    return out


def _checkpoint(given: Path | None, g: Any) -> Path:
    if given is not None:
        return given
    prov = g.provenance
    path = prov.model.path if prov is not None and prov.model.path else None
    if path and Path(path).is_dir() and (Path(path) / "config.json").is_file():
        return Path(path)
    raise CliError("give --checkpoint DIR (or 'smollm2'): the record does not name a local "
                   "checkpoint directory to serve")


def measure(g: Any, rep: Any, args: argparse.Namespace) -> Any:
    """Run the what-ifs of ``rep``'s model on real servers; the run (``WhatifRun``).
    :class:`CliError` (one line) for anything wrong, checked before any server starts."""
    from attnprof.analyze.whatif import shape_from_report
    from attnprof.tools.whatif import RunConfig, WhatifError, run_whatifs

    if len(rep.models) != 1:
        raise CliError(f"the source holds {len(rep.models)} models; a measured run takes one "
                       "(with --prometheus: --model LABEL)")
    m = rep.models[0]
    duration = args.duration_s
    base_args = list(args.base_args)
    variants = _variants(m, args.only, args.variant)
    if not variants:
        raise CliError("nothing to measure: no what-if of this report has a flag the "
                       "installed vLLM accepts (give --variant FLAGS to measure your own)")
    mml = m.traffic.max_model_len
    if mml is None:
        raise CliError("the source has no max_model_len: give --baseline-args "
                       "'--max-model-len N'")
    if "--max-model-len" not in base_args:
        base_args = ["--max-model-len", str(mml), *base_args]
    try:
        shape = shape_from_report(m.traffic, m.kv, ", ".join(rep.source.where), mml,
                                  args.concurrency)
    except ValueError as err:
        raise CliError(str(err)) from None
    ckpt = _checkpoint(args.ckpt, g)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(ckpt)
    units = 1 + sum(1 + args.rounds * 2 + int(v.outputs_change) for v in variants)
    names = ", ".join(v.what_if for v in variants)
    print(f"attnprof: measuring {len(variants)} what-if(s) ({names}) in {args.rounds} "
          f"paired rounds of {duration:g} s per arm, concurrency "
          f"{shape.concurrency}", file=sys.stderr)
    bar = progress_bar(units, "whatif", unit="step")
    with tempfile.TemporaryDirectory(prefix="attnprof-whatif-") as tmp, \
            StopSignals() as stop:
        logs = args.keep_logs or Path(tmp)
        logs.mkdir(parents=True, exist_ok=True)
        cfg = RunConfig(model_dir=ckpt, baseline_args=base_args, rounds=args.rounds,
                        duration_s=duration, seed=args.seed, log_dir=logs)

        def tick(msg: str) -> None:
            bar.set_postfix_str(msg[:40])
            bar.update(1)

        try:
            run = run_whatifs(cfg, shape, variants, tok, progress=tick,
                              stop=lambda: stop.requested)
        except WhatifError as err:
            raise CliError(str(err)) from None
        finally:
            bar.close()
    run.provenance = g.provenance
    return run


def remeasured_report(g: Any, rep: Any, run: Any, settings: Any, t0: float) -> Any:
    """The report again with each measured what-if's money computed from the run (its
    evidence ``measured``), each what-if carrying its predictions beside the measurements
    (the predictions are those of ``rep``, the estimate)."""
    from attnprof.analyze.cost import Measured
    from attnprof.analyze.whatif import validate
    from attnprof.tools import report as rp

    m = rep.models[0]
    est = {w.id: w for w in m.what_ifs}
    measured = {}
    for res in run.variants:
        tps = res.changes.get("tokens_per_s")
        if res.what_if not in est or res.status != "measured" or tps is None:
            continue
        kv = (1.0 - res.baseline_kv_capacity_tokens / res.kv_capacity_tokens
              if res.kv_capacity_tokens and res.baseline_kv_capacity_tokens else None)
        measured[res.what_if] = Measured(
            time_saving=1.0 - 1.0 / (1.0 + tps.mean) if tps.mean > -1 else -1.0,
            kv_saving=kv,
            detail=f"measured on real vLLM servers: throughput {tps.mean:+.1%} "
                   f"[{tps.low:+.1%}, {tps.high:+.1%}] over {tps.rounds} paired rounds"
                   + (f", KV capacity {res.kv_capacity_tokens:,} vs "
                      f"{res.baseline_kv_capacity_tokens:,} tokens (vLLM's figures)"
                      if res.kv_capacity_tokens and res.baseline_kv_capacity_tokens else ""))
    g.inputs[0].measured = measured
    out = rp.build_report(g, settings, t0)
    by_id = {w.id: w for w in out.models[0].what_ifs}
    for res in run.variants:
        if res.what_if in est and res.what_if in by_id:
            by_id[res.what_if].validation = validate(est[res.what_if], m.time, res,
                                                     "this run", run)
    return out


