"""Compare two profiles or two snapshots: kernel changes with the input that changed, fused
fractions, attention share, per-layer time (with a statistical test), memory and the OOM
length, window advice, the context-length distribution, and what changed in provenance.

Pure: typed documents in, a typed :class:`DiffReport` out; no files, no subprocesses (the
CLI adds ``git log``). Thresholds decide which findings are regressions; noise must not
trip them, so a time regression needs both a significant test and a confidence interval
wholly beyond the threshold.
"""

from __future__ import annotations

import math
import re
import statistics
import zlib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, cast

from attnprof.aggregate.histogram import bucket_quantile
from attnprof.analyze.headline import first_layers, fused_fractions, kernel_rows, step_shares
from attnprof.analyze.twosample import distribution_distance, ratio_test
from attnprof.contracts.diff import Change, DiffReport, DiffSide, Finding, Severity
from attnprof.contracts.profile import ProfileReport
from attnprof.contracts.provenance import Provenance
from attnprof.contracts.snapshot import Snapshot
from attnprof.facts.layers import ranges_text, runs
from attnprof.facts.shape import layer_label, site_order

__all__ = [
    "DEFAULT_THRESHOLDS",
    "Incomparable",
    "compare",
    "format_layers",
    "format_sites",
    "parse_fail_on",
]

DEFAULT_THRESHOLDS: dict[str, float | None] = {
    "kernel": 1.0,
    "fused-drop": 0.05,
    "time": 0.10,
    "share": 0.10,
    "memory": 0.10,
    "oom": 0.10,
    "context-shift": None,
    "window": None,
}
"""--fail-on keys and defaults. kernel: 1 = any fused -> fallback (or known downgrade)
fails; fused-drop: fused fraction of calls or time down by more than this (absolute);
time: per-layer or total attention time up by more than this (relative, the whole 95%
interval beyond it and p < ALPHA); share: attention share of a phase up by more than this
(absolute); memory: peak memory up (relative); oom: predicted max length down (relative);
context-shift: KS distance of the context-length distributions above this; window: window
advice's attention-FLOP saving down by more than this (absolute). None: never fails."""

ALPHA = 0.01
"""Significance level of the per-layer time test (Mann-Whitney)."""
MIN_SAMPLES = 6
"""Fewest samples per side with which Mann-Whitney's p can go below ALPHA (n=5: 0.012)."""

_KERNEL_RANK = (
    (re.compile(r"\[amx\]"), 3), (re.compile(r"\[(vec|vec16|neon|vsx|vxe)\]"), 2),
    (re.compile(r"FA4"), 4), (re.compile(r"FA3"), 3), (re.compile(r"FA2"), 2),
)
"""Known orderings among fused kernel variants (higher is the faster one on its hardware):
a fused -> fused change down this list is a downgrade, not just a change."""


class Incomparable(ValueError):
    """The two inputs cannot be compared (another kind, another model); one line."""


def parse_fail_on(text: str | None) -> dict[str, float | None]:
    """``"fused-drop=5%,time=10%,oom=off"`` over :data:`DEFAULT_THRESHOLDS`; ``ValueError``
    (one line) for an unknown key or a value that is not a number, a percentage or off."""
    out = dict(DEFAULT_THRESHOLDS)
    if not text:
        return out
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        key, sep, raw = part.partition("=")
        key = key.strip().lower()
        if key not in out:
            raise ValueError(f"--fail-on: unknown check {key[:30]!r} (one of "
                             f"{', '.join(out)})")
        raw = raw.strip().lower()
        if not sep or not raw:
            raise ValueError(f"--fail-on: {key} needs a value, e.g. {key}=10% or {key}=off")
        if raw in ("off", "none", "never"):
            out[key] = None
            continue
        if key == "kernel":
            if raw in ("on", "yes", "true", "1"):
                out[key] = 1.0
                continue
            if raw in ("0", "no", "false"):
                out[key] = None
                continue
            raise ValueError(f"--fail-on: kernel={raw[:20]!r}: use kernel=on or kernel=off")
        pct = raw.endswith("%")
        try:
            value = float(raw.removesuffix("%"))
        except ValueError:
            raise ValueError(f"--fail-on: {key}={raw[:20]!r} is not a number, a percentage "
                             f"or off") from None
        if pct:
            value /= 100
        if not math.isfinite(value) or value < 0 or value > 1000:
            raise ValueError(f"--fail-on: {key}={raw[:20]!r} must be between 0 and 1000")
        if not pct and value > 1:
            # time=10 would silently mean 1000%: a missing % sign, not a threshold.
            raise ValueError(f"--fail-on: {key}={raw[:20]!r} is ambiguous: write "
                             f"{key}={value:g}% (or a fraction such as {key}=0.1)")
        out[key] = value
    return out


