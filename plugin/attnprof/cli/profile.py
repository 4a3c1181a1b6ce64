"""``attnprof profile MODEL``: kernel map, per-layer time and memory, scaling fits, OOM
prediction and advice for a Hugging Face checkpoint (or the embedded ``smollm2``).

Writes, only when the whole run succeeded: ``profile.json`` (an ``attnprof.profile``
document, :class:`attnprof.contracts.profile.ProfileReport`; schema in
docs/schema/profile.schema.json), ``trace.json`` (Chrome/Perfetto trace with the
``attn::L{layer}::{backend}`` ranges), ``scaling.png`` and the kernel activation map as
``activation_map.png`` / ``activation_map.svg``; with ``--tensorboard DIR`` also one
TensorBoard event file in DIR. ``--show FILE`` prints the summary of a profile.json written
before.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import tempfile
import time
from pathlib import Path
from typing import Any

from attnprof.cli._common import (
    MAX_LENGTH,
    CliError,
    ensure_writable_dir,
    int_in_range,
    out_dir_arg,
    progress_bar,
    read_json,
    require_module,
    resolve_model,
    write_atomic,
)
from attnprof.contracts.base import ContractError
from attnprof.contracts.profile import ProfileReport
from attnprof.exporters.scaling_plot import scaling_png
from attnprof.exporters.terminal_profile import summary

__all__ = ["add_parser", "parse_bytes", "parse_seq_lens", "read_profile", "show_profile"]

_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3,
          "gb": 1000**3, "t": 1000**4, "tb": 1000**4, "kib": 1 << 10, "mib": 1 << 20,
          "gib": 1 << 30, "tib": 1 << 40}


MAX_BYTES = 1 << 60
"""Largest --memory-budget (1 EiB): anything above is a typo, and stays an exact int."""
MAX_SEQ_LENS = 64


def parse_bytes(text: str) -> int:
    """``24GiB``, ``500MB``, ``8e9`` -> bytes; :class:`CliError` (one line) for anything
    else, zero, or more than :data:`MAX_BYTES`."""
    shown = text if len(text) <= 40 else text[:37] + "..."
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE]\+?[0-9]+)?)\s*([a-zA-Z]*)\s*", text,
                     flags=re.ASCII)
    if not m or m.group(2).lower() not in _UNITS:
        raise CliError(f"--memory-budget {shown!r} is not a size (e.g. 24GiB, 500MiB, 8e9)")
    number = float(m.group(1)) * _UNITS[m.group(2).lower()]
    if not math.isfinite(number) or number > MAX_BYTES:
        raise CliError(f"--memory-budget {shown!r} is too large (at most {MAX_BYTES} bytes)")
    value = int(number)
    if value <= 0:
        raise CliError(f"--memory-budget must be positive, got {shown!r}")
    return value


def parse_seq_lens(text: str) -> list[int]:
    """``512,1024`` -> sorted distinct lengths in 1..MAX_LENGTH (at most 64 of them)."""
    out = []
    for part in text.split(","):
        part = part.strip()
        if not part.isascii() or not part.isdigit() or len(part) > 12:
            raise CliError(f"--seq-lens: {part[:20]!r} is not a positive integer")
        n = int(part)
        if not 0 < n <= MAX_LENGTH:
            raise CliError(f"--seq-lens: lengths must be in 1..{MAX_LENGTH}, got {n}")
        out.append(n)
    if len(set(out)) > MAX_SEQ_LENS:
        raise CliError(f"--seq-lens: at most {MAX_SEQ_LENS} lengths")
    return sorted(set(out))


def add_parser(sub: Any) -> None:
    p = sub.add_parser("profile", help="profile a HF model's attention: kernels and reasons, "
                                       "per-layer time/memory, scaling, OOM prediction, advice")
    p.add_argument("model", metavar="MODEL", nargs="?",
                   help="local HF checkpoint directory or 'smollm2'")
    p.add_argument("--show", type=Path, metavar="PROFILE_JSON",
                   help="print the summary of an existing profile.json instead of profiling")
    p.add_argument("--seq-lens", default="512,1024,2048,4096",
                   help="comma-separated prefill lengths (default 512,1024,2048,4096)")
    p.add_argument("--batch-size", type=int, default=1, help="batch size (default 1)")
    p.add_argument("--memory-budget", default="24GiB",
                   help="memory budget for the OOM prediction (default 24GiB)")
    p.add_argument("--out", type=out_dir_arg, default=Path("attnprof-out/profile"),
                   help="output directory (default attnprof-out/profile)")
    p.add_argument("--attn-implementation", default=None,
                   help="override the model's attention implementation (sdpa, eager, ...)")
    p.add_argument("--train", action="store_true",
                   help="profile in training mode (dropout active), as fine-tuning runs it")
    p.add_argument("--attention-dropout", type=float, default=None, metavar="P",
                   help="override the config's attention dropout (in [0, 1); acts with --train)")
    p.add_argument("--repeats", type=int, default=2, help="timed runs per length (default 2)")
    p.add_argument("--paths", default="flash_cpu,math,eager",
                   help="attention paths to micro-benchmark (default flash_cpu,math,eager)")
    p.add_argument("--no-validate", action="store_true",
                   help="do not run at the predicted maximum length")
    p.add_argument("--lengths", type=Path, default=None,
                   help="context lengths of your traffic (any suggest-window --lengths format): "
                        "adds a sliding-window suggestion (window_advice) to profile.json")
    p.add_argument("--head-stats", type=Path, default=None,
                   help="head statistics JSON (a snapshot or HeadStatsAccumulator) for "
                        "window_advice; without it the advice is traffic-only")
    p.add_argument("--validate-max-seconds", type=float, default=120.0,
                   help="run the validation only if its forward is predicted under this")
    p.add_argument("--tensorboard", type=out_dir_arg, metavar="DIR", default=None,
                   help="also write a TensorBoard event file in DIR: per-layer time, fused "
                        "fraction, attention share, window savings, the kernel map and plots")
    p.set_defaults(func=_run)


def read_profile(path: Path) -> ProfileReport:
    """A profile.json (any 1.x); :class:`CliError` (one line) when it is unreadable, another
    kind of document, another major version or malformed."""
    data = read_json(path)
    try:
        return ProfileReport.from_json(data)
    except ContractError as err:
        raise CliError(f"{path}: {err}") from None


def show_profile(path: Path) -> str:
    """``--show``: the summary of a profile.json; :class:`CliError` (one line) when the file
    is unreadable, not a profile, or holds values the summary cannot show."""
    rep = read_profile(path)
    try:
        return summary(rep, path.parent)
    except (KeyError, TypeError, ValueError, ZeroDivisionError, OverflowError) as err:
        raise CliError(f"{path}: inconsistent profile ({type(err).__name__}: "
                       f"{str(err)[:100]})".replace("\n", " ")) from None


def _write_events(logdir: Path, result: ProfileReport, kernel_map: str,
                  images: dict[str, bytes]) -> Path:
    """The profile's TensorBoard event file, written aside and moved into ``logdir`` whole
    (TensorBoard may be watching the directory)."""
    from attnprof.exporters.tensorboard import write_profile_events

    logdir = ensure_writable_dir(logdir)
    with tempfile.TemporaryDirectory(prefix=".attnprof-", dir=logdir) as tmp:
        try:
            path = write_profile_events(Path(tmp), result, kernel_map, images, time.time())
            final = logdir / path.name
            path.replace(final)
        except OSError as err:
            raise CliError(f"cannot write to --tensorboard {str(logdir)!r}: "
                           f"{err.strerror}") from None
    return final


def _run(args: argparse.Namespace) -> int:
    from attnprof.analyze import scaling
    from attnprof.exporters import activation_map as amap

    if args.show is not None:
        if args.model is not None:
            raise CliError("give MODEL to profile or --show PROFILE_JSON, not both")
        print(show_profile(args.show))
        return 0
    if args.model is None:
        raise CliError("MODEL is required (a checkpoint directory or 'smollm2')")
    seq_lens = parse_seq_lens(args.seq_lens)
    int_in_range(args.batch_size, "--batch-size", 1, 1 << 20)
    int_in_range(args.repeats, "--repeats", 1, 1000)
    if not math.isfinite(args.validate_max_seconds) or args.validate_max_seconds < 0:
        raise CliError("--validate-max-seconds must be a finite number >= 0")
    budget = parse_bytes(args.memory_budget)
    paths = tuple(p.strip() for p in args.paths.split(",") if p.strip())
    bad = [p for p in paths if p not in scaling.PATHS]
    if bad or not paths:
        raise CliError(f"--paths: unknown path {bad[0] if bad else '(none)'!r} "
                       f"(one of {', '.join(scaling.PATHS)})")
    if args.attn_implementation not in (None, "sdpa", "eager", "flex_attention"):
        raise CliError(f"--attn-implementation {args.attn_implementation!r}: use sdpa, eager "
                       f"or flex_attention")
    if args.attention_dropout is not None and not 0.0 <= args.attention_dropout < 1.0:
        raise CliError(f"--attention-dropout must be in [0, 1), got {args.attention_dropout}")
    if args.out.exists() and not args.out.is_dir():
        raise CliError(f"--out {str(args.out)!r} is a file; --out names a directory")
    require_module("matplotlib", "attnprof profile (scaling.png)", "report")
    if args.tensorboard is not None:
        from attnprof.cli.tensorboard import check_logdir

        check_logdir(args.tensorboard, "--tensorboard")
        require_module("tensorboard", "attnprof profile --tensorboard", "tensorboard")
    require_module("tqdm", "attnprof profile", "torch")
    model_dir = resolve_model(args.model)
    advice_inputs = _advice_inputs(args, model_dir)
    out_dir = ensure_writable_dir(args.out)

    from attnprof.tools.profile_run import ProfileOptions, run_profile

    steps = 3 + len(seq_lens) * (1 + len(paths))
    bar = progress_bar(steps, "attnprof profile", unit="step")

    def step(msg: str) -> None:
        bar.set_postfix_str(msg)
        bar.update(1)

    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix=".attnprof-", dir=out_dir) as tmp:
        trace_tmp = Path(tmp) / "trace.json"
        opts = ProfileOptions(
            model_dir=model_dir, model_name=args.model, seq_lens=seq_lens,
            batch_size=args.batch_size, memory_budget=budget,
            attn_implementation=args.attn_implementation, repeats=args.repeats, paths=paths,
            validate=not args.no_validate, validate_max_seconds=args.validate_max_seconds,
            trace_path=trace_tmp, progress=step, train=args.train,
            attention_dropout=args.attention_dropout)
        try:
            result = run_profile(opts)
        except (OSError, ValueError) as err:
            raise CliError(f"profiling {args.model!r} failed: {err}") from None
        finally:
            bar.n = bar.total
            bar.close()
        if advice_inputs is not None:
            from attnprof.analyze.sparsity.recommend import export_summary, recommend

            dist, arch, stats = advice_inputs
            result.window_advice = export_summary(recommend(dist, arch, stats))
        result.run.wall_s = round(time.monotonic() - t0, 1)
        png = scaling_png(result)
        grid = amap.grid_from_profile(result)
        map_png, map_svg = amap.render(grid, "png"), amap.render(grid, "svg")
        roof = _roofline_images(result)
        trace = trace_tmp.read_bytes() if trace_tmp.exists() else b'{"traceEvents": []}'
    outputs = {"profile": "profile.json", "trace": "trace.json", "plot": "scaling.png",
               "activation_map": "activation_map.png", "activation_map_svg": "activation_map.svg"}
    if args.tensorboard is not None:
        events = _write_events(args.tensorboard, result, amap.markdown(grid),
                               {"activation_map": map_png, "scaling": png})
        outputs["tensorboard"] = str(events.resolve())
    write_atomic(out_dir / "trace.json", trace)
    write_atomic(out_dir / "scaling.png", png)
    write_atomic(out_dir / "activation_map.png", map_png)
    write_atomic(out_dir / "activation_map.svg", map_svg)
    for name, data in roof.items():
        write_atomic(out_dir / name, data)
        outputs["roofline" + ("_svg" if name.endswith(".svg") else "")] = name
    result.outputs = outputs
    write_atomic(out_dir / "profile.json",
                 json.dumps(result.to_json(), indent=2, default=str) + "\n")
    print(summary(result, out_dir))
    return 0


def _roofline_images(result: ProfileReport) -> dict[str, bytes]:
    """roofline.png and roofline.svg (none when the probe failed: its error is in
    profile.json's errors)."""
    if result.roofline is None:
        return {}
    from attnprof.exporters.roofline_plot import render

    title = f"{result.model.name}: attention roofline ({result.model.dtype})"
    return {"roofline.png": render(result.roofline, "png", title),
            "roofline.svg": render(result.roofline, "svg", title)}


def _advice_inputs(args: argparse.Namespace, model_dir: Path) -> tuple[Any, Any, Any] | None:
    """Read --lengths/--head-stats before the (minutes-long) profile so bad files fail fast."""
    if args.lengths is None:
        if args.head_stats is not None:
            raise CliError("--head-stats needs --lengths (the traffic to weigh savings by)")
        return None
    from attnprof.cli.suggest import load_arch, load_head_stats, read_lengths

    dist = read_lengths(args.lengths)
    stats = load_head_stats(args.head_stats) if args.head_stats is not None else None
    return dist, load_arch(str(model_dir)), stats
