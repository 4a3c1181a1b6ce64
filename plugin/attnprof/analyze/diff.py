"""Compare two profiles or two snapshots: kernel changes with the input that changed, fused
fractions, attention share, per-layer time (with a statistical test), memory and the OOM
length, window advice, the context-length distribution, and what changed in provenance.

Pure: typed documents in, a typed :class:`DiffReport` out; no files, no subprocesses, no
``git`` (the revisions each file recorded are compared; a note says how to list the commits
between them, for the reader to run in a checkout they trust). Thresholds decide which
findings are regressions; noise must not trip them, so a time regression needs both a
significant test and a confidence interval wholly beyond the threshold. The parts that
change for their own reasons live beside it:
:mod:`.diff_sides` reads each document into one shape, :mod:`.diff_time` is the time test,
:mod:`.diff_thresholds` the ``--fail-on`` checks and their parser.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any, cast

from attnprof.aggregate.histogram import bucket_quantile
from attnprof.analyze.diff_sides import Side, side_of, site_key, site_label
from attnprof.analyze.diff_thresholds import DEFAULT_THRESHOLDS
from attnprof.analyze.diff_time import ALPHA, time_findings
from attnprof.analyze.headline import fused_fractions
from attnprof.analyze.twosample import distribution_distance
from attnprof.contracts.diff import Change, DiffReport, Finding, Severity
from attnprof.contracts.profile import ProfileReport
from attnprof.contracts.provenance import Provenance
from attnprof.contracts.snapshot import Snapshot
from attnprof.facts.layers import format_sites

__all__ = ["Incomparable", "compare"]

_KERNEL_RANK = (
    (re.compile(r"\[amx\]"), 3), (re.compile(r"\[(vec|vec16|neon|vsx|vxe)\]"), 2),
    (re.compile(r"FA4"), 4), (re.compile(r"FA3"), 3), (re.compile(r"FA2"), 2),
)
"""Known orderings among fused kernel variants (higher is the faster one on its hardware):
a fused -> fused change down this list is a downgrade, not just a change."""


class Incomparable(ValueError):
    """The two inputs cannot be compared (another kind, another model); one line."""


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


def _kernel_findings(b: Side, n: Side, on: bool) -> tuple[list[Finding], list[str]]:
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
        sites = sorted({c[0] for c in g["classes"]}, key=site_key)
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
            title=(f"{format_sites(site_label(x) for x in sites)}: {label(kb, fb)} -> "
                   f"{label(kn, fn)}{reason}"),
            layers=layers, sites=[site_label(x) for x in sites], base=kb, new=kn,
            threshold="kernel",
            evidence={"shape_classes": shapes[:20], "inputs_changed": why,
                      "reason_codes": list(g["codes"])}))
    missing = len(set(b.cells) ^ set(n.cells))
    if missing:
        notes.append(f"{missing} layer/shape classes appear in one input only (not compared)")
    return out, notes


def _fused_findings(b: Side, n: Side, limit: float | None) -> list[Finding]:
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


def _share_findings(b: Side, n: Side, limit: float | None,
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




def _memory_findings(b: Side, n: Side, th: Mapping[str, float | None]) -> list[Finding]:
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


def _window_findings(b: Side, n: Side, lim: float | None) -> list[Finding]:
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


def _context_findings(b: Side, n: Side, lim: float | None) -> tuple[list[Finding],
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


_REVISION = re.compile(r"[0-9a-f]{7,64}")
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
    b = side_of(base, base_name, base_raw or {})
    n = side_of(new, new_name, new_raw or {})
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
    tf, tnotes = time_findings(b, n, th.get("time"))
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
    rb, rn = b.side.git_revision if b.side else None, n.side.git_revision if n.side else None
    if rb and rn and rb != rn and _REVISION.fullmatch(rb) and _REVISION.fullmatch(rn):
        # Only hex revisions reach a command a reader may paste into a shell.
        notes.append(f"attnprof's source changed: git log --oneline {rb[:12]}..{rn[:12]} in "
                     f"attnprof's checkout lists the commits (diff runs no git)")
    if not b.times or not n.times:
        notes.append("per-call times missing on one side (a file from before profile 1.2 / "
                     "snapshot 1.5): per-layer time not tested")
    assert b.side is not None and n.side is not None
    return DiffReport(base=b.side, new=n.side,
                      regression=any(f.severity == "regression" for f in findings),
                      thresholds=th, findings=findings,
                      changes=_run_changes(base, new) + _changes(b.provenance, n.provenance),
                      notes=notes)
