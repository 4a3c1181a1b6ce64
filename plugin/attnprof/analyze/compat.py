"""The compatibility matrix as tables: one case (``attnprof compat``) or the whole matrix
(``attnprof compat --markdown``, which generates docs/compat-matrix.md)."""

from __future__ import annotations

from typing import Any

from attnprof.analyze import vllm_matrix
from attnprof.analyze.rules import (
    evaluate,
    evaluate_all,
    load_matrix,
    predict_sdpa_cuda,
)
from attnprof.analyze.vllm_matrix import VllmCase

__all__ = ["FEATURES", "case_report", "markdown_matrix", "render_case", "vllm_section"]

FEATURES = ("mask", "sliding_window", "sinks", "fp8_kv")
_GRID_HEAD_DIMS = (64, 80, 96, 128, 256, 512)


def case_report(hardware: str, head_dim: int, dtype: str,
                features: dict[str, bool] | None = None,
                vllm_case: VllmCase | None = None) -> dict[str, Any]:
    """One case: vLLM's verdicts (derived from vLLM's own code) and the hand-kept rules for
    what vLLM does not decide (torch SDPA, standalone FlashAttention, xformers, flex).

    ``vllm_case`` answers a case outside the shipped grid (derived by the caller, which may
    run vLLM); without it the shipped data is read.
    """
    m = load_matrix()
    hw = _hw(hardware)
    vendor = m["hardware"][hw]["vendor"]
    verdicts = evaluate_all(hardware, head_dim, dtype, features)
    rep: dict[str, Any] = {
        "matrix_version": m["matrix_version"], "covers": m["covers"],
        "query": {"hardware": hardware,
                  "hardware_key": hw, "head_dim": head_dim, "dtype": dtype,
                  "features": {k: v for k, v in (features or {}).items() if v}},
        "vllm": vllm_section(hw, head_dim, dtype, features, vllm_case),
        "active": [v.backend for v in verdicts if v.ok],
        "backends": [v.as_dict() for v in verdicts],
        "torch_sdpa_choice": None,
    }
    if vendor != "cpu":
        # What torch's CUDA dispatcher would pick for a prefill of this layer (8 heads, 1024
        # tokens): causal without a mask unless --mask, as transformers calls it.
        mask = bool((features or {}).get("mask")) or bool((features or {}).get("sliding_window"))
        shape = (1, 8, 1024, head_dim)
        rep["torch_sdpa_choice"] = predict_sdpa_cuda(hw, shape, shape, shape, dtype,
                                                     has_mask=mask, is_causal=not mask)
    return rep


def vllm_section(hw: str, head_dim: int, dtype: str, features: dict[str, bool] | None,
                 vllm_case: VllmCase | None = None) -> dict[str, Any]:
    """What vLLM picks for the case and why not the others, or why attnprof cannot say."""
    case = vllm_case or vllm_matrix.lookup(hw, head_dim, dtype, features)
    if case is not None:
        return {"available": True, **case.as_dict()}
    vendor = load_matrix()["hardware"][hw]["vendor"]
    if vendor == "cpu":
        why = ("vLLM's CPU platform always runs CPU_ATTN: see the vllm_cpu_attn row (the live "
               "report asks vLLM itself on the running CPU)")
    elif vendor != "nvidia":
        why = (f"vLLM's {vendor.upper()} platform is not derived; only its CUDA platform is "
               "(attnprof compat --regenerate)")
    elif dtype not in vllm_matrix.load()["grid"]["dtypes"]:
        why = (f"vLLM runs models in {', '.join(vllm_matrix.load()['grid']['dtypes'])}"
               + ("; fp8 is a KV-cache dtype there (--fp8-kv)" if dtype.startswith("fp8")
                  else f", not {dtype}"))
    else:
        why = (f"head dim {head_dim} is outside the shipped grid "
               f"({', '.join(map(str, vllm_matrix.load()['grid']['head_sizes']))}); with vLLM "
               f"installed, `attnprof compat` derives it from vLLM's own code")
    return {"available": False, "reason": why, "hardware": hw}


def _hw(name: str) -> str:
    from attnprof.analyze.rules import resolve_hardware

    return resolve_hardware(name)


