"""Backend advice: for every fallback, the change that activates a fused path and its gain.

Keys on the reason codes of :mod:`.sdpa` (CPU ground truth), :mod:`.rules` (CUDA port)
and the transformers integration ("eager"). Gains come from measured per-path times and
peaks when the caller has them (``attnprof profile`` measures fused vs unfused at every
length), else from the analytic memory model.
"""

from __future__ import annotations

from typing import Any

__all__ = ["FIXES", "advise"]

FIXES: dict[str, str] = {
    "eager": "load the model with attn_implementation='sdpa' (or call "
             "model.set_attn_implementation('sdpa')): the fused SDPA kernel never materializes "
             "the score matrix",
    "dropout": "set attention dropout to 0 at inference (model.eval(), or attention_dropout=0 "
               "in the config): fused kernels need dropout_p == 0",
    "head_dim_mismatch": "pad the value head dim to the query/key head dim with zeros and "
                         "slice the output back (fused kernels need equal q/k/v head dims)",
    "not_4d": "pass 4-D [batch, heads, length, head_dim] tensors (unsqueeze the batch dim)",
    "non_contiguous_last_dim": "make q/k/v contiguous in the last dim (.contiguous() after "
                               "the transpose, or transpose(1, 2) on [B, L, H, D] views)",
    "gqa_without_enable_gqa": "call scaled_dot_product_attention(..., enable_gqa=True) "
                              "instead of passing fewer K/V heads (or repeat_kv first)",
    "dtype": "cast q/k/v to a supported dtype (bf16/fp16 on GPU; fp32/bf16/fp16 on CPU)",
    "mask": "pass is_causal=True instead of an explicit causal mask; for padding use an "
            "unpadded/varlen batch (attn_implementation='flash_attention_2') or let SDPA "
            "pick the memory-efficient kernel",
    "head_dim": "pad the head dim up to the next size the kernel supports (multiple of 8; "
                "64/128/256 for FlashInfer) and slice the output",
    "causal_shape": "for is_causal with Lq != Lk, pass an explicit bottom-right mask or "
                    "split prefill so Lq == Lk",
    "hardware": "pick another backend explicitly (sdpa_kernel([...]) in torch, "
                "--attention-backend in vLLM) that supports this GPU",
    "zero_length": "skip empty sequences before calling attention",
    "disabled": "re-enable the fused SDPA backends (torch.backends.cuda.enable_flash_sdp / "
                "remove the sdpa_kernel([MATH]) context)",
    "sliding_window": "pick a backend with sliding-window support (FlashAttention 2/3, "
                      "FlashInfer, Triton) or pass the window as a mask to the efficient "
                      "kernel",
    "sinks": "pick a backend with attention-sink support (FA3 in vLLM, Triton, FlashInfer "
             "on Blackwell)",
    "fp8_kv": "keep the KV cache in the model dtype, or use FA3 (sm90) / FlashInfer / "
              "Triton for fp8 KV",
}


def advise(entries: list[dict[str, Any]], measured: dict[str, Any] | None = None
           ) -> list[dict[str, Any]]:
    """One advice item per distinct (reason code, kernel) among unfused activation rows.

    ``measured`` may hold ``{"time_s": {path: {L: s}}, "peak_bytes": {path: {L: b}}}`` from
    the per-path benchmark; the gain is the unfused/fused ratio at the longest common length.
    """
    out: dict[tuple[str, str], dict[str, Any]] = {}
    for e in entries:
        if e.get("fused"):
            continue
        reasons = e.get("reasons") or [{"code": "other", "message": "unfused path"}]
        for r in reasons:
            code = str(r.get("code", "other"))
            key = (code, str(e.get("kernel")))
            item = out.get(key)
            if item is None:
                item = out[key] = {
                    "reason": code, "message": r.get("message", ""),
                    "kernel": e.get("kernel"), "layers": [],
                    "change": FIXES.get(code, "no known fused alternative for this case; see "
                                              "the reasons and `attnprof compat`"),
                    "target": "flash_cpu" if e.get("device", "cpu") == "cpu" else "fused",
                    "expected_gain": _gain(str(e.get("kernel")), measured),
                }
            if e.get("layer_idx") not in item["layers"]:
                item["layers"].append(e.get("layer_idx"))
    return list(out.values())


def _gain(kernel: str, measured: dict[str, Any] | None) -> dict[str, Any] | None:
    if not measured:
        return None
    path = "eager" if kernel == "eager" else "math"
    t = measured.get("time_s", {})
    m = measured.get("peak_bytes", {})
    fused_t, slow_t = t.get("flash_cpu", {}), t.get(path, {})
    common = sorted(set(fused_t) & set(slow_t), key=int)
    if not common:
        return None
    L = common[-1]
    res: dict[str, Any] = {"at_seq_len": int(L), "source": "measured per-path benchmark"}
    if fused_t[L] > 0:
        res["speedup"] = round(slow_t[L] / fused_t[L], 2)
    fm, sm = m.get("flash_cpu", {}).get(L), m.get(path, {}).get(L)
    if fm and sm:
        res["attention_peak_bytes_saved"] = int(sm - fm)
        res["memory_ratio"] = round(sm / fm, 1)
    return res
