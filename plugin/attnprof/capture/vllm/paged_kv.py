"""One request's keys (and values) read back from a layer's paged KV cache.

Chunked prompts, prefix-cache hits and decode steps attend to keys computed by earlier steps,
which only the layer's paged cache still holds. :func:`read_kv` gathers the request's blocks
(its block-table row) and returns positions [0, n) as [n, Hkv, D] in the cache's dtype. The
layout of the ``kv_cache`` tensor vLLM hands ``impl.forward`` is one of (vLLM 0.32; which one
a layer uses is decided in :mod:`.args`, the adapter, from the backend and its ISA):

* ``logical`` (FLASH_ATTN, FLASHINFER, TRITON_ATTN): the per-layer view is logical
  [blocks, Hkv, block_size, 2 D] whatever the physical stride order
  (``vllm/v1/kv_cache_layout.py: KVCacheLayout``); a token's key is ``[..., :D]``, its
  value ``[..., D:]`` (each backend's ``kv_cache.transpose(1, 2).split(head_size, -1)``).
* CPU_ATTN (``vllm/v1/attention/backends/cpu_attn.py``): the same tensor viewed as
  [blocks, Hkv, 2 block_size, D]; per (block, head) the first half is the key slab, the second
  the value slab, each packed for the kernel's ISA by ``cpu_attn_reshape_and_cache`` (learnt by
  writing through vLLM's own op, tests/unit/capture/test_paged_kv.py):

  - ``cpu_vec`` (ISA vec, vec16): key slab is K^T [D, block]; value slab natural [block, D];
  - ``cpu_amx`` 2-byte dtypes: key (t, j) at [t // 16, j // 2, t % 16, j % 2] of
    [block/16, D/2, 16, 2]; value at [j // 16, t // 2, j % 16, t % 2] of [D/16, block/2, 16, 2];
  - ``cpu_amx`` fp32: key at [t // 16, j, t % 16]; value at [j // 16, t, j % 16].

Quantized (fp8) caches are not read (the adapter gives no layout for them): their keys
would need the layer's scales, and a wrong scale would skew every statistic silently.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["LAYOUTS", "CacheLayout", "read_keys_t", "read_kv"]

LAYOUTS = ("logical", "cpu_vec", "cpu_amx")


@dataclass(frozen=True)
class CacheLayout:
    """How one layer's ``kv_cache`` tensor holds keys and values (see the module doc)."""

    kind: str
    head_size: int

    def __post_init__(self) -> None:
        if self.kind not in LAYOUTS:
            raise ValueError(f"unknown KV-cache layout {self.kind!r}")


