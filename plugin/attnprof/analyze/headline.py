"""The headline numbers several outputs show (``attnprof diff``, TensorBoard): the fused
fraction of attention calls and time, and attention's share of a step per phase. One
definition each, so a diff and a dashboard of the same file agree."""

from __future__ import annotations

from collections.abc import Iterable

from attnprof.contracts.profile import ProfileReport
from attnprof.contracts.snapshot import LayerProfile, Snapshot

__all__ = ["first_layers", "fused_fractions", "kernel_rows", "step_shares"]


def first_layers(snap: Snapshot) -> list[LayerProfile]:
    """Each layer once, from the first worker holding it (tensor-parallel ranks repeat the
    same layers: counting them all would multiply calls), in layer order."""
    seen: dict[int, LayerProfile] = {}
    for w in snap.workers:
        for lay in w.layers:
            seen.setdefault(lay.index, lay)
    return [seen[i] for i in sorted(seen)]


def kernel_rows(doc: ProfileReport | Snapshot) -> list[tuple[bool, int, float]]:
    """``(fused, calls, seconds)`` per layer x shape class (profile: activation-map rows;
    snapshot: each layer's phases)."""
    if isinstance(doc, ProfileReport):
        return [(r.fused, r.calls, r.time_s) for r in doc.activation_map if r.calls > 0]
    return [(lay.fused, st.calls, st.time_s) for lay in first_layers(doc)
            for st in lay.phases.values() if st.calls > 0]


def fused_fractions(rows: Iterable[tuple[bool, int, float]]) -> tuple[float | None,
                                                                       float | None]:
    """The fused fraction of calls and of attention time (None where there is nothing)."""
    calls = fused_calls = 0
    secs = fused_secs = 0.0
    for fused, c, t in rows:
        calls += c
        secs += t
        if fused:
            fused_calls += c
            fused_secs += t
    return (fused_calls / calls if calls > 0 else None,
            fused_secs / secs if secs > 0 else None)


def step_shares(doc: ProfileReport | Snapshot) -> dict[str, float]:
    """Attention's share of the step per phase. Snapshot: the ratio of sums over workers
    (pipeline stages time only their own layers; tensor-parallel ranks time the same step, so
    the ratio is theirs); keys are phases. Profile: per measured prefill length; keys
    ``prefill L=<n>``."""
    if isinstance(doc, ProfileReport):
        return {f"prefill L={r.seq_len}": r.attention_s / r.forward_s
                for r in doc.scaling.by_seq_len if r.forward_s > 0}
    model_t: dict[str, float] = {}
    attn_t: dict[str, float] = {}
    for w in doc.workers:
        for phase, sp in w.steps.items():
            model_t[phase] = model_t.get(phase, 0.0) + sp.model_time_s
            attn_t[phase] = attn_t.get(phase, 0.0) + sp.attention_time_s
    return {p: attn_t[p] / t for p, t in model_t.items() if t > 0}
