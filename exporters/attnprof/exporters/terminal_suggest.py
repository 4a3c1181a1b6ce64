"""The terminal text of ``attnprof suggest-window``: plain lines over its JSON result."""

from __future__ import annotations

from typing import Any

__all__ = ["render"]


def render(out: dict[str, Any]) -> str:
    """The terminal text of ``attnprof suggest-window``'s result (``out``: its JSON
    document): the recommendation, replay, KV per request, heads at risk, the Pareto table,
    KV-head classes, underused heads, the head-level split and the advice."""
    from attnprof.analyze.sparsity.recommend import format_summary

    lines = [format_summary(out, out.get("replay")), f"basis: {out.get('basis', '')}"]
    if out.get("replay"):
        lines.append(f"replay: {out['replay']['verdict']} ({out['replay']['positions']} "
                     f"positions)")
    if out.get("attention_flop_share") is not None:
        lines.append(f"attention share of model FLOPs {out['attention_flop_share']:.1%}: "
                     f"end-to-end FLOP saving {out['end_to_end_flop_saving']:.1%}")
    kvb = out["kv_bytes_per_request"]
    lines.append(f"KV per request: {kvb['full'] / 2**20:.1f} MiB -> "
                 f"{kvb['windowed'] / 2**20:.1f} MiB; naive mean of per-request savings "
                 f"(not used) {out['naive_mean_request_saving']:.1%}")
    if out.get("heads_at_risk_count") is not None:
        lines.append(f"heads at risk (coverage below target): {out['heads_at_risk_count']}; "
                     f"undecided (within sampling error): {out.get('heads_undecided_count')}; "
                     f"unverified (no long enough sample): {out['heads_unverified_count']}")
        for r in (out.get("heads_at_risk") or [])[:10]:
            lines.append(f"  layer {r['layer']} kv head {r['kv_head']}: "
                         f"coverage {r['coverage_q']:.3f}")
    else:
        lines.append("heads at risk: unknown (no head statistics)")
    ref = out.get("refinement")
    if ref is not None:
        left = sum(ref["undecided_after"].values())
        lines.append(f"exact refinement: {len(ref['layers'])} layers rerun on every query in "
                     f"{ref['seconds']:.1f} s; undecided KV-head windows "
                     f"{sum(ref['undecided_before'].values())} -> {left}")
    if out.get("pareto"):
        lines.append("")
        lines.append(f"{'window':>8} {'layers':>6} {'attn FLOPs':>11} {'KV mem':>8} "
                     f"{'exact':>7} {'at risk':>7} {'undecided':>9}")
        for e in out["pareto"]:
            risk = "-" if e["heads_at_risk_count"] is None else str(e["heads_at_risk_count"])
            und = "-" if e.get("heads_undecided") is None else str(e["heads_undecided"])
            lines.append(f"{e['window']:>8} {e['layers']:>6} "
                         f"{e['attention_flop_saving']:>10.1%} {e['kv_memory_saving']:>7.1%} "
                         f"{e['exact_request_fraction']:>6.1%} {risk:>7} {und:>9}")
    if out.get("classification"):
        cls = out["classification"]
        lines.append("")
        lines.append("KV-head classes: " + ", ".join(f"{k} {v}"
                                                     for k, v in cls["class_counts"].items()))
        for x in cls["layers"]:
            lines.append(f"  layer {x['layer']:>3}: window {x['window']!s:>6}  sink mass "
                         f"{x['sink_mass']}  " + " ".join(f"{k}={v}"
                                                           for k, v in x["classes"].items()))
    if out.get("underused_heads"):
        lines.append("")
        lines += _underused_lines(out["underused_heads"])
    hs = out.get("head_level_split")
    if hs:
        lines.append(f"head-level split ({hs['windowed_kv_heads']} KV heads at their own "
                     f"window): {hs['attention_flop_saving']:.1%} attention FLOPs, "
                     f"{hs['kv_memory_saving']:.1%} KV memory")
    ds = out.get("dynamic_sparse_prefill")
    if ds:
        lines.append(f"dynamic sparse prefill (> {ds['min_tokens']} tokens): "
                     f"{ds['request_fraction']:.1%} of requests, "
                     f"{ds['attention_flop_share']:.1%} of attention FLOPs"
                     + (f", expected saving {ds['expected_attention_flop_saving']:.1%}"
                        if ds.get("expected_attention_flop_saving") is not None else ""))
    cov = out.get("coverage")
    if cov:
        lines.append(f"coverage: statistics of {cov['folded_requests']} requests"
                     + (f" of {cov['traffic_requests']}" if cov.get("traffic_requests")
                        is not None else "")
                     + (f", {cov['traffic_share']:.0%} of prompt tokens represented"
                        if cov.get("traffic_share") is not None else "")
                     + ("; weighted to the traffic's context buckets" if cov.get("corrected")
                        else "; as sampled (no per-bucket traffic counts)"))
        for u in cov.get("under_covered") or []:
            span = f"{u['bucket']}+" if u.get("hi") is None else f"{u['bucket']}-{u['hi'] - 1}"
            lines.append(f"  too little coverage at {span} tokens ({u['kv_share']:.0%} of KV "
                         f"block-seconds): {u['undecided_kv_heads']} KV heads undecided, "
                         f"{u['unmeasured_kv_heads']} unmeasured"
                         + (f", n_eff >= {u['min_n_eff']:g}" if u.get("min_n_eff") is not None
                            else ""))
        if cov.get("dynamic_kv_heads") is not None:
            rated = cov.get("rated_kv_heads")
            lines.append(f"  dynamic KV heads (class changes across epochs and buckets, kept "
                         f"full): {cov['dynamic_kv_heads']} of {cov['kv_heads']} "
                         f"({cov['dynamic_share']:.1%}"
                         + (f"; {rated} rated by two or more views" if rated is not None
                            else "") + ")")
    for a in out.get("advice") or []:
        lines.append(f"advice: {a}")
    nw = out.get("native_windows")
    if nw:
        for g in nw["sliding"]:
            lines.append(f"native window {g['window']} on {len(g['layers'])} layers: binds for "
                         f"{g['binding_request_fraction']:.1%} of requests ({g['note']})")
        lines.append(f"global layers hold {nw['global_kv_share']:.1%} of KV memory and "
                     f"{nw['global_attention_flop_share']:.1%} of attention FLOPs")
    return "\n".join(lines) + "\n"


def _underused_lines(found: dict[str, Any], limit: int = 20) -> list[str]:
    """The underused-heads result (:func:`attnprof.analyze.sparsity.underused.find_underused`)
    as lines: the counts, then one line per finding (at most ``limit``)."""
    c = found["counts"]
    lines = [f"underused heads: {c['dormant']} dormant, {c['near_uniform']} near-uniform, "
             f"{c['redundant']} redundant of {found['heads_checked']} query heads, holding "
             f"{(found['kv_share_total'] or 0):.2%} of KV (not replayed: run attnprof "
             "validate-heads before acting)"]
    for f in found["findings"][:limit]:
        ev = ", ".join(f"{k} {v}" for k, v in f["evidence"].items())
        twin = "" if f["twin"] is None else f" ~ head {f['twin']}"
        share = "?" if f["kv_share"] is None else f"{f['kv_share']:.2%}"
        lines.append(f"  {f['kind']:<12} layer {f['layer']:>3} head {f['head']:>3}{twin}: "
                     f"KV share {share} ({ev})")
    if len(found["findings"]) > limit:
        lines.append(f"  ... {len(found['findings']) - limit} more (--json lists them)")
    return lines
