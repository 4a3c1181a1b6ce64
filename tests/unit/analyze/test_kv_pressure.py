"""KV pressure: the stat logger's aggregate (time-weighted usage, preemptions, waiting,
block-seconds), the verdict rules and the capacity figures, on hand-built stats."""

from __future__ import annotations

import numpy as np
import pytest

from attnprof.aggregate.kv import FinishedRequest, KvPressure, block_seconds
from attnprof.aggregate.layers import LayerInfo
from attnprof.aggregate.requests import RequestAggregates
from attnprof.analyze import kv_pressure as kvp
from attnprof.analyze.sparsity.savings import kv_tokens
from attnprof.analyze.window import window_between
from attnprof.contracts.snapshot import KvLayer, KvPressureStats, Snapshot
from attnprof.exporters.catalog import spec
from attnprof.exporters.samples import Sample, kv_samples
from attnprof.facts.kv import blocks_held, held_tokens, kv_cache_dtype, kv_element_bytes
from attnprof.facts.shape import AttentionShape


def _run(agg: KvPressure, states: list[tuple[float, float, int, int, int]]) -> None:
    """``states``: (time, usage, running, waiting, preempted) stats batches."""
    for t, u, r, w, p in states:
        agg.record(t, u, r, w, p)


def test_usage_is_time_weighted_and_above_90_exact() -> None:
    agg = KvPressure()
    # 2 s at 0.5, 3 s at 0.95, 1 s at 0.9 (not above), then idle 100 s (not busy).
    _run(agg, [(0.0, 0.5, 2, 0, 0), (2.0, 0.95, 3, 1, 1), (5.0, 0.9, 3, 0, 2),
               (6.0, 0.0, 0, 0, 0), (106.0, 0.2, 1, 0, 0)])
    st = agg.summary()
    assert st.busy_seconds == pytest.approx(6.0)
    assert st.peak == 0.95 and st.current == 0.2
    assert st.preemptions == 3
    assert st.waiting_seconds == pytest.approx(3.0)
    assert st.waiting_kv_high_seconds == pytest.approx(3.0)
    assert st.running_request_seconds == pytest.approx(2 * 2 + 3 * 3 + 3 * 1)
    by_edge = dict(zip(st.usage_bounds, st.usage_seconds, strict=True))
    assert by_edge[0.5] == pytest.approx(2.0)
    assert by_edge[0.95] == pytest.approx(3.0)
    assert by_edge[0.9] == pytest.approx(1.0)
    assert sum(st.usage_seconds) == pytest.approx(st.busy_seconds)


def test_block_seconds_estimate_and_classes() -> None:
    r = FinishedRequest(prompt_tokens=1000, generation_tokens=200, prefill_time_s=2.0,
                        decode_time_s=4.0)
    # 1000 tok x 2 s + 1100 tok x 4 s = 6400 token-seconds = 400 blocks of 16 x 1 s
    assert block_seconds(r, 16) == pytest.approx(400.0)
    assert block_seconds(r, 16, window=100) == pytest.approx(100 * 6 / 16)
    agg = KvPressure()
    agg.configure(block_size=16)
    agg.record(0.0, 0.1, 1, 0, 0, [r, FinishedRequest(40, 20, 0.1, 0.5),
                                    FinishedRequest(4000, 100, 1.0, 1.0)])
    st = agg.summary()
    assert st.class_names == ["short", "medium", "long"]
    assert st.class_requests == [1, 1, 1]
    assert st.class_block_seconds[1] == pytest.approx(400.0)


def _requests(states: list[tuple[float, float, int, int, int]], finished: int = 30,
              max_num_seqs: int = 8, context: int = 1000) -> RequestAggregates:
    req = RequestAggregates(4096)
    req.kv.configure(max_num_seqs=max_num_seqs, block_size=16, num_blocks=1000)
    _run(req.kv, states)
    for _ in range(finished):
        req.observe(context - 10, 10)
    return req


