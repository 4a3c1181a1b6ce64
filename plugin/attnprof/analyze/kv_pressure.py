"""Is a server KV-bound, compute-bound or neither? Pure functions over the stat logger's
:class:`~attnprof.contracts.snapshot.KvPressureStats` (docs/kv-pressure.md).

Rules (busy time: at least one request running or waiting; thresholds are constants here):

- **kv_bound** when any of: KV usage above 90% for at least ``ABOVE_90_FRACTION`` of busy
  time; preemptions at a rate of at least ``PREEMPTIONS_PER_REQUEST`` per finished request
  (any preemption when no request finished yet); requests waiting for capacity while usage
  is above 90% for at least ``WAITING_FRACTION`` of busy time.
- **compute_bound** when not KV-bound, p95 usage at most ``LOW_USAGE``, and requests wait
  (``WAITING_FRACTION`` of busy time) or the running batch is at ``max_num_seqs`` for
  ``SATURATED_FRACTION`` of it: the engine cannot take more work although KV has room.
- **neither** otherwise, and always below ``MIN_BUSY_S`` busy seconds.

Confidence is ``high`` from ``CONFIDENT_BUSY_S`` busy seconds and ``CONFIDENT_REQUESTS``
finished requests, else ``low``. Never raises on well-typed input; never imports vLLM.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import cast

from attnprof.aggregate.histogram import bucket_quantile
from attnprof.aggregate.kv import HIGH_USAGE
from attnprof.analyze.memory import kv_bytes_per_token
from attnprof.contracts.snapshot import KvAssessment, KvLayer, KvPressureStats, RequestStats
from attnprof.facts.kv import blocks_held, held_tokens
from attnprof.facts.shape import AttentionShape

__all__ = ["ABOVE_90_FRACTION", "CONFIDENT_BUSY_S", "CONFIDENT_REQUESTS", "LOW_USAGE",
           "MIN_BUSY_S", "PREEMPTIONS_PER_REQUEST", "SATURATED_FRACTION", "VERDICTS",
           "WAITING_FRACTION", "assess", "capacity_sequences", "head_bytes",
           "kv_layers", "layer_shares", "usable_blocks"]

VERDICTS = ("kv_bound", "compute_bound", "neither")
ABOVE_90_FRACTION = 0.10
PREEMPTIONS_PER_REQUEST = 0.01
WAITING_FRACTION = 0.10
LOW_USAGE = 0.70
SATURATED_FRACTION = 0.50
MIN_BUSY_S = 2.0
CONFIDENT_BUSY_S = 30.0
CONFIDENT_REQUESTS = 20


def kv_layers(shape: AttentionShape, kv_cache_dtype: str) -> list[KvLayer]:
    """KV bytes per token of every layer in ``kv_cache_dtype`` (from the one formula in
    :func:`attnprof.facts.kv.kv_bytes_per_token`); ``ValueError`` for an unknown dtype."""
    b = kv_bytes_per_token(shape.num_kv_heads, shape.head_dim, kv_cache_dtype,
                           num_heads=shape.num_heads)
    return [KvLayer(layer=i, num_heads=shape.num_heads, num_kv_heads=shape.num_kv_heads,
                    window=shape.window(i), bytes_per_token=b["per_layer"],
                    per_kv_head=b["per_kv_head"], per_query_head=b["per_query_head"])
            for i in range(shape.num_layers)]


def capacity_sequences(stats: KvPressureStats, context: float) -> float | None:
    """Sequences of ``context`` tokens that fit in the cache at once, in whole sequences.

    vLLM allocates whole blocks: one sequence takes ``blocks_held(context, window, block_size)``
    blocks of each layer (:func:`attnprof.facts.kv.blocks_held`: ``ceil(min(L, w) / bs)``, one
    more for a window that straddles a block edge), out of :func:`usable_blocks`. When every
    layer takes the same number (no windows, or one window for all) this is exactly
    ``usable // blocks``. A hybrid model's windowed layers take fewer: the usable blocks of
    every layer, in bytes, over one sequence's block bytes (``sum(bytes_per_token x
    blocks)``), rounded down; an upper bound, since vLLM pages groups of layers separately
    there. None without the cache size or a context."""
    usable = usable_blocks(stats)
    if not usable or not stats.block_size or context <= 0:
        return None
    bs = stats.block_size
    if not stats.layers:
        return float(usable // blocks_held(context, None, bs))
    per_block = sum(lay.bytes_per_token for lay in stats.layers)
    per_seq = sum(lay.bytes_per_token * blocks_held(context, lay.window, bs)
                  for lay in stats.layers)
    # Bytes are floats: a ratio that is a whole number must not round down below it.
    return float(math.floor(usable * per_block / per_seq + 1e-9)) if per_seq > 0 else None


def usable_blocks(stats: KvPressureStats) -> int | None:
    """Blocks requests can hold: vLLM's block pool keeps one of ``num_blocks`` as its null
    block, and its usage (``kv_cache_usage``) is the share of the others in use."""
    return max(0, stats.num_blocks - 1) if stats.num_blocks else None


def layer_shares(layers: Sequence[KvLayer], context: float) -> dict[int, float]:
    """Share of one sequence's KV each layer holds at ``context`` tokens (windows honoured)."""
    held = {lay.layer: lay.bytes_per_token * held_tokens(max(1.0, context), lay.window)
            for lay in layers}
    total = sum(held.values())
    return {k: v / total for k, v in held.items()} if total > 0 else {}


