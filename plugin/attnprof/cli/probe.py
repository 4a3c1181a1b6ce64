"""``attnprof probe``: measure this machine's peak memory bandwidth (a read-only stream,
STREAM-like copy and triad beside it) and matmul FLOP/s, the roofs ``attnprof profile`` and
the live roofline place attention against. Prints the result (``--json``: the
``attnprof.probe`` document); writes nothing."""

from __future__ import annotations

import argparse
import json
from typing import Any

from attnprof.cli._common import CliError, int_in_range, require_module

__all__ = ["add_parser"]


def add_parser(sub: Any) -> None:
    p = sub.add_parser("probe", help="measure peak memory bandwidth and matmul FLOP/s "
                                     "(the roofline's roofs); a few seconds")
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"),
                   help="where to measure (default: cuda when available, else cpu)")
    p.add_argument("--dtype", default="float32",
                   help="matmul dtype: the one the model runs (float32, bfloat16, float16; "
                        "default float32)")
    p.add_argument("--repeats", type=int, default=5, help="timed runs per kernel (default 5)")
    p.add_argument("--array-mib", type=int, default=None, metavar="MIB",
                   help="MiB per probe array (default: above the last-level cache; "
                        "256-512 on CPU, 1024 on GPU)")
    p.add_argument("--json", action="store_true", help="print the attnprof.probe JSON")
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    int_in_range(args.repeats, "--repeats", 1, 100)
    if args.array_mib is not None:
        int_in_range(args.array_mib, "--array-mib", 1, 1 << 16)
    from attnprof.facts.dtypes import normalize, torch_dtype

    try:
        dtype = normalize(args.dtype)
        torch_dtype(dtype)
    except ValueError as err:
        raise CliError(f"--dtype: {err}") from None
    require_module("torch", "attnprof probe", "torch")
    from attnprof.exporters.roofline_plot import probe_lines
    from attnprof.tools.probe import probe

    try:
        res = probe(device=args.device, dtype=dtype, repeats=args.repeats,
                    array_bytes=None if args.array_mib is None else args.array_mib << 20)
    except (ValueError, RuntimeError, MemoryError) as err:
        first = (str(err).splitlines() or [type(err).__name__])[0]
        raise CliError(f"probe failed: {first}") from None
    if args.json:
        print(json.dumps(res.to_json(), indent=2))
    else:
        print("\n".join(probe_lines(res)))
    return 0
