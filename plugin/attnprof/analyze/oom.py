"""OOM prediction bounded by the analytic memory model.

Predictions (:func:`predict_oom`) never rest on the fit alone. A fit through a few short
lengths cannot see the score matrices an unfused path must hold at long lengths (two points
give no L^2 term at all), so the analytic memory model (:mod:`attnprof.analyze.memory`) sets a
floor under the predicted peak: weights + the KV cache held up to each layer + that layer's
modeled attention peak on the path it actually ran (+ eager's model-level mask). The predicted
peak is ``max(floor(L) + R(L), F(L))``: ``R`` fits what the measured attention-moment peaks hold
beyond the floor (hidden states; non-negative, so never below the floor), ``F`` fits the
whole forward's peak linearly (logits and MLP activations, which grow with L only). The
prediction is thus never past the analytic bound (the largest L the floor alone allows).
Each prediction carries its extrapolation factor and a confidence (:func:`confidence`).
:func:`oom_prediction` assembles profile.json's ``oom_prediction`` from these. Pure.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Literal

from attnprof.analyze.memory import (
    AttnShape,
    analytic_attention_peak,
    kv_bytes_per_token,
    model_mask_bytes,
)
from attnprof.analyze.scaling import PATHS, eval_poly2, fit_poly2, predict_max
from attnprof.contracts.profile import (
    ActivationRow,
    LayerReport,
    OomPrediction,
    Scaling,
    Validation,
    WhatIf,
)
from attnprof.facts.shape import AttentionShape, layer_label, site_order

__all__ = [
    "CONFIDENCE_RULE",
    "EXTRAPOLATION_LIMIT",
    "FloorSite",
    "Prediction",
    "Site",
    "analytic_path",
    "attention_model_error",
    "confidence",
    "floor_sites",
    "forward_floor",
    "oom_prediction",
    "predict_oom",
    "run_sites",
    "site_causal",
]

Confidence = Literal["high", "medium", "low"]

EXTRAPOLATION_LIMIT = 4.0
"""Beyond this extrapolation factor (predicted length / longest measured length) every output
says the prediction is an extrapolation. Its confidence is then low unless a run at the
predicted length validated it (measured peak within 5%, under the budget): a validated
prediction is high at any factor (see :data:`CONFIDENCE_RULE`)."""

CONFIDENCE_RULE = (
    "high: validated by a run at the predicted length (measured peak within 5% and under the "
    "budget), or at most 2x the longest measured length; medium: at most "
    f"{EXTRAPOLATION_LIMIT:g}x; low: beyond {EXTRAPOLATION_LIMIT:g}x (an extrapolation), or "
    "no length fits the budget; one level lower when the analytic attention model misses the "
    "measured attention peaks by more than 10%")


def analytic_path(kernel: str | None) -> str:
    """The memory model's path for a kernel-map kernel: eager, math, or flash_cpu (every
    fused kernel holds no score matrix; the CPU tiles bound the GPU ones from above)."""
    if kernel in ("eager", "math"):
        return str(kernel)
    return "flash_cpu"


@dataclass(frozen=True)
class Site:
    """One attention site as it ran (:func:`run_sites`): its stack (None: single-stack
    model), layer index, kind (self/cross), label (:func:`attnprof.facts.shape.layer_label`)
    and the memory model's path (:func:`analytic_path`)."""

    stack: str | None
    layer: int
    kind: str
    label: str
    path: str


def run_sites(activation_map: Sequence[ActivationRow], num_layers: int) -> list[Site]:
    """Each attention site's path, in model order, from the kernel map: for an unpadded
    prefill (the calls the scaling runs make) the longest length bucket wins (the
    dispatcher may change kernel with length); a site without such a row takes its
    costliest kernel seen. Sites are told apart by (stack, layer, kind), so an
    encoder-decoder's encoder.L0, decoder.L0 and decoder.L0.cross are three sites; a
    single-stack model without rows for some layers gets them as plain sites."""
    best: dict[tuple[str | None, int, str], tuple[int, str]] = {}
    seen: dict[tuple[str | None, int, str], set[str]] = {}
    for r in activation_map:
        key = (r.stack, int(r.layer_idx), r.kind)
        seen.setdefault(key, set()).add(analytic_path(r.kernel))
        if r.phase == "prefill" and r.mask == "none":
            b = int(r.length_bucket or 0)
            if key not in best or b >= best[key][0]:
                best[key] = (b, analytic_path(r.kernel))
    if not any(k[0] is not None for k in seen):
        for i in range(num_layers):
            seen.setdefault((None, i, "self"), set())
    order = {"eager": 0, "math": 1, "flash_cpu": 2}
    out = []
    for site in sorted(seen, key=lambda k: site_order(k[0], k[1], k[2])):
        stack, i, kind = site
        path = best[site][1] if site in best else min(seen[site] or {"flash_cpu"},
                                                      key=order.__getitem__)
        out.append(Site(stack, i, kind, layer_label(i, stack, kind), path))
    return out


