"""Per-layer/phase attention aggregates of one worker process, fed typed records by capture.

Capture hands one :class:`StepRecord` per sampled step (the layers' timed calls and the
step's model time); :class:`WorkerAggregates` folds it into running totals bounded by
layers x phases, and renders them as the snapshot contract. Analytic FLOPs and bytes are
computed here, from the layer's shape and the batch, so that capture only measures.
"""

from __future__ import annotations

import re
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from typing import Literal

from attnprof.contracts.snapshot import LayerFacts, LayerProfile, PhaseStats, StepPhaseStats
from attnprof.facts.dtypes import dtype_bytes
from attnprof.facts.kv import kv_element_bytes

__all__ = [
    "PHASES",
    "UNFUSED_BACKENDS",
    "BatchShape",
    "LayerCall",
    "LayerInfo",
    "Phase",
    "StepRecord",
    "WorkerAggregates",
    "attention_bytes",
    "attention_flops",
    "causal_pairs",
    "keys_read",
    "kv_read_bytes",
    "layer_index",
    "q_o_bytes",
]

Phase = Literal["prefill", "decode", "mixed"]
PHASES: tuple[Phase, ...] = ("prefill", "decode", "mixed")
Outcome = Literal["sampled", "sampled_long", "blind"]
OUTCOMES: tuple[Outcome, ...] = ("sampled", "sampled_long", "blind")

# Fused = the backend runs attention as one kernel that never materializes the score
# matrix. Every paged vLLM backend is; the ones listed here are not.
UNFUSED_BACKENDS = frozenset({"TORCH_SDPA_MATH", "NAIVE"})
_LAYER_RE = re.compile(r"\.(\d+)\.")


def layer_index(name: str) -> int:
    """``model.layers.12.self_attn.attn`` -> 12; -1 when the name has no index."""
    m = _LAYER_RE.search(name + ".")
    return int(m.group(1)) if m else -1


_FACT_FIELDS = tuple(f.name for f in fields(LayerFacts))  # what a LayerProfile copies


@dataclass
class LayerInfo(LayerFacts):
    """A layer's static facts (the contract's field list) as capture keeps them: ``kernel``
    and ``kv_cache_bytes`` are filled in on the first sampled call, the KV-cache group's
    facts when vLLM allocates the KV cache."""

    kv_spec: str | None = None
    """The group's spec class name (``FullAttentionSpec``, ``SlidingWindowSpec``, ...)."""
    kv_block_size: int = 0
    kv_bytes_per_token: int = 0
    """KV-cache bytes one token holds in this layer (the spec's page size / block size)."""

    @property
    def kv_element_bytes(self) -> int:
        """Bytes per KV-cache element: the cache dtype (e.g. fp8) when set, else the model's."""
        return kv_element_bytes(self.kv_cache_dtype, self.dtype)


def causal_pairs(q: int, s: int, window: int | None = None) -> int:
    """(query, key) pairs a causal mask keeps when the ``q`` queries are the last ``q`` of
    ``s`` positions (a chunked prefill: sum over i < q of s-q+i+1, not q*s). With a sliding
    window ``w`` position p sees its w most recent keys, itself included: min(p+1, w)
    (transformers' and vLLM's window, ``analyze.sparsity.savings.pairs_window`` without
    sinks)."""
    q = min(q, s)

    def upto(t: int) -> int:  # pairs of positions 0..t-1
        if window is None or t <= window:
            return t * (t + 1) // 2
        return window * (window + 1) // 2 + (t - window) * window

    return upto(s) - upto(s - q)


def keys_read(q: int, s: int, window: int | None = None) -> int:
    """Key positions the last ``q`` queries of ``s`` need: all of them, or with a window
    ``w`` the last q+w-1 (decode: min(s, w)); a paged kernel skips the blocks outside."""
    return s if window is None else min(s, q + window - 1)