def test_verdict_kv_bound_on_time_above_90() -> None:
    req = _requests([(0.0, 0.95, 4, 2, 0), (20.0, 0.5, 4, 0, 0), (40.0, 0.0, 0, 0, 0)])
    a = kvp.assess(req.summary())
    assert a is not None and a.verdict == "kv_bound"
    assert a.above_90_seconds == pytest.approx(20.0)
    assert a.above_90_fraction == pytest.approx(0.5)
    assert any("above 90%" in e for e in a.evidence)
    assert a.confidence == "high"


def test_verdict_kv_bound_on_preemptions_alone() -> None:
    req = _requests([(0.0, 0.6, 4, 0, 0), (10.0, 0.6, 4, 0, 3), (20.0, 0.0, 0, 0, 0)])
    a = kvp.assess(req.summary())
    assert a is not None and a.verdict == "kv_bound" and a.preemptions == 3
    assert any("3 preemption(s)" in e for e in a.evidence)


def test_verdict_compute_bound_when_queue_with_low_kv() -> None:
    req = _requests([(0.0, 0.2, 8, 5, 0), (30.0, 0.3, 8, 5, 0), (60.0, 0.0, 0, 0, 0)])
    a = kvp.assess(req.summary())
    assert a is not None
    assert a.verdict == "compute_bound", a.evidence
    assert "max_num_seqs=8" in a.evidence[0] and "requests wait" in a.evidence[0]


def test_verdict_neither_for_light_traffic_and_too_little_time() -> None:
    req = _requests([(0.0, 0.1, 2, 0, 0), (30.0, 0.05, 1, 0, 0), (60.0, 0.0, 0, 0, 0)])
    a = kvp.assess(req.summary())
    assert a is not None and a.verdict == "neither"
    short = kvp.assess(_requests([(0.0, 0.99, 2, 3, 5), (1.0, 0.0, 0, 0, 0)]).summary())
    assert short is not None and short.verdict == "neither"
    assert "too little traffic" in short.evidence[0]
    # Queue while KV sits at 85-90% (the demo's 8 long documents on one CPU): not compute-bound
    # (KV is far from idle), not KV-bound (rarely above 90%, no preemptions): near capacity.
    near = kvp.assess(_requests([(0.0, 0.88, 4, 3, 0), (50.0, 0.95, 4, 3, 0),
                                 (53.0, 0.0, 0, 0, 0)]).summary())
    assert near is not None and near.verdict == "neither"
    assert "near KV capacity" in near.evidence[1]


def test_kv_layers_honour_dtype_and_windows() -> None:
    shape = AttentionShape(num_layers=4, num_heads=8, num_kv_heads=2, head_dim=64,
                           dtype="bfloat16", layer_windows=(128, None, 128, None))
    bf16 = kvp.kv_layers(shape, kv_cache_dtype("auto", "torch.bfloat16"))
    fp8 = kvp.kv_layers(shape, kv_cache_dtype("fp8_e4m3", "torch.bfloat16"))
    assert kv_cache_dtype("fp8", "bfloat16") == "fp8"
    assert bf16[0].bytes_per_token == 2 * 2 * 64 * 2 and fp8[0].bytes_per_token == 2 * 2 * 64
    assert bf16[0].per_kv_head == 256 and bf16[0].per_query_head == 64
    assert [lay.window for lay in bf16] == [128, None, 128, None]
    st = _requests([(0.0, 0.5, 1, 0, 0)]).summary().kv_pressure
    assert st is not None
    st.layers = bf16
    # 1000 blocks of 16 tokens of every layer, one of them vLLM's null block. A 1000-token
    # sequence takes 63 blocks of each full layer and 128/16 + 1 = 9 of each windowed one
    # (the window straddles a block edge): 999 x 4 block-layers / (2x63 + 2x9), rounded down.
    assert kvp.capacity_sequences(st, 1000) == 999 * 4 // (2 * 63 + 2 * 9)
    assert kvp.capacity_sequences(st, 100) == 999 // 7  # 7 blocks, inside the window
    shares = kvp.layer_shares(bf16, 1000)
    assert shares[1] == pytest.approx(1000 / 2256)
    hb = kvp.head_bytes(st, 0.5, 1000)  # usage is a share of the 999 usable blocks
    assert sum(hb[k] * 2 for k in hb) == pytest.approx(0.5 * 999 * 16 * 4 * 512)


