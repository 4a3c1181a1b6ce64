"""The terminal summary of an ``attnprof profile`` run or ``--show FILE``: the kernel
activation map, scaling, the attention paths, the OOM prediction, advice and what was
written. Plain text over a :class:`~attnprof.contracts.profile.ProfileReport`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from attnprof.contracts.profile import ProfileReport
from attnprof.facts.shape import layer_label

__all__ = ["how_sure", "summary"]


def _n(x: int | None) -> str:
    return "?" if x is None else f"{x:,}"


def how_sure(factor: float | None, extrapolation: bool | None, confidence: str | None,
              longest: int, validated: bool = False) -> str:
    """" (EXTRAPOLATION: 71x the longest measured length (256), confidence low)"; empty for
    profiles written before predictions carried these. ``validated``: a run at the predicted
    length agreed within 5%, which is why an extrapolation can be high confidence."""
    if confidence is None:
        return ""
    if factor is None:
        return f" (confidence {confidence})"
    word = ("EXTRAPOLATION (validated): " if validated else "EXTRAPOLATION: ") \
        if extrapolation else ""
    return (f" ({word}{factor:g}x the longest measured length ({longest}), "
            f"confidence {confidence})")


def _gib(b: float | None) -> str:
    return "-" if b is None else f"{b / 2**30:.2f} GiB"


def summary(res: ProfileReport, out_dir: Path) -> str:
    """The terminal summary of a profile (kernel map, scaling, OOM prediction, advice)."""
    m = res.model
    lines = [f"{m.name}: {m.architecture}, {m.num_layers} layers, "
             f"{m.num_heads}/{m.num_kv_heads} heads x {m.head_dim}, {m.dtype}, "
             f"attn_implementation={m.attn_implementation}", ""]
    lines.append("Kernel activation map (per shape class; same for every layer unless listed):")
    groups: dict[tuple[Any, ...], list[int]] = {}
    # Encoder-decoder models: encoder, decoder and cross-attention sites named apart.
    sites = {(r.stack, r.layer_idx, r.kind): layer_label(r.layer_idx, r.stack, r.kind)
             for r in res.activation_map if r.stack is not None or r.kind != "self"}
    site_groups: dict[tuple[Any, ...], list[str]] = {}
    for r in res.activation_map:
        key = (r.phase, r.mask, r.length_bucket, r.kernel, r.fused,
               "; ".join(x.code for x in r.reasons))
        groups.setdefault(key, []).append(r.layer_idx)
        site_groups.setdefault(key, []).append(layer_label(r.layer_idx, r.stack, r.kind))
    lines.append(f"{'phase':<8} {'mask':<6} {'bucket':>6}  {'kernel':<10} {'fused':<5} "
                 f"{'layers':<10} reasons")
    for (ph, mk, bk, kern, fu, why), lays in sorted(groups.items(), key=lambda kv: kv[0][:3]):
        lay = "all" if len(set(lays)) == m.num_layers else ",".join(map(str, sorted(
            set(lays))))[:10]
        if sites:
            named = site_groups[(ph, mk, bk, kern, fu, why)]
            lay = "all" if set(named) == set(sites.values()) else ",".join(
                dict.fromkeys(named))
        lines.append(f"{ph:<8} {mk:<6} {bk:>6}  {kern:<10} {'yes' if fu else 'no':<5} "
                     f"{lay:<10} {why or '-'}")
    routed = sorted({layer_label(r.layer_idx, r.stack, r.kind) for r in res.activation_map
                     if r.impl == "module"})
    if routed:
        lines.append(f"note: {len(routed)} attention module(s) do not call transformers' "
                     "attention registry; profiled by wrapping their forward (time includes "
                     "their projections; no per-call records): " + ",".join(routed))
    lines += ["", f"Scaling (model forward, batch {res.run.batch_size}):",
              f"{'seq_len':>8} {'forward s':>10} {'attn s':>8} {'peak':>11} {'KV cache':>11}"]
    for row in res.scaling.by_seq_len:
        lines.append(f"{row.seq_len:>8} {row.forward_s:>10.3f} {row.attention_s:>8.3f} "
                     f"{_gib(row.peak_total_bytes):>11} "
                     f"{_gib(row.kv_cache_bytes_analytic):>11}")
    lines += ["", "Attention paths (one layer call, this model's shape):",
              f"{'path':<10} {'seq_len':>8} {'time ms':>9} {'peak MiB':>9} {'model MiB':>9}"]
    for path, e in res.scaling.paths.items():
        for L, t in e.time_s.items():
            pk = e.peak_bytes[L]
            an = e.analytic_peak_bytes.get(L, 0)
            lines.append(f"{path:<10} {L:>8} {t * 1e3:>9.2f} {pk / 2**20:>9.1f} "
                         f"{an / 2**20:>9.1f}")
    o = res.oom_prediction
    longest = max(res.run.seq_lens) if res.run.seq_lens else 0
    # Counted per attention site (encoder, decoder and cross-attention apart) when known.
    per = o.attention_sites or o.attention_paths
    n_all = sum(len(v) for v in o.attention_sites.values()) if o.attention_sites \
        else m.num_layers
    unit = "sites" if o.attention_sites and any(
        "." in x for v in o.attention_sites.values() for x in v) else "layers"
    ran = "; ".join(f"{p}: {'all' if len(ls) == n_all else len(ls)} {unit}"
                    for p, ls in per.items())
    v = o.validation
    validated = bool(v is not None and v.fits_budget and v.rel_error is not None
                     and v.rel_error <= 0.05)
    how = how_sure(o.extrapolation_factor, o.extrapolation, o.confidence, longest,
                    validated=validated)
    lines += ["", f"OOM prediction for a {_gib(o.memory_budget_bytes)} budget"
                  f"{f' (attention as this model ran it: {ran})' if ran else ''}: "
                  f"max seq_len {_n(o.max_seq_len)} at batch {o.batch_size}"
                  f"{how}"]
    if o.max_seq_len and o.model_max_context and o.max_seq_len > o.model_max_context:
        lines.append(f"  beyond the model's maximum context ({_n(o.model_max_context)} tokens): "
                     f"memory would allow {_n(o.max_seq_len)}, the model's positions do not")
    if o.analytic_max_seq_len is not None:
        lines.append(f"  analytic bound (weights + KV cache + attention peaks alone): "
                     f"{_n(o.analytic_max_seq_len)}")
    if o.note:
        lines.append(f"  note: {o.note}")
    for path, w in o.if_attention_path.items():
        lines.append(f"  if attention ran on {path}: max seq_len {_n(w.max_seq_len)}"
                     f"{how_sure(w.extrapolation_factor, w.extrapolation, w.confidence, longest)}")
    v = o.validation
    if v is not None and v.measured_peak_bytes is not None:
        lines.append(f"  validated at L={v.seq_len}: measured {_gib(v.measured_peak_bytes)}"
                     f" vs predicted {_gib(v.predicted_peak_bytes)} "
                     f"({(v.rel_error or 0.0) * 100:.1f}% off), fits budget: {v.fits_budget}")
    elif v is not None and v.skipped:
        lines.append(f"  validation skipped: {v.skipped}")
    lines += ["", "Advice:"]
    for a in res.advice:
        gain = a.expected_gain
        g = (f" (expected: {gain.speedup}x faster, "
             f"{'?' if gain.memory_ratio is None else gain.memory_ratio}x less "
             f"attention memory at L={gain.at_seq_len})"
             if gain is not None and gain.speedup is not None else "")
        lines.append(f"  - [{a.reason}] {a.change}{g}")
    wall = "?" if res.run.wall_s is None else res.run.wall_s
    files = [v for k, v in res.outputs.items() if k != "tensorboard"] or [
        "profile.json", "trace.json", "scaling.png"]
    lines += ["", f"wrote {out_dir}/{', '.join(files)} ({wall} s)"]
    if "tensorboard" in res.outputs:
        lines.append(f"TensorBoard events: {res.outputs['tensorboard']}")
    if res.window_advice is not None:
        lines.append(f"Window advice: {res.window_advice.summary}")
    if res.roofline is not None:
        from attnprof.exporters.roofline_plot import summary_lines

        lines += ["", "Roofline (attention vs the probed peaks):"]
        lines += ["  " + x for x in summary_lines(res.roofline)]
    return "\n".join(lines)