def _blocks(kv_cache: Any, block_row: Any, n: int) -> tuple[Any, int]:
    """The request's first ceil(n / block_size) block ids (on the cache's device), block size."""
    import torch

    bs = int(kv_cache.shape[2])
    nb = -(-n // bs)
    ids = torch.as_tensor(block_row)[:nb].to(device=kv_cache.device, dtype=torch.long)
    if ids.numel() < nb:
        raise ValueError(f"block table row holds {ids.numel()} blocks, {nb} needed for {n}")
    return ids, bs


def read_kv(kv_cache: Any, layout: CacheLayout, block_row: Any, n: int,
            values: bool = False) -> tuple[Any, Any]:
    """(keys [n, Hkv, D], values [n, Hkv, D] or None) of positions [0, n) of the request
    whose block-table row is ``block_row``; copies only the request's blocks."""
    d = layout.head_size
    if n <= 0:
        empty = kv_cache.new_empty((0, int(kv_cache.shape[1]), d))
        return empty, (empty if values else None)
    ids, bs = _blocks(kv_cache, block_row, n)
    hkv = int(kv_cache.shape[1])
    nb = int(ids.numel())
    if layout.kind == "logical":
        blk = _gather(kv_cache, ids)  # [nb, H, bs, 2D]
        k = blk[..., :d].permute(0, 2, 1, 3).reshape(nb * bs, hkv, d)[:n]
        v = blk[..., d:2 * d].permute(0, 2, 1, 3).reshape(nb * bs, hkv, d)[:n] if values else None
        return k, v
    # CPU_ATTN: per (block, head) a key slab then a value slab, bs * D elements each
    slabs = kv_cache.view(kv_cache.shape[0], hkv, 2, bs * d)
    es = kv_cache.element_size()
    k = _cpu_slab(_gather(slabs[:, :, 0], ids), layout.kind, True, bs, d, es)
    v = _cpu_slab(_gather(slabs[:, :, 1], ids), layout.kind, False, bs, d, es) if values else None
    k = k.permute(0, 2, 1, 3).reshape(nb * bs, hkv, d)[:n]
    if v is not None:
        v = v.permute(0, 2, 1, 3).reshape(nb * bs, hkv, d)[:n]
    return k, v


def read_keys_t(kv_cache: Any, layout: CacheLayout, block_row: Any, n: int, own: Any,
                own_start: int, dtype: Any = None) -> Any:
    """Keys of positions [0, n) as [n, Hkv, D], a view of one contiguous [Hkv, D, n] tensor
    in ``dtype`` (default the cache's): the transposed layout a ``q @ K^T`` product reads
    as is. Positions below ``own_start`` come from the paged cache, the rest from ``own``
    (the call's keys, [>= n - own_start, Hkv, D]). The keys are copied once: CPU_ATTN's
    ``cpu_vec`` key slab already is K^T per block, copied block by block into place (a
    stack of the blocks, a transpose and a concatenation were three copies, ~1 ms a layer
    at 4K keys); other layouts go through :func:`read_kv`."""
    import torch

    hkv, d = int(kv_cache.shape[1]), layout.head_size
    out = torch.empty(hkv, d, max(0, n), dtype=dtype or kv_cache.dtype, device=kv_cache.device)
    m = max(0, min(n, own_start))
    if m and layout.kind == "cpu_vec" and kv_cache.device.type == "cpu":
        ids, bs = _blocks(kv_cache, block_row, m)
        kt = kv_cache.view(kv_cache.shape[0], hkv, 2, d, bs)  # [:, :, 0]: K^T [D, block]
        for b, i in enumerate(ids.tolist()):
            a = b * bs
            out[:, :, a:min(m, a + bs)].copy_(kt[i, :, 0, :, :min(bs, m - a)])
    elif m:
        out[:, :, :m].copy_(read_kv(kv_cache, layout, block_row, m)[0].permute(1, 2, 0))
    if n > m:
        out[:, :, m:].copy_(own[:n - m].permute(1, 2, 0))
    return out.permute(2, 0, 1)


def _gather(t: Any, ids: Any) -> Any:
    """``t[ids]`` along dim 0 as one new tensor. On CPU block by block: ``index_select`` over
    a whole cache took 15-130 ms for 8 blocks there (measured, torch 2.13), a stack of the
    blocks' views 0.08 ms; on a GPU one ``index_select`` (no host sync on the ids)."""
    import torch

    if t.device.type == "cpu":
        return torch.stack([t[i] for i in ids.tolist()])
    return t.index_select(0, ids)


def _cpu_slab(s: Any, kind: str, key: bool, bs: int, d: int, esize: int) -> Any:
    """Slabs [nb, H, bs * D] in the kernel's packing -> natural [nb, H, bs, D]."""
    nb, h = int(s.shape[0]), int(s.shape[1])
    if kind == "cpu_vec":
        if key:  # K^T per block
            return s.reshape(nb, h, d, bs).transpose(2, 3)
        return s.reshape(nb, h, bs, d)
    if esize == 2:  # AMX, VNNI pairs
        if key:  # [bs/16, D/2, 16, 2] -> (t//16, t%16, j//2, j%2)
            return s.reshape(nb, h, bs // 16, d // 2, 16, 2).permute(0, 1, 2, 4, 3, 5).reshape(
                nb, h, bs, d)
        # [D/16, bs/2, 16, 2] -> (t//2, t%2, j//16, j%16)
        return s.reshape(nb, h, d // 16, bs // 2, 16, 2).permute(0, 1, 3, 5, 2, 4).reshape(
            nb, h, bs, d)
    if key:  # AMX fp32: [bs/16, D, 16] -> (t//16, t%16, j)
        return s.reshape(nb, h, bs // 16, d, 16).permute(0, 1, 2, 4, 3).reshape(nb, h, bs, d)
    # [D/16, bs, 16] -> (t, j//16, j%16)
    return s.reshape(nb, h, d // 16, bs, 16).permute(0, 1, 3, 2, 4).reshape(nb, h, bs, d)
