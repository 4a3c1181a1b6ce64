"""Head statistics folded off the engine's thread (capture/head_worker.py): the engine's
thread only copies what a fold reads; the worker's folds equal the inline ones exactly; a
full queue drops (counted), never waits, and its copies stay under the stated bound; a
failing fold is counted and switches statistics off; a pull's delta and the offline
snapshot hold every fold handed over before them; decode detail queries are one per step,
weighted to stay unbiased."""

from __future__ import annotations

import threading
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch

from attnprof.aggregate.head_stats import HeadStatsAccumulator
from attnprof.aggregate.head_stats_buffer import HeadStatsDoubleBuffer
from attnprof.aggregate.head_strata import HeadStatsStrata
from attnprof.capture import head_rows
from attnprof.capture.head_worker import HeadStatsWorker
from attnprof.capture.vllm.hooks import DECODE_SEQS_PER_STEP, Capture

from .test_hs_plan import _cap, _md


def _arrays(acc: HeadStatsAccumulator) -> dict[str, Any]:
    return {k: x for k, x in vars(acc).items() if isinstance(x, np.ndarray)}


def _start_layer(cap: Capture) -> None:
    """One CPU_ATTN layer (4 query heads on 2 KV heads of 16) known to ``cap``, its head
    statistics started (the worker running)."""
    from attnprof.aggregate.layers import LayerInfo

    info = LayerInfo(name="model.layers.0.self_attn.attn", index=0, backend="CPU_ATTN",
                     impl="CPUAttentionBackendImpl", num_heads=4, num_kv_heads=2, head_size=16,
                     head_size_v=16, sliding_window=None, dtype="float32",
                     kv_cache_dtype="auto", fused=True, scale=0.25)
    cap.aggs.add_layer(info)
    cap._hs_start(info)


def drained_buffer(w: HeadStatsWorker) -> tuple[HeadStatsDoubleBuffer, HeadStatsAccumulator]:
    """A double buffer over one layer's strata (4 query heads on 2 KV heads; ``.active``)
    whose drain waits for ``w``'s folds, and the prompts' accumulator the folds land in."""
    strata = HeadStatsStrata(HeadStatsAccumulator(1, 2, 2))
    buf = HeadStatsDoubleBuffer(strata)
    buf.folds = w
    return buf, strata.get("prefill", 0)


def _step(inline: bool, seed: int = 0, max_bytes: int | None = None) -> tuple[Capture, Any]:
    """Two layers' calls of a batch with a whole 300-token prompt, a 200-token chunk of a
    600-token prompt (its first 256 keys in a CPU_ATTN cache, written by vLLM's own op) and
    a decode sequence; the call's q/k buffers are overwritten right after each call, as the
    engine's next layer does."""
    ops = pytest.importorskip("vllm._custom_ops")
    from vllm.platforms import current_platform

    from attnprof.aggregate.layers import LayerInfo
    from attnprof.capture.vllm.args import ImplCall

    current_platform.import_kernels()
    cap = _cap([300, 600, 300])
    cap.hs_inline = inline
    g = torch.Generator().manual_seed(seed)
    kv_cache = torch.zeros(16, 2, 128, 128)
    key_cache, value_cache = kv_cache.view(16, 2, 256, 64).chunk(2, dim=2)
    past = torch.randn(256, 2, 64, generator=g)
    ops.cpu_attn_reshape_and_cache(past, past, key_cache, value_cache,
                                   torch.arange(4 * 128, 4 * 128 + 256), "vec")
    dec = torch.randn(300, 2, 64, generator=g)
    ops.cpu_attn_reshape_and_cache(dec, dec, key_cache, value_cache,
                                   torch.arange(8 * 128, 8 * 128 + 300), "vec")
    md = _md([300, 200, 1], [300, 456, 301])
    md.block_table[1, :2] = torch.tensor([4, 5], dtype=torch.int32)
    md.block_table[2, :3] = torch.tensor([8, 9, 10], dtype=torch.int32)
    q = torch.empty(501, 4 * 64)
    k = torch.empty(501, 2 * 64)
    for layer in range(2):
        info = LayerInfo(name=f"model.layers.{layer}.self_attn.attn", index=layer,
                         backend="CPU_ATTN", impl="CPUAttentionBackendImpl", num_heads=4,
                         num_kv_heads=2, head_size=64, head_size_v=64, sliding_window=None,
                         dtype="float32", kv_cache_dtype="auto", fused=True, scale=0.125)
        cap.aggs.add_layer(info)
    if max_bytes is not None:  # the worker's byte bound, set before the step begins
        cap._hs_start(info)
        cap.hs_worker.max_bytes = max_bytes
    for layer in range(2):
        info = cap.aggs.layers[f"model.layers.{layer}.self_attn.attn"]
        q.copy_(torch.randn(q.shape, generator=g))
        k.copy_(torch.randn(k.shape, generator=g))
        cap._head_stats(info, ImplCall(SimpleNamespace(isa="vec"), q, k, k, kv_cache, md))
        q.fill_(float("nan"))  # the engine reuses its buffers
        k.fill_(float("nan"))
        kv_cache[4:6].fill_(float("nan"))  # and its blocks
    return cap, md


