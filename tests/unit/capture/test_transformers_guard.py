"""The transformers wrapper's own guarantees, on a tiny random-weight Llama: records stay
bounded in a long-running process, no attnprof failure reaches the model (outputs bit-identical,
the original attention run exactly once, the failure counted), and a timed CUDA call waits for
the device at most once."""

from __future__ import annotations

import tracemalloc
from collections.abc import Callable, Iterator
from types import SimpleNamespace
from typing import Any

import pytest
import torch

import attnprof
from attnprof.capture import device_clock
from attnprof.capture import sdpa as sdpa_mod
from attnprof.capture import transformers as tr

CFG: dict[str, Any] = dict(vocab_size=100, hidden_size=64, intermediate_size=128,
                           num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                           head_dim=16, max_position_embeddings=256)


def tiny(impl: str = "sdpa") -> Any:
    import transformers as tf

    torch.manual_seed(0)
    return tf.LlamaForCausalLM(tf.LlamaConfig(**CFG, attn_implementation=impl)).eval()


def padded_batch() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 100, (2, 20), generator=g)
    am = torch.ones(2, 20, dtype=torch.long)
    am[1, :5] = 0
    return {"input_ids": ids, "attention_mask": am}


def wrapper_of(model: Any) -> Callable[..., Any]:
    """The attention function an instrumented model calls (attnprof's wrapper)."""
    from transformers.modeling_utils import AttentionInterface

    return AttentionInterface._global_mapping[model.config._attn_implementation]  # type: ignore[no-any-return]


def qkv(cls: type[torch.Tensor] = torch.Tensor) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(2)
    q = torch.randn(1, 4, 8, 16, generator=g)
    k = torch.randn(1, 2, 8, 16, generator=g)
    v = torch.randn(1, 2, 8, 16, generator=g)
    return tuple(t.as_subclass(cls) for t in (q, k, v))


# ----- bounded records -----

@pytest.mark.slow
def test_long_loop_keeps_records_and_memory_bounded() -> None:
    """Default settings, many more calls than the ring holds: the record count stops growing
    and so does Python memory (an unbounded list grows by a CallRecord per call)."""
    m = tiny()
    prof = attnprof.instrument(m)
    try:
        call = wrapper_of(m)
        mod = m.model.layers[0].self_attn
        q, k, v = qkv()
        tracemalloc.start()
        try:
            with torch.no_grad():
                for _ in range(4500):  # past the default ring: it now drops one per call
                    call(mod, q, k, v, None, dropout=0.0, scaling=0.25)
                before = tracemalloc.get_traced_memory()[0]
                for _ in range(2000):
                    call(mod, q, k, v, None, dropout=0.0, scaling=0.25)
                grown = tracemalloc.get_traced_memory()[0] - before
        finally:
            tracemalloc.stop()
    finally:
        prof.uninstrument()
    assert grown < 128 * 1024, grown  # an unbounded list: ~1 MiB for these 2000 calls
    assert len(prof.records) < 6500
    assert len(prof.records) == tr.DEFAULT_MAX_RECORDS
    assert prof.records_total == 6500
    assert prof.records_dropped == 6500 - tr.DEFAULT_MAX_RECORDS
    assert len(prof.kernels) == 1 and prof.activation_map()[0]["calls"] == 6500
    assert not prof.errors and prof.error_count == 0


@pytest.mark.slow
def test_model_loop_ring_size_and_unbounded_opt_in() -> None:
    m = tiny()
    ids = torch.randint(0, 100, (1, 8))
    with torch.no_grad(), attnprof.profile(m, max_records=16) as ring:
        for _ in range(40):
            m(input_ids=ids)
    assert len(ring.records) == 16 and ring.records_total == 80
    assert [r.layer_idx for r in ring.records][-2:] == [0, 1]  # the most recent calls
    # Aggregates are per layer and shape class, not per call.
    assert [(r["layer_idx"], r["calls"]) for r in ring.activation_map()] == [(0, 40), (1, 40)]
    with torch.no_grad(), attnprof.profile(m, max_records=None) as full:
        for _ in range(40):
            m(input_ids=ids)
    assert isinstance(full.records, list) and len(full.records) == 80
    assert full.records_dropped == 0
    with torch.no_grad(), attnprof.profile(m, keep_records=False) as agg:
        for _ in range(5):
            m(input_ids=ids)
    assert len(agg.records) == 0 and sum(r["calls"] for r in agg.activation_map()) == 10


