"""Device check: a sampled layer call's head statistics on a CUDA device never synchronise
the host, and fold the numbers the CPU folds.

Torch only (no vLLM needed on the device machine): a layer call of ``--keys`` keys (Hq 32,
Hkv 8, D 128, bf16 as a served model's), its earlier keys read from a paged cache in the
logical layout FLASH_ATTN/FlashInfer use (``paged_kv.read_keys_t``), statistics computed by
``head_rows.prepare`` + ``head_rows.run`` (what the engine's thread does on a GPU) under
``torch.cuda.set_sync_debug_mode("error")``, which raises on any synchronising call. Then
``Folds.apply`` (the worker's part) and the same fold on the CPU; the accumulators compared
(TF32 off). Also the engine thread's host time of the enqueue against the device time of the
work (CUDA events). Writes ``head_rows_gpu_check.json`` to ``--out``.

``python benchmarks/head_rows_gpu_check.py --out DIR`` (a minute on an H100);
``--dry-run`` checks the script's arguments and imports on a machine without a GPU.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import numpy as np


def _case(torch: Any, keys: int, dev: str) -> dict[str, Any]:
    from attnprof.aggregate.head_stats import HeadStatsAccumulator
    from attnprof.capture import head_rows
    from attnprof.capture.vllm.paged_kv import CacheLayout, read_keys_t

    hq, hkv, d, bs, chunk = 32, 8, 128, 16, 512
    g = torch.Generator().manual_seed(0)
    q = torch.randn(chunk, hq, d, generator=g).to(torch.bfloat16)
    own = torch.randn(chunk, hkv, d, generator=g).to(torch.bfloat16)
    past = keys - chunk
    nb = -(-past // bs)
    cache = torch.zeros(nb + 4, hkv, bs, 2 * d, dtype=torch.bfloat16)  # logical layout
    order = torch.randperm(nb + 4, generator=g)[:nb]
    kp = torch.randn(nb * bs, hkv, d, generator=g).to(torch.bfloat16)
    cache[order, :, :, :d] = kp.view(nb, bs, hkv, d).permute(0, 2, 1, 3)
    layout = CacheLayout("logical", d)

    def fold(acc: Any, device: str) -> tuple[Any, float, float]:
        qd, od, cd, row = (t.to(device) for t in (q, own, cache, order))
        idx, wts, det, share = head_rows.span_plan(acc, chunk, keys, past)

        def k(n: int) -> Any:
            return read_keys_t(cd, layout, row, n, od, past, torch.float32)

        if device == "cpu":
            head_rows.fold_plan(acc, 0, qd, k, d ** -0.5, past, idx, wts, det,
                                request_share=share)
            return acc, 0.0, 0.0
        torch.cuda.synchronize()
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.set_sync_debug_mode("error")
        try:
            t0 = time.perf_counter()
            e0.record()
            folds = head_rows.run(acc, head_rows.prepare(acc, 0, qd, k, d ** -0.5, past, idx,
                                                         wts, det, request_share=share))
            e1.record()
            host = time.perf_counter() - t0
        finally:
            torch.cuda.set_sync_debug_mode(0)
        folds.apply()  # the worker's part: waits for the copies, folds
        return acc, host, e0.elapsed_time(e1) / 1e3

    def new() -> Any:
        return HeadStatsAccumulator(1, hkv, hq // hkv, seed=0)

    ref, _, _ = fold(new(), "cpu")
    if dev == "cpu":  # the dry run: the reference fold only
        return {"keys": keys, "queries": int(ref.queries[0].max())}
    got, host_s, device_s = fold(new(), dev)
    worst = {}
    for name, x in vars(ref).items():
        if isinstance(x, np.ndarray) and x.dtype.kind == "f":
            y = vars(got)[name]
            worst[name] = float(np.max(np.abs(y - x) / (np.abs(x) + 1e-6))) if x.size else 0.0
    exact = {name: bool(np.array_equal(vars(got)[name], x)) for name, x in vars(ref).items()
             if isinstance(x, np.ndarray) and x.dtype.kind != "f"}
    return {"keys": keys, "queries": int(ref.queries[0].max()),
            "engine_thread_host_ms": round(host_s * 1e3, 3),
            "device_ms": round(device_s * 1e3, 3), "max_rel_diff": worst,
            "integer_fields_equal": exact, "synchronised": False}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=Path("."))
    ap.add_argument("--keys", type=int, nargs="*", default=[1024, 4096, 16384])
    ap.add_argument("--dry-run", action="store_true")
    args = ap.parse_args()
    import torch

    if args.dry_run:  # the CPU reference of the smallest case, no device
        print(json.dumps({"dry_run": True, "cuda": torch.cuda.is_available(),
                          "reference": _case(torch, min(args.keys), "cpu")}))
        return
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    out = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
           "cases": [_case(torch, n, "cuda") for n in args.keys]}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "head_rows_gpu_check.json").write_text(json.dumps(out, indent=2) + "\n")
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
