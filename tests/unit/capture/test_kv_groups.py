"""Layers keyed on vLLM's KV-cache group: the adapter reads vLLM's own ``KVCacheConfig``
(built here from vLLM 0.32's real spec classes), and the kernel map splits and sums by group."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from attnprof.aggregate.layers import LayerInfo
from attnprof.aggregate.worker_snapshot import kernel_groups
from attnprof.capture.vllm.args import KvGroupFacts, kv_cache_groups


def _name(i: int) -> str:
    return f"model.layers.{i}.self_attn.attn"


@pytest.mark.slow
def test_adapter_reads_vllms_kv_cache_config() -> None:
    kvi = pytest.importorskip("vllm.v1.kv_cache_interface")
    full = kvi.FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=64,
                                 dtype=torch.bfloat16)
    sliding = kvi.SlidingWindowSpec(block_size=16, num_kv_heads=2, head_size=64,
                                    dtype=torch.bfloat16, sliding_window=128)
    fp32 = kvi.FullAttentionSpec(block_size=32, num_kv_heads=4, head_size=128,
                                 dtype=torch.float32)
    uniform = kvi.UniformTypeKVCacheSpecs(block_size=32, kv_cache_specs={_name(4): fp32})
    cfg = kvi.KVCacheConfig(num_blocks=10, kv_cache_tensors=[], kv_cache_groups=[
        kvi.KVCacheGroupSpec([_name(0), _name(2)], sliding),
        kvi.KVCacheGroupSpec([_name(1), _name(3)], full),
        kvi.KVCacheGroupSpec([_name(4)], uniform)])
    got = kv_cache_groups(cfg)
    # K and V, 2 heads x 64, 2 bytes (bf16); fp32 4 heads x 128, 4 bytes
    assert got[_name(0)] == KvGroupFacts(0, "SlidingWindowSpec", 16, 128, 2 * 2 * 64 * 2)
    assert got[_name(3)] == KvGroupFacts(1, "FullAttentionSpec", 16, None, 2 * 2 * 64 * 2)
    assert got[_name(4)] == KvGroupFacts(2, "FullAttentionSpec", 32, None, 2 * 4 * 128 * 4)
    assert len(got) == 5
    assert kv_cache_groups(None) == {}


def _info(i: int, window: int | None, group: int | None, per_token: int = 0) -> LayerInfo:
    return LayerInfo(name=_name(i), index=i, backend="FLASH_ATTN", impl="FlashAttentionImpl",
                     num_heads=8, num_kv_heads=2, head_size=64, head_size_v=64,
                     sliding_window=window, dtype="bfloat16", kv_cache_dtype="auto",
                     fused=True, kv_group=group,
                     kv_spec=None if group is None else ("SlidingWindowSpec" if window
                                                         else "FullAttentionSpec"),
                     kv_block_size=16 if group is not None else 0,
                     kv_bytes_per_token=per_token)


def test_kernel_map_keys_on_the_group() -> None:
    """Two groups of identical shape (vLLM may split same-spec layers into groups of equal
    size) stay apart; each group's bytes per token sum its layers'."""
    infos = [_info(0, 128, 0, 512), _info(1, None, 1, 512), _info(2, 128, 0, 512),
             _info(3, None, 2, 512), _info(4, None, 1, 512)]
    reps: dict[Any, dict[str, Any]] = {None: {}}
    out = kernel_groups(infos, lambda i: None, reps)
    assert [(g.kv_group, g.layers, g.sliding_window, g.kv_spec, g.kv_bytes_per_token)
            for g in out] == [(0, [0, 2], 128, "SlidingWindowSpec", 1024),
                              (1, [1, 4], None, "FullAttentionSpec", 1024),
                              (2, [3], None, "FullAttentionSpec", 512)]
    assert {g.kv_block_size for g in out} == {16}
    # before the KV cache exists: no group, no bytes (not zero)
    (g,) = kernel_groups([_info(0, None, None), _info(1, None, None)], lambda i: None, reps)
    assert g.layers == [0, 1] and g.kv_group is None and g.kv_bytes_per_token is None
