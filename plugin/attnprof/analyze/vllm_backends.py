"""vLLM attention backends' rules: the answer read from the derived matrix
(``data/vllm_matrix.json``, computed from vLLM's own code by ``attnprof compat --regenerate``)
for a target this process does not run on (an H100 asked about from a CPU process). A CUDA
backend is never validated under another platform: vLLM would then see no FlashAttention at
all and the verdict would be the CPU build's, not the GPU's.

Asking the installed vLLM itself (on the device a worker runs on) is capture's:
:mod:`attnprof.capture.vllm.backends`, which falls back to :func:`from_matrix` when its caller
hands it in (capture imports no analyze; the plugin host does). The question and the report's
shape are :mod:`attnprof.facts.backend_report`. Pure: no vLLM, no torch.
"""

from __future__ import annotations

from typing import Any

from attnprof.analyze import vllm_matrix
from attnprof.facts.backend_report import Layer, finish
from attnprof.facts.dtypes import normalize

__all__ = ["from_matrix"]

_FP8 = {"fp8", "fp8_e4m3"}  # the grid's fp8 KV (--kv-cache-dtype fp8 is e4m3 on CUDA)
_PLAIN_KV = {None, "auto", "bfloat16", "float16"}  # vLLM's --kv-cache-dtype spellings


def _short_dtype(dtype: Any) -> str:
    try:
        return normalize(dtype)
    except ValueError:  # not a dtype attnprof knows: no grid row will match it
        return str(dtype).removeprefix("torch.")


def from_matrix(out: dict[str, Any], cc: tuple[int, int], lay: Layer,
                 installed: str | None) -> None:
    """Fill ``out`` (:func:`~attnprof.facts.backend_report.new_report`) for capability ``cc``
    from the derived matrix, or say in ``note`` why it cannot; ``installed``: the vLLM version
    this process runs (None: no vLLM), noted where the matrix was derived from another."""
    data = vllm_matrix.load()
    notes = [out["note"]] if out.get("note") else []

    def unanswered(why: str) -> None:
        out["note"] = "; ".join([*notes, why])

    hw = next((k for k, c in data["capabilities"].items()
               if tuple(c["capability"]) == tuple(cc)), None)
    kv = None if lay.kv_cache_dtype is None else str(lay.kv_cache_dtype)
    if hw is None:
        return unanswered(f"capability {cc[0]}.{cc[1]} is not in the derived matrix "
                          f"({', '.join(data['capabilities'])}); run this on that GPU, where "
                          "vLLM answers itself")
    if kv not in _FP8 and kv not in _PLAIN_KV:
        return unanswered(f"KV cache dtype {kv} is not in the derived grid (auto, fp8): run on "
                          "the GPU, or attnprof compat --regenerate after widening the grid")
    if not lay.decoder_grid:
        return unanswered(f"{lay.attn_type} attention is outside the derived grid (decoder "
                          "self-attention): run on the GPU, where vLLM answers itself")
    feats = {"sliding_window": bool(lay.sliding_window), "sinks": lay.has_sink,
             "fp8_kv": kv in _FP8}
    case = vllm_matrix.lookup(hw, lay.head_size, _short_dtype(lay.dtype), feats)
    if case is None:
        return unanswered(f"head size {lay.head_size} / dtype {_short_dtype(lay.dtype)} is "
                          "outside the derived grid: `attnprof compat` derives it from vLLM's "
                          "own code")
    out["source"] = (f"attnprof derived matrix ({vllm_matrix.source_line(data)}; CUDA "
                     f"platform pinned to {cc[0]}.{cc[1]}), not the running platform")
    if installed is not None and installed.split("+")[0] != data["vllm_version"]:
        notes.append(f"derived from vLLM {data['vllm_version']}, this process runs vLLM "
                     f"{installed}")
    block = lay.block_size if lay.selector is None else getattr(lay.selector, "block_size", None)
    if block is not None:
        notes.append(f"derived for vLLM's automatic block size, not {block}")
    out["note"] = "; ".join(notes) or None
    finish(out, {b["backend"]: {"priority": b["priority"], "valid": b["valid"],
                                 "reasons": b["reasons"]}
                  for b in case.as_dict()["backends"]})
    out["flash_attn_version"] = case.flash_attn_version if "FLASH_ATTN" in out["valid"] else None
    return None