def format_layers(layers: Iterable[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``"layers 0-2, 5"`` (``"layer 3"`` for one)."""
    rs = runs(layers)
    if not rs:
        return "no layers"
    return (("layer " if len(rs) == 1 and rs[0][0] == rs[0][1] else "layers ")
            + ranges_text(layers, ", "))


Site = tuple[str | None, int, str]
"""(stack, layer index, kind): one attention site (an encoder-decoder numbers each stack
from 0, so the index alone would merge encoder.L0, decoder.L0 and decoder.L0.cross)."""


def _order(site: Site) -> tuple[int, str, int, int]:
    return site_order(*site)


def _label(site: Site) -> str:
    return layer_label(site[1], site[0], site[2])


_PLAIN = re.compile(r"L(\d+)")


def format_sites(labels: Iterable[str]) -> str:
    """Site labels (:func:`attnprof.facts.shape.layer_label`, in model order): plain
    one-stack layers as ranges, every other site by its label, in the order given:
    ``["L0", "L1", "L2", "L5"]`` -> ``"layers 0-2, 5"``; ``["encoder.L0",
    "decoder.L0.cross"]`` -> ``"encoder.L0, decoder.L0.cross"``."""
    xs = list(dict.fromkeys(labels))
    plain = [int(m.group(1)) for x in xs if (m := _PLAIN.fullmatch(x))]
    parts = ([format_layers(plain)] if plain else []) + \
        [x for x in xs if not _PLAIN.fullmatch(x)]
    return ", ".join(parts) if parts else "no layers"


# ----- one side, whatever the document -----
@dataclass
class _Cell:
    """One layer x shape class: the kernel that ran and the inputs that chose it."""

    kernel: str
    fused: bool
    reasons: list[str]
    inputs: dict[str, Any]


@dataclass
class _Side:
    kind: str
    model: str
    model_key: tuple[Any, ...]
    """What identifies the model when a side has no config hash (older files)."""
    provenance: Provenance | None
    cells: dict[tuple[Any, ...], _Cell] = field(default_factory=dict)
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


def _profile_side(rep: ProfileReport, name: str, raw: Mapping[str, Any]) -> _Side:
    m = rep.model
    prov = rep.provenance
    key = (m.architecture, m.num_layers, m.num_heads, m.num_kv_heads, m.head_dim)
    s = _Side(kind="attnprof.profile", model=m.name, model_key=key, provenance=prov)
    for r in rep.activation_map:
        args = r.sdpa_args or {}
        inputs = {"attn_implementation": r.impl, "mask": r.mask, "dtype": r.dtype}
        for k in ("dropout_p", "is_causal", "enable_gqa"):
            if k in args:
                inputs[k] = args[k]
        cls = ((r.stack, r.layer_idx, r.kind), r.phase, r.length_bucket,
               bool(r.tags.get("padded", False)))
        s.cells[cls] = _Cell(r.kernel, r.fused, [x.code for x in r.reasons], inputs)
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


def _snapshot_side(snap: Snapshot, name: str, raw: Mapping[str, Any]) -> _Side:
    prov = snap.provenance
    shapes = sorted({(lay.index, lay.num_heads, lay.num_kv_heads, lay.head_size)
                     for w in snap.workers for lay in w.layers})
    s = _Side(kind="attnprof.snapshot", model=snap.model, model_key=(snap.model, *shapes),
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
            s.cells[((None, lay.index, "self"), phase)] = _Cell(kernel, lay.fused, [], inputs)
            if st.recent_time_s:
                s.times.setdefault((None, lay.index, "self"), {})[phase] = \
                    list(st.recent_time_s)
        if not lay.phases:
            s.cells[((None, lay.index, "self"), "any")] = _Cell(kernel, lay.fused, [], inputs)
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


def _side_of(doc: ProfileReport | Snapshot, name: str, raw: Mapping[str, Any]) -> _Side:
    if isinstance(doc, ProfileReport):
        return _profile_side(doc, name, raw)
    return _snapshot_side(doc, name, raw)


# ----- comparisons -----
def _sev(x: str) -> Severity:
    assert x in ("regression", "improvement", "info"), x
    return cast(Severity, x)


def _rank(kernel: str) -> int | None:
    for pat, r in _KERNEL_RANK:
        if pat.search(kernel):
            return r
    return None


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:g}"
    return "none" if v is None else str(v)


def _kernel_findings(b: _Side, n: _Side, on: bool) -> tuple[list[Finding], list[str]]:
    """Layers whose kernel changed, grouped by (old, new, verdict), each with the recorded
    inputs that changed (only those both sides recorded) and new fallback reason codes."""
    groups: dict[tuple[Any, ...], dict[str, Any]] = {}
    notes: list[str] = []
    for cls in sorted(set(b.cells) & set(n.cells), key=str):
        cb, cn = b.cells[cls], n.cells[cls]
        if (cb.kernel, cb.fused) == (cn.kernel, cn.fused):
            continue
        if cb.fused and not cn.fused:
            sev = "regression"
        elif cn.fused and not cb.fused:
            sev = "improvement"
        else:
            rb, rn = _rank(cb.kernel), _rank(cn.kernel)
            sev = ("regression" if rb is not None and rn is not None and rn < rb else
                   "improvement" if rb is not None and rn is not None and rn > rb else "info")
        g = groups.setdefault((cb.kernel, cb.fused, cn.kernel, cn.fused, sev),
                              {"classes": [], "inputs": {}, "codes": []})
        g["classes"].append(cls)
        for k in sorted(set(cb.inputs) & set(cn.inputs)):
            if cb.inputs[k] != cn.inputs[k] and cb.inputs[k] is not None \
                    and cn.inputs[k] is not None:
                pair = (_fmt(cb.inputs[k]), _fmt(cn.inputs[k]))
                if pair not in g["inputs"].setdefault(k, []):
                    g["inputs"][k].append(pair)
        for c in cn.reasons:
            if c not in cb.reasons and c not in g["codes"]:
                g["codes"].append(c)
    out = []
    for (kb, fb, kn, fn, sev), g in groups.items():
        sites = sorted({c[0] for c in g["classes"]}, key=_order)
        layers = sorted({c[1] for c in sites})
        shapes = sorted({"/".join(str(x) for x in c[1:]) for c in g["classes"]})
        why = [f"{k} " + ", ".join(f"{a} -> {z}" for a, z in pairs)
               for k, pairs in g["inputs"].items()]
        if g["codes"]:
            why.append("fallback reason: " + ", ".join(g["codes"]))
        reason = ": " + "; ".join(why) if why else ": no recorded input changed"

        def label(k: str, f: bool) -> str:
            return k if f else f"{k} (fallback)"

        out.append(Finding(
            kind="kernel", severity=_sev(sev if on or sev != "regression" else "info"),
            title=(f"{format_sites(_label(x) for x in sites)}: {label(kb, fb)} -> "
                   f"{label(kn, fn)}{reason}"),
            layers=layers, sites=[_label(x) for x in sites], base=kb, new=kn, threshold="kernel",
            evidence={"shape_classes": shapes[:20], "inputs_changed": why,
                      "reason_codes": list(g["codes"])}))
    missing = len(set(b.cells) ^ set(n.cells))
    if missing:
        notes.append(f"{missing} layer/shape classes appear in one input only (not compared)")
    return out, notes


def _fused_findings(b: _Side, n: _Side, limit: float | None) -> list[Finding]:
    out = []
    base, new = fused_fractions(b.calls), fused_fractions(n.calls)
    for i, kind, what in ((0, "fused_fraction_calls", "calls"),
                          (1, "fused_fraction_time", "attention time")):
        fb, fn = base[i], new[i]
        if fb is None or fn is None:
            continue
        d = fn - fb
        sev = ("regression" if limit is not None and -d > limit else
               "improvement" if d > 0.005 else "info")
        out.append(Finding(kind=kind, severity=_sev(sev),
                           title=f"fused fraction of {what}: {fb:.0%} -> {fn:.0%}",
                           base=round(fb, 4), new=round(fn, 4), change=round(d, 4),
                           threshold="fused-drop"))
    return out


def _share_findings(b: _Side, n: _Side, limit: float | None,
                    slower: bool | None) -> list[Finding]:
    """Attention share per phase. A share is one number per side, with no spread of its own:
    a rise counts as a regression only when the time test also found attention slower
    relative to the rest of the model (``slower``; None: no per-call times to test)."""
    out = []
    for phase in sorted(set(b.shares) & set(n.shares)):
        sb, sn = b.shares[phase], n.shares[phase]
        d = sn - sb
        sev = ("regression" if limit is not None and d > limit and slower is not False
               else "info")
        out.append(Finding(kind="attention_share", severity=_sev(sev),
                           title=f"attention share of {phase}: {sb:.0%} -> {sn:.0%}",
                           base=round(sb, 4), new=round(sn, 4), change=round(d, 4),
                           threshold="share"))
    return out


def _normalised(b: _Side, n: _Side, layer: Site, relative: bool
                ) -> tuple[list[float], list[float]]:
    """Both sides' calls of one layer, each divided by the base median of its group (a
    sequence length or a phase), so groups of different lengths pool into one test.
    ``relative``: the new side is also divided by how much slower the rest of its model
    ran (a busy or slower machine slows everything; a kernel regression slows attention)."""
    gb, gn = b.times.get(layer, {}), n.times.get(layer, {})
    xb: list[float] = []
    xn: list[float] = []
    for g in sorted(set(gb) & set(gn)):
        sb, sn = _scale_group(b, n, g, gb[g], gn[g], relative)
        xb += sb
        xn += sn
    return xb, xn


def _scale_group(b: _Side, n: _Side, g: str, base: list[float], new: list[float],
                 relative: bool) -> tuple[list[float], list[float]]:
    """One group's samples divided by the base median (and the new side, ``relative``, by
    how much slower the rest of its model ran); empty when the group cannot be compared."""
    base = [x for x in base if x > 0]
    if not base or not new:
        return [], []
    k = 1.0
    if relative:
        ob, on = b.other.get(g), n.other.get(g)
        if not ob or not on:
            return [], []
        k = on / ob
    m = statistics.median(base)
    return [x / m for x in base], [x / m / k for x in new if x > 0]


def _machine_speed(b: _Side, n: _Side) -> float | None:
    """Median over groups of new/base non-attention time (1.0: the rest ran as fast)."""
    ks = [n.other[g] / b.other[g] for g in set(b.other) & set(n.other) if b.other[g] > 0]
    return statistics.median(ks) if ks else None


def _time_findings(b: _Side, n: _Side, limit: float | None) -> tuple[list[Finding],
                                                                     list[str]]:
    """Per layer and in total: attention time relative to the rest of the model when both
    sides measured it (what a regression changes and a busy machine does not), else raw."""
    speed = _machine_speed(b, n)
    relative = speed is not None
    out = []
    small = 0
    for site in sorted(set(b.times) & set(n.times), key=_order):
        xb, xn = _normalised(b, n, site, relative)
        small += min(len(xb), len(xn)) < MIN_SAMPLES
        # A plain layer keeps its index as the bootstrap seed; other sites a stable hash.
        seed = site[1] if site[0] is None and site[2] == "self" else \
            zlib.crc32(_label(site).encode())
        t = ratio_test(xb, xn, seed=seed, resamples=1000)
        if t is None:
            continue
        raw = ratio_test(*_normalised(b, n, site, False), resamples=0) if relative else t
        out.append(_time_finding("layer_time", format_sites([_label(site)]), [site[1]], t,
                                 limit, raw, relative, sites=[_label(site)]))
    t = ratio_test(*_totals(b, n, relative), seed=10_000)
    if t is not None:
        raw = ratio_test(*_totals(b, n, False), resamples=0) if relative else None
        out.insert(0, _time_finding("attention_time", "attention time per forward (all "
                                    "layers)", [], t, limit, raw, relative))
    notes = []
    if speed is not None and abs(speed - 1) > 0.10:
        notes.append(f"the rest of the model ran {speed:.2f}x as long in NEW as in BASE "
                     f"(another machine, load, or a framework change): attention times are "
                     f"compared relative to it")
    if small:
        notes.append(f"{small} layer(s) have fewer than {MIN_SAMPLES} calls per side: their "
                     f"per-layer time test cannot reach p < {ALPHA:g} (profile with more "
                     f"--repeats or lengths)")
    return out, notes


def _sums(groups: dict[Site, dict[str, list[float]]], g: str) -> list[float]:
    """Per forward (profile repeat) or step (snapshot), the sum of every layer's call in
    group ``g``: the independent unit. The calls of one forward share its machine state,
    so testing pooled calls would overstate the evidence."""
    lists = [groups[site][g] for site in sorted(groups, key=_order) if g in groups[site]]
    if not lists or len(lists) != len(groups):
        return []
    k = min(len(x) for x in lists)  # the last k calls of each layer: the same forwards
    return [sum(x[len(x) - k + i] for x in lists) for i in range(k)]


def _totals(b: _Side, n: _Side, relative: bool) -> tuple[list[float], list[float]]:
    """Per-forward attention totals of both sides, each group divided by its base median
    (and, ``relative``, the new side by how much slower the rest of the model ran)."""
    layers = sorted(set(b.times) & set(n.times), key=_order)
    tb = {layer: b.times[layer] for layer in layers}
    tn = {layer: n.times[layer] for layer in layers}
    groups = set.intersection(*(set(tb[x]) & set(tn[x]) for x in layers)) if layers else set()
    xb: list[float] = []
    xn: list[float] = []
    for g in sorted(groups):
        sb, sn = _scale_group(b, n, g, _sums(tb, g), _sums(tn, g), relative)
        xb += sb
        xn += sn
    return xb, xn


def _time_finding(kind: str, what: str, layers: list[int], t: Any, limit: float | None,
                  raw: Any, relative: bool, sites: list[str] | None = None) -> Finding:
    slower = t.p_value < ALPHA and limit is not None and t.low > 1 + limit
    faster = t.p_value < ALPHA and t.high < 1 - (0.10 if limit is None else limit)
    sev = "regression" if slower else "improvement" if faster else "info"
    rel = " relative to the rest of the model" if relative else ""
    if relative and raw is not None and kind == "attention_time":
        rel += f" (raw {raw.ratio - 1:+.0%})"
    ev = {"ratio": round(t.ratio, 4), "ci_low": round(t.low, 4), "ci_high": round(t.high, 4),
          "p_value": t.p_value, "n_base": t.n_base, "n_new": t.n_new, "relative": relative,
          "test": "Mann-Whitney U; bootstrap 95% CI of the ratio of medians"}
    if raw is not None and relative:
        ev["raw_ratio"] = round(raw.ratio, 4)
    return Finding(
        kind=kind, severity=_sev(sev),
        title=(f"{what}: {t.ratio - 1:+.0%}{rel} (95% CI {t.low - 1:+.0%} to "
               f"{t.high - 1:+.0%}, p={t.p_value:.2g}, n={t.n_base}/{t.n_new})"),
        layers=layers, sites=sites or [], base=1.0, new=round(t.ratio, 4),
        change=round(t.ratio - 1, 4),
        threshold="time", evidence=ev)


def _memory_findings(b: _Side, n: _Side, th: Mapping[str, float | None]) -> list[Finding]:
    out = []
    lim = th.get("memory")
    for key in sorted(set(b.memory) & set(n.memory), key=lambda k: int(k.split("=")[-1])):
        mb, mn = b.memory[key], n.memory[key]
        if mb <= 0:
            continue
        ch = mn / mb - 1
        sev = ("regression" if lim is not None and ch > lim else
               "improvement" if ch < -(lim or 0.10) else "info")
        out.append(Finding(kind="memory", severity=_sev(sev),
                           title=f"{key}: {mb / 2**20:,.1f} -> {mn / 2**20:,.1f} MiB "
                                 f"({ch:+.0%})",
                           base=mb, new=mn, change=round(ch, 4), threshold="memory"))
    if b.oom and n.oom:
        lim = th.get("oom")
        ch = n.oom / b.oom - 1
        sev = ("regression" if lim is not None and -ch > lim else
               "improvement" if ch > (lim or 0.10) else "info")
        out.append(Finding(kind="oom", severity=_sev(sev),
                           title=f"predicted max sequence length: {b.oom:,} -> {n.oom:,} "
                                 f"({ch:+.0%})"
                                 + (f"; new: {n.oom_how}" if n.oom_how else ""),
                           base=b.oom, new=n.oom, change=round(ch, 4), threshold="oom"))
    elif (b.oom is None) != (n.oom is None) and b.kind == "attnprof.profile":
        out.append(Finding(kind="oom", severity="info",
                           title=f"predicted max sequence length: {_fmt(b.oom)} -> "
                                 f"{_fmt(n.oom)} (one side measured fewer than two lengths: "
                                 f"not compared)", base=b.oom, new=n.oom))
    if b.kv_bytes and n.kv_bytes and b.kv_bytes != n.kv_bytes:
        ch = n.kv_bytes / b.kv_bytes - 1
        out.append(Finding(kind="kv_cache", severity="info",
                           title=f"KV cache: {b.kv_bytes / 2**20:,.1f} -> "
                                 f"{n.kv_bytes / 2**20:,.1f} MiB ({ch:+.0%})",
                           base=b.kv_bytes, new=n.kv_bytes, change=round(ch, 4)))
    return out


def _window_findings(b: _Side, n: _Side, lim: float | None) -> list[Finding]:
    if b.window is None or n.window is None:
        return []
    wb, wn = b.window, n.window
    fb, fn = wb.get("attention_flop_saving") or 0.0, wn.get("attention_flop_saving") or 0.0
    same = (wb.get("window"), wb.get("sinks")) == (wn.get("window"), wn.get("sinks"))
    d = fn - fb
    if same and abs(d) < 0.005:
        return []
    sev = "regression" if lim is not None and -d > lim else "info"
    return [Finding(kind="window_advice", severity=_sev(sev),
                    title=(f"window advice: sinks {_fmt(wb.get('sinks'))} + window "
                           f"{_fmt(wb.get('window'))} -> sinks {_fmt(wn.get('sinks'))} + "
                           f"window {_fmt(wn.get('window'))}; attention FLOPs saved "
                           f"{fb:.0%} -> {fn:.0%}"),
                    base=round(fb, 4), new=round(fn, 4), change=round(d, 4),
                    threshold="window",
                    evidence={"base_summary": wb.get("summary"),
                              "new_summary": wn.get("summary")})]


def _context_findings(b: _Side, n: _Side, lim: float | None) -> tuple[list[Finding],
                                                                        list[str]]:
    if b.context is None or n.context is None:
        return [], []
    (bb, cb), (bn, cn) = b.context, n.context
    if bb != bn:
        return [], ["context-length histograms use different buckets (max_model_len "
                    "changed?): distribution not compared"]
    d = distribution_distance(bb, cb, cn)
    if d is None:
        return [], ["no finished requests on one side: context lengths not compared"]
    ks, w1 = d

    def p50(counts: list[int]) -> float:  # bb is non-empty: distribution_distance checked
        return bucket_quantile(bb, counts, 0.5) or 0.0

    sev = "regression" if lim is not None and ks > lim else "info"
    return [Finding(kind="context_shift", severity=_sev(sev),
                    title=(f"context lengths: KS distance {ks:.2f}, "
                           f"{w1:.2f} octaves moved; median bucket <= {p50(cb):,.0f} -> "
                           f"<= {p50(cn):,.0f} tokens ({sum(cb)} vs {sum(cn)} requests)"),
                    base=sum(cb), new=sum(cn), change=round(ks, 4), threshold="context-shift",
                    evidence={"ks": round(ks, 4), "wasserstein_octaves": round(w1, 4)})], []


_PROV_FIELDS = ("attnprof", "python", "torch", "transformers", "vllm")


def _changes(b: Provenance | None, n: Provenance | None) -> list[Change]:
    if b is None or n is None:
        return []
    jb, jn = b.to_json(), n.to_json()
    out = [Change(field=k, base=jb.get(k), new=jn.get(k)) for k in _PROV_FIELDS
           if jb.get(k) != jn.get(k)]
    for part in ("hardware", "model"):
        pb, pn = jb.get(part) or {}, jn.get(part) or {}
        for k in sorted(set(pb) | set(pn)):
            if pb.get(k) != pn.get(k):
                out.append(Change(field=f"{part}.{k}", base=pb.get(k), new=pn.get(k)))
    gb, gn = jb.get("git") or {}, jn.get("git") or {}
    for k in ("revision", "dirty"):
        if gb.get(k) != gn.get(k):
            out.append(Change(field=f"git.{k}", base=gb.get(k), new=gn.get(k)))
    if jb.get("command") != jn.get("command"):
        out.append(Change(field="command", base=" ".join(jb.get("command") or []),
                          new=" ".join(jn.get("command") or [])))
    return out


_RUN_FIELDS = ("seq_lens", "batch_size", "repeats", "train", "attention_dropout")


def _run_changes(base: ProfileReport | Snapshot, new: ProfileReport | Snapshot
                 ) -> list[Change]:
    """How the two profiles were run, where it differs (attn_implementation, training mode,
    lengths): often the whole story of a kernel change."""
    if not isinstance(base, ProfileReport) or not isinstance(new, ProfileReport):
        return []
    out = []
    if base.model.attn_implementation != new.model.attn_implementation:
        out.append(Change(field="model.attn_implementation",
                          base=base.model.attn_implementation,
                          new=new.model.attn_implementation))
    if base.model.dtype != new.model.dtype:
        out.append(Change(field="model.dtype", base=base.model.dtype, new=new.model.dtype))
    for k in _RUN_FIELDS:
        vb, vn = getattr(base.run, k), getattr(new.run, k)
        if vb != vn:
            out.append(Change(field=f"run.{k}", base=vb, new=vn))
    return out


def compare(base: ProfileReport | Snapshot, new: ProfileReport | Snapshot, *,
            base_name: str = "BASE", new_name: str = "NEW",
            base_raw: Mapping[str, Any] | None = None, new_raw: Mapping[str, Any] | None = None,
            thresholds: Mapping[str, float | None] | None = None,
            allow_model_change: bool = False) -> DiffReport:
    """The diff of two documents of one kind; :class:`Incomparable` (one line) for two
    kinds, or two models without ``allow_model_change``."""
    th = dict(DEFAULT_THRESHOLDS)
    th.update(thresholds or {})
    if type(base) is not type(new):
        def what(d: Any) -> str:
            return "a profile" if isinstance(d, ProfileReport) else "a snapshot"

        raise Incomparable(f"{base_name} is {what(base)} and {new_name} is {what(new)}: "
                           f"diff two profiles or two snapshots/records")
    b = _side_of(base, base_name, base_raw or {})
    n = _side_of(new, new_name, new_raw or {})
    notes: list[str] = []
    hb = b.provenance.model.config_sha256 if b.provenance is not None else None
    hn = n.provenance.model.config_sha256 if n.provenance is not None else None
    # The config hash when both sides have one; else the attention shape (and label).
    if (hb != hn) if hb and hn else (b.model_key != n.model_key):
        if not allow_model_change:
            raise Incomparable(f"{base_name} ({b.model}) and {new_name} ({n.model}) are "
                               f"different models (config differs); pass "
                               f"--allow-model-change to compare them anyway")
        notes.append(f"different models compared on purpose: {b.model} vs {n.model}")
    findings, knotes = _kernel_findings(b, n, th.get("kernel") is not None)
    notes += knotes
    findings += _fused_findings(b, n, th.get("fused-drop"))
    tf, tnotes = _time_findings(b, n, th.get("time"))
    total = next((f for f in tf if f.kind == "attention_time"), None)
    slower = None if total is None else bool(
        total.evidence["p_value"] < ALPHA and total.evidence["ci_low"] > 1.0)
    findings += _share_findings(b, n, th.get("share"), slower)
    findings += tf
    notes += tnotes
    findings += _memory_findings(b, n, th)
    findings += _window_findings(b, n, th.get("window"))
    ctx, cnotes = _context_findings(b, n, th.get("context-shift"))
    findings += ctx
    notes += cnotes
    if not b.times or not n.times:
        notes.append("per-call times missing on one side (a file from before profile 1.2 / "
                     "snapshot 1.5): per-layer time not tested")
    assert b.side is not None and n.side is not None
    return DiffReport(base=b.side, new=n.side,
                      regression=any(f.severity == "regression" for f in findings),
                      thresholds=th, findings=findings,
                      changes=_run_changes(base, new) + _changes(b.provenance, n.provenance),
                      notes=notes)
