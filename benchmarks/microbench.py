"""Micro-benchmark of attnprof's unsampled hot path (goal: <= 1 us per call).

Measures, against calling the wrapped function directly:
- the step hook (``Capture.model_forward``) on unsampled steps at the default rate,
- the per-layer ``impl.forward`` wrapper when the step is not sampled.
Writes benchmarks/results/microbench.json. Run: ``.venv/bin/python benchmarks/microbench.py``.
"""

from __future__ import annotations

import json
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from attnprof.capture.vllm.hooks import Capture
from attnprof.capture.vllm.runtime import State
from attnprof.config import Config

OUT = Path(__file__).parent / "results" / "microbench.json"
N = 1_000_000
REPEATS = 7


def _orig(*args: Any, **kwargs: Any) -> None:
    return None


class _Impl:
    def forward(self, *args: Any, **kwargs: Any) -> None:
        return None


class _Layer:
    layer_name = "model.layers.0.self_attn.attn"
    num_heads, num_kv_heads, head_size, head_size_v = 9, 3, 64, 64
    sliding_window = None
    dtype = "float32"
    kv_cache_dtype = "auto"

    def __init__(self) -> None:
        self.impl = _Impl()


def _per_call(fn: Any, n: int = N) -> float:
    best = []
    for _ in range(REPEATS):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        best.append((time.perf_counter() - t0) / n)
    return statistics.median(best)


def main() -> int:
    state = State(config=Config(enabled=True, sample_rate=0.05, long_prefill_rate=0.5, seed=0,
                                model_label="bench"))
    cap = Capture(state)
    cap._sampled_step = lambda orig, runner, a, k, o: orig(runner, *a, **k)  # type: ignore
    layer = _Layer()
    cap.wrap_layer(layer)
    wrapped = layer.impl.forward
    base = _Impl().forward
    import torch

    # A realistic decode batch: 8 sequences, one token each.
    kwargs: dict[str, Any] = {"input_ids": torch.zeros(8, dtype=torch.long),
                              "positions": torch.arange(8)}

    direct_step = _per_call(lambda: _orig(None, **kwargs))
    hooked_step = _per_call(lambda: cap.model_forward(_orig, None, (), kwargs))
    direct_layer = _per_call(lambda: base(layer, 1, 2, 3, None, None))
    hooked_layer = _per_call(lambda: wrapped(layer, 1, 2, 3, None, None))
    res = {
        "python": sys.version.split()[0], "machine": platform.machine(),
        "calls": N, "repeats": REPEATS,
        "step_hook_overhead_ns": round((hooked_step - direct_step) * 1e9, 1),
        "layer_wrapper_overhead_ns": round((hooked_layer - direct_layer) * 1e9, 1),
        "goal_ns": 1000,
    }
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps(res, indent=2) + "\n")
    print(json.dumps(res, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
