"""What a sampled step's head statistics fold, decided once per step from vLLM's own attention
metadata class (``CPUAttentionMetadata``) and the runner's prompt lengths: prompt pieces in the
prompt's context bucket (a chunk is never a short prompt), decode sequences bounded per step,
Horvitz-Thompson weighted and drawn alike for every metadata object (KV-cache group) of a step.
The runner is a stand-in holding ``input_batch.num_prompt_tokens`` (the real one runs in
tests/integration/test_head_stats_paged.py)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch

from attnprof.aggregate.head_strata import HEAD_STATS_MAX_TOKENS
from attnprof.capture.vllm.hooks import DECODE_SEQS_PER_STEP, Capture
from attnprof.config import Config
from attnprof.host.vllm.runtime import State


def _md(q_lens: list[int], seq_lens: list[int]) -> Any:
    cpu_attn = pytest.importorskip("vllm.v1.attention.backends.cpu_attn")
    qsl = torch.tensor([0, *np.cumsum(q_lens).tolist()], dtype=torch.int32)
    return cpu_attn.CPUAttentionMetadata(
        num_actual_tokens=int(sum(q_lens)), max_query_len=max(q_lens), query_start_loc=qsl,
        max_seq_len=max(seq_lens), seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_table=torch.zeros(len(q_lens), 8, dtype=torch.int32),
        slot_mapping=torch.zeros(int(sum(q_lens)), dtype=torch.int64), scheduler_metadata=None)


def _cap(prompts: list[int], min_tokens: int = 256) -> Capture:
    cap = Capture(State(config=Config(enabled=True, sample_rate=1.0, seed=0, model_label="m",
                                      head_stats_min_tokens=min_tokens)))
    cap._runner = SimpleNamespace(input_batch=SimpleNamespace(
        num_prompt_tokens=np.array(prompts, dtype=np.int32)))
    return cap


def test_prompt_pieces_land_in_the_prompts_bucket() -> None:
    # a first chunk of a 3000-token prompt, a middle chunk, a cached tail, a short chat
    cap = _cap([3000, 3000, 700, 40])
    plan = cap._hs_plan(_md([512, 512, 188, 40], [512, 2048, 700, 40]))
    assert [(f.phase, f.bucket, f.start, f.q_len, f.q_pos, f.prompt_len) for f in plan] == [
        ("prefill", 2048, 0, 512, 0, 3000),
        ("prefill", 2048, 512, 512, 1536, 3000),
        ("prefill", 512, 1024, 188, 512, 700),
        ("prefill", 0, 1212, 40, 0, 40)]


def test_decode_is_bounded_weighted_and_the_same_for_every_group_of_a_step() -> None:
    n = 3 * DECODE_SEQS_PER_STEP
    prompts = [300] * n
    cap = _cap(prompts)
    ctx = [301 + i for i in range(n)]
    a = cap._hs_plan(_md([1] * n, ctx))
    b = cap._hs_plan(_md([1] * n, ctx))  # another KV-cache group's metadata, same step
    assert len(a) == DECODE_SEQS_PER_STEP and all(f.phase == "decode" for f in a)
    assert [f.row for f in a] == [f.row for f in b]
    assert all(f.weight == pytest.approx(n / DECODE_SEQS_PER_STEP) for f in a)
    assert all(f.q_pos == ctx[f.row] - 1 and f.start == f.row for f in a)
    rows: set[int] = set()
    for step in range(20):  # other steps draw other sequences
        cap.seen = step + 1
        cap._hs_plans.clear()
        rows.update(f.row for f in cap._hs_plan(_md([1] * n, ctx)))
    assert len(rows) > DECODE_SEQS_PER_STEP


def test_long_contexts_and_unknown_prompts() -> None:
    cap = _cap([HEAD_STATS_MAX_TOKENS + 1, 10])
    # too long a prompt is left out; a few decode sequences are all taken, weight 1
    plan = cap._hs_plan(_md([512, 1], [512, 11]))
    assert [(f.phase, f.row, f.weight) for f in plan] == [("decode", 1, 1.0)]
    cap._runner = None  # no prompt lengths: only pieces from position 0 fold
    # A new step, as _run_sampled starts one: both caches are keyed by id(metadata), and the
    # first metadata object is gone, so its id may be reused by the next one.
    cap._hs_plans.clear()
    cap._shapes.clear()
    plan = cap._hs_plan(_md([300, 64], [300, 128]))
    assert [(f.phase, f.row, f.prompt_len) for f in plan] == [("prefill", 0, 300)]


def _fold_step(sliding: int | None) -> tuple[Capture, Any]:
    """One layer's call of a batch holding a whole 300-token prompt and a decode sequence of
    context 301, its earlier keys written into a CPU_ATTN cache by vLLM's own op."""
    ops = pytest.importorskip("vllm._custom_ops")
    from vllm.platforms import current_platform

    from attnprof.aggregate.layers import LayerInfo
    from attnprof.capture.vllm.args import ImplCall

    current_platform.import_kernels()
    info = LayerInfo(name="model.layers.0.self_attn.attn", index=0, backend="CPU_ATTN",
                     impl="CPUAttentionBackendImpl", num_heads=4, num_kv_heads=2, head_size=64,
                     head_size_v=64, sliding_window=sliding, dtype="float32",
                     kv_cache_dtype="auto", fused=True, scale=0.125)
    cap = _cap([300, 300])
    cap.aggs.add_layer(info)
    g = torch.Generator().manual_seed(0)
    kv_cache = torch.zeros(8, 2, 128, 128)
    key_cache, value_cache = kv_cache.view(8, 2, 256, 64).chunk(2, dim=2)
    past = torch.randn(300, 2, 64, generator=g)  # the decode sequence's keys 0..299
    slots = torch.tensor([4 * 128 + i for i in range(300)])  # its blocks: 4, 5, 6
    ops.cpu_attn_reshape_and_cache(past, past, key_cache, value_cache, slots, "vec")
    md = _md([300, 1], [300, 301])
    md.block_table[1, :3] = torch.tensor([4, 5, 6], dtype=torch.int32)
    q = torch.randn(301, 4 * 64, generator=g)
    k = torch.randn(301, 2 * 64, generator=g)
    cap._head_stats(info, ImplCall(SimpleNamespace(isa="vec"), q, k, k, kv_cache, md))
    assert cap.settle_head_stats()  # the statistics' worker folded them
    return cap, (q, k, past)


