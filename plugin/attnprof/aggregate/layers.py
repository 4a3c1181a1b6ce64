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
from dataclasses import dataclass, field, fields
from typing import Literal

from attnprof.contracts.snapshot import LayerFacts, LayerProfile, PhaseStats, StepPhaseStats
from attnprof.facts.dtypes import dtype_bytes

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
    "layer_index",
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
    and ``kv_cache_bytes`` are filled in on the first sampled call."""

    @property
    def kv_element_bytes(self) -> int:
        """Bytes per KV-cache element: the cache dtype (e.g. fp8) when set, else the model's."""
        model = dtype_bytes(self.dtype, 2)
        return model if self.kv_cache_dtype == "auto" else dtype_bytes(self.kv_cache_dtype, model)


@dataclass(slots=True)
class BatchShape:
    """What one attention-metadata object says about the batch (computed once per step)."""

    phase: Phase
    num_tokens: int
    pairs: int
    """Sum over requests of query_len * seq_len (dense, no causal discount)."""
    kv_tokens: int
    """Sum of seq_lens."""
    num_reqs: int
    max_seq_len: int
    whole_prompts: tuple[tuple[int, int], ...] = ()
    """(start, length) of requests whose entire context is computed in this step."""


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


def attention_flops(info: LayerInfo, shape: BatchShape) -> int:
    """QK^T: 2*D and PV: 2*Dv FLOPs per (query, key) pair and query head."""
    return 2 * info.num_heads * (info.head_size + info.head_size_v) * shape.pairs


def attention_bytes(info: LayerInfo, shape: BatchShape) -> int:
    """Q read + O written per query token; K and V read per key position."""
    d = info.head_size + info.head_size_v
    return (dtype_bytes(info.dtype, 2) * shape.num_tokens * info.num_heads * d
            + info.kv_element_bytes * shape.kv_tokens * info.num_kv_heads * d)


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
        with self.lock:
            infos = sorted(self.layers.values(), key=lambda i: i.index)
            aggs = {k: (a.calls, a.time_s, a.tokens, a.flops, a.bytes, a.requests,
                        a.kv_tokens, a.max_seq_len, list(a.recent))
                    for k, a in self.agg.items()}
        out = []
        for info in infos:
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
        return out

    def step_stats(self) -> dict[str, StepPhaseStats]:
        with self.lock:
            return {p: StepPhaseStats(steps=int(v[0]), model_time_s=v[1], attention_time_s=v[2],
                                      attention_share=(v[2] / v[1]) if v[1] > 0 else None)
                    for p, v in self.steps.items() if v[0]}
