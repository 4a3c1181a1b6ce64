"""vLLM attention backends: which are valid for a layer, which one vLLM picks, and why not the
others, in vLLM's own words.

Where the answer comes from, always named in ``source``:
- the running platform is the target (a worker on its own GPU, or on its own CPU): vLLM itself,
  ``CudaPlatform.get_valid_backends`` / the CPU backend's ``validate_configuration``;
- another target (an H100 asked about from a CPU process): the derived matrix
  (``data/vllm_matrix.json``, computed from vLLM's own code by ``attnprof compat
  --regenerate``). A CUDA backend is never validated under another platform: vLLM would then
  see no FlashAttention at all and the verdict would be the CPU build's, not the GPU's.

Safe inside a vLLM worker: nothing is allocated, no kernel runs, no process is started.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from attnprof.analyze import vllm_matrix
from attnprof.facts.dtypes import normalize, torch_dtype

__all__ = ["ask_cuda", "vllm_backend_report"]

logger = logging.getLogger("attnprof")

_FP8 = {"fp8", "fp8_e4m3"}  # the grid's fp8 KV (--kv-cache-dtype fp8 is e4m3 on CUDA)
_PLAIN_KV = {None, "auto", "bfloat16", "float16"}  # vLLM's --kv-cache-dtype spellings


def _short_dtype(dtype: Any) -> str:
    try:
        return normalize(dtype)
    except ValueError:  # not a dtype attnprof knows: no grid row will match it
        return str(dtype).removeprefix("torch.")


def _running() -> tuple[str | None, Any, str | None]:
    """(platform class name, current_platform, vLLM version) without forcing anything."""
    try:
        import vllm
        from vllm.platforms import current_platform

        return type(current_platform).__name__, current_platform, str(vllm.__version__)
    except Exception as exc:  # no vLLM here
        logger.debug("vLLM not importable (%s)", exc)
        return None, None, None


@dataclass
class _Layer:
    """The selector's inputs for one layer (vLLM's own ``AttentionSelectorConfig`` when the
    caller has it; otherwise built from the layer's facts)."""

    num_heads: int
    head_size: int
    dtype: Any
    kv_cache_dtype: str | None
    block_size: int | None
    has_sink: bool
    sliding_window: int | None
    selector: Any = None
    requires_alibi: bool = False
    requires_softcap: bool = False

    @property
    def attn_type(self) -> str:
        t = getattr(self.selector, "attn_type", None) or "decoder"
        return str(getattr(t, "value", t))

    @property
    def decoder_grid(self) -> bool:
        """Within the derived grid's assumptions (decoder self-attention, no mm prefix)."""
        sel = self.selector
        return self.attn_type == "decoder" and not getattr(sel, "use_mm_prefix", False)