def test_assessment_reports_capacity_classes_and_top_layers() -> None:
    req = _requests([(0.0, 0.95, 4, 2, 0), (20.0, 0.0, 0, 0, 0)], context=2000)
    req.kv.configure(layers=kvp.kv_layers(AttentionShape(3, 4, 2, 64, "float32",
                                                         (None, 256, None)), "fp32"))
    req.kv.record(21.0, 0.0, 0, 0, 0, [FinishedRequest(1990, 10, 1.0, 1.0),
                                       FinishedRequest(30, 10, 1.0, 1.0)])
    a = kvp.assess(req.summary())
    assert a is not None
    assert a.capacity_tokens == 16000
    # p50 2000 tokens: 125 blocks of 16 per full layer, 256/16 + 1 = 17 for the window.
    assert a.capacity_sequences["p50"] == 999 * 3 // (125 * 2 + 17)
    assert a.top_layers == [0, 2]
    assert a.class_share["medium"] > 0.9 and a.class_share["short"] < 0.1
    # At peak (0.95) the cache's 16000 tokens x 3 layers are split 2000:256:2000
    # (p50 bucket bound 2000 vs the 256 window), over 2 KV heads per layer (1024 B/token);
    # usage is a share of the 999 usable blocks (vLLM keeps one as its null block).
    cache = 0.95 * 999 * 16 * 3 * 1024
    assert a.head_bytes_peak["0"] == pytest.approx(cache * 2000 / 4256 / 2, rel=1e-6)
    assert a.head_bytes_peak["1"] == pytest.approx(cache * 256 / 4256 / 2, rel=1e-6)


def test_window_subtracts_kv_counters_and_recomputes_verdict() -> None:
    req = _requests([(0.0, 0.95, 4, 2, 2), (30.0, 0.0, 0, 0, 0)])
    first = Snapshot(time=0.0, model="m", enabled=True, requests=req.summary())
    _run(req.kv, [(100.0, 0.1, 1, 0, 0), (140.0, 0.0, 0, 0, 0)])
    for _ in range(30):
        req.observe(50, 10)
    second = Snapshot(time=140.0, model="m", enabled=True, requests=req.summary())
    whole = kvp.assess(second.requests)
    assert whole is not None and whole.verdict == "kv_bound"
    w = window_between(first, second)
    assert w.requests is not None and w.requests.kv_pressure is not None
    kv = w.requests.kv_pressure
    assert kv.busy_seconds == pytest.approx(40.0) and kv.preemptions == 0
    assert kv.peak == pytest.approx(0.1)
    assert w.kv_pressure is not None and w.kv_pressure.verdict == "neither"
    # The contract round-trips.
    back = Snapshot.from_json(w.to_json())
    assert back.kv_pressure == w.kv_pressure and back.requests == w.requests