def test_a_decode_query_reads_its_context_from_the_cache() -> None:
    from attnprof.aggregate.head_stats import HeadStatsAccumulator
    from attnprof.capture import head_rows

    cap, (q, k, past) = _fold_step(None)
    strata = cap.hs_buffer.active
    assert [key for key, _ in strata.items()] == [("prefill", 256), ("decode", 256)]
    want = HeadStatsAccumulator(1, 2, 2, seed=0)  # the decode query against its context
    head_rows.fold_plan(want, 0, q[300:].view(1, 4, 64), torch.cat([past, k[300:].view(1, 2, 64)]),
                        0.125, 300, (0,), [1.0], {0: 1.0}, request_share=0.0)
    got = strata.get("decode", 256)
    for f in ("queries", "sink_sum", "cov_sum", "cov_hist", "entropy_sum", "js_sum"):
        np.testing.assert_allclose(getattr(got, f), getattr(want, f), rtol=1e-6, err_msg=f)


def test_sliding_layers_read_nothing_behind_their_window() -> None:
    cap, _ = _fold_step(64)  # context 301 > window 64: blocks behind it may be freed
    assert [key for key, _ in cap.hs_buffer.active.items()] == [("prefill", 256)]
    assert cap.errors.dropped == {"head_stats_sliding_window": 1}
    cap, _ = _fold_step(1024)  # the whole context within the window: nothing was freed
    assert [key for key, _ in cap.hs_buffer.active.items()] == [("prefill", 256),
                                                                ("decode", 256)]
    assert not cap.errors.dropped


def test_on_a_gpu_the_plan_reads_the_runners_host_lengths_not_the_device(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A GPU step's plan comes from the runner's host copies of the lengths (V1
    ``query_start_loc.np``, ``optimistic_seq_lens_cpu``), never the metadata's device tensors:
    the same plan as reading the metadata, with no tensor read back; without them the step's
    statistics are left out (counted), not waited for."""
    q_lens, seq_lens = [512, 188, 1, 1], [2048, 700, 301, 302]
    want = _cap([3000, 700, 300, 300])._hs_plan(_md(q_lens, seq_lens))
    cap = _cap([3000, 700, 300, 300])
    cap._cuda = True
    cap._runner.query_start_loc = SimpleNamespace(np=np.array([0, *np.cumsum(q_lens), 999, 999],
                                                              dtype=np.int32))
    cap._runner.optimistic_seq_lens_cpu = np.array([*seq_lens, 0], dtype=np.int32)
    md = _md(q_lens, seq_lens)
    # the metadata's tensors stand for device ones: none of them may be read on the host
    device = {t.untyped_storage().data_ptr() for t in (md.seq_lens, md.query_start_loc,
                                                        md.block_table, md.slot_mapping)}
    reads: list[str] = []
    for name in ("tolist", "item", "numpy", "__int__", "__index__", "cpu"):
        orig = getattr(torch.Tensor, name)

        def rec(self: Any, *a: Any, _n: str = name, _o: Any = orig, **kw: Any) -> Any:
            if self.untyped_storage().data_ptr() in device:
                reads.append(_n)
            return _o(self, *a, **kw)

        monkeypatch.setattr(torch.Tensor, name, rec)
    got = cap._hs_plan(md)
    monkeypatch.undo()
    assert reads == [] and got == want and len(got) == 4
    cap = _cap([300])
    cap._cuda = True  # a runner without the buffers
    assert cap._hs_plan(_md([300], [300])) == []
    assert cap.errors.dropped == {"head_stats_lengths_unread": 1}