def _fa(v: int | None) -> str:
    return f" (FlashAttention {v})" if v else ""


def render_case(rep: dict[str, Any]) -> str:
    q = rep["query"]
    feats = ", ".join(q["features"]) or "none"
    lines = [f"{q['hardware_key']} ({q['hardware']}), head dim {q['head_dim']}, {q['dtype']}, "
             f"features: {feats}   [matrix {rep['matrix_version']}]", ""]
    v = rep.get("vllm") or {}
    lines.append("vLLM:")
    if v.get("available"):
        lines.append(f"  picks {v['selected'] or 'nothing (no valid backend)'}"
                     f"{_fa(v['flash_attn_version']) if v['selected'] == 'FLASH_ATTN' else ''}")
        if v.get("flash_attn_note"):
            lines.append(f"  vLLM: {v['flash_attn_note']}")
        w = max(len(b["backend"]) for b in v["backends"])
        for b in v["backends"]:
            mark = "yes" if b["valid"] else "no "
            extra = (_fa(v["flash_attn_version"]).strip()
                     if b["backend"] == "FLASH_ATTN" and b["valid"] else "")
            lines.append(f"  {b['priority'] + 1}. {b['backend']:<{w}}  {mark}  "
                         f"{'; '.join(b['reasons']) or extra}".rstrip())
        lines.append(f"  source: {v['source']}")
    else:
        lines.append(f"  {v.get('reason', 'not available')}")
    lines += ["", "torch SDPA and standalone kernels (hand-kept rules, pinned sources):"]
    here = [b for b in rep["backends"]
            if not any(r["code"] == "hardware" for r in b["reasons"])]
    elsewhere = [b["backend"] for b in rep["backends"] if b not in here]
    w = max(len(b["backend"]) for b in here or rep["backends"])
    for b in here:
        mark = "yes" if b["ok"] else "no "
        kind = "fused" if b["fused"] else "unfused"
        why = "; ".join(r["message"] for r in b["reasons"]) if b["reasons"] else b["notes"]
        lines.append(f"  {b['backend']:<{w}}  {mark}  {kind:<7}  {why}")
    if elsewhere:
        lines.append(f"  (not built for {q['hardware_key']}: {', '.join(elsewhere)})")
    lines += ["", f"  activates: {', '.join(rep['active']) or 'none'}"]
    ch = rep.get("torch_sdpa_choice")
    if ch:
        why = "; ".join(r["message"] for r in ch["reasons"])
        lines.append(f"  torch SDPA would run: {ch['backend']} (order {' > '.join(ch['order'])})"
                     + (f"; skipped because: {why}" if why else ""))
    return "\n".join(lines)


_FEATURE_LABELS = {"sliding_window": "window", "sinks": "sinks", "fp8_kv": "fp8 KV"}
_SHORT = {"FLASH_ATTN": "FA", "FLASHINFER": "FlashInfer", "TRITON_ATTN": "Triton",
          "FLEX_ATTENTION": "Flex", "TURBOQUANT": "TurboQuant"}


def _cell(sel: str | None, fa: int | None) -> str:
    if sel is None:
        return "**none**"
    return f"{_SHORT.get(sel, sel)}{fa}" if sel == "FLASH_ATTN" and fa else _SHORT.get(sel, sel)