@dataclass(slots=True)
class BatchShape:
    """What one attention-metadata object says about the batch (computed once per step, on
    sampled steps only)."""

    phase: Phase
    num_tokens: int
    pairs: int
    """Sum over requests of query_len * seq_len (dense, no causal discount)."""
    kv_tokens: int
    """Sum of seq_lens (the context, whatever a layer's window)."""
    num_reqs: int
    max_seq_len: int
    whole_prompts: tuple[tuple[int, int], ...] = ()
    """(start, length) of requests whose entire context is computed in this step."""
    q_lens: tuple[int, ...] = ()
    seq_lens: tuple[int, ...] = ()
    """Per request: new queries and context (new included). Empty on a hand-made shape,
    whose ``pairs`` and ``kv_tokens`` are then taken as given."""
    _counts: dict[tuple[int | None, bool], tuple[int, int]] = field(
        default_factory=dict, repr=False, compare=False)

    @classmethod
    def of(cls, q_lens: tuple[int, ...], seq_lens: tuple[int, ...], num_tokens: int,
           whole_prompts: tuple[tuple[int, int], ...] = ()) -> BatchShape:
        n_dec = sum(1 for q in q_lens if q <= 1)
        phase: Phase = ("decode" if n_dec == len(q_lens) else
                        "prefill" if n_dec == 0 else "mixed")
        pairs = sum(q * s for q, s in zip(q_lens, seq_lens, strict=False))
        return cls(phase, num_tokens, pairs, sum(seq_lens), len(seq_lens),
                   max(seq_lens, default=0), whole_prompts, q_lens, seq_lens)

    def counts(self, window: int | None, causal: bool) -> tuple[int, int]:
        """(query-key pairs computed, key positions read) by a layer with this ``window``
        (None: full), causal or not; once per distinct (window, causal) per step."""
        if not self.seq_lens:
            return self.pairs, self.kv_tokens
        key = (window, causal)
        got = self._counts.get(key)
        if got is None:
            if causal:
                qs = list(zip(self.q_lens, self.seq_lens, strict=False))
                got = (sum(causal_pairs(q, s, window) for q, s in qs),
                       sum(keys_read(q, s, window) for q, s in qs))
            else:  # encoder / cross-attention: every query sees every key
                got = (self.pairs, self.kv_tokens)
            self._counts[key] = got
        return got


@dataclass(slots=True)
class LayerCall:
    """One timed attention call of a sampled step."""

    layer: LayerInfo
    shape: BatchShape
    time_s: float


@dataclass(slots=True)
class StepRecord:
    """One sampled step as capture saw it."""

    outcome: Outcome
    model_time_s: float
    calls: list[LayerCall] = field(default_factory=list)


def _counts(info: LayerInfo, shape: BatchShape) -> tuple[int, int]:
    return shape.counts(info.sliding_window, info.attn_type == "decoder")


def attention_flops(info: LayerInfo, shape: BatchShape) -> int:
    """QK^T: 2*D and PV: 2*Dv FLOPs per (query, key) pair and query head, over the pairs
    the layer's mask keeps (causal, and its sliding window)."""
    return 2 * info.num_heads * (info.head_size + info.head_size_v) * _counts(info, shape)[0]


def q_o_bytes(facts: LayerFacts, tokens: int) -> int:
    """Q read + O written: model-dtype bytes x query tokens x query heads x (D + Dv)."""
    return (dtype_bytes(facts.dtype, 2) * tokens * facts.num_heads
            * (facts.head_size + facts.head_size_v))


def kv_read_bytes(info: LayerInfo, shape: BatchShape) -> int:
    """K and V read per key position the layer needs (a windowed layer: its window)."""
    return (info.kv_element_bytes * _counts(info, shape)[1] * info.num_kv_heads
            * (info.head_size + info.head_size_v))


def attention_bytes(info: LayerInfo, shape: BatchShape) -> int:
    """Q read + O written per query token; K and V read per key position needed."""
    return q_o_bytes(info, shape.num_tokens) + kv_read_bytes(info, shape)


RECENT_CALLS = 64
"""Per (layer, phase): the last calls' seconds kept for ``attnprof diff``'s test."""


class _Agg:
    __slots__ = ("bytes", "calls", "flops", "kv_tokens", "max_seq_len", "recent", "requests",
                 "time_s", "tokens")

    def __init__(self) -> None:
        self.calls = 0
        self.time_s = 0.0
        self.flops = 0
        self.bytes = 0
        self.tokens = 0
        self.kv_tokens = 0
        self.requests = 0
        self.max_seq_len = 0
        self.recent: deque[float] = deque(maxlen=RECENT_CALLS)