def vllm_backend_report(num_heads: int, num_kv_heads: int, head_size: int, dtype: Any,
                        kv_cache_dtype: str | None = "auto", sliding_window: int | None = None,
                        *, has_sink: bool = False, block_size: int | None = None,
                        device_capability: tuple[int, int] | None = None,
                        selected: str | None = None, selector_config: Any = None,
                        flash_attn_version: int | None = None, requires_alibi: bool = False,
                        requires_softcap: bool = False) -> dict[str, Any]:
    """Per-backend validity for one attention layer, as vLLM judges it.

    ``device_capability`` None means "the device this process runs on". ``selector_config``
    is the ``AttentionSelectorConfig`` vLLM's selector built for the layer (the capture keeps
    it): with it vLLM is asked with exactly its own inputs (attention type, block size,
    multimodal prefix, ...). ``flash_attn_version`` is the version the layer's implementation
    resolved (what runs); without it vLLM's resolution is asked with ``requires_alibi`` and
    ``requires_softcap`` as the implementation passes them.

    vLLM is asked live only inside its own config context (as at model build in a worker);
    this never sets vLLM's process-global config. Returns ``{"source", "vllm_version",
    "platform", "device_capability", "layer", "selected", "valid", "predicted",
    "flash_attn_version", "note", "backends": {NAME: {"valid", "reasons", "priority"}}}``;
    ``selected`` echoes the backend the worker uses, ``predicted`` is what vLLM picks without
    ``--attention-backend``; ``valid`` is None when no source can answer (``note`` says why).
    """
    lay = _Layer(num_heads, head_size, dtype, kv_cache_dtype, block_size, has_sink,
                 sliding_window, selector_config, requires_alibi, requires_softcap)
    out: dict[str, Any] = {
        "layer": {"num_heads": num_heads, "num_kv_heads": num_kv_heads, "head_size": head_size,
                  "dtype": str(dtype).removeprefix("torch."), "kv_cache_dtype": kv_cache_dtype,
                  "sliding_window": sliding_window, "has_sink": has_sink,
                  "block_size": block_size, "attn_type": lay.attn_type},
        "selected": selected, "backends": {}, "valid": None, "predicted": None,
        "flash_attn_version": None, "source": None, "note": None,
        "vllm_version": None, "platform": None,
        "device_capability": list(device_capability) if device_capability else None,
    }
    platform_name, platform, version = _running()
    out["platform"], out["vllm_version"] = platform_name, version
    if device_capability is not None:
        device_capability = (int(device_capability[0]), int(device_capability[1]))
    running_cc: tuple[int, int] | None = None
    is_cuda = bool(platform is not None and _call(platform, "is_cuda"))
    if is_cuda:
        cc = platform.get_device_capability()
        running_cc = (int(cc.major), int(cc.minor)) if cc is not None else None
    if device_capability is None and is_cuda:
        device_capability = running_cc
        out["device_capability"] = list(running_cc) if running_cc else None
    if device_capability is None:
        if platform is not None and _call(platform, "is_cpu"):
            _cpu_live(out, lay)
        else:
            out["note"] = ("no vLLM platform to ask and no target capability given: pass "
                           "device_capability for a GPU target")
        return out
    if is_cuda and device_capability == running_cc and _cuda_live(out, device_capability, lay):
        if out["valid"] and "FLASH_ATTN" in out["valid"] and flash_attn_version is not None:
            out["flash_attn_version"] = flash_attn_version  # what the implementation runs
        return out
    _from_matrix(out, device_capability, lay, version)
    return out


def _call(obj: Any, name: str) -> Any:
    try:
        return getattr(obj, name)()
    except Exception:
        return None


def _finish(out: dict[str, Any], backends: dict[str, dict[str, Any]]) -> None:
    out["backends"] = dict(sorted(backends.items(), key=lambda kv: kv[1]["priority"]))
    out["valid"] = [n for n, e in out["backends"].items() if e["valid"]]
    out["predicted"] = out["valid"][0] if out["valid"] else None


def _selector(lay: _Layer) -> Any:
    """vLLM's own selector inputs, or the same built from the layer's facts."""
    if lay.selector is not None:
        return lay.selector
    from vllm.v1.attention.selector import AttentionSelectorConfig

    return AttentionSelectorConfig(head_size=lay.head_size, dtype=torch_dtype(lay.dtype),
                                   kv_cache_dtype=lay.kv_cache_dtype, block_size=lay.block_size,
                                   has_sink=lay.has_sink,
                                   has_sliding_window=bool(lay.sliding_window))