def test_the_workers_folds_equal_the_inline_ones_exactly() -> None:
    inline, _ = _step(True)
    assert inline.hs_worker is not None and inline.hs_worker.submitted == 0
    cap, _ = _step(False)
    assert cap.settle_head_stats()
    assert cap.hs_worker.submitted == 6 and cap.hs_worker.done == 6  # 3 folds x 2 layers
    a, b = inline.hs_buffer.active, cap.hs_buffer.active
    assert [key for key, _ in a.items()] == [key for key, _ in b.items()] and len(a.items()) == 3
    for key, acc in a.items():
        want, got = _arrays(acc), _arrays(b.get(*key))
        assert want["queries"].any()
        for name, x in want.items():
            np.testing.assert_array_equal(got[name], x, err_msg=f"{key} {name}")
    assert not cap.errors.dropped and not cap.errors.by_place


def test_a_full_queue_drops_and_counts_never_waits_and_stays_bounded() -> None:
    gate = threading.Event()
    errors: list[BaseException] = []
    w = HeadStatsWorker(errors.append, max_jobs=3, max_bytes=1000)
    done: list[int] = []
    def first() -> None:
        gate.wait(30)
        done.append(0)

    assert w.submit(first, 400)  # holds the thread
    assert w.submit(lambda: done.append(1), 400)
    assert not w.submit(lambda: done.append(2), 400)  # 1200 bytes > 1000: dropped at once
    assert w.submit(lambda: done.append(3), 200)
    assert not w.submit(lambda: done.append(4), 1)  # 3 jobs pending: dropped
    assert w.dropped == 2 and w.peak_bytes <= 1000 and w.pending == 3 and w.lagging
    gate.set()
    assert w.wait_idle(30)
    assert done == [0, 1, 3] and w.bytes == 0 and not errors and not w.lagging


def test_a_full_queue_is_a_drop_reason_of_the_capture() -> None:
    cap = _cap([300])
    cap.hs_worker = HeadStatsWorker(cap._hs_error, max_jobs=1, max_bytes=1 << 30)
    gate = threading.Event()
    assert cap.hs_worker.submit(lambda: gate.wait(30), 0)
    acc = HeadStatsAccumulator(1, 2, 2)
    job = head_rows.prepare(acc, 0, torch.randn(8, 4, 16), torch.randn(8, 2, 16), 0.25, 0,
                            (7,), [1.0], {}, copy=True)
    cap._hs_submit(acc, job, False)
    gate.set()
    assert cap.hs_worker.wait_idle(30)
    assert cap.errors.dropped == {"head_stats_queue_full": 1} and not acc.queries.any()


def test_the_copies_are_owned_and_their_bytes_stated() -> None:
    acc = HeadStatsAccumulator(1, 2, 2)
    q, k = torch.randn(64, 4, 16), torch.randn(64, 2, 16)
    job = head_rows.prepare(acc, 0, q, k, 0.25, 0, np.array([3, 40]), [1.0, 1.0], {}, copy=True)
    # only the sampled queries, and the keys up to the last of them, in fp32
    assert job.q.shape == (2, 4, 16) and job.kt.shape == (2, 16, 41)
    assert job.nbytes == 4 * (2 * 4 * 16 + 41 * 2 * 16)
    assert job.q.untyped_storage().data_ptr() != q.untyped_storage().data_ptr()
    assert job.kt.untyped_storage().data_ptr() != k.untyped_storage().data_ptr()