class WorkerAggregates:
    """Running totals of one worker: per (layer, phase), per step phase, per outcome.

    ``record_step`` runs on the serving thread (sampled steps only); readers (flusher
    thread, snapshot RPC) copy under ``lock``. Memory is bounded by layers x phases.
    """

    def __init__(self) -> None:
        self.layers: dict[str, LayerInfo] = {}
        self.agg: dict[tuple[int, str], _Agg] = {}
        self.steps: dict[str, list[float]] = {p: [0, 0.0, 0.0] for p in PHASES}
        self.outcomes: dict[str, int] = dict.fromkeys(OUTCOMES, 0)
        self.lock = threading.Lock()

    def add_layer(self, info: LayerInfo) -> None:
        self.layers[info.name or str(len(self.layers))] = info

    def record_step(self, step: StepRecord) -> None:
        """Fold one sampled step (an empty ``calls`` list is fine: nothing per layer)."""
        with self.lock:
            self.outcomes[step.outcome] += 1
            if step.outcome == "blind":
                return
            attn_total = 0.0
            phase: str = "decode"
            for call in step.calls:
                info, shape = call.layer, call.shape
                attn_total += call.time_s
                phase = shape.phase
                key = (info.index, shape.phase)
                a = self.agg.get(key)
                if a is None:
                    a = self.agg[key] = _Agg()
                a.calls += 1
                a.time_s += call.time_s
                a.recent.append(call.time_s)
                a.tokens += shape.num_tokens
                a.kv_tokens += shape.kv_tokens
                a.requests += shape.num_reqs
                a.max_seq_len = max(a.max_seq_len, shape.max_seq_len)
                a.flops += attention_flops(info, shape)
                a.bytes += attention_bytes(info, shape)
            st = self.steps[phase]
            st[0] += 1
            st[1] += step.model_time_s
            st[2] += attn_total

    def layer_profiles(self) -> list[LayerProfile]:
        """Every layer's profile (see :meth:`cut`)."""
        return self.cut()[0]

    def cut(self, pause: Callable[[], None] | None = None
            ) -> tuple[list[LayerProfile], dict[str, StepPhaseStats]]:
        """Every layer's profile and the per-phase step totals, copied under one lock (of
        the same step); ``pause()`` (a background reader handing over the GIL) runs after
        the copy and after each layer."""
        with self.lock:
            steps = self._step_stats()
            infos = sorted(self.layers.values(), key=lambda i: i.index)
            aggs = {k: (a.calls, a.time_s, a.tokens, a.flops, a.bytes, a.requests,
                        a.kv_tokens, a.max_seq_len, list(a.recent))
                    for k, a in self.agg.items()}
        out = []
        for info in infos:
            if pause is not None:
                pause()
            phases: dict[str, PhaseStats] = {}
            for phase in PHASES:
                v = aggs.get((info.index, phase))
                if v is None:
                    continue
                calls, t, tokens, flops, nbytes, reqs, kv, mx, recent = v
                phases[phase] = PhaseStats(
                    calls=calls, time_s=t, mean_time_s=t / calls if calls else 0.0,
                    tokens=tokens, flops=flops, bytes=nbytes,
                    mean_batch_requests=reqs / calls if calls else 0.0,
                    mean_seq_len=kv / reqs if reqs else 0.0, max_seq_len=mx,
                    recent_time_s=recent)
            facts = {name: getattr(info, name) for name in _FACT_FIELDS}
            out.append(LayerProfile(**facts, phases=phases))
        return out, steps

    def step_stats(self) -> dict[str, StepPhaseStats]:
        with self.lock:
            return self._step_stats()

    def _step_stats(self) -> dict[str, StepPhaseStats]:  # under the lock
        return {p: StepPhaseStats(steps=int(v[0]), model_time_s=v[1], attention_time_s=v[2],
                                  attention_share=(v[2] / v[1]) if v[1] > 0 else None)
                for p, v in self.steps.items() if v[0]}
