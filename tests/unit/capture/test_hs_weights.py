"""Every sampling stage's probability is in the head statistics' weights, and decode strata
count sequences. The step's inclusion probability (base coin, the long-prefill stratum's own
coin, the rate in force) is checked by driving the real step hook (``hooks.step_hook``, its
inline fast path and the sampler's real coins) over many steps and seeds: the weights'
Horvitz-Thompson estimate of the number of steps must come out right for ordinary and long
steps alike (unweighted, long steps count ~10x over at the default rates). The decode plan
is checked on vLLM's own ``CPUAttentionMetadata`` as in test_hs_plan."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch

from attnprof.capture.vllm import hooks
from attnprof.capture.vllm.hooks import DECODE_SEQS_PER_STEP, Capture
from attnprof.config import Config
from attnprof.host.vllm.runtime import State
from tests.unit.capture.test_hs_plan import _md


def _capture(seed: int, **kw: Any) -> Capture:
    return Capture(State(config=Config(enabled=True, seed=seed, model_label="m",
                                       head_stats_rate=1.0, overhead_budget=1.0, **kw)))


def _ht_steps(cap: Capture, tokens: int, steps: int) -> tuple[float, int]:
    """(sum of the sampled steps' weights, sampled steps) over ``steps`` steps of
    ``tokens`` scheduled tokens each, run through the real step hook."""
    got: list[float] = []

    def forward(_runner: Any, *_a: Any, **_kw: Any) -> None:
        if cap.in_step:  # inside a sampled step: the weight its statistics would carry
            got.append(cap._hs_weight)

    fwd = hooks.step_hook(cap, forward)
    ids = torch.zeros(tokens, dtype=torch.long)
    runner = SimpleNamespace()
    for _ in range(steps):
        fwd(runner, input_ids=ids)
    return float(sum(got)), len(got)


@pytest.mark.parametrize("tokens", [64, 2048])  # an ordinary step, a long-prefill one
def test_step_weights_make_the_sample_stand_for_every_step(tokens: int) -> None:
    steps, seeds = 4000, range(5)
    est, sampled = [], []
    for seed in seeds:
        cap = _capture(seed, sample_rate=0.05, long_prefill_rate=0.5,
                       long_prefill_tokens=1024)
        total, n = _ht_steps(cap, tokens, steps)
        est.append(total / cap.sampler.base_rate)  # weights are relative to rate 0.05
        sampled.append(n)
    p = 0.05 if tokens < 1024 else 1 - 0.95 * 0.5
    assert np.mean(sampled) == pytest.approx(p * steps, rel=0.1)  # the stratum's own rate
    assert np.mean(est) == pytest.approx(steps, rel=0.1)  # ... undone by the weights
    # unweighted, a long step would stand for itself only: 10.5x its share of the steps
    assert tokens < 1024 or np.mean(sampled) / 0.05 > 5 * steps


def test_step_weight_follows_the_rate_in_force() -> None:
    cap = _capture(0, sample_rate=0.1, long_prefill_rate=0.5, long_prefill_tokens=1024)
    cap.sampler.scale = 0.25  # the budget throttled the rate to 0.025
    cap._step_tokens = 100
    assert cap._step_weight((), {}) == pytest.approx(0.1 / 0.025)
    cap._step_tokens = 4096  # long: the base coin or the stratum's (0.5 x 0.25)
    assert cap._step_weight((), {}) == pytest.approx(0.1 / (1 - 0.975 * 0.875))
    off = _capture(0, sample_rate=0.1, long_prefill_rate=0.0)
    off._step_tokens = 4096  # no long-prefill stratum: every step alike
    assert off._step_weight((), {}) == 1.0


def _decode_cap(ids: list[str]) -> Capture:
    cap = Capture(State(config=Config(enabled=True, sample_rate=1.0, seed=0, model_label="m")))
    cap._runner = SimpleNamespace(input_batch=SimpleNamespace(
        num_prompt_tokens=np.array([300] * len(ids), dtype=np.int32), req_ids=list(ids)))
    return cap


def _step(cap: Capture, ctx: list[int], weight: float = 1.0) -> list[Any]:
    """One sampled step's plan, as _run_sampled starts it (new step, its weight)."""
    cap.seen += 1
    cap._hs_plans.clear()
    cap._shapes.clear()
    cap._decode_step.clear()
    cap._hs_weight = weight
    return cap._hs_plan(_md([1] * len(ctx), ctx))


def test_decode_sequences_count_once_per_bucket() -> None:
    ids = ["a", "b"]
    cap = _decode_cap(ids)
    first = _step(cap, [301, 401])
    again = cap._hs_plan(_md([1, 1], [301, 401]))  # another KV-cache group, same step
    assert [f.seq_share for f in first] == [f.seq_share for f in again] == [1.0, 1.0]
    assert [f.seq_share for f in _step(cap, [302, 402])] == [0.0, 0.0]  # already counted
    # "b" grew past 512 tokens: a sequence of the next bucket now
    later = _step(cap, [303, 513])
    assert [(f.bucket, f.seq_share) for f in later] == [(256, 0.0), (512, 1.0)]


def test_decode_weights_carry_the_step_weight_and_counts_stay_bounded() -> None:
    n = 2 * DECODE_SEQS_PER_STEP
    cap = _decode_cap([f"r{i}" for i in range(n)])
    plan = _step(cap, [301 + i for i in range(n)], weight=3.0)
    assert all(f.weight == pytest.approx(3.0 * n / DECODE_SEQS_PER_STEP) for f in plan)
    for i in range(hooks.DECODE_SEQS_SEEN + 10):
        cap._first_decode_fold(i, 256)
    assert len(cap._decode_seen) == hooks.DECODE_SEQS_SEEN
    cap._runner = SimpleNamespace(input_batch=SimpleNamespace(
        num_prompt_tokens=np.array([300] * n, dtype=np.int32)))  # ids unreadable
    assert {f.seq_share for f in _step(cap, [305 + i for i in range(n)])} == {0.0}