@dataclass(frozen=True)
class FloorSite:
    """One attention site of a prefill forward, in execution order, for
    :func:`forward_floor`: the path it runs, its own mask, whether it writes a KV cache
    (decoder self- and cross-attention do; encoder layers hold none), whether its queries
    are an encoder-decoder's decoder (``decoder_len(L)`` of them) and its keys the
    encoder's (cross-attention), and its sliding window."""

    path: str
    causal: bool = True
    keeps_kv: bool = True
    decoder: bool = False
    cross: bool = False
    window: int | None = None


def forward_floor(L: int, *, static_bytes: float, batch: int, num_heads: int, num_kv_heads: int,
                  head_dim: int, dtype: str, layer_paths: Sequence[str] = (),
                  layer_windows: Sequence[int | None] | None = None,
                  threads: int | None = None, sites: Sequence[FloorSite] | None = None,
                  decoder_len: Callable[[int], int] | None = None) -> float:
    """Analytic lower bound of a length-L prefill forward's peak: weights + max over sites
    of (KV cache written up to that site + its modeled attention peak) + eager's mask.

    ``sites`` (default: ``layer_paths``/``layer_windows`` as causal decoder layers) say each
    site's mask and KV: an encoder's self-attention is dense and keeps no KV, a decoder's
    self-attention over ``decoder_len(L)`` tokens keeps that many, cross-attention keeps the
    encoder's ``L``."""
    if sites is None:
        wins = list(layer_windows or [])
        sites = [FloorSite(p, window=wins[i] if i < len(wins) else None)
                 for i, p in enumerate(layer_paths)]
    per_tok = kv_bytes_per_token(num_kv_heads, head_dim, dtype)["per_layer"] * batch
    dec = decoder_len(L) if decoder_len is not None else L
    attn: dict[tuple[str, int, int, bool], float] = {}
    kv = top = mask = 0.0
    for s in sites:
        q = dec if s.decoder else L
        k = L if s.cross else q
        if s.keeps_kv:
            kv += per_tok * (k if s.window is None else min(k, int(s.window)))
        key = (s.path, q, k, s.causal)
        if key not in attn:
            attn[key] = analytic_attention_peak(
                AttnShape(batch, num_heads, num_kv_heads, q, k, head_dim, head_dim, dtype),
                s.path, causal=s.causal, threads=threads)["total"]
        top = max(top, kv + attn[key])
        if s.causal:  # eager's model-level float mask for a causal prefill
            mask = max(mask, model_mask_bytes(batch, q, k, s.path, dtype))
    return float(static_bytes) + top + mask


def confidence(factor: float | None, *, validated: bool = False,
               model_error: float | None = None) -> Confidence:
    """high / medium / low by :data:`CONFIDENCE_RULE`."""
    if factor is None or factor <= 0:
        return "low"
    if validated:
        return "high"
    levels: list[Confidence] = ["low", "medium", "high"]
    i = 2 if factor <= 2 else (1 if factor <= EXTRAPOLATION_LIMIT else 0)
    if model_error is not None and model_error > 0.10:
        i = max(0, i - 1)
    return levels[i]


@dataclass(frozen=True)
class Prediction:
    """:func:`predict_oom`'s answer for one attention path."""

    max_seq_len: int
    """The longest length whose predicted peak fits the budget (0: none)."""
    predicted_peak_bytes_at_max: float | None
    analytic_max_seq_len: int
    """The bound: the longest length the analytic floor alone allows."""
    fit_max_seq_len: int
    """The plain ``a + b*L + c*L^2`` fit's answer, for comparison."""
    extrapolation_factor: float | None
    extrapolation: bool
    confidence: Confidence
    note: str | None = None

    def what_if(self) -> WhatIf:
        """profile.json's ``if_attention_path`` entry for this prediction."""
        return WhatIf(self.max_seq_len, self.extrapolation_factor, self.extrapolation,
                      self.confidence, self.analytic_max_seq_len,
                      self.predicted_peak_bytes_at_max)


