"""One input of ``attnprof diff``, whatever the document: a profile or a snapshot read into
the same :class:`Side` (kernel per layer x shape class, per-call times per site, memory,
OOM length, window advice, context lengths), so each comparison is written once.

Changes here when a profile or snapshot field a comparison needs is added or moved."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from attnprof.analyze.headline import first_layers, kernel_rows, step_shares
from attnprof.contracts.diff import DiffSide
from attnprof.contracts.profile import ProfileReport
from attnprof.contracts.provenance import Provenance
from attnprof.contracts.snapshot import Snapshot
from attnprof.facts.shape import layer_label, site_order

__all__ = ["Cell", "Side", "Site", "side_of", "site_key", "site_label"]

Site = tuple[str | None, int, str]
"""(stack, layer index, kind): one attention site (an encoder-decoder numbers each stack
from 0, so the index alone would merge encoder.L0, decoder.L0 and decoder.L0.cross)."""


def site_key(site: Site) -> tuple[int, str, int, int]:
    """Model order of a site (encoder before decoder, self before cross)."""
    return site_order(*site)


def site_label(site: Site) -> str:
    """The site's label (``L3``, ``decoder.L0.cross``): what findings name it by."""
    return layer_label(site[1], site[0], site[2])


@dataclass
class Cell:
    """One layer x shape class: the kernel that ran and the inputs that chose it."""

    kernel: str
    fused: bool
    reasons: list[str]
    inputs: dict[str, Any]


@dataclass
class Side:
    """One input of a diff, whatever the document: what every comparison reads."""

    kind: str
    model: str
    model_key: tuple[Any, ...]
    """What identifies the model when a side has no config hash (older files)."""
    provenance: Provenance | None
    cells: dict[tuple[Any, ...], Cell] = field(default_factory=dict)
    calls: list[tuple[bool, int, float]] = field(default_factory=list)
    """(fused, calls, time_s) per layer x shape class."""
    shares: dict[str, float] = field(default_factory=dict)
    times: dict[Site, dict[str, list[float]]] = field(default_factory=dict)
    """site -> group (seq_len or phase) -> per-call seconds."""
    other: dict[str, float] = field(default_factory=dict)
    """group -> seconds of the model's non-attention work (per forward or per step): the
    run's own yardstick for machine speed."""
    memory: dict[str, float] = field(default_factory=dict)
    oom: int | None = None
    oom_how: str = ""
    """How sure the prediction is: its extrapolation factor and confidence (profiles)."""
    kv_bytes: int | None = None
    window: dict[str, Any] | None = None
    context: tuple[list[float], list[int]] | None = None
    side: DiffSide | None = None


def _profile_side(rep: ProfileReport, name: str, raw: Mapping[str, Any]) -> Side:
    m = rep.model
    prov = rep.provenance
    key = (m.architecture, m.num_layers, m.num_heads, m.num_kv_heads, m.head_dim)
    s = Side(kind="attnprof.profile", model=m.name, model_key=key, provenance=prov)
    for r in rep.activation_map:
        args = r.sdpa_args or {}
        inputs = {"attn_implementation": r.impl, "mask": r.mask, "dtype": r.dtype}
        for k in ("dropout_p", "is_causal", "enable_gqa"):
            if k in args:
                inputs[k] = args[k]
        cls = ((r.stack, r.layer_idx, r.kind), r.phase, r.length_bucket,
               bool(r.tags.get("padded", False)))
        s.cells[cls] = Cell(r.kernel, r.fused, [x.code for x in r.reasons], inputs)
    s.calls = kernel_rows(rep)
    s.shares = step_shares(rep)
    for row in rep.scaling.by_seq_len:
        if row.forward_s > row.attention_s:
            s.other[f"L={row.seq_len}"] = row.forward_s - row.attention_s
        s.memory[f"peak at L={row.seq_len}"] = float(row.peak_total_bytes)
    for lay in rep.layers:
        t = lay.timing
        groups = t.samples_s_by_seq_len or {k: [v] for k, v in t.median_s_by_seq_len.items()}
        s.times[(lay.stack, lay.layer, lay.kind)] = {f"L={k}": list(v) for k, v in groups.items()}
    s.oom = rep.oom_prediction.max_seq_len
    o = rep.oom_prediction
    if o.confidence is not None and o.extrapolation_factor is not None:
        s.oom_how = (f"{'an extrapolation, ' if o.extrapolation else ''}"
                     f"{o.extrapolation_factor:g}x the longest measured length, "
                     f"confidence {o.confidence}")
    if rep.window_advice is not None:
        s.window = rep.window_advice.to_json()
    s.side = DiffSide(file=name, kind=s.kind, schema_version=str(raw.get("schema_version")),
                      model=m.name, time_iso=prov.time_iso if prov else None,
                      git_revision=prov.git.revision if prov and prov.git else None,
                      git_dirty=prov.git.dirty if prov and prov.git else None)
    return s