def _vllm_markdown() -> list[str]:
    d = vllm_matrix.load()
    pick = {(c.hardware, c.head_size, c.dtype, c.features): _cell(c.selected,
                                                                  c.flash_attn_version)
            for c in vllm_matrix.cases(d)}
    # One column per feature set in the data (a new feature gets its columns): fewest first.
    def order(fk: str) -> tuple[int, list[int]]:
        fs = [f for f in fk.split("+") if f]
        return len(fs), [vllm_matrix.FEATURES.index(f) for f in fs]

    columns = [(fk, " + ".join(_FEATURE_LABELS.get(f, f) for f in fk.split("+")) or "none")
               for fk in sorted({k[3] for k in pick}, key=order)]
    out = ["## vLLM on CUDA (derived from vLLM's own code)", "",
           f"Every cell below is {vllm_matrix.source_line(d)}: `attnprof compat --regenerate` "
           "runs `CudaPlatform.get_valid_backends` and `get_flash_attn_version` with vLLM's "
           "CUDA platform pinned to each capability, and `tests/unit/analyze/test_vllm_matrix.py` "
           "regenerates it and compares, so a vLLM upgrade that changes a rule fails loudly.",
           "",
           "Cells name the backend vLLM picks without `--attention-backend` and, for "
           "FlashAttention, the version that runs (FA2/FA3/FA4). `attnprof compat` gives every "
           "other backend's reasons in vLLM's words.", "",
           f"Grid: head sizes {', '.join(map(str, d['grid']['head_sizes']))}; dtypes "
           f"{', '.join(d['grid']['dtypes'])}; fp8 KV = `--kv-cache-dtype "
           f"{d['grid']['fp8_kv_dtype']}`; block size {d['grid']['block_size']}.", "",
           "Abbreviations: " + ", ".join(f"{v} = `{k}`" for k, v in _SHORT.items()) + ".", ""]
    blocks: dict[str, list[str]] = {}
    for key, cap in d["capabilities"].items():
        f = cap["facts"]
        out += [f"### `{key}` (capability {cap['capability'][0]}.{cap['capability'][1]})", "",
                f"Priority: {' > '.join(cap['priority'])}. FlashAttention versions vLLM "
                f"supports here: {', '.join(map(str, f['flash_attn_versions_supported']))}; "
                f"FlashInfer TRT-LLM kernels: decode "
                f"{'yes' if f['flashinfer_trtllm_decode'] else 'no'}, prefill "
                f"{'yes' if f['flashinfer_trtllm_prefill'] else 'no'}.", ""]
        block: list[str] = []
        seen: dict[str, tuple[str, ...]] = {}
        for dtype in d["grid"]["dtypes"]:
            table = []
            for h in d["grid"]["head_sizes"]:
                cells = []
                for fk, _ in columns:
                    cells.append(pick[(key, h, dtype, fk)])
                table.append(f"| {h} | " + " | ".join(cells) + " |")
            same = next((k for k, t in seen.items() if t == tuple(table)), None)
            if same is not None:
                block += [f"{dtype}: the same as {same} in every cell.", ""]
                continue
            seen[dtype] = tuple(table)
            block += [f"{dtype}:", "",
                      "| head size | " + " | ".join(n for _, n in columns) + " |",
                      "|---|" + "---|" * len(columns), *table, ""]
        twin = next((k for k, b in blocks.items() if b == block), None)
        if twin is not None:
            out += [f"Picks: the same as `{twin}` in every cell (the reasons can differ: "
                    "`attnprof compat` shows them).", ""]
        else:
            out += block
        blocks[key] = block
    out += ["### Assumptions (platform facts only; verdicts are never faked)", "",
            *[f"- {a}" for a in d["assumptions"]], "",
            f"Deciding source files (sha256 over the set: `{d['source_digest']['combined']}`): "
            + ", ".join(f"`{p}`" for p in d["source_digest"]["files"]) + ".", ""]
    return out


def markdown_matrix() -> str:
    d = vllm_matrix.load()
    m = load_matrix()
    out = [
        "# Attention backend compatibility matrix",
        "",
        "Generated by `attnprof compat --markdown --out docs/compat-matrix.md`; do not edit by "
        "hand. Answer one case, with the reason for every rejected backend:",
        "",
        "```",
        "attnprof compat --head-dim 96 --dtype bf16 --gpu h100 [--sliding-window] [--sinks] "
        "[--fp8-kv] [--mask] [--json]",
        "```",
        "",
        "## Where every cell comes from",
        "",
        "| part | comes from | kept true by |",
        "|---|---|---|",
        f"| vLLM's CUDA backends ({', '.join(next(iter(d['capabilities'].values()))['priority'])}"
        f"): valid or not, vLLM's reasons, the pick, the FlashAttention version | derived: "
        f"{d['vllm_distribution']} {d['vllm_version']}'s own selection code, source digest "
        f"`{d['source_digest']['combined'][:12]}` | `attnprof compat --regenerate`; a test "
        "regenerates and compares |",
        "| torch SDPA's CUDA backends and their order (`torch SDPA would run`) | rules ported "
        "from torch v2.13.0 `sdp_utils.cpp` (tag **source**) | compared with "
        "`torch._fused_sdp_choice` when a GPU is present |",
        "| torch SDPA on CPU (`torch_sdpa_flash_cpu`, `torch_sdpa_math`) | measured on this "
        "machine (tag **measured**) | unit tests against torch's own dispatcher |",
        "| standalone flash-attn 2/3/4, xformers, flex attention | hand-kept rules with pinned "
        "sources (tag **source**) | review; links pinned to tags and commits |",
        "| vLLM CPU_ATTN for other CPUs (`vllm_cpu_attn`) | hand-kept, vLLM v0.32.0 "
        "`cpu_attn.py` | the live report asks vLLM itself on the running CPU |",
        f"| hardware names and aliases | hand-kept (matrix {m['matrix_version']}) | unit "
        "tests |",
        "",
        *_vllm_markdown(),
        *_hand_kept_markdown(),
        "",
    ]
    return "\n".join(out)


