"""What ``attnprof whatif`` and ``attnprof report --validate`` share: the measured-run flags
(checked before any work), the run on real vLLM servers (the baseline with the recorded
server's own engine flags, an A/A control, instance pairs, rounds sized by ``--mde``), and the
report again with each measured what-if's money from the run (its interval, verdict, and
whether the measurement is the fleet's setup at all) and its predictions beside the
measurements."""

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

__all__ = ["MEASURABLE", "add_measure_flags", "baseline_args", "check_measure_args", "measure",
           "measure_flags_given", "remeasured_report"]

DEFAULT_ROUNDS = 4
DEFAULT_DURATION = "8s"
DEFAULT_MAX_ROUNDS = 12
DEFAULT_INSTANCES = 2
"""Instance pairs per arm: one pair gives the noise floor one degree of freedom (the A/A's
offset alone), two give every arm one more (docs/report.md, "Instances")."""
DEVICE_PLANS = ("auto", "side_by_side", "turns")
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
                   help="vLLM flags added to (or overriding) the recorded server's own engine "
                        "flags, for both servers (default: the record's flags as its "
                        "provenance holds them; its --max-model-len when none)")
    p.add_argument("--rounds", type=int_arg(1, 50), default=DEFAULT_ROUNDS,
                   help=f"paired rounds per what-if (default {DEFAULT_ROUNDS}; with --mde the "
                        f"pilot sizes them)")
    p.add_argument("--mde", type=float, default=None, metavar="X",
                   help="size the rounds to detect a throughput change of X (a share, e.g. "
                        "0.05 for 5%%) from a pilot of the first arm's rounds; the MDE the "
                        "run reached is printed")
    p.add_argument("--max-rounds", type=int_arg(2, 50), default=DEFAULT_MAX_ROUNDS,
                   help=f"cap on the rounds --mde asks for (default {DEFAULT_MAX_ROUNDS})")
    p.add_argument("--instances", type=int_arg(1, 8), default=DEFAULT_INSTANCES, metavar="K",
                   help="fresh baseline/variant instance pairs per what-if (rounds split "
                        "between them), so intervals cover instance-to-instance spread "
                        f"(default {DEFAULT_INSTANCES}: each arm then sees that spread "
                        "itself, besides the A/A arm)")
    p.add_argument("--no-aa", dest="aa", action="store_false",
                   help="skip the A/A control arm (a second baseline instance measured like "
                        "a variant: the run's noise floor)")
    p.add_argument("--device-plan", choices=DEVICE_PLANS, default="auto",
                   help="side_by_side: baseline and variant up at once (CPU); turns: one "
                        "server at a time, each turn a fresh instance (a GPU, where the "
                        "baseline takes the device's memory); default auto")
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
    if args.mde is not None and not 0 < args.mde < 1:  # NaN fails both: refused
        raise CliError(f"--mde must be a share in (0, 1) (0.05 for 5%), got {args.mde}")
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


def baseline_args(g: Any, mml: int | None, given: list[str]) -> tuple[list[str], str]:
    """The baseline's vLLM flags: the recorded server's engine flags (its provenance), its
    max_model_len when they do not carry one, then ``--baseline-args`` (later words win, as
    vLLM's parser reads them); with where they came from, in words.
    :class:`CliError` when no max_model_len is known."""
    from attnprof.tools.whatif import recorded_setup

    setup = recorded_setup(g.provenance)
    args = list(setup.args)
    basis = setup.basis
    if not any(a == "--max-model-len" or a.startswith("--max-model-len=")
               for a in [*args, *given]):
        if mml is None:
            raise CliError("the source has no max_model_len: give --baseline-args "
                           "'--max-model-len N'")
        args = ["--max-model-len", str(mml), *args]
        basis += f"; --max-model-len {mml} from the record's traffic"
    if given:
        basis += "; --baseline-args on top"
    return [*args, *given], basis


