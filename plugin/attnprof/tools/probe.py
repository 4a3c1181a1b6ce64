"""The peak probe: a short STREAM-like memory-bandwidth measurement (a read-only stream, copy
and triad on arrays larger than the last-level cache) and a square-GEMM FLOP/s peak, on the
CPU with torch's thread count or on the GPU timed with CUDA events. A few seconds, not
minutes.

Used by ``attnprof probe``, ``attnprof profile`` (the roofline's roofs) and, with
``ATTNPROF_PROBE=1``, once per worker in a background thread after start-up
(:func:`start_background`; never raises into the host).
"""

from __future__ import annotations

import contextlib
import logging
import statistics
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from attnprof.contracts.roofline import MemoryProbe, ProbeKernel, SpecCheck
from attnprof.facts import gpu_specs
from attnprof.facts.dtypes import normalize, torch_dtype

__all__ = ["Timer", "cpu_array", "default_array_bytes", "llc_bytes", "probe", "read_loops",
           "spec_check", "start_background", "write_allocates"]

logger = logging.getLogger("attnprof")

MIN_CPU_ARRAY = 256 << 20
MAX_CPU_ARRAY = 512 << 20
"""CPU arrays: at least 256 MiB, twice the LLC when it is larger, at most 512 MiB (on the
2-core Xeon with a 480 MiB shared L3 we measured on, copy runs flat from 64 MiB up: the
cache a few cores get is far smaller than the L3 reported)."""
GPU_ARRAY = 1 << 30
"""1 GiB per array on the GPU (L2 is 40-60 MB on A100/H100/H200), or 1/8 of the free memory
when less (at least 64 MiB)."""


def llc_bytes() -> int | None:
    """The largest CPU cache Linux reports (bytes), None when it says nothing."""
    best = None
    with contextlib.suppress(OSError, ValueError):
        for p in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"):
            text = p.read_text().strip().upper()
            mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
            n = int(text.rstrip("KMG")) * mult
            best = n if best is None else max(best, n)
    return best