def predict_oom(lengths: Sequence[int], peaks: Sequence[float], budget: float,
                floor: Callable[[int], float], *,
                attention_peaks: Sequence[float] | None = None,
                model_error: float | None = None, hi: int = 1 << 24) -> Prediction:
    """The longest length whose predicted peak fits ``budget``, never past what the analytic
    ``floor`` allows.

    ``peaks``: measured peak bytes per length (whole forward, or one call); ``attention_peaks``:
    what was held at the highest attention call of each forward (default ``peaks``). The
    :class:`Prediction` carries the bound, the plain fit's answer, the extrapolation factor,
    the confidence and a note when the plain fit would go past the bound.
    """
    xs = [int(x) for x in lengths]
    att = list(attention_peaks) if attention_peaks is not None else list(peaks)
    # What the attention moment holds beyond the floor (non-negative terms; c only with 3+
    # lengths); the rest of the forward grows linearly with L.
    rest = fit_poly2(xs, [a - floor(x) for x, a in zip(xs, att, strict=True)])
    lin = fit_poly2(xs, list(peaks), quadratic=False)

    def est(x: int) -> float:
        return max(floor(x) + eval_poly2(rest, x), eval_poly2(lin, x))

    plain = fit_poly2(xs, list(peaks))
    L = predict_max(rest, budget, hi=hi, f=est)
    bound = predict_max(rest, budget, hi=hi, f=floor)
    fit_only = predict_max(plain, budget, hi=hi)
    longest = max(xs)
    factor = round(L / longest, 2) if L else None
    note = None
    if fit_only > bound:
        c_need = (floor(2 * longest) - 2 * floor(longest) + floor(0)) / (2.0 * longest**2)
        note = (
            f"the fit of the measured peaks alone (L^2 term {plain['c']:.1f} B/token^2 from "
            f"{len(xs)} lengths) would allow {fit_only:,} tokens, which the analytic model "
            f"rules out: the attention path must hold ~{c_need:.1f} B/token^2")
    return Prediction(
        max_seq_len=L, predicted_peak_bytes_at_max=est(L) if L else None,
        analytic_max_seq_len=bound, fit_max_seq_len=fit_only, extrapolation_factor=factor,
        extrapolation=bool(factor is not None and factor > EXTRAPOLATION_LIMIT),
        confidence=confidence(factor, model_error=model_error), note=note)


def site_causal(stack: str | None, kind: str, causal: bool) -> bool:
    """Only a decoder's self-attention is causal (cross and encoder layers see all keys);
    ``causal``: whether a single-stack model is a decoder (not BERT/ViT)."""
    return kind == "self" and stack != "encoder" and (stack == "decoder" or causal)


def floor_sites(sites: Sequence[Site], causal: bool,
                windows: Sequence[int | None] | None) -> list[FloorSite]:
    """The floor's view of each site: the causal ones and cross-attention write a KV cache
    (a decoder's); encoder layers (BERT, ViT, an encoder-decoder's encoder) hold none."""
    out = []
    for s in sites:
        c = site_causal(s.stack, s.kind, causal)
        w = windows[s.layer] if s.stack is None and windows and \
            s.layer < len(windows) else None
        out.append(FloorSite(s.path, causal=c, keeps_kv=c or s.kind == "cross",
                             decoder=s.stack == "decoder", cross=s.kind == "cross",
                             window=w))
    return out


def attention_model_error(layers: Sequence[LayerReport]) -> float | None:
    """How far the analytic attention model is from the measured per-layer peaks on the
    paths they ran: the largest relative error (None: nothing measured)."""
    errs = [float(p.rel_error) for lay in layers for p in lay.memory.attention_peak
            if p.rel_error is not None]
    return max(errs) if errs else None


