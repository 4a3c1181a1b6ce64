"""Terminal tables for snapshots (used by ``attnprof snapshot`` and ``attnprof demo``)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from attnprof.facts.layers import ranges_text

__all__ = ["render_coverage", "render_kv", "render_snapshot", "table"]


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    cells = [[str(h) for h in headers]] + [["" if c is None else str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]

    def fmt(r: list[str]) -> str:
        return "  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in
                         enumerate(zip(r, widths, strict=True))).rstrip()

    return "\n".join([fmt(cells[0]), fmt(["-" * w for w in widths])] + [fmt(r) for r in cells[1:]])


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x * 1e3:.3f}"


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{x * 100:.1f}%"


def _tok(x: float | None) -> str:
    return "-" if x is None else f"{x:.0f}"


def runner_line(r: dict[str, Any] | None) -> str:
    """Which vLLM model runner a worker runs and whether attnprof hooks its steps (an empty
    profile then says why); "" for a snapshot without the report."""
    if not r:
        return ""
    head = f"Model runner: {r.get('runner')} ({r.get('runner_class') or '?'})"
    if not r.get("hooked"):
        return f"{head}: {r.get('note') or 'not hooked'}: no step is sampled or timed"
    return f"{head}, hooked" + (f" ({r['note']})" if r.get("note") else "")


def render_snapshot(snap: dict[str, Any]) -> str:
    out: list[str] = []
    procs = [p for p in snap.get("processes") or [] if p.get("alive")]
    if procs:
        out.append("Processes with attnprof live:")
        out.append(table(["role", "pid", "process"],
                         [[p.get("role"), p.get("pid"), p.get("process")] for p in procs]))
        out.append("")
    for w in snap.get("workers") or []:
        rl = runner_line(w.get("runner"))
        if rl:
            out += [rl, ""]
        layers = w.get("layers") or []
        steps = w.get("steps") or {}
        share = {p: v.get("attention_share") for p, v in steps.items()}
        rows = []
        for lay in layers:
            ph = lay.get("phases", {})
            row = [lay["index"], lay["backend"], lay["impl"], "yes" if lay["fused"] else "NO",
                   f"{lay['num_heads']}/{lay['num_kv_heads']}x{lay['head_size']}",
                   lay.get("sliding_window") or "-", lay["dtype"]]
            for phase in ("prefill", "mixed", "decode"):
                st = ph.get(phase, {})
                row += [_ms(st.get("mean_time_s")), st.get("calls", 0)]
            rows.append(row)
        out.append(f"Attention layers in worker pid {w.get('pid')} ({w.get('process')}); "
                   "mean ms per call by phase (mixed = chunked prefill batched with decodes):")
        out.append(table(["layer", "backend", "impl", "fused", "heads q/kv x d", "window",
                          "dtype", "prefill ms", "calls", "mixed ms", "calls", "decode ms",
                          "calls"], rows))
        out.append("")
        kmap = w.get("kernel_map") or []
        if kmap:
            out.append("Kernel map (which backend and kernel ran, and vLLM's reason for each "
                       "backend it rejects here):")
            krows = []
            why_lines = []
            for g in kmap:
                krows.append([ranges_text(g["layers"]), g["backend"], g.get("kernel") or "-",
                              "yes" if g["fused"] else "NO",
                              ",".join(g.get("valid_backends") or []) or "-"])
                for name, rs in (g.get("rejected") or {}).items():
                    if rs:
                        why_lines.append(f"  layers {ranges_text(g['layers'])}: {name} not valid: "
                                         + "; ".join(rs))
            out.append(table(["layers", "backend", "kernel", "fused", "valid backends"], krows))
            out.extend(why_lines)
            out.extend(f"  layers {ranges_text(g['layers'])}: {g['note']}" for g in kmap
                       if g.get("note"))
            for src in dict.fromkeys(g.get("source") for g in kmap if g.get("source")):
                out.append(f"  verdicts from: {src}")
            out.append("")
        if steps:
            out.append("Attention share of model time on sampled steps:")
            out.append(table(["phase", "steps", "model s", "attention s", "share"],
                             [[p, v["steps"], f"{v['model_time_s']:.3f}",
                               f"{v['attention_time_s']:.3f}", _pct(share[p])]
                              for p, v in steps.items()]))
            out.append("")
        s = w.get("sampler") or {}
        if s:
            out.append(f"Sampler: {s.get('seen')} steps seen, {s.get('sampled')} sampled "
                       f"(+{s.get('sampled_long')} long-prefill), {s.get('blind')} blind; "
                       f"effective rate {s.get('effective_rate'):.3g}; self time "
                       f"{_pct(s.get('self_time_fraction'))} of wall time; errors "
                       f"{sum((w.get('errors') or {}).values())}")
            out.append("")
    req = snap.get("requests")
    if req:
        c = req["context_tokens"]
        p = req["prompt_tokens"]
        g = req["generation_tokens"]
        out.append(f"Context lengths of {req['requests']} finished requests "
                   f"(max_model_len {req['max_model_len']}):")
        out.append(table(["tokens", "p50", "p90", "p99", "mean", "max"],
                         [[n, _tok(d.get("p50")), _tok(d.get("p90")), _tok(d.get("p99")),
                           _tok(d.get("mean")), _tok(d.get("max"))]
                          for n, d in (("context", c), ("prompt", p), ("generated", g))]))
        # No "usage (last)" line: the last gauge value reads 0% once the server is idle and
        # disagrees with the report's p95/peak; render_kv prints those from the aggregate.
    cov = render_coverage(snap)
    if cov:
        out += ["", cov]
    kv = render_kv(snap)
    if kv:
        out += ["", kv]
    return "\n".join(out).rstrip() + "\n"


def _span(lo: int, hi: int | None) -> str:
    return f"{lo}+" if hi is None else f"{lo}-{hi - 1}"


def render_coverage(snap: dict[str, Any]) -> str:
    """The snapshot's coverage section (``coverage``): per phase and context bucket, the
    requests the head statistics folded against the traffic's, the share of the bucket's
    query tokens they stand for, the bucket's KV share and post-stratification weight; what
    each phase's corrected statistics stand on; the dynamic heads. Empty without it."""
    cov = snap.get("coverage")
    if not cov:
        return ""
    out = [f"Head-statistics coverage by context bucket (bucket 0: prompts under "
           f"{cov.get('min_tokens')} tokens; weight: traffic share / sampled share):"]
    rows = []
    for r in cov.get("buckets") or []:
        if not (r.get("traffic_requests") or r.get("folded_requests")
                or r.get("traffic_queries")):
            continue  # a bucket nothing reached
        rows.append([r["phase"], _span(r["bucket"], r.get("hi")),
                     f"{r['folded_requests']}/{r['traffic_requests']}",
                     _pct(r.get("query_share")), _pct(r.get("kv_share")),
                     "-" if r.get("weight") is None else f"{r['weight']:.3g}"])
    out.append(table(["phase", "tokens", "folded/requests", "query share", "KV share",
                      "weight"], rows))
    for ph in cov.get("phases") or []:
        share = ph.get("traffic_query_share")
        # decode folds are steps of running sequences: the sequences, and their queries
        n_dec = sum(r.get("sampled_queries") or 0 for r in cov.get("buckets") or []
                    if r["phase"] == "decode")
        what = (f"{ph['folded_requests']} requests" if ph["phase"] == "prefill"
                else f"{ph['folded_requests']} sequences ({n_dec} sampled decode queries)")
        out.append(f"  {ph['phase']}: statistics of {what} stand on "
                   + ("an unknown share of the traffic (no per-bucket counts)" if share is None
                      else f"{share:.0%} of the traffic's query tokens"))
    st = cov.get("stability")
    if st:
        kappas = [(x["kappa"], x["layer"]) for x in st.get("layers") or []
                  if x.get("kappa") is not None]
        rated = sum(x.get("rated_kv_heads") or 0 for x in st.get("layers") or [])
        views = st["views"]
        line = (f"Head stability over {len(views)} view{'s' if len(views) != 1 else ''} "
                f"with enough traffic ({', '.join(views[:6]) or 'none'}"
                f"{', ...' if len(views) > 6 else ''}): {st['dynamic_kv_heads']} of "
                f"{st['kv_heads']} KV heads dynamic ({st['dynamic_share']:.1%}; {rated} "
                f"rated by two or more views), kept full")
        if kappas:
            k, layer = min(kappas)
            line += f"; lowest kappa {k:.2f} (layer {layer})"
        out.append(line)
    return "\n".join(out)


