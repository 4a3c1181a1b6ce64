"""``attnprof compat``: which attention backends activate for a head dim, dtype and GPU."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from attnprof.cli._common import CliError, write_atomic

__all__ = ["add_parser"]


def add_parser(sub: Any) -> None:
    p = sub.add_parser("compat", help="which attention backends activate for a case, and why "
                                      "the others do not (versioned rules, no GPU needed)")
    p.add_argument("--head-dim", type=int, default=128, help="attention head dim (default 128)")
    p.add_argument("--dtype", default="bf16", help="fp32, fp16, bf16 or fp8 (default bf16)")
    p.add_argument("--gpu", default="h100", help="hardware: sm80..sm100, a100, h100, b200, "
                                                  "mi300x, cpu, avx512... (default h100)")
    p.add_argument("--sliding-window", action="store_true", help="the model uses local attention")
    p.add_argument("--sinks", action="store_true", help="learned attention-sink logits")
    p.add_argument("--fp8-kv", action="store_true", help="fp8 KV cache")
    p.add_argument("--mask", action="store_true", help="an explicit attention mask (padding)")
    p.add_argument("--json", action="store_true", help="print the verdicts as JSON")
    p.add_argument("--markdown", action="store_true",
                   help="print the whole matrix as Markdown (docs/compat-matrix.md)")
    p.add_argument("--out", type=Path, default=None, help="write the output to this file")
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    from attnprof.analyze import compat, rules

    if args.markdown:
        text = compat.markdown_matrix()
    else:
        if args.head_dim <= 0:
            raise CliError(f"--head-dim must be a positive integer, got {args.head_dim}")
        try:
            rules.resolve_hardware(args.gpu)
        except ValueError as err:
            raise CliError(str(err)) from None
        try:
            rules.normalize_dtype(args.dtype)
        except ValueError as err:
            raise CliError(str(err)) from None
        feats = {"mask": args.mask, "sliding_window": args.sliding_window,
                 "sinks": args.sinks, "fp8_kv": args.fp8_kv}
        rep = compat.case_report(args.gpu, args.head_dim, args.dtype, feats)
        text = json.dumps(rep, indent=2) if args.json else compat.render_case(rep)
    if args.out is not None:
        write_atomic(args.out, text + "\n")
    else:
        print(text)
    return 0