def test_samples_are_catalog_names_with_one_verdict() -> None:
    req = _requests([(0.0, 0.95, 4, 2, 1), (20.0, 0.0, 0, 0, 0)])
    req.kv.configure(layers=kvp.kv_layers(AttentionShape(2, 4, 2, 64, "float32"), "fp32"))
    summ = req.summary()
    a = kvp.assess(summ)
    assert a is not None and summ.kv_pressure is not None
    out = kv_samples("m", summ.kv_pressure, a, kvp.head_bytes(summ.kv_pressure, 0.5, 100),
                     kvp.VERDICTS)
    names = {x.name for x in out}
    for n in names:
        spec(n)  # KeyError when a name is not in the catalog
    gauges = [x for x in out if isinstance(x, Sample)]
    verdict = {dict(x.labels)["verdict"]: x.value for x in gauges
               if x.name == "attnprof_kv_verdict"}
    assert verdict == {"kv_bound": 1.0, "compute_bound": 0.0, "neither": 0.0}
    pre = [x.value for x in gauges if x.name == "attnprof_kv_preemptions_total"]
    assert pre == [1.0]
    assert "attnprof_kv_head_bytes" in names and "attnprof_kv_bytes_per_token" in names


def test_terminal_prints_verdict_evidence_capacity_and_layers() -> None:
    from attnprof.exporters.terminal import render_snapshot

    req = _requests([(0.0, 0.95, 4, 2, 1), (20.0, 0.0, 0, 0, 0)])
    req.kv.configure(kv_dtype="fp32", layers=kvp.kv_layers(
        AttentionShape(3, 4, 2, 64, "float32", (None, 256, None)), "fp32"))
    snap = Snapshot(time=0.0, model="m", enabled=True, requests=req.summary())
    snap.kv_pressure = kvp.assess(snap.requests)
    text = render_snapshot(snap.to_json())
    assert "KV cache: KV-BOUND (confidence low)" in text
    assert "  - KV usage above 90% for 20.0 s, 100.0% of busy time" in text
    assert "KV bytes per token (fp32" in text
    rows = [ln for ln in text.splitlines() if ln.startswith(("0,2 ", "1 "))]
    assert len(rows) == 2 and "most" in rows[0] and "256" in rows[1]


def _cache(num_blocks: int, block_size: int, layers: list[KvLayer] | None = None
           ) -> KvPressureStats:
    st = KvPressure().summary()
    st.num_blocks, st.block_size, st.layers = num_blocks, block_size, layers or []
    return st


def test_capacity_counts_whole_blocks() -> None:
    # vLLM-CPU's default block of 128 tokens, 64 blocks of which 63 usable (one is vLLM's
    # null block): a 100-token sequence takes a whole block (63 fit, not 8192 / 100 = 81.9);
    # 136 tokens take two (31, not 60.2).
    full = kvp.kv_layers(AttentionShape(2, 4, 2, 64, "float32"), "fp32")
    for layers in ([], full):
        st = _cache(64, 128, layers)
        assert kvp.capacity_sequences(st, 100) == 63
        assert kvp.capacity_sequences(st, 136) == 31
        assert kvp.capacity_sequences(st, 128) == 63
        assert kvp.capacity_sequences(st, 129) == 31
        assert kvp.usable_blocks(st) == 63
    # Every layer windowed at 200: whole blocks of the window, plus one for its edge.
    win = kvp.kv_layers(AttentionShape(2, 4, 2, 64, "float32", (200, 200)), "fp32")
    assert kvp.capacity_sequences(_cache(64, 128, win), 150) == 31   # 2 blocks, no slide
    assert kvp.capacity_sequences(_cache(64, 128, win), 5000) == 21  # 2 + 1 blocks
    assert blocks_held(5000, 200, 128) == 3 and blocks_held(200, 200, 128) == 2
    assert blocks_held(0, None, 128) == 0 and blocks_held(1, None, 128) == 1