# ----- the guard -----

@pytest.fixture
def counted_sdpa(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[int]]:
    """Count calls of transformers' own sdpa function (what attnprof wraps at install)."""
    from transformers.modeling_utils import AttentionInterface

    real = AttentionInterface._global_mapping["sdpa"]
    calls: list[int] = []

    def counting(*a: Any, **kw: Any) -> Any:
        calls.append(1)
        return real(*a, **kw)

    monkeypatch.setitem(AttentionInterface._global_mapping, "sdpa", counting)
    yield calls


def _boom(*a: Any, **kw: Any) -> Any:
    raise RuntimeError("injected attnprof fault")


def _raise_after_real_exit(self: Any, *exc: Any) -> None:
    real_exit(self, *exc)  # leave no mode behind, then fail
    raise RuntimeError("injected attnprof fault")


real_exit = sdpa_mod.SDPASpy.__exit__

FAULTS = [  # (where, what, fault, whether the faulted call is still accounted)
    pytest.param(tr.Profile, "_class_key", _boom, 0, id="class_key"),
    pytest.param(tr.Profile, "_layer_idx", _boom, 0, id="layer_idx"),
    pytest.param(sdpa_mod.SDPASpy, "__init__", _boom, 0, id="spy_init"),
    pytest.param(sdpa_mod.SDPASpy, "__enter__", _boom, 0, id="spy_enter"),
    pytest.param(sdpa_mod.SDPASpy, "_describe", _boom, 0, id="spy_describe"),
    # The spy saw the call and was undone; only its exit's complaint is counted.
    pytest.param(sdpa_mod.SDPASpy, "__exit__", _raise_after_real_exit, 1, id="spy_exit"),
    pytest.param(torch.profiler, "record_function", _boom, 0, id="record_function"),
]


@pytest.mark.parametrize(("owner", "name", "fault", "kept"), FAULTS)
def test_fault_in_attnprof_never_reaches_the_model(
        monkeypatch: pytest.MonkeyPatch, counted_sdpa: list[int], owner: Any, name: str,
        fault: Any, kept: int) -> None:
    m = tiny()
    batch = padded_batch()
    with torch.no_grad():
        ref = m(**batch).logits
        counted_sdpa.clear()
        with attnprof.profile(m) as prof:
            monkeypatch.setattr(owner, name, fault)
            out = m(**batch).logits
            monkeypatch.undo()
            calls_under_fault = len(counted_sdpa)
            again = m(**batch).logits  # the fault gone, profiling resumes
    assert torch.equal(ref, out)  # bit-identical to the uninstrumented model
    assert torch.equal(ref, again)
    assert calls_under_fault == 2  # the original attention ran exactly once per layer
    assert prof.error_count >= 1
    assert prof.errors and "injected attnprof fault" in prof.errors[0]
    assert not torch.overrides._get_current_function_mode_stack()  # no spy left behind
    # Calls whose set-up failed were dropped, not recorded with a wrong kernel; later ones
    # count (and the kernel is resolved once the fault is gone).
    rows = prof.activation_map()
    assert [(r["layer_idx"], r["kernel"], r["calls"]) for r in rows] == [
        (0, "flash_cpu", 1 + kept), (1, "flash_cpu", 1 + kept)]


def test_fault_in_eager_class_key(monkeypatch: pytest.MonkeyPatch) -> None:
    m = tiny("eager")
    batch = padded_batch()
    with torch.no_grad():
        ref = m(**batch).logits
        with attnprof.profile(m) as prof:
            monkeypatch.setattr(tr.Profile, "_class_key", _boom)
            out = m(**batch).logits
    assert torch.equal(ref, out)
    assert prof.error_count == 2 and not prof.kernels