def _hand_kept_markdown() -> list[str]:
    m = load_matrix()
    hw = m["hardware"]
    out = [
        "## Hand-kept rules: torch SDPA and standalone kernels",
        "",
        f"From `plugin/attnprof/analyze/data/compat_matrix.json` (matrix {m['matrix_version']}; "
        f"covers {', '.join(f'{k} {v}' for k, v in m['covers'].items())}). Only what vLLM "
        "does not decide: torch SDPA's backends and the standalone kernels transformers users "
        "run. Tags: **measured** = " + m['tags']['measured'] + "; **source** = "
        + m['tags']['source'] + ". Every source is pinned to a tag, a versioned doc or a "
        "commit.",
        "",
        "### Backends",
        "",
        "| backend | fused | hardware | dtypes | head dim | mask | sliding window | sinks "
        "| fp8 KV | tag | notes | sources |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]

    def feat(v: Any) -> str:
        return ", ".join(v) if isinstance(v, list) else ("yes" if v else "no")

    for name, s in m["backends"].items():
        hd = s.get("head_dim", {})
        parts = []
        if "one_of" in hd:
            parts.append("{" + ", ".join(map(str, hd["one_of"])) + "}")
        if "min" in hd:
            parts.append(f">= {hd['min']}")
        if "max" in hd:
            parts.append(f"<= {hd['max']}")
        for k, v in hd.get("max_by_hardware", {}).items():
            parts.append(f"<= {v} on {k}")
        if "multiple_of" in hd:
            parts.append(f"% {hd['multiple_of']}")
        for k, v in hd.get("multiple_of_by_dtype", {}).items():
            parts.append(f"% {v} for {k}")
        f = s["features"]
        srcs = " ".join(f"[{i + 1}]({u})" for i, u in enumerate(s.get("sources", [])))
        out.append(f"| `{name}` | {'yes' if s['fused'] else 'no'} | {', '.join(s['hardware'])} "
                   f"| {', '.join(s['dtypes'])} | {'; '.join(parts) or 'any'} "
                   f"| {feat(f.get('mask'))} | {feat(f.get('sliding_window'))} "
                   f"| {feat(f.get('sinks'))} | {feat(f.get('fp8_kv'))} | {s.get('tag', '')} "
                   f"| {s.get('notes', '')} | {srcs} |")
    out += ["", "### Hardware", "", "| key | name | aliases (`--gpu`) |", "|---|---|---|"]
    for k, s in hw.items():
        out.append(f"| `{k}` | {s['name']} | {', '.join(s['aliases'])} |")
    for dtype in ("bf16", "fp32"):
        out += ["", f"### Which of these activate: {dtype}, no extra features", "",
                "| hardware | " + " | ".join(f"head dim {d}" for d in _GRID_HEAD_DIMS) + " |",
                "|---|" + "---|" * len(_GRID_HEAD_DIMS)]
        for k in hw:
            cells = []
            for d in _GRID_HEAD_DIMS:
                ok = [b for b in m["backends"] if evaluate(b, k, d, dtype).ok
                      and m["backends"][b]["fused"]]
                cells.append(", ".join(ok) or "**none fused**")
            out.append(f"| `{k}` | " + " | ".join(cells) + " |")
    return out
