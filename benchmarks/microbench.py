"""Micro-benchmark of attnprof's unsampled hot path (goal: <= 1 us per call).

Measures, against calling the wrapped function directly:
- the step hook as installed (``hooks.step_hook``) on unsampled steps at the default rate,
  with the long-prefill stratum on (the default) and off;
- a layer's ``impl.forward`` after ``wrap_layer`` when the step is not sampled (attnprof
  installs its layer wrappers only for sampled steps, so this should be zero);
- the per-step cost for a 30-layer model (SmolLM2-135M) = step hook + 30 layers.
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

from attnprof.capture.vllm.hooks import Capture, step_hook
from attnprof.config import Config
from attnprof.host.vllm.runtime import State

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
    import torch

    res: dict[str, Any] = {"python": sys.version.split()[0], "machine": platform.machine(),
                           "calls": N, "repeats": REPEATS, "goal_ns_per_unsampled_step": 1000}
    # A realistic decode batch: 8 sequences, one token each.
    kwargs: dict[str, Any] = {"input_ids": torch.zeros(8, dtype=torch.long),
                              "positions": torch.arange(8)}
    direct_step = _per_call(lambda: _orig(None, **kwargs))
    for long_rate, key in ((0.5, "step_hook_overhead_ns"), (0.0, "step_hook_no_long_ns")):
        state = State(config=Config(enabled=True, sample_rate=0.05, long_prefill_rate=long_rate,
                                    seed=0, model_label="bench"))
        cap = Capture(state)
        # Sampled steps are not what this measures: run them as plain calls.
        cap._sampled_step = lambda orig, runner, a, k, o: orig(runner, *a, **k)  # type: ignore
        hook = step_hook(cap, _orig)
        hooked_step = _per_call(lambda hook=hook: hook(None, **kwargs))
        res[key] = round((hooked_step - direct_step) * 1e9, 1)
    layer = _Layer()
    cap.wrap_layer(layer)
    unsampled = layer.impl.forward  # what vLLM calls on an unsampled step
    base = _Impl().forward
    direct_layer = _per_call(lambda: base(layer, 1, 2, 3, None, None))
    hooked_layer = _per_call(lambda: unsampled(layer, 1, 2, 3, None, None))
    res["layer_unsampled_overhead_ns"] = round((hooked_layer - direct_layer) * 1e9, 1)
    res["layer_forward_is_vllms_own_when_unsampled"] = "forward" not in vars(layer.impl)
    res["smollm2_30_layer_step_ns"] = round(
        res["step_hook_overhead_ns"] + 30 * max(0.0, res["layer_unsampled_overhead_ns"]), 1)
    if state.hub is not None:  # wrap_layer started this process's export loop
        state.hub.stop(final_flush=False)
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps(res, indent=2) + "\n")
    print(json.dumps(res, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
