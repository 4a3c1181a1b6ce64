"""Measured what-ifs, the pure part: the traffic shape a run replays (from a record), the
prompt lengths it draws, the paired-round intervals, and each prediction of the cost report
checked against what the run measured.

A prediction is off when the measurement's 95% interval lies wholly outside the prediction
plus or minus the band its stated confidence allows (``BANDS``): the report says so in words
and ``report.json`` carries ``validation.off``. The runner that starts the servers and sends
the traffic is :mod:`attnprof.tools.whatif`.
"""

from __future__ import annotations

import itertools
import math
import random
import statistics
from collections.abc import Sequence

from attnprof.contracts.report import KvMemory, TimeBreakdown, Traffic, WhatIf
from attnprof.contracts.whatif import (
    Check,
    Interval,
    TrafficShape,
    Validation,
    VariantResult,
    WhatifRun,
)

__all__ = ["BANDS", "CAPACITY_BAND", "PREDICTED", "check", "draw_lengths", "paired_interval",
           "predictions", "shape_from_report", "validate", "vllm_window_capacity_gain"]

BANDS: dict[str, float] = {"high": 0.05, "medium": 0.15, "low": 0.30}
"""The tolerance a stated confidence allows a predicted relative change (throughput, ITL):
plus or minus 5, 15 or 30 percentage points. Shares (requests refused, greedy agreement)
take a fifth of it (1, 3 or 6 points)."""
CAPACITY_BAND = 0.02
"""KV capacity is arithmetic (bytes / bytes per token), off only by block rounding: 2%."""
PREDICTED = ("tokens_per_s", "itl_p50", "itl_p99", "kv_capacity", "refused_share",
             "greedy_agreement")
"""The metrics a validation can check, in the order the report shows them."""
DEFAULT_CONCURRENCY = 4
_MAX_CONCURRENCY = 64

# Two-sided 95% Student-t quantiles by degrees of freedom (1..30); beyond it, 1.96.
_T95 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179,
        2.160, 2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064,
        2.060, 2.056, 2.052, 2.048, 2.045, 2.042)


def paired_interval(base: Sequence[float | None], var: Sequence[float | None]
                    ) -> Interval | None:
    """Mean relative change ``var / base - 1`` over paired rounds with its 95% Student-t
    interval; None when no round has a positive baseline (a round missing either side is
    left out)."""
    ch = [v / b - 1.0 for b, v in zip(base, var, strict=False)
          if b is not None and v is not None and b > 0 and math.isfinite(b)
          and math.isfinite(v)]
    if not ch:
        return None
    m = statistics.fmean(ch)
    if len(ch) < 2:
        return Interval(m, m, m, 1)
    half = _T95[min(len(ch) - 1, len(_T95)) - 1] * statistics.stdev(ch) / math.sqrt(len(ch))
    if len(ch) - 1 > len(_T95):
        half = 1.96 * statistics.stdev(ch) / math.sqrt(len(ch))
    return Interval(m, m - half, m + half, len(ch))


def shape_from_report(traffic: Traffic, kv: KvMemory, source: str, max_model_len: int,
                      concurrency: int | None = None) -> TrafficShape:
    """The traffic a run replays, from what the report read: prompt lengths at the recorded
    context quantiles less the mean output (prompts and outputs are not recorded jointly),
    the mean output, and the mean running requests as the concurrency (``concurrency``
    overrides it). :class:`ValueError` (one line) when nothing was recorded."""
    c = traffic.context
    if traffic.requests <= 0 or c.p50 is None:
        raise ValueError(f"{source}: no finished requests recorded: nothing to replay "
                         "(record a window with traffic: attnprof record --out FILE)")
    out = max(2, round(traffic.generation_tokens / traffic.requests))
    cap = max(1, max_model_len - out - 1)
    quant = {k: max(1.0, float(v) - out) for k, v in (("p50", c.p50), ("p90", c.p90),
                                                       ("p99", c.p99), ("max", c.max))
             if v is not None}
    if concurrency is not None:
        conc, basis = concurrency, "--concurrency"
    elif kv.mean_running is not None and kv.mean_running > 0:
        conc = min(_MAX_CONCURRENCY, max(1, math.ceil(kv.mean_running)))
        basis = f"the record's mean running requests ({kv.mean_running:.2f}), rounded up"
    else:
        conc, basis = DEFAULT_CONCURRENCY, ("default (the source has no mean running "
                                            "requests: give --concurrency)")
    return TrafficShape(source=source, concurrency=conc, concurrency_basis=basis,
                        prompt_quantiles=quant, output_tokens=out,
                        max_prompt_tokens=int(min(cap, quant.get("max", cap))))