def render_kv(snap: dict[str, Any]) -> str:
    """The KV verdict with its evidence, usage over time, capacity, block-seconds by
    request-length class and bytes per token per layer (empty without KV stats)."""
    a = snap.get("kv_pressure")
    st = (snap.get("requests") or {}).get("kv_pressure")
    if not a or not st:
        return ""
    out = [f"KV cache: {a['verdict'].replace('_', '-').upper()} (confidence {a['confidence']})"]
    out += [f"  - {e}" for e in a.get("evidence") or []]
    frac = a.get("above_90_fraction")
    caps = a.get("capacity_sequences") or {}
    ctx = a.get("context_tokens") or {}
    out.append(table(
        ["peak", "p95", "above 90% s", "of busy", "preemptions", "waiting", "mean running",
         "capacity tokens", "seqs at p50 ctx", "seqs at p99 ctx"],
        [[_pct(a.get("peak")), _pct(a.get("p95")), f"{a['above_90_seconds']:.1f}", _pct(frac),
          a["preemptions"], _pct(a.get("waiting_fraction")),
          "-" if a.get("mean_running") is None else f"{a['mean_running']:.1f}",
          a.get("capacity_tokens") or "-",
          f"{caps['p50']:.1f} ({_tok(ctx.get('p50'))})" if "p50" in caps else "-",
          f"{caps['p99']:.1f} ({_tok(ctx.get('p99'))})" if "p99" in caps else "-"]]))
    share = a.get("class_share") or {}
    if share:
        bounds = st.get("class_bounds") or []
        names = st.get("class_names") or []
        spans = [f"<= {b}" for b in bounds] + [f"> {bounds[-1]}" if bounds else ""]
        out.append("KV block-seconds by request context length: " + ", ".join(
            f"{n} ({sp} tokens) {_pct(share.get(n))}" for n, sp in zip(names, spans,
                                                                        strict=False)))
    layers = st.get("layers") or []
    if layers:
        groups: dict[tuple[Any, ...], list[int]] = {}
        for lay in layers:
            key = (lay["bytes_per_token"], lay["per_kv_head"], lay["per_query_head"],
                   lay.get("window"), lay["num_heads"], lay["num_kv_heads"])
            groups.setdefault(key, []).append(lay["layer"])
        top = set(a.get("top_layers") or [])
        ls = a.get("layer_share") or {}
        hb = a.get("head_bytes_peak") or {}

        def mib(idx: list[int]) -> str:
            v = hb.get(str(idx[0]))
            return "-" if v is None else f"{v / 2**20:.1f}"

        rows = [[ranges_text(idx), f"{k[0]:.0f}", f"{k[1]:.0f}",
                 f"{k[4] // max(1, k[5])} q heads", f"{k[2]:.0f}", k[3] or "full",
                 _pct(sum(ls.get(str(i), 0.0) for i in idx)), mib(idx),
                 "most" if top & set(idx) else ""] for k, idx in groups.items()]
        out.append(f"KV bytes per token ({st.get('kv_dtype') or '?'}; a query-head group "
                   "shares its KV head):")
        out.append(table(["layers", "B/token/layer", "B/token/KV head", "group",
                          "B/token/q head", "window", "share at p99 ctx",
                          "MiB/KV head at peak", "holds"], rows))
    return "\n".join(out)