def test_shared_kv_definitions() -> None:
    # One rule for "auto" (the model's dtype) for the stat logger and the capture's layers.
    assert kv_cache_dtype("auto", "torch.float32") == "fp32"
    assert kv_cache_dtype("fp8_e5m2", "bfloat16") == "fp8"
    info = LayerInfo(name="l.0.attn", index=0, backend="CPU_ATTN", impl="x", num_heads=4,
                     num_kv_heads=2, head_size=64, head_size_v=64, sliding_window=None,
                     attn_type="decoder", dtype="torch.float32", kv_cache_dtype="auto",
                     fused=True)
    assert info.kv_element_bytes == kv_element_bytes("auto", "torch.float32") == 4
    info.kv_cache_dtype = "fp8"
    assert info.kv_element_bytes == 1
    # One "tokens a windowed layer holds": the sparsity cost model, the capacity shares and
    # the block-seconds estimate agree with it.
    t = np.array([10.0, 100.0, 1000.0])
    assert list(kv_tokens(t, 128, 4)) == [held_tokens(float(x), 128, 4) for x in t]
    assert list(kv_tokens(t, None)) == list(t)
    r = FinishedRequest(1000, 200, 2.0, 4.0)
    assert block_seconds(r, 16, 300) == pytest.approx(held_tokens(1000.0, 300) * 6 / 16)
    lay = kvp.kv_layers(AttentionShape(2, 4, 2, 64, "float32", (300, None)), "fp32")
    assert kvp.layer_shares(lay, 1000)[0] == pytest.approx(300 / 1300)


def test_engines_are_integrated_apart() -> None:
    # Two engines (data parallel) interleave their stats batches: engine 0 at 95%, engine 1
    # at 10%. Each interval is its own engine's: 20 engine-seconds above 90%, 20 at 10%.
    agg = KvPressure()
    for t, e, u, r in [(0.0, 0, 0.95, 4), (1.0, 1, 0.1, 1), (10.0, 0, 0.95, 4),
                       (11.0, 1, 0.1, 1), (20.0, 0, 0.0, 0), (21.0, 1, 0.1, 1),
                       (25.0, 1, 0.0, 0)]:
        agg.record(t, u, r, 0, 0, engine=e)
    st = agg.summary()
    by_edge = dict(zip(st.usage_bounds, st.usage_seconds, strict=True))
    assert by_edge[0.95] == pytest.approx(20.0)
    assert by_edge[0.1] == pytest.approx(24.0)
    assert st.busy_seconds == pytest.approx(44.0)  # engine-seconds
    assert st.running_request_seconds == pytest.approx(4 * 20 + 1 * 24)
    assert st.peak == 0.95 and st.current == 0.0
    agg.record(26.0, 0.3, 1, 0, 0, engine=1)
    agg.record(26.5, 0.6, 1, 0, 0, engine=0)
    agg.record(27.0, 0.2, 1, 0, 0, engine=1)
    assert agg.summary().current == 0.6  # the fullest engine's latest


def _snap(req: RequestAggregates, t: float) -> Snapshot:
    return Snapshot(time=t, model="m", enabled=True, requests=req.summary())


def test_window_without_busy_time_has_no_peak() -> None:
    req = _requests([(0.0, 0.95, 4, 2, 0), (30.0, 0.0, 0, 0, 0)])
    first = _snap(req, 30.0)
    second = _snap(req, 60.0)  # nothing ran in between
    w = window_between(first, second)
    kv = w.requests.kv_pressure if w.requests is not None else None
    assert kv is not None and kv.busy_seconds == 0 and kv.peak is None


def test_window_across_an_api_server_restart_takes_the_new_server() -> None:
    old = _requests([(0.0, 0.95, 4, 2, 3), (100.0, 0.0, 0, 0, 0)], finished=5)
    first = _snap(old, 100.0)
    # The new server has served more requests than the old one had, so the request count
    # alone does not reveal the restart; its KV totals (busy seconds, preemptions) went down.
    new = _requests([(0.0, 0.5, 2, 0, 1), (20.0, 0.0, 0, 0, 0)], finished=40)
    second = _snap(new, 200.0)
    w = window_between(first, second)
    kv = w.requests.kv_pressure if w.requests is not None else None
    assert kv is not None
    assert kv.busy_seconds == pytest.approx(20.0) and kv.preemptions == 1
    assert kv.peak == 0.5
    assert sum(kv.usage_seconds) == pytest.approx(20.0)