def _inverse_cdf(shape: TrafficShape, u: float) -> float:
    q = shape.prompt_quantiles
    knots = [(0.0, 1.0)] + [(x, q[k]) for x, k in ((0.5, "p50"), (0.9, "p90"), (0.99, "p99"),
                                                   (1.0, "max")) if k in q]
    knots.sort()
    for (u0, v0), (u1, v1) in itertools.pairwise(knots):
        if u <= u1:
            return v0 + (v1 - v0) * ((u - u0) / (u1 - u0) if u1 > u0 else 1.0)
    return knots[-1][1]


def draw_lengths(shape: TrafficShape, n: int, seed: int) -> list[int]:
    """``n`` prompt lengths from the shape, stratified (one draw in each 1/n of the
    distribution, in a seeded random order) so even a short round spans its tail."""
    rng = random.Random(seed)
    us = [(i + rng.random()) / n for i in range(n)]
    rng.shuffle(us)
    hi = max(1, shape.max_prompt_tokens)
    return [int(min(hi, max(1, round(_inverse_cdf(shape, u))))) for u in us]


def vllm_window_capacity_gain(num_layers: int, windowed: int, window: int,
                              max_model_len: int, in_flight_tokens: int,
                              block_size: int) -> float:
    """The change in vLLM's own KV capacity figure when ``windowed`` of ``num_layers`` layers
    slide a window: vLLM states capacity as concurrency at max_model_len x max_model_len, and
    admits a request by its worst case, where a windowed layer holds ``min(window - 1 +
    in-flight tokens, max_model_len)`` tokens plus one block (vLLM 0.32,
    ``SlidingWindowSpec.max_admission_blocks_per_request``), not the window alone."""
    full = -(-max_model_len // block_size)
    win = -(-min(window - 1 + in_flight_tokens, max_model_len) // block_size) + 1
    now = num_layers * full
    after = (num_layers - windowed) * full + windowed * min(win, full)
    return now / after - 1.0 if after > 0 else 0.0


def predictions(w: WhatIf, time: TimeBreakdown, *, max_model_len: int | None = None,
                in_flight_tokens: int | None = None,
                block_size: int | None = None) -> dict[str, float]:
    """What the report's model predicts a what-if changes, by metric: throughput change
    ``t / (1 - t)`` from its time saving t; ITL p99 change ``-(decode attention share x decode
    saving)`` (decode is one step per token; its attention reads the KV); KV capacity change
    ``1 / (1 - s) - 1`` (for a window, vLLM's admission rule:
    :func:`vllm_window_capacity_gain`); the share of requests refused (``max_model_len``);
    greedy agreement from its replay."""
    out: dict[str, float] = {}
    t = w.time_saving
    if t is not None and t < 1:
        out["tokens_per_s"] = t / (1.0 - t)
    s = w.kv_saving
    dec = time.attention_share.get("decode")
    if s is not None and dec is not None and math.isfinite(dec):
        # One decode step per token: the typical gap (p50) is the step; p99 also holds the
        # stalls behind other requests' prefills, which the what-if does not change.
        out["itl_p50"] = out["itl_p99"] = -min(1.0, max(0.0, dec)) * s
    if s is not None and s < 1:
        out["kv_capacity"] = 1.0 / (1.0 - s) - 1.0
    ins = w.inputs
    win, lay, n = ins.get("window"), ins.get("layers"), ins.get("num_layers")
    if (w.id == "window" and isinstance(win, (int, float)) and isinstance(lay, (int, float))
            and isinstance(n, (int, float)) and max_model_len and in_flight_tokens
            and block_size):
        # vLLM's figure is admission capacity at max_model_len, not the memory the traffic
        # holds (the advice's s): the model of that figure is vLLM's own rule.
        out["kv_capacity"] = vllm_window_capacity_gain(int(n), int(lay), int(win),
                                                       max_model_len, in_flight_tokens,
                                                       block_size)
    refused = w.inputs.get("refused_share")
    if isinstance(refused, (int, float)):
        out["refused_share"] = float(refused)
    a = w.inputs.get("replay_agreement")
    if isinstance(a, (int, float)):
        out["greedy_agreement"] = float(a)
    return out


def _band(metric: str, confidence: str) -> float:
    if metric == "kv_capacity":
        return CAPACITY_BAND
    b = BANDS.get(confidence.strip().lower(), BANDS["low"])
    return b / 5 if metric in ("refused_share", "greedy_agreement") else b


_EXACT = ("kv_capacity", "refused_share", "greedy_agreement")
"""Metrics a run measures as one exact figure (vLLM's capacity, counts), not per round."""


def check(metric: str, predicted: float, confidence: str, measured: float | None,
          low: float | None = None, high: float | None = None) -> Check:
    """One prediction against a measurement: an exact figure, or a mean with its 95%
    interval (``low``, ``high``; a per-round metric without them, one round, gets no
    verdict)."""
    band = _band(metric, confidence)
    if metric in _EXACT:
        low = high = measured
    off = (low is not None and high is not None
           and (low > predicted + band or high < predicted - band))
    return Check(metric=metric, predicted=predicted, band=band, measured=measured, low=low,
                 high=high, off=off)


def _measured(res: VariantResult) -> dict[str, tuple[float, float | None, float | None]]:
    """(value, low, high) per metric the run measured: exact figures are their own
    interval; a per-round mean from one round has none."""
    out: dict[str, tuple[float, float | None, float | None]] = {}
    for metric in ("tokens_per_s", "itl_p50", "itl_p99"):
        iv = res.changes.get(metric)
        if iv is not None:
            out[metric] = ((iv.mean, iv.low, iv.high) if iv.rounds >= 2
                           else (iv.mean, None, None))
    if res.kv_capacity_tokens and res.baseline_kv_capacity_tokens:
        c = res.kv_capacity_tokens / res.baseline_kv_capacity_tokens - 1.0
        out["kv_capacity"] = (c, c, c)
    b, v = res.baseline, res.variant
    if b is not None and v is not None and b.requests and v.requests:
        r = v.refused / v.requests - b.refused / b.requests
        out["refused_share"] = (r, r, r)
    if res.agreement is not None and res.agreement.positions:
        g = res.agreement.greedy_agreement
        out["greedy_agreement"] = (g, g, g)
    return out


def validate(w: WhatIf, time: TimeBreakdown, res: VariantResult, source: str,
             run: WhatifRun | None = None) -> Validation:
    """The report's predictions for ``w`` beside what ``res`` measured (``run``: the
    scheduler facts vLLM's capacity figure depends on)."""
    pred = predictions(w, time, max_model_len=run.max_model_len if run else None,
                       in_flight_tokens=run.in_flight_tokens if run else None,
                       block_size=run.block_size if run else None)
    got = _measured(res) if res.status == "measured" else {}
    checks = []
    for metric in PREDICTED:
        if metric in pred:
            m = got.get(metric)
            checks.append(check(metric, pred[metric], w.confidence, *(m or (None,))))
        elif metric in got:  # measured with nothing predicted (FP8's agreement): shown
            m = got[metric]
            checks.append(Check(metric=metric, predicted=None, band=0.0, measured=m[0],
                                low=m[1], high=m[2], off=False))
    return Validation(status=res.status, flags=list(res.flags), reason=res.reason,
                      checks=checks, off=any(c.off for c in checks), rounds=res.rounds,
                      source=source)