def measure(g: Any, rep: Any, args: argparse.Namespace) -> Any:
    """Run the what-ifs of ``rep``'s model on real servers; the run (``WhatifRun``, with
    this run's own provenance and hardware beside the record's). :class:`CliError` (one
    line) for anything wrong, checked before any server starts."""
    from attnprof.analyze.whatif import shape_from_report
    from attnprof.tools.provenance import collect, run_hardware
    from attnprof.tools.server import on_cpu
    from attnprof.tools.whatif import (
        RunConfig,
        WhatifError,
        int_flag,
        planned_units,
        run_whatifs,
        served_dtype,
    )

    if len(rep.models) != 1:
        raise CliError(f"the source holds {len(rep.models)} models; a measured run takes one "
                       "(with --prometheus: --model LABEL)")
    m = rep.models[0]
    duration = args.duration_s
    variants = _variants(m, args.only, args.variant)
    if not variants:
        raise CliError("nothing to measure: no what-if of this report has a flag the "
                       "installed vLLM accepts (give --variant FLAGS to measure your own)")
    base_args, basis = baseline_args(g, m.traffic.max_model_len, list(args.base_args))
    mml = int_flag(base_args, "--max-model-len")
    if mml is None:
        raise CliError("--max-model-len must be an integer (the recorded flags or "
                       "--baseline-args)")
    try:
        shape = shape_from_report(m.traffic, m.kv, ", ".join(rep.source.where), mml,
                                  args.concurrency)
    except ValueError as err:
        raise CliError(str(err)) from None
    ckpt = _checkpoint(args.ckpt, g)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(ckpt)
    cpu = on_cpu()
    plan = args.device_plan if args.device_plan != "auto" else \
        ("side_by_side" if cpu else "turns")
    instances = args.instances
    names = ", ".join(v.what_if for v in variants)
    print(f"attnprof: measuring {len(variants)} what-if(s) ({names})"
          f"{' and an A/A control' if args.aa else ''}, "
          + (f"rounds sized for an MDE of {args.mde:.1%} (at most {args.max_rounds})"
             if args.mde is not None else f"{args.rounds} paired rounds")
          + f" of {duration:g} s per arm on {instances} instance pair(s) each ({plan}), "
          f"concurrency {shape.concurrency}; baseline: {basis}", file=sys.stderr)
    with tempfile.TemporaryDirectory(prefix="attnprof-whatif-") as tmp, \
            StopSignals() as stop:
        logs = args.keep_logs or Path(tmp)
        logs.mkdir(parents=True, exist_ok=True)
        cfg = RunConfig(model_dir=ckpt, baseline_args=base_args, rounds=args.rounds,
                        duration_s=duration, seed=args.seed, log_dir=logs,
                        instances=instances, control=args.aa, mde=args.mde,
                        max_rounds=max(args.max_rounds, args.rounds if args.mde is None
                                       else 2),
                        device_plan=plan)
        bar = progress_bar(planned_units(cfg, variants), "whatif", unit="step")

        def tick(msg: str) -> None:
            bar.set_postfix_str(msg[:40])
            bar.update(1)

        try:
            run = run_whatifs(cfg, shape, variants, tok, progress=tick,
                              stop=lambda: stop.requested,
                              say=lambda line: bar.write(f"attnprof: {line}", file=sys.stderr))
        except WhatifError as err:
            raise CliError(str(err)) from None
        finally:
            bar.close()
    run.source_provenance = g.provenance
    run.provenance = collect(run.model, ckpt)
    run.hardware = run_hardware(served_dtype(base_args, ckpt, cpu))
    run.baseline_basis = basis
    return run


def _agreement_ok(res: Any) -> bool | None:
    """False when the measured greedy agreement (per token, to each prompt's first
    divergence) is below the window replay's target: the what-if is then not ranked as a
    saving. None when it was not measured."""
    from attnprof.analyze.measure_stats import agreement_interval
    from attnprof.tools.replay import TARGET_AGREEMENT

    a = res.agreement
    if a is None or not a.positions:
        return None
    per_token = (agreement_interval(a.diverged_at, a.compared_tokens).per_token
                 if a.diverged_at else a.greedy_agreement)
    return per_token is not None and per_token >= TARGET_AGREEMENT


def _saving(change: float) -> float:
    """The time saving of a throughput change: 1 - 1 / (1 + change) (rising with it)."""
    return 1.0 - 1.0 / (1.0 + change) if change > -1 else -1.0