def test_a_failing_fold_is_counted_and_switches_statistics_off() -> None:
    cap = _cap([300])
    cap.hs_worker = HeadStatsWorker(cap._hs_error)
    acc = HeadStatsAccumulator(1, 2, 2)
    job = head_rows.prepare(acc, 0, torch.randn(8, 4, 16), torch.randn(8, 2, 16), 0.25, 0,
                            (7,), [1.0], {}, copy=True)
    job = job._replace(layer=5)  # no such layer: the fold raises on the worker
    cap._hs_submit(acc, job, False)
    assert cap.hs_worker.wait_idle(30)
    assert cap.errors.by_place == {"head_stats": 1} and cap.hs_rate == 0.0


def test_a_pulls_delta_holds_every_fold_handed_over_before_it() -> None:
    """The drain waits for the folds submitted before the swap: none lands in the next
    half, none is zeroed away mid-fold."""
    gate = threading.Event()
    w = HeadStatsWorker(lambda exc: None)
    buf, acc = drained_buffer(w)
    assert w.submit(lambda: gate.wait(30), 0)  # the worker is busy: the fold is pending
    job = head_rows.prepare(acc, 0, torch.randn(8, 4, 16), torch.randn(8, 2, 16), 0.25, 0,
                            (3, 7), [1.0, 2.0], {}, copy=True)
    assert w.submit(lambda: head_rows.run(acc, job).apply(), job.nbytes)
    got: list[bytes] = []

    def finish(chunks: list[Any]) -> bytes:
        got.append(b"".join(chunks))
        return b"x"

    # nothing has landed in the active half (its one stratum) yet: the pending fold is
    # data to swap
    assert not acc.queries.any() and buf.swap(finish)
    assert buf.draining  # waiting for the fold
    gate.set()
    assert buf.wait(30) and got
    delta = HeadStatsStrata.from_bytes(got[0]).get("prefill", 0)
    want = HeadStatsAccumulator(1, 2, 2)
    head_rows.run(want, job._replace()).apply()
    assert want.queries.sum() == 2 * 4  # two queries, four heads
    for name, x in _arrays(want).items():
        np.testing.assert_array_equal(_arrays(delta)[name], x, err_msg=name)
    active = buf.active
    assert isinstance(active, HeadStatsStrata) and not active.has_data()


def test_decode_detail_is_one_sequence_a_step_weighted_to_stay_unbiased() -> None:
    n = 3 * DECODE_SEQS_PER_STEP
    cap = _cap([300] * n)
    ctx = [301 + i for i in range(n)]
    chosen: dict[int, float] = {}
    for step in range(400):
        cap.seen = step
        cap._hs_plans.clear()
        plan = cap._hs_plan(_md([1] * n, ctx))
        det = [f for f in plan if f.detail]
        assert len(plan) == DECODE_SEQS_PER_STEP and len(det) == 1
        # the detail query stands for the folded sequences: its weight is theirs summed
        assert det[0].detail == pytest.approx(sum(f.weight for f in plan)) == pytest.approx(n)
        chosen[det[0].row] = chosen.get(det[0].row, 0.0) + det[0].detail
    # every sequence gets detail queries, each about its share of the total weight (n / n)
    assert set(chosen) == set(range(n))
    share = np.array([chosen[r] for r in range(n)]) / (400 * n)
    assert np.all(np.abs(share - 1 / n) < 0.05)


def test_the_worker_gives_way_to_the_engine() -> None:
    """Its torch ops run on one intra-op thread and the thread has the lowest priority (the
    engine's OpenMP team keeps the cores); the calling thread's torch threads are as they
    were."""
    import os

    from attnprof.capture.head_worker import quiet_thread

    before = torch.get_num_threads()
    prio = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    seen: list[tuple[int, int]] = []
    w = HeadStatsWorker(lambda exc: None, setup=quiet_thread)
    assert w.submit(lambda: seen.append((torch.get_num_threads(), os.getpriority(
        os.PRIO_PROCESS, threading.get_native_id()))), 0)
    assert w.wait_idle(30)
    assert seen == [(1, 19)]
    assert torch.get_num_threads() == before
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == prio


