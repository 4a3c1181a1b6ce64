"""Head statistics split by (phase, context bucket): one edge function, lazily created strata,
totals equal to folding everything into one accumulator, and every wire format (dict, delta
bytes, the double buffer, the API server's rank merge) carrying each stratum intact; data of
the version before strata still loads, as the one stratum ("prefill", 0)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from attnprof.aggregate.head_stats import HeadStatsAccumulator
from attnprof.aggregate.head_stats_buffer import HeadStatsDoubleBuffer
from attnprof.aggregate.head_stats_merge import add_rank_delta, global_for
from attnprof.aggregate.head_strata import (
    HeadStatsStrata,
    context_bucket,
    context_bucket_edges,
)
from attnprof.capture import head_rows

LAYERS, HKV, G, D = 2, 2, 2, 16


def _template() -> HeadStatsAccumulator:
    return HeadStatsAccumulator(LAYERS, HKV, G, n_random=8, n_detail=1,
                                window_grid=(8, 32, 128))


def _fold(acc: HeadStatsAccumulator, n: int, seed: int) -> None:
    """A real fold (head_rows on random q/k) of one n-token prompt at every layer."""
    g = torch.Generator().manual_seed(seed)
    for layer in range(LAYERS):
        q = torch.randn(n, HKV * G, D, generator=g)
        k = torch.randn(n, HKV, D, generator=g)
        head_rows.update(acc, layer, q, k, D ** -0.5, q_start=0)


def _same(a: HeadStatsAccumulator, b: HeadStatsAccumulator) -> None:
    for f in (*HeadStatsAccumulator._SUM_FIELDS, "cov_min"):
        np.testing.assert_allclose(getattr(a, f), getattr(b, f), rtol=1e-12, atol=0, err_msg=f)


def _filled() -> HeadStatsStrata:
    st = HeadStatsStrata(_template())
    _fold(st.get("prefill", 0), 40, 1)
    _fold(st.get("prefill", 256), 300, 2)
    _fold(st.get("decode", 256), 30, 3)
    return st


def test_bucket_edges_are_the_minimum_then_doublings() -> None:
    edges = context_bucket_edges(256, 8192)
    assert edges == (0, 256, 512, 1024, 2048, 4096, 8192)
    assert [context_bucket(n, edges) for n in (1, 255, 256, 511, 512, 5000, 10 ** 6)] == [
        0, 0, 256, 256, 512, 4096, 8192]
    # a minimum that is no power of two: the next doubling bucket starts at a power of two
    assert context_bucket_edges(300, 2048) == (0, 300, 512, 1024, 2048)
    assert context_bucket_edges(0, 256) == (0, 64, 128, 256)


def test_strata_are_created_lazily_and_sorted() -> None:
    st = HeadStatsStrata(_template())
    assert st.items() == [] and not st.has_data()
    a = st.get("decode", 512)
    assert st.get("decode", 512) is a
    st.get("prefill", 1024)
    st.get("prefill", 0)
    assert [k for k, _ in st.items()] == [("prefill", 0), ("prefill", 1024), ("decode", 512)]
    with pytest.raises(ValueError):
        st.get("generate", 0)


def test_total_equals_one_accumulator_that_saw_everything() -> None:
    st = _filled()
    every = _template()
    _fold(every, 40, 1)
    _fold(every, 300, 2)
    _fold(every, 30, 3)
    _same(st.total(), every)
    pre = _template()
    _fold(pre, 40, 1)
    _fold(pre, 300, 2)
    _same(st.total("prefill"), pre)
    assert st.total("decode").requests.tolist() == [1.0, 1.0]
    assert list(st.layers_with_data()) == [0, 1]


def test_delta_bytes_carry_each_stratum_and_restart_from_zero() -> None:
    st = _filled()
    want = {k: HeadStatsAccumulator.from_dict(a.to_dict()) for k, a in st.items()}
    st.get("decode", 4096)  # created, never fed: left out of the delta
    data = st.take_bytes(piece=1000)
    assert not st.has_data()
    back = HeadStatsStrata.from_bytes(data)
    assert [k for k, _ in back.items()] == sorted(want, key=lambda k: (k[0] != "prefill", k))
    for k, acc in back.items():
        _same(acc, want[k])
    # an empty take still loads (the shape travels in the index line)
    assert HeadStatsStrata.from_bytes(st.take_bytes()).items() == []
    for bad in (b"", b"junk", data[:-10], data + b"x", data[:40]):
        with pytest.raises(ValueError):
            HeadStatsStrata.from_bytes(bad)


def test_dict_round_trip_and_data_before_strata() -> None:
    st = _filled()
    back = HeadStatsStrata.load(st.to_dict())
    assert [k for k, _ in back.items()] == [k for k, _ in st.items()]
    for (_k, a), (_k2, b) in zip(back.items(), st.items(), strict=True):
        _same(a, b)
    old = _template()
    _fold(old, 50, 9)
    for loaded in (HeadStatsStrata.load(old.to_dict()),
                   HeadStatsStrata.from_bytes(old.empty_like().merge(old).take_bytes())):
        ((key, acc),) = loaded.items()
        assert key == ("prefill", 0)
        _same(acc, old)


def test_double_buffer_swaps_strata() -> None:
    buf = HeadStatsDoubleBuffer(HeadStatsStrata(_template()))
    assert not buf.swap(lambda c: b"".join(c))  # nothing folded yet: nothing swapped
    active = buf.active
    assert isinstance(active, HeadStatsStrata)
    _fold(active.get("decode", 512), 20, 4)
    assert buf.swap(lambda c: b"".join(c))
    assert buf.wait(60)
    (delta,) = buf.take_ready()
    ((key, acc),) = HeadStatsStrata.from_bytes(delta).items()
    assert key == ("decode", 512) and acc.requests.tolist() == [1.0, 1.0]


def test_rank_merge_places_each_ranks_heads_in_each_stratum() -> None:
    # two tensor-parallel ranks, one KV head each: the global strata hold both halves
    parts = []
    for r in range(2):
        st = HeadStatsStrata(HeadStatsAccumulator(LAYERS, 1, G, n_random=8, n_detail=1,
                                                  window_grid=(8, 32, 128)))
        g = torch.Generator().manual_seed(r)
        for layer in range(LAYERS):
            head_rows.update(st.get("prefill", 256), layer, torch.randn(30, G, D, generator=g),
                             torch.randn(30, 1, D, generator=g), D ** -0.5, q_start=0)
        parts.append(HeadStatsStrata.from_bytes(st.take_bytes()))
    glob: Any = None
    for r, part in enumerate(parts):
        rank = {"tp_rank": r, "tp_size": 2}
        glob = global_for(glob, part, rank, total_kv_heads=2, total_layers=LAYERS + 1)
        add_rank_delta(glob, part, rank)
    assert isinstance(glob, HeadStatsStrata) and glob.num_layers == LAYERS + 1
    ((key, acc),) = glob.items()
    assert key == ("prefill", 256) and acc.num_q_heads == 2 * G
    for r, part in enumerate(parts):
        ((_k, p),) = part.items()
        np.testing.assert_array_equal(acc.sink_sum[:LAYERS, r * G:(r + 1) * G], p.sink_sum)
    assert acc.requests.tolist() == [1.0, 1.0, 0.0]  # counted by the first rank only