def ask_cuda(platform_cls: Any, cc: tuple[int, int], selector: Any, num_heads: int | None, *,
             requires_alibi: bool = False, requires_softcap: bool = False,
             before_fa: Callable[[], None] | None = None,
             ) -> tuple[dict[str, dict[str, Any]], int | None]:
    """vLLM's own answer on a CUDA capability, asked as its selector and FlashAttentionImpl
    ask: every backend with ``priority``, ``valid`` and ``reasons``, in priority order, and
    the FlashAttention version vLLM resolves (None unless FLASH_ATTN is valid).

    The one place attnprof calls these vLLM functions: the live report (on its own GPU) and
    the derivation (on a pinned capability) both come here. The caller holds vLLM's config
    context; ``before_fa`` runs just before the version is resolved (the derivation starts
    catching vLLM's log lines there)."""
    from vllm.platforms.interface import DeviceCapability
    from vllm.v1.attention.backends.fa_utils import get_flash_attn_version

    valid, invalid = platform_cls.get_valid_backends(DeviceCapability(*cc), selector,
                                                     num_heads=num_heads)
    backends = {c.backend.name: {"priority": c.priority, "valid": True, "reasons": []}
                for c in valid}
    for be, (prio, reasons) in invalid.items():
        backends[be.name] = {"priority": prio, "valid": False, "reasons": list(reasons)}
    fa = None
    if "FLASH_ATTN" in backends and backends["FLASH_ATTN"]["valid"]:
        if before_fa is not None:
            before_fa()
        # The arguments FlashAttentionImpl.__init__ passes (flash_attn.py).
        fa = get_flash_attn_version(
            requires_alibi=requires_alibi, head_size=selector.head_size,
            has_sinks=selector.has_sink, requires_softcap=requires_softcap,
            supports_fa4_hd256=True)
    return dict(sorted(backends.items(), key=lambda kv: kv[1]["priority"])), fa


def _cpu_live(out: dict[str, Any], lay: _Layer) -> None:
    """The CPU platform always selects CPU_ATTN (non-MLA); ask that class itself."""
    try:
        from vllm.v1.attention.backends.registry import AttentionBackendEnum

        cls = AttentionBackendEnum["CPU_ATTN"].get_class()
        reasons = list(cls.validate_configuration(device_capability=None,
                                                  **_selector(lay)._asdict()))
    except Exception as exc:
        out["note"] = f"vLLM's CPU_ATTN could not be asked: {type(exc).__name__}: {exc}"
        return
    out["source"] = "vllm.validate_configuration (CpuPlatform, this machine)"
    _finish(out, {"CPU_ATTN": {"priority": 0, "valid": not reasons, "reasons": reasons}})


def _cuda_live(out: dict[str, Any], cc: tuple[int, int], lay: _Layer) -> bool:
    """``CudaPlatform.get_valid_backends`` on the device this process runs on, in vLLM's own
    config context (its sink check and FA version read the config). False, with a note, where
    vLLM cannot be asked as its selector was."""
    try:
        from vllm.config import get_current_vllm_config_or_none

        vcfg = get_current_vllm_config_or_none()
        if vcfg is None:
            out["note"] = ("asked outside vLLM's config context, where vLLM's answers would "
                           "miss the model's settings: the derived matrix answers instead")
            return False
        pinned = getattr(vcfg.attention_config, "backend", None)
        if pinned is not None:
            # vLLM judged only the pinned backend; asking it about the others here would import
            # them (and may probe for FlashInfer kernels) during model build.
            out["note"] = (f"--attention-backend {getattr(pinned, 'name', pinned)} is pinned, "
                           "so vLLM judged no other backend; the derived matrix answers for "
                           "the others")
            return False
        from vllm.platforms import current_platform

        backends, fa = ask_cuda(type(current_platform), cc, _selector(lay), lay.num_heads,
                                requires_alibi=lay.requires_alibi,
                                requires_softcap=lay.requires_softcap)
    except Exception as exc:
        logger.debug("CudaPlatform.get_valid_backends unavailable: %s", exc)
        out["note"] = f"vLLM could not be asked ({type(exc).__name__}: {exc})"
        return False
    out["source"] = f"vllm.get_valid_backends (CudaPlatform, this device {cc[0]}.{cc[1]})"
    if lay.selector is None:
        out["note"] = ("vLLM's own selector inputs were not seen: asked with the layer's "
                       "facts (decoder attention, automatic block size)")
    _finish(out, backends)
    out["flash_attn_version"] = fa
    return True


def _from_matrix(out: dict[str, Any], cc: tuple[int, int], lay: _Layer,
                 installed: str | None) -> None:
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
    _finish(out, {b["backend"]: {"priority": b["priority"], "valid": b["valid"],
                                 "reasons": b["reasons"]}
                  for b in case.as_dict()["backends"]})
    out["flash_attn_version"] = case.flash_attn_version if "FLASH_ATTN" in out["valid"] else None
    return None