def _fresh_thread_team() -> int:
    got: list[int] = []
    t = threading.Thread(target=lambda: got.append(torch.get_num_threads()))
    t.start()
    t.join()
    return got[0]


def test_the_quiet_worker_leaves_later_host_threads_their_team() -> None:
    """A thread the host starts after the worker (a ``generate`` in a thread of its own)
    still gets the process's torch threads, not the worker's one."""
    from attnprof.capture.head_worker import quiet_thread

    # a known default of 2 (an earlier test in the run may have left 1; vLLM-CPU's worker
    # replaces torch.set_num_threads, hence torch's own setter)
    mine = torch.get_num_threads()
    torch._C.set_num_threads(2)
    try:
        assert _fresh_thread_team() == 2
        w = HeadStatsWorker(lambda exc: None, setup=quiet_thread)
        seen: list[int] = []
        assert w.submit(lambda: seen.append(torch.get_num_threads()), 0)
        assert w.wait_idle(30)
        assert seen == [1]
        assert _fresh_thread_team() == 2
    finally:
        torch._C.set_num_threads(mine)


def test_a_step_beginning_while_the_worker_lags_is_left_out_whole() -> None:
    """Every layer of a step folds the same requests: a step that begins with the worker at
    half its bound folds nothing at any layer (counted), the next one once it caught up."""
    gate = threading.Event()
    cap, _ = _step(False)  # makes the worker; its folds are done below
    assert cap.settle_head_stats()
    w = cap.hs_worker
    before = {key: _arrays(acc)["queries"].copy() for key, acc in cap.hs_buffer.active.items()}
    assert w.submit(lambda: gate.wait(30), w.max_bytes // 2)  # half the bound held
    calls: list[int] = []

    def orig(*a: Any, **kw: Any) -> None:
        calls.append(int(cap._hs_step))

    cap.hs_rate = 1.0
    cap.install_layers = cap.remove_layers = lambda: None  # type: ignore[method-assign]
    cap._run_sampled(orig, None, (), {}, "sampled")
    assert calls == [0] and cap.errors.dropped == {"head_stats_worker_busy": 1}
    gate.set()
    assert w.wait_idle(30) and not w.lagging
    cap._run_sampled(orig, None, (), {}, "sampled")
    assert calls == [0, 1]
    after = {key: _arrays(acc)["queries"] for key, acc in cap.hs_buffer.active.items()}
    assert all(np.array_equal(before[key], after[key]) for key in before)


def test_the_worker_does_not_keep_its_capture_alive() -> None:
    import gc
    import weakref

    cap = _cap([300])
    _start_layer(cap)
    w, ref = cap.hs_worker, weakref.ref(cap)
    acc = cap.hs_buffer.active.get("prefill", 0)
    job = head_rows.prepare(acc, 0, torch.randn(8, 4, 16), torch.randn(8, 2, 16), 0.25, 0,
                            (7,), [1.0], {}, copy=True)
    cap._hs_submit(acc, job, False)
    assert w.wait_idle(30)
    del cap
    gc.collect()
    assert ref() is None and w.done == 1 and acc.queries.any()


def test_the_offline_snapshot_holds_the_folds_handed_over_before_it() -> None:
    """The worker's snapshot with head statistics (``worker_rpc.snapshot``, the
    ``attnprof_snapshot`` RPC an offline ``LLM`` can make; ``attnprof.snapshot(llm)`` asks
    without them) settles the worker first: a fold still queued when it is asked for is in
    its head statistics."""
    from attnprof.host.vllm import worker_rpc

    cap = _cap([300])
    _start_layer(cap)
    gate = threading.Event()
    assert cap.hs_worker.submit(lambda: gate.wait(30), 0)  # the fold below waits behind it
    acc = cap.hs_buffer.active.get("prefill", 0)
    job = head_rows.prepare(acc, 0, torch.randn(8, 4, 16), torch.randn(8, 2, 16), 0.25, 0,
                            (3, 7), [1.0, 1.0], {}, copy=True)
    cap._hs_submit(acc, job, False)
    w = cap.hs_worker
    orig = w.barrier

    def barrier() -> Any:  # the snapshot asks for the folds so far: the worker may go on
        wait = orig()
        gate.set()
        return wait

    w.barrier = barrier  # type: ignore[method-assign]
    snap = worker_rpc.snapshot(cap)
    gate.set()
    assert snap.head_stats is not None
    strata = HeadStatsStrata.load(snap.head_stats)
    assert strata.get("prefill", 0).queries.sum() == 2 * 4  # two queries, four heads


def test_the_queue_bound_is_the_servers_setting() -> None:
    """``ATTNPROF_HEAD_STATS_QUEUE_MB`` sizes the worker's byte bound (a long prompt's step
    copies more keys than the default holds); the default is head_worker.MAX_BYTES."""
    from attnprof.capture.head_worker import MAX_BYTES
    from attnprof.config import Config
    from attnprof.host.vllm.runtime import State

    sized = Capture(State(config=Config.from_env({"ATTNPROF_ENABLED": "1",
                                                  "ATTNPROF_HEAD_STATS_QUEUE_MB": "512"})))
    _start_layer(sized)
    default = Capture(State(config=Config(enabled=True)))
    _start_layer(default)
    assert sized.hs_worker.max_bytes == 512 << 20
    assert default.hs_worker.max_bytes == MAX_BYTES == Config().head_stats_queue_mb << 20


def test_a_step_whose_copies_cannot_fit_is_sized_before_anything_is_copied(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The engine's thread sizes the step's copies (every layer's folds) against the
    worker's free bound before reading any key: a step that cannot fit is left out whole,
    counted, with no copy made; one that just fits is folded whole."""
    made: list[int] = []
    prepare = head_rows.prepare

    def counted(*a: Any, **kw: Any) -> Any:
        job = prepare(*a, **kw)
        made.append(job.nbytes)
        return job

    monkeypatch.setattr(head_rows, "prepare", counted)
    cap, _ = _step(False)
    assert cap.settle_head_stats() and len(made) == 6
    need = sum(made)  # 3 folds x 2 layers: what the step copies
    made.clear()
    cap, _ = _step(False, max_bytes=need)
    assert cap.settle_head_stats() and len(made) == 6 and cap.hs_worker.submitted == 6
    assert not cap.errors.dropped
    made.clear()
    cap, _ = _step(False, max_bytes=need - 1)
    assert made == [] and cap.hs_worker.submitted == 0
    # the step is off for its later layers (the layer hook calls no statistics then; this
    # test calls each layer's directly, so each counts)
    assert set(cap.errors.dropped) == {"head_stats_step_too_large"} and not cap._hs_step
    assert not any(acc.queries.any() for _, acc in cap.hs_buffer.active.items())
    assert cap.hs.queries == 0  # nothing folded, nothing counted as folded


def test_inline_folding_is_the_servers_setting() -> None:
    """``ATTNPROF_HEAD_STATS_INLINE=1`` (offline runs, the demo) folds on the engine's
    thread; serving's default hands folds to the worker."""
    from attnprof.config import Config
    from attnprof.host.vllm.runtime import State

    inline = Capture(State(config=Config.from_env({"ATTNPROF_ENABLED": "1",
                                                   "ATTNPROF_HEAD_STATS_INLINE": "1"})))
    assert inline.hs_inline
    assert not Capture(State(config=Config.from_env({"ATTNPROF_ENABLED": "1"}))).hs_inline


def test_the_backlog_a_pull_waits_for_stays_about_one_step() -> None:
    """From LAG_JOBS jobs waiting the worker is behind (a new step's statistics are left
    out), far below the hard bound: a pull's delta never waits for thousands of folds."""
    from attnprof.capture.head_worker import LAG_JOBS, MAX_JOBS

    gate = threading.Event()
    w = HeadStatsWorker(lambda exc: None)
    assert LAG_JOBS < MAX_JOBS // 8
    assert w.submit(lambda: gate.wait(30), 0)
    for _ in range(LAG_JOBS - 2):
        assert w.submit(lambda: None, 0)
    assert not w.lagging  # LAG_JOBS - 1 waiting
    assert w.submit(lambda: None, 0)
    assert w.lagging
    gate.set()
    assert w.wait_idle(30) and not w.lagging