def test_timer_fault_is_counted(monkeypatch: pytest.MonkeyPatch, counted_sdpa: list[int]
                                ) -> None:
    m = tiny()
    batch = padded_batch()
    with torch.no_grad():
        ref = m(**batch).logits
        with attnprof.profile(m) as prof:
            monkeypatch.setattr(device_clock, "time", SimpleNamespace(perf_counter=_boom))
            out = m(**batch).logits
    assert torch.equal(ref, out) and len(counted_sdpa) == 4  # 2 layers, plain + profiled
    assert prof.error_count == 2 and not prof.records


def test_host_exception_propagates_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """The guard swallows attnprof's failures only: the model's own exception goes through,
    raised by a single run of its attention, with the spy's mode popped."""
    from transformers.modeling_utils import AttentionInterface

    calls: list[int] = []

    def failing(*a: Any, **kw: Any) -> Any:
        calls.append(1)
        raise ValueError("model bug")

    monkeypatch.setitem(AttentionInterface._global_mapping, "sdpa", failing)
    m = tiny()
    with torch.no_grad(), attnprof.profile(m) as prof, pytest.raises(ValueError, match="model bug"):
        m(input_ids=torch.randint(0, 100, (1, 8)))
    assert calls == [1]
    assert not prof.errors
    assert not torch.overrides._get_current_function_mode_stack()


# ----- device syncs -----

class FakeCuda(torch.Tensor):  # type: ignore[misc]
    """A CPU tensor that says it is on CUDA, so the wrapper takes its CUDA timing path."""

    @property
    def is_cuda(self) -> bool:  # type: ignore[override]
        return True


def test_at_most_one_device_sync_per_timed_call(monkeypatch: pytest.MonkeyPatch) -> None:
    waits: list[str] = []

    class FakeEvent:
        def __init__(self, enable_timing: bool = False) -> None:
            self.t = 0.0

        def record(self, stream: Any = None) -> None:
            import time

            self.t = time.perf_counter()

        def synchronize(self) -> None:
            waits.append("event")

        def query(self) -> bool:
            return True

        def elapsed_time(self, end: FakeEvent) -> float:
            return (end.t - self.t) * 1000.0

    class FakeStream:
        def synchronize(self) -> None:
            waits.append("stream")

        def wait_event(self, event: Any) -> None:
            pass

    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: FakeStream())
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: waits.append("device"))

    m = tiny()
    prof = attnprof.instrument(m)
    try:
        call = wrapper_of(m)
        mod = m.model.layers[0].self_attn
        q, k, v = qkv(FakeCuda)
        per_call = []
        with torch.no_grad():
            for _ in range(3):  # the first one runs the spy (sampled), the others are timed
                waits.clear()
                call(mod, q, k, v, None, dropout=0.0, scaling=0.25)
                per_call.append(len(waits))
    finally:
        prof.uninstrument()
    assert per_call == [1, 1, 1], per_call  # one wait, at the end of each timed call
    assert not prof.errors
    assert prof.activation_map()[0]["calls"] == 3
    assert all(r.elapsed_s >= 0 for r in prof.records)


def test_eager_without_a_findable_eager_function_is_left_unwrapped(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A modeling file without ``eager_attention_forward`` (remote code, a class imported from
    elsewhere): attnprof leaves eager attention as it is, counted, instead of installing a
    wrapper that would raise into the model."""
    import sys

    m = tiny("eager")
    batch = padded_batch()
    owner = sys.modules[type(m.model.layers[0].self_attn).__module__]
    with torch.no_grad():
        ref = m(**batch).logits
        monkeypatch.delattr(owner, "eager_attention_forward")
        with attnprof.profile(m) as prof:
            assert m.config._attn_implementation == "eager"  # not swapped
    assert prof.error_count == 1 and "eager_attention_forward" in prof.errors[0]
    monkeypatch.undo()
    with torch.no_grad():
        assert torch.equal(ref, m(**batch).logits)