def head_bytes(stats: KvPressureStats, usage: float | None, context: float) -> dict[int, float]:
    """KV bytes each KV head of each layer holds at ``usage`` of the cache, the cache's bytes
    split by :func:`layer_shares` at ``context`` (a query-head group shares these bytes)."""
    usable = usable_blocks(stats)
    if usage is None or not usable or not stats.block_size or not stats.layers:
        return {}
    cache = usable * stats.block_size * sum(lay.bytes_per_token for lay in stats.layers)
    shares = layer_shares(stats.layers, context)
    return {lay.layer: usage * cache * shares.get(lay.layer, 0.0) / max(1, lay.num_kv_heads)
            for lay in stats.layers}


def _p95(stats: KvPressureStats) -> float | None:
    # Seconds are float weights; bucket_quantile only sums and compares them.
    return bucket_quantile(stats.usage_bounds, cast(Sequence[int], stats.usage_seconds), 0.95)


def _above_90(stats: KvPressureStats) -> float:
    return sum(s for b, s in zip(stats.usage_bounds, stats.usage_seconds, strict=False)
               if b > HIGH_USAGE + 1e-12)


def _pct(x: float) -> str:
    return f"{100 * x:.1f}%"


def assess(requests: RequestStats | None) -> KvAssessment | None:
    """The verdict, its evidence and the capacity figures for the stat logger's stats
    (None when there are none: no API server here, or an older snapshot)."""
    st = requests.kv_pressure if requests is not None else None
    if requests is None or st is None:
        return None
    busy = st.busy_seconds
    above = _above_90(st)
    p95 = _p95(st)
    ctx = requests.context_tokens
    contexts = {k: float(v) for k, v in (("p50", ctx.p50), ("p99", ctx.p99)) if v}
    out = KvAssessment(
        verdict="neither", confidence="low", busy_seconds=round(busy, 3), peak=st.peak,
        p95=p95, above_90_seconds=round(above, 3),
        above_90_fraction=above / busy if busy > 0 else None, preemptions=st.preemptions,
        waiting_fraction=st.waiting_seconds / busy if busy > 0 else None,
        mean_running=st.running_request_seconds / busy if busy > 0 else None,
        capacity_tokens=(st.num_blocks * st.block_size if st.num_blocks and st.block_size
                         else None),
        context_tokens=contexts)
    for k, c in contexts.items():
        cap = capacity_sequences(st, c)
        if cap is not None:
            out.capacity_sequences[k] = round(cap, 2)
    total_bs = sum(st.class_block_seconds)
    if total_bs > 0:
        out.class_share = {n: round(b / total_bs, 4)
                           for n, b in zip(st.class_names, st.class_block_seconds, strict=False)}
    if st.layers:
        shares = layer_shares(st.layers, contexts.get("p99", 1.0))
        out.layer_share = {str(k): round(v, 4) for k, v in shares.items()}
        top = max(shares.values(), default=0.0)
        out.top_layers = sorted(k for k, v in shares.items() if v >= top * (1 - 1e-9))
        out.head_bytes_peak = {str(k): round(v, 1) for k, v in head_bytes(
            st, st.peak, contexts.get("p50", 1.0)).items()}
    n_req = requests.requests
    if busy >= CONFIDENT_BUSY_S and n_req >= CONFIDENT_REQUESTS:
        out.confidence = "high"
    why = f"{busy:.1f} busy seconds, {n_req} finished requests"
    if busy < MIN_BUSY_S:
        out.evidence = [f"too little traffic to judge: {why} (needs {MIN_BUSY_S:g} s)"]
        return out
    kv: list[str] = []
    if above / busy >= ABOVE_90_FRACTION:
        kv.append(f"KV usage above 90% for {above:.1f} s, {_pct(above / busy)} of busy time "
                  f"(threshold {_pct(ABOVE_90_FRACTION)})")
    if st.preemptions and (n_req == 0 or st.preemptions / n_req >= PREEMPTIONS_PER_REQUEST):
        kv.append(f"{st.preemptions} preemption(s) for {n_req} finished requests (vLLM frees a "
                  f"running request's KV when a new block cannot be allocated)")
    if st.waiting_kv_high_seconds / busy >= WAITING_FRACTION:
        kv.append(f"requests waited for capacity with KV above 90% for "
                  f"{st.waiting_kv_high_seconds:.1f} s, "
                  f"{_pct(st.waiting_kv_high_seconds / busy)} of busy time")
    peak = f"peak {_pct(st.peak)}" if st.peak is not None else "no usage seen"
    p95s = f"p95 {_pct(p95)}" if p95 is not None else "no p95"
    if kv:
        out.verdict = "kv_bound"
        out.evidence = [*kv, f"KV usage {peak}, {p95s} ({why})"]
        return out
    waiting = st.waiting_seconds / busy
    saturated = st.saturated_seconds / busy
    if p95 is not None and p95 <= LOW_USAGE and (waiting >= WAITING_FRACTION
                                                 or saturated >= SATURATED_FRACTION):
        out.verdict = "compute_bound"
        ev = [f"KV usage stays low ({p95s}, {peak}) while"]
        if waiting >= WAITING_FRACTION:
            ev.append(f"requests wait for {_pct(waiting)} of busy time")
        if saturated >= SATURATED_FRACTION:
            ev.append(f"the running batch is at max_num_seqs={st.max_num_seqs} for "
                      f"{_pct(saturated)} of busy time")
        out.evidence = [" ".join([*ev[:1], " and ".join(ev[1:])]) + f" ({why})"]
        return out
    out.evidence = [f"KV usage above 90% for {_pct(above / busy)} of busy time (threshold "
                    f"{_pct(ABOVE_90_FRACTION)}), {st.preemptions} preemption(s), {peak}, "
                    f"{p95s} ({why})"]
    if waiting >= WAITING_FRACTION or saturated >= SATURATED_FRACTION:
        high = st.waiting_kv_high_seconds / busy
        out.evidence.append(
            f"requests waited for {_pct(waiting)} of busy time ({_pct(high)} with KV above "
            f"90%), batch full {_pct(saturated)}; KV is not low enough to call it "
            f"compute-bound (p95 above {_pct(LOW_USAGE)}): near KV capacity")
    else:
        out.evidence.append(f"no queue: waiting {_pct(waiting)}, batch full {_pct(saturated)} "
                            f"of busy time")
    return out