def _snapshot_side(snap: Snapshot, name: str, raw: Mapping[str, Any]) -> Side:
    prov = snap.provenance
    shapes = sorted({(lay.index, lay.num_heads, lay.num_kv_heads, lay.head_size)
                     for w in snap.workers for lay in w.layers})
    s = Side(kind="attnprof.snapshot", model=snap.model, model_key=(snap.model, *shapes),
              provenance=prov)
    kv = 0
    for lay in first_layers(snap):
        kv += lay.kv_cache_bytes
        kernel = lay.kernel or lay.backend
        inputs = {"backend": lay.backend, "impl": lay.impl, "dtype": lay.dtype,
                  "kv_cache_dtype": lay.kv_cache_dtype, "head_size": lay.head_size,
                  "sliding_window": lay.sliding_window, "attn_type": lay.attn_type,
                  "has_sink": lay.has_sink}
        for phase, st in lay.phases.items():
            s.cells[((None, lay.index, "self"), phase)] = Cell(kernel, lay.fused, [], inputs)
            if st.recent_time_s:
                s.times.setdefault((None, lay.index, "self"), {})[phase] = \
                    list(st.recent_time_s)
        if not lay.phases:
            s.cells[((None, lay.index, "self"), "any")] = Cell(kernel, lay.fused, [], inputs)
    s.kv_bytes = kv or None
    s.calls = kernel_rows(snap)
    s.shares = step_shares(snap)
    other: dict[str, list[float]] = {}
    for w in snap.workers:
        for phase, step in w.steps.items():
            o = other.setdefault(phase, [0.0, 0.0])
            o[0] += step.model_time_s - step.attention_time_s
            o[1] += step.steps
    s.other = {p: t / n for p, (t, n) in other.items() if n > 0 and t > 0}
    if snap.window_advice is not None and hasattr(snap.window_advice, "summary"):
        s.window = snap.window_advice.to_json()
    req = snap.requests
    if req is not None and req.context_histogram is not None:
        s.context = (list(req.context_histogram.bounds), list(req.context_histogram.counts))
    s.side = DiffSide(file=name, kind=s.kind, schema_version=str(raw.get("schema_version")),
                      model=snap.model, time_iso=prov.time_iso if prov else None,
                      git_revision=prov.git.revision if prov and prov.git else None,
                      git_dirty=prov.git.dirty if prov and prov.git else None,
                      window_s=snap.window.duration_s if snap.window else None)
    return s


def side_of(doc: ProfileReport | Snapshot, name: str, raw: Mapping[str, Any]) -> Side:
    """The :class:`Side` of a profile or a snapshot (``raw``: its JSON, for the schema
    version); reads only, never raises on a document that parsed."""
    if isinstance(doc, ProfileReport):
        return _profile_side(doc, name, raw)
    return _snapshot_side(doc, name, raw)