def measurements(run: Any, est: dict[str, Any], time: Any
                 ) -> tuple[dict[str, Any], dict[str, Any], Any]:
    """(validation per what-if, ``Measured`` per what-if, the A/A arm's validation or
    None) of a run against the estimate's what-ifs ``est`` (id -> WhatIf) and its time
    breakdown: what :func:`remeasured_report` builds the report from (pure)."""
    from attnprof.analyze.cost import Measured
    from attnprof.analyze.whatif import noise_floor, validate, validate_control
    from attnprof.tools.whatif import mismatch, recorded_setup

    differs = mismatch(run, recorded_setup(run.source_provenance))
    validations = {res.what_if: validate(est[res.what_if], time, res, "this run", run)
                   for res in run.variants if res.what_if in est and not res.control}
    control = next((r for r in run.variants if r.control), None)
    floor = validate_control(control, "this run", run) if control is not None else None
    # No money from an interval the run cannot stand behind: without a noise floor (no A/A
    # arm, no replicated instances) the throughput interval covers round noise only, and
    # with the A/A arm off the floor itself is understated.
    floorless = noise_floor(run)[1] == 0
    aa_off = floor is not None and floor.verdict == "off"
    if aa_off:
        for v in validations.values():
            v.verdict, v.off = "inconclusive", False
    measured = {}
    for res in run.variants:
        if res.what_if not in est or res.control:
            continue
        v = validations[res.what_if]
        tps = next((c for c in v.checks if c.metric == "tokens_per_s"), None)
        if res.status != "measured" or tps is None or tps.measured is None:
            measured[res.what_if] = Measured(
                time_saving=0.0, kv_saving=None,
                status="failed" if res.status == "measured" else res.status,
                detail=f"{res.status.replace('_', ' ')}: {res.reason or 'no throughput'}",
                comparable=not differs, mismatch=differs)
            continue
        kv = (1.0 - res.baseline_kv_capacity_tokens / res.kv_capacity_tokens
              if res.kv_capacity_tokens and res.baseline_kv_capacity_tokens else None)
        # One round, no noise floor, or an A/A arm off: no interval to bank (banks 0).
        banked = res.rounds >= 2 and not floorless and not aa_off
        low, high = (tps.low, tps.high) if banked else (None, None)
        measured[res.what_if] = Measured(
            time_saving=_saving(tps.measured), kv_saving=kv,
            time_saving_low=_saving(low) if low is not None else None,
            time_saving_high=_saving(high) if high is not None else None,
            verdict=v.verdict, status="measured", agreement_ok=_agreement_ok(res),
            comparable=not differs, mismatch=differs,
            detail=f"measured on real vLLM servers: throughput {tps.measured:+.1%}"
                   + (f" [{low:+.1%}, {high:+.1%}]" if low is not None and high is not None
                      else " (no interval: the A/A arm is off)" if aa_off
                      else " (no interval: no noise floor, no A/A arm or replicated "
                           "instances)" if floorless and res.rounds >= 2
                      else " (no interval: one round)")
                   + f" over {res.rounds} paired rounds on {res.instances} instance pair(s)"
                   + (f", KV capacity {res.kv_capacity_tokens:,} vs "
                      f"{res.baseline_kv_capacity_tokens:,} tokens (vLLM's figures)"
                      if res.kv_capacity_tokens and res.baseline_kv_capacity_tokens else ""))
    return validations, measured, floor


def remeasured_report(g: Any, rep: Any, run: Any, settings: Any, t0: float) -> Any:
    """The report again with each measured what-if's money computed from the run (its
    evidence ``measured``), each what-if carrying its predictions beside the measurements
    (the predictions are those of ``rep``, the estimate), and the A/A arm as the model's
    noise floor. The throughput change and its interval are the validation's own (the
    run's noise floor included); money banks them only when the measurement is the fleet's
    setup (:func:`attnprof.tools.whatif.mismatch` empty), else it is passed as not
    comparable, shown beside the estimate. Variants that could not start or failed are
    passed too: never ranked."""
    from attnprof.tools import report as rp

    m = rep.models[0]
    validations, measured, floor = measurements(run, {w.id: w for w in m.what_ifs}, m.time)
    g.inputs[0].measured = measured
    out = rp.build_report(g, settings, t0)
    model = out.models[0]
    by_id = {w.id: w for w in model.what_ifs}
    for wid, val in validations.items():
        if wid in by_id:
            by_id[wid].validation = val
    model.noise_floor = floor
    return out