def default_array_bytes(device: str) -> int:
    """Bytes per probe array on ``device`` (cpu or cuda)."""
    if device == "cuda":
        import torch

        # Inside a server most of the memory is the KV cache: take at most 1/8 of what is free.
        free = int(torch.cuda.mem_get_info()[0])
        return max(64 << 20, min(GPU_ARRAY, free // 8))
    llc = llc_bytes() or 0
    return max(MIN_CPU_ARRAY, min(MAX_CPU_ARRAY, 2 * llc))


Timer = Callable[[Callable[[], Any]], float]
"""Runs a kernel and returns the seconds it took (the probe's one clock)."""


def _timer(device: str) -> Timer:
    import torch

    if device == "cuda":
        def cuda_time(fn: Callable[[], Any]) -> float:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(
                enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            return float(start.elapsed_time(end)) / 1e3

        return cuda_time

    def host_time(fn: Callable[[], Any]) -> float:
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0

    return host_time


HUGE_PAGE = 2 << 20


def cpu_array(n: int, fill: float) -> Any:
    """A float32 CPU tensor of ``n`` elements set to ``fill``, in its own anonymous mapping
    advised for transparent huge pages and aligned to 2 MiB.

    Why: torch's CPU allocator does not ask for huge pages (unless THP_MEM_ALLOC_ENABLE=1),
    and on a kernel whose THP mode is ``madvise`` (Debian's default, and this project's CI)
    its large arrays live in 4 KiB pages, which read 12-23% slower here than the same bytes
    in 2 MiB pages (a TLB miss every 4 KiB of a stream). A peak is the best the memory
    gives; numpy and STREAM's static arrays get huge pages, so a probe on torch's own pages
    read 0.88x an independent numpy read on a clean CI run. Where the kernel says no (THP
    ``never``, or no huge page free) this is still an ordinary mapping."""
    import ctypes
    import mmap

    import torch

    if not hasattr(mmap, "MAP_ANONYMOUS"):  # Windows: no anonymous private mappings
        return torch.full((n,), fill, dtype=torch.float32)
    m = mmap.mmap(-1, n * 4 + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_HUGEPAGE"):  # Linux only; before the first touch
        with contextlib.suppress(OSError):
            m.madvise(mmap.MADV_HUGEPAGE)
    head = ctypes.c_char.from_buffer(m)
    offset = (-ctypes.addressof(head)) % HUGE_PAGE
    del head  # a live export would keep the mapping from ever closing
    # frombuffer holds a reference to the mapping: it lives as long as the tensor does.
    t = torch.frombuffer(m, dtype=torch.float32, count=n, offset=offset)
    return t.fill_(fill) if fill else t  # an anonymous mapping is already zeros


def _kernel(name: str, work: float, times: list[float], size: int, dtype: str) -> ProbeKernel:
    rates = sorted(work / t for t in times if t > 0)
    return ProbeKernel(name=name, median=statistics.median(rates), low=rates[0],
                       high=rates[-1], runs=len(rates), size=size, dtype=dtype)


def write_allocates(device: str) -> bool:
    """Whether a store to memory not in cache first reads the line (CPU: yes, for torch's
    ordinary stores; GPU: no). Copy and triad count the bytes that really move: copy reads one
    array and writes one (2 arrays, 3 on CPU with the write-allocate read), triad reads two
    and writes one (3, 4 on CPU). STREAM's own count leaves the write-allocate read out."""
    return device != "cuda"


def read_loops(x: Any) -> tuple[Callable[[], Any], ...]:
    """Read-only reductions over ``x``'s bytes; a run of the read kernel is the fastest of
    them. Why several: no one loop is the fastest read on every CPU. On this project's CI
    Xeon (torch 2.13, 2 threads, 512 MiB in huge pages) a roof from torch's float sum alone
    was 0.874x an independent numpy read (median of 21 paired rounds), so every utilisation
    against it was 13% too high; with these three, 0.994 (docs/roofline.md). A peak is the
    best a read stream reaches."""
    import torch

    return (lambda: torch.sum(x), lambda: torch.amax(x),
            lambda: torch.amax(x.view(torch.int32)))


def _bandwidth(device: str, nbytes: int, repeats: int, timed: Timer) -> list[ProbeKernel]:
    import torch

    n = max(1, nbytes // 4)
    if device == "cpu":
        a, b, c = cpu_array(n, 0.0), cpu_array(n, 1.0), cpu_array(n, 2.0)
    else:
        a = torch.empty(n, dtype=torch.float32, device=device)
        b = torch.ones(n, dtype=torch.float32, device=device)
        c = torch.full((n,), 2.0, dtype=torch.float32, device=device)
    out = []
    wa = 1 if write_allocates(device) else 0
    # Each kernel is one or more loops over the same bytes; a run is its fastest loop's.
    kernels: tuple[tuple[str, int, tuple[Callable[[], Any], ...]], ...] = (
        # read: what decode attention does to the KV cache (reads it, writes almost nothing)
        ("read", 1, read_loops(b)),
        ("copy", 2 + wa, (lambda: a.copy_(b),)),
        ("triad", 3 + wa, (lambda: torch.add(b, c, alpha=3.0, out=a),)))
    for name, arrays, loops in kernels:
        for fn in loops:
            fn()  # first touch: page faults and lazy allocation are not bandwidth
        times = [min(timed(fn) for fn in loops) for _ in range(repeats)]
        out.append(_kernel(name, float(arrays * n * 4), times, n * 4, "float32"))
    return out


def _matmul(device: str, dtype: str, n: int, repeats: int, timed: Timer) -> ProbeKernel:
    import torch

    td = torch_dtype(dtype)
    g = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(n, n, device=device, generator=g).to(td)
    y = torch.randn(n, n, device=device, generator=g).to(td)
    torch.mm(x, y)  # warm-up: kernel selection, thread pool start
    times = [timed(lambda: torch.mm(x, y)) for _ in range(repeats)]
    return _kernel("matmul", 2.0 * n ** 3, times, n, dtype)


def _gpu_name() -> str | None:
    from attnprof.tools import provenance

    name = provenance.hardware().gpu_name  # NVML's name: the spec table's key
    if name:
        return name
    import torch

    return str(torch.cuda.get_device_name())


def probe(device: str = "auto", dtype: str = "float32", array_bytes: int | None = None,
          repeats: int = 5, matmul_n: int | None = None, timer: Timer | None = None
          ) -> MemoryProbe:
    """Measure peak bandwidth (a read-only stream; copy and triad beside it) and matmul FLOP/s
    in ``dtype`` on ``device`` (auto: cuda when available). Takes seconds; raises
    (``ValueError`` for a bad argument, ``RuntimeError``/``MemoryError`` from torch): callers
    inside a host catch it. ``timer``: the clock every kernel run is timed with (default:
    the device's); a test passes its own, so the rates' arithmetic is checked exactly
    rather than against another timing on a loaded machine."""
    import torch

    t0 = time.perf_counter()
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device not in ("cpu", "cuda"):
        raise ValueError(f"device {device!r}: cpu or cuda")
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("device cuda: torch sees no CUDA device")
    # torch's own name (float32, bfloat16): what layer facts and the spec check use.
    dtype = str(torch_dtype(normalize(dtype))).removeprefix("torch.")
    if repeats < 1:
        raise ValueError("repeats must be >= 1")
    nbytes = array_bytes or default_array_bytes(device)
    n = matmul_n or (8192 if device == "cuda" else 1024)
    timed = timer or _timer(device)
    kernels = _bandwidth(device, nbytes, repeats, timed)
    kernels.append(_matmul(device, dtype, n, max(repeats, 10 if device == "cuda" else 1),
                           timed))
    by = {k.name: k for k in kernels}
    res = MemoryProbe(
        # Peaks are the best run, as STREAM reports: other load only ever slows a run down.
        # The bandwidth roof is the read stream's, not copy's or triad's: their bytes moved
        # include writes, which on a CPU overlap the reads (measured on an AMD EPYC: copy
        # moves 52 GB/s counting its write-allocate read and write-backs, while no read-only
        # stream passes 35), so a read-dominated kernel measured against them could never
        # reach 100%.
        device=device, bandwidth_bytes_per_second=by["read"].high,
        matmul_flops_per_second=by["matmul"].high, kernels=kernels, time=time.time(),
        threads=torch.get_num_threads() if device == "cpu" else None)
    if device == "cuda":
        res.device_name = _gpu_name()
        res.spec = spec_check(res.device_name, res.bandwidth_bytes_per_second,
                              res.matmul_flops_per_second, dtype)
        if res.spec is None:
            res.note = f"{res.device_name!r} is not in attnprof's GPU spec table"
    else:
        from attnprof.tools.provenance import cpu_info

        res.device_name = cpu_info()[0]
    res.seconds = round(time.perf_counter() - t0, 3)
    return res


def spec_check(name: str | None, bandwidth: float, flops: float, dtype: str
               ) -> SpecCheck | None:
    """The probe against the datasheet of GPU ``name`` (None when the part is unknown).
    The FLOP ratio only for 16-bit dtypes: the table holds the BF16/FP16 tensor peak."""
    spec = gpu_specs.lookup(name)
    if spec is None:
        return None
    return SpecCheck(
        part=spec.name, bandwidth_bytes_per_second=spec.bandwidth_bytes_per_second,
        flops_per_second=spec.bf16_flops_per_second, source=spec.source,
        bandwidth_ratio=gpu_specs.spec_ratio(bandwidth, spec.bandwidth_bytes_per_second),
        flops_ratio=(gpu_specs.spec_ratio(flops, spec.bf16_flops_per_second)
                     if dtype in ("bfloat16", "float16") else None))


def wait_idle(steps: Callable[[], int], idle_s: float = 1.0, max_wait_s: float = 120.0,
              poll_s: float = 0.1) -> bool:
    """Wait until ``steps()`` (a count of model steps) stays unchanged for ``idle_s``: the
    worker is idle, so a probe does not compete with serving for the same memory bus and
    cores (on a CPU server a probe under load read 8 GB/s against 38 GB/s idle). Returns
    False when ``max_wait_s`` passed without such a gap (the probe then runs under load)."""
    deadline = time.monotonic() + max_wait_s
    last, since = steps(), time.monotonic()
    while time.monotonic() < deadline:
        time.sleep(poll_s)
        now_steps, now = steps(), time.monotonic()
        if now_steps != last:
            last, since = now_steps, now
        elif now - since >= idle_s:
            return True
    return False


def start_background(done: Callable[[MemoryProbe], None], on_error: Callable[[Exception], None],
                     dtype: Callable[[], str | None] = lambda: "float32",
                     delay_s: float = 5.0, wait_s: float = 900.0,
                     steps: Callable[[], int] | None = None,
                     idle_wait_s: float = 120.0) -> threading.Thread:
    """Run :func:`probe` once in a daemon thread, off the serving path: after ``delay_s``,
    once ``dtype()`` names the model's dtype; not at all when it names none within
    ``wait_s`` (a process without a model). With ``steps`` (the worker's step count), it
    then waits up to ``idle_wait_s`` for an idle second (:func:`wait_idle`); a probe that
    found none says so in its ``note``. The result goes to ``done``, an exception to
    ``on_error``; nothing is raised."""

    def run() -> None:
        try:
            time.sleep(delay_s)
            deadline = time.monotonic() + wait_s
            dt = dtype()
            while dt is None and time.monotonic() < deadline:
                time.sleep(1.0)
                dt = dtype()
            if dt is None:
                return
            idle = True if steps is None else wait_idle(steps, max_wait_s=idle_wait_s)
            # With the thread's own torch/OpenMP threads: torch.set_num_threads would also
            # change MKL's and the thread pool's process-wide settings under the serving
            # thread (a guest never retunes its host).
            result = probe(dtype=dt)
            if not idle:
                busy = (f"probed under load: the worker never idled for 1 s within "
                        f"{idle_wait_s:.0f} s, so the peaks may read low")
                result.note = f"{result.note}; {busy}" if result.note else busy
            done(result)
        except Exception as exc:
            on_error(exc)

    t = threading.Thread(target=run, name="attnprof-probe", daemon=True)
    t.start()
    return t
