"""On a device, a sampled layer call's head statistics only enqueue work: nothing the
per-layer entry points do reads a device value on the host (no ``.item()``, ``.tolist()``,
``.numpy()``, blocking copies, data-dependent shapes). Proven on the CPU by forcing the
device path on CPU tensors and recording every operation that would wait for a GPU:
dispatched ops (``TorchDispatchMode``) and the host reads that never dispatch. The folded
numbers reach the accumulator only through :meth:`Folds.apply`, and equal the CPU path's."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from attnprof.aggregate.head_stats import HeadStatsAccumulator
from attnprof.capture import head_rows

# ops that read a device value back or whose output shape depends on the data
_SYNC_OPS = ("_local_scalar_dense", "item", "nonzero", "equal", "is_nonzero", "masked_select",
             "unique", "_unique", "_unique2", "unique_consecutive", "unique_dim", "argwhere",
             "repeat_interleave", "bincount", "histc", "_assert_async")


class _Syncs(TorchDispatchMode):  # type: ignore[misc]
    def __init__(self) -> None:
        super().__init__()
        self.seen: list[str] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None
                           ) -> Any:
        name = func.overloadpacket.__name__
        if name in _SYNC_OPS:
            self.seen.append(name)
        if name in ("_to_copy", "copy_") and not (kwargs or {}).get("non_blocking", False):
            dev = (kwargs or {}).get("device")
            if dev is not None and torch.device(dev).type == "cpu" and name == "_to_copy":
                self.seen.append(f"{name} to cpu (blocking)")
        return func(*args, **(kwargs or {}))


@pytest.fixture
def host_reads(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Host reads of tensors that never reach the dispatcher, recorded."""
    seen: list[str] = []
    for name in ("numpy", "tolist", "item", "cpu", "__bool__", "__int__", "__float__",
                 "__index__", "pin_memory"):
        orig = getattr(torch.Tensor, name)

        def rec(self: Any, *a: Any, _n: str = name, _o: Any = orig, **kw: Any) -> Any:
            seen.append(_n)
            return _o(self, *a, **kw)

        monkeypatch.setattr(torch.Tensor, name, rec)
    orig_to = torch.Tensor.to

    def to(self: Any, *a: Any, **kw: Any) -> Any:
        dev = kw.get("device") or next((x for x in a if isinstance(x, str | torch.device)),
                                       None)
        if dev is not None and not kw.get("non_blocking", False):
            seen.append(f"to({dev}) blocking")
        return orig_to(self, *a, **kw)

    monkeypatch.setattr(torch.Tensor, "to", to)
    return seen


def _inputs(n: int = 300, hq: int = 6, hkv: int = 2, d: int = 16, seed: int = 0
            ) -> tuple[Any, Any, Any, Any]:
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(n, hq, d, generator=g)
    k = torch.randn(n, hkv, d, generator=g)
    v = torch.randn(n, hkv, d, generator=g)
    sinks = torch.randn(hq, generator=g)
    return q, k, v, sinks


def _acc() -> HeadStatsAccumulator:
    return HeadStatsAccumulator(num_layers=2, num_kv_heads=2, group_size=3, seed=0,
                                n_random=24, n_detail=3)


def _plan(acc: HeadStatsAccumulator, n: int) -> tuple[Any, Any, dict[int, float]]:
    idx, wts = acc.sample_plan(n, 0)
    return idx, wts, dict(acc.detail_subset(len(idx), wts, 0))


@pytest.mark.parametrize("extras", [{}, {"softcap": 30.0}, {"sinks": True, "values": True}])
def test_the_device_path_reads_nothing_back_and_folds_the_cpu_numbers(
        monkeypatch: pytest.MonkeyPatch, host_reads: list[str], extras: dict[str, Any]) -> None:
    q, k, v, sinks = _inputs()
    kw: dict[str, Any] = {"softcap": extras.get("softcap"),
                          "sink_logits": sinks if extras.get("sinks") else None,
                          "v": v if extras.get("values") else None}
    cpu = _acc()
    idx, wts, det = _plan(cpu, q.shape[0])
    head_rows.fold_plan(cpu, 1, q, k, 0.25, 0, idx, wts, det, **kw)
    host_reads.clear()

    dev = _acc()
    # a new memo: the index tensors are built (and copied to the device) inside the check
    monkeypatch.setattr(head_rows, "_INDEX", {})
    monkeypatch.setattr(head_rows, "_on_device", lambda _dev: True)
    job = head_rows.prepare(dev, 1, q, k, 0.25, 0, idx, wts, det, **kw)
    with _Syncs() as mode:
        folds = head_rows.run(dev, job)
    assert mode.seen == [] and host_reads == [], (mode.seen, host_reads)
    assert folds.calls and not dev.queries.any()  # nothing folded before apply
    folds.apply()
    _same(cpu, dev)


def _same(a: HeadStatsAccumulator, b: HeadStatsAccumulator) -> None:
    """Every array of the two accumulators equal (the full sort's counts equal the partial
    top-k's; everything else is the same arithmetic)."""
    da, db = vars(a), vars(b)
    arrays = [k for k, x in da.items() if isinstance(x, np.ndarray)]
    assert arrays
    for key in arrays:
        np.testing.assert_allclose(db[key], da[key], rtol=1e-12, atol=0, err_msg=key)


def test_the_check_sees_todays_host_reads(monkeypatch: pytest.MonkeyPatch,
                                          host_reads: list[str]) -> None:
    """The recorder is not blind: the CPU path (numbers to numpy at once, a partial top-k
    that decides on the values) is caught by it."""
    q, k, _v, _s = _inputs()
    acc = _acc()
    idx, wts, det = _plan(acc, q.shape[0])
    job = head_rows.prepare(acc, 0, q, k, 0.25, 0, idx, wts, det)
    with _Syncs() as mode:
        head_rows.run(acc, job)
    assert host_reads or mode.seen