def oom_prediction(sc: Scaling, static: int, shape: AttentionShape, dtype: str, *,
                   budget: int, batch: int, threads: int, available_bytes: int,
                   validate: bool = True, validate_max_seconds: float = 120.0,
                   amap: Sequence[ActivationRow] = (), model_error: float | None = None,
                   causal: bool = True,
                   decoder_len: Callable[[int], int] | None = None) -> OomPrediction:
    """profile.json's ``oom_prediction`` (before the validation run): the longest length
    whose predicted peak fits ``budget`` (:func:`predict_oom` over the analytic floor of the
    sites as they ran, from the kernel map ``amap``), the max batch per measured length, the
    what-ifs with every site on another path, and whether a validation run is affordable
    (``available_bytes``: free memory now; ``validate_max_seconds``: the longest forward
    allowed). ``sc``: :func:`attnprof.analyze.scaling.scaling_summary` (its runs per length
    and the forward-time fit); ``shape``: the model's attention shape (``dtype`` is the one
    it ran in); ``threads``: intra-op threads of the runs; ``model_error``:
    :func:`attention_model_error`; ``decoder_len``: an encoder-decoder's decoder length per
    encoder length."""
    B = batch
    # Per site (stack, layer, kind): an encoder-decoder's encoder.L0, decoder.L0 and
    # decoder.L0.cross are three sites with their own paths, masks and KV.
    sites = run_sites(amap, shape.num_layers)
    paths = [s.path for s in sites]
    by_path: dict[str, list[int]] = {}
    by_site: dict[str, list[str]] = {}
    for s in sites:
        if s.layer not in by_path.setdefault(s.path, []):
            by_path[s.path].append(s.layer)
        by_site.setdefault(s.path, []).append(s.label)
    out = OomPrediction(
        memory_budget_bytes=budget, batch_size=B, static_bytes=static,
        method=(
            "largest L whose predicted peak fits the budget; predicted peak = max(analytic "
            "floor(L) + fitted remainder of the attention-moment peaks, linear fit of the "
            "forward peaks); floor = weights + KV cache + each layer's modeled attention peak "
            "on the path it ran (kernel map) + eager's mask. Never past the analytic bound."),
        attention_paths=by_path, attention_sites=by_site,
        extrapolation_limit=EXTRAPOLATION_LIMIT, confidence_rule=CONFIDENCE_RULE)
    runs = sorted(sc.by_seq_len, key=lambda r: r.seq_len)
    Ls = [r.seq_len for r in runs]
    if len(Ls) < 2:
        return replace(out, max_seq_len=None, note="need at least two --seq-lens to fit")
    if static >= budget:
        return replace(out, max_seq_len=0, note="the weights alone exceed the budget",
                       confidence="high", extrapolation=False)
    peaks = [float(r.peak_total_bytes) for r in runs]
    held = [r.attention_peak_total_bytes for r in runs]
    att = None if any(h is None for h in held) else [float(h or 0) for h in held]
    fsites = floor_sites(sites, causal, list(shape.layer_windows) or None)

    def floor_for(layer_paths: list[str]) -> Callable[[int], float]:
        run = [replace(f, path=p) for f, p in zip(fsites, layer_paths, strict=True)]
        return lambda x: forward_floor(
            x, static_bytes=static, batch=B, num_heads=shape.num_heads,
            num_kv_heads=shape.num_kv_heads, head_dim=shape.head_dim, dtype=dtype,
            sites=run, threads=threads, decoder_len=decoder_len)

    head = predict_oom(Ls, peaks, budget, floor_for(paths), attention_peaks=att,
                       model_error=model_error)
    Lmax = int(head.max_seq_len)
    # What-if: every layer on another path; the rest of the forward as measured.
    rest = [a - floor_for(paths)(x) for x, a in zip(Ls, att or peaks, strict=True)]
    what_if: dict[str, WhatIf] = {}
    for path in PATHS:
        if set(paths) == {path}:
            continue
        fl = floor_for([path] * len(paths))
        what_if[path] = predict_oom(
            Ls, peaks, budget, fl,
            attention_peaks=[fl(x) + r for x, r in zip(Ls, rest, strict=True)]).what_if()
    est_t = eval_poly2(_coefs(sc, "forward_time_s"), Lmax) if Lmax else math.inf
    affordable = (validate and Lmax > 0 and est_t <= validate_max_seconds
                  and float(head.predicted_peak_bytes_at_max or 0) - static
                  < 0.5 * available_bytes)
    validation = Validation(planned=affordable,
                            estimated_forward_s=est_t if Lmax else None)
    if not affordable:
        validation.skipped = (
            "disabled (--no-validate)" if not validate else
            f"running at L={Lmax} is not affordable here (estimated {est_t:.0f} s forward, "
            f"limit {validate_max_seconds:.0f} s, or over half the free memory)")
    return replace(
        out, max_seq_len=head.max_seq_len, note=head.note,
        predicted_peak_bytes_at_max=head.predicted_peak_bytes_at_max,
        # Max batch at each measured length: activations scale ~linearly with batch.
        max_batch_by_seq_len={
            str(r.seq_len): max(0, int((budget - static)
                                       // max(1, (r.peak_total_bytes - static) / B)))
            for r in runs},
        if_attention_path=what_if, validation=validation,
        extrapolation_factor=head.extrapolation_factor, extrapolation=head.extrapolation,
        confidence=head.confidence, analytic_max_seq_len=head.analytic_max_seq_len,
        fit_max_seq_len=head.fit_max_seq_len)


def _coefs(sc: Scaling, name: str) -> dict[str, float]:
    f = sc.fits[name]
    return {"a": f.a, "b": f.b, "c": f.c}
