"""vLLM attention backends: which are valid for a layer, which one vLLM picks, and why not the
others, in vLLM's own words.

Where the answer comes from, always named in ``source``:
- the running platform is the target (a worker on its own GPU, or on its own CPU): vLLM itself,
  ``CudaPlatform.get_valid_backends`` / the CPU backend's ``validate_configuration`` (here);
- another target (an H100 asked about from a CPU process), or vLLM cannot be asked as its
  selector was: the ``fallback`` the caller hands in (the derived matrix,
  :func:`attnprof.analyze.vllm_backends.from_matrix`, which the plugin host passes;
  capture imports no analyze). Without one, ``valid`` stays None and ``note`` says why.

Safe inside a vLLM worker: nothing is allocated, no kernel runs, no process is started.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from attnprof.facts.backend_report import Layer, finish, new_report
from attnprof.facts.dtypes import torch_dtype

__all__ = ["Fallback", "ask_cuda", "vllm_backend_report"]

Fallback = Callable[[dict[str, Any], tuple[int, int], Layer, str | None], None]
"""Fills a report for a capability vLLM cannot be asked about here: ``(report, capability,
layer, installed vLLM version)`` (:func:`attnprof.analyze.vllm_backends.from_matrix`)."""

logger = logging.getLogger("attnprof")


def _running() -> tuple[str | None, Any, str | None]:
    """(platform class name, current_platform, vLLM version) without forcing anything."""
    try:
        import vllm
        from vllm.platforms import current_platform

        return type(current_platform).__name__, current_platform, str(vllm.__version__)
    except Exception as exc:  # no vLLM here
        logger.debug("vLLM not importable (%s)", exc)
        return None, None, None


def vllm_backend_report(num_heads: int, num_kv_heads: int, head_size: int, dtype: Any,
                        kv_cache_dtype: str | None = "auto", sliding_window: int | None = None,
                        *, has_sink: bool = False, block_size: int | None = None,
                        device_capability: tuple[int, int] | None = None,
                        selected: str | None = None, selector_config: Any = None,
                        flash_attn_version: int | None = None, requires_alibi: bool = False,
                        requires_softcap: bool = False,
                        fallback: Fallback | None = None) -> dict[str, Any]:
    """Per-backend validity for one attention layer, as vLLM judges it.

    ``device_capability`` None means "the device this process runs on". ``selector_config``
    is the ``AttentionSelectorConfig`` vLLM's selector built for the layer (the capture keeps
    it): with it vLLM is asked with exactly its own inputs (attention type, block size,
    multimodal prefix, ...). ``flash_attn_version`` is the version the layer's implementation
    resolved (what runs); without it vLLM's resolution is asked with ``requires_alibi`` and
    ``requires_softcap`` as the implementation passes them. ``fallback`` answers where vLLM
    cannot (another target, a pinned backend, outside vLLM's config context).

    vLLM is asked live only inside its own config context (as at model build in a worker);
    this never sets vLLM's process-global config. Returns ``{"source", "vllm_version",
    "platform", "device_capability", "layer", "selected", "valid", "predicted",
    "flash_attn_version", "note", "backends": {NAME: {"valid", "reasons", "priority"}}}``;
    ``selected`` echoes the backend the worker uses, ``predicted`` is what vLLM picks without
    ``--attention-backend``; ``valid`` is None when no source can answer (``note`` says why).
    """
    lay = Layer(num_heads, head_size, dtype, kv_cache_dtype, block_size, has_sink,
                sliding_window, selector_config, requires_alibi, requires_softcap)
    out = new_report(lay, num_kv_heads, selected, device_capability)
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
    if fallback is None:
        notes = [out["note"]] if out.get("note") else []
        out["note"] = "; ".join([*notes, "vLLM cannot answer for this target here and no "
                                 "derived matrix was handed in"])
        return out
    fallback(out, device_capability, lay, version)
    return out


def _call(obj: Any, name: str) -> Any:
    try:
        return getattr(obj, name)()
    except Exception:
        return None


def _selector(lay: Layer) -> Any:
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


def _cpu_live(out: dict[str, Any], lay: Layer) -> None:
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
    finish(out, {"CPU_ATTN": {"priority": 0, "valid": not reasons, "reasons": reasons}})


def _cuda_live(out: dict[str, Any], cc: tuple[int, int], lay: Layer) -> bool:
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
    finish(out, backends)
    out["flash_attn_version"] = fa
    return True
