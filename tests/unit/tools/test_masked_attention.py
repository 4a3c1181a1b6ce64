"""The one masked attention both replays run: every tensor it makes follows the input's device
(run on ``meta``, where a CPU-made position tensor cannot mix in), and its mask is the causal
+ model window + sinks/window mask, checked against a loop over (query, key) pairs."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")

from attnprof.tools.masked_attention import ReplayError, allowed_mask, masked_attention  # noqa: E402

LAYER = SimpleNamespace(layer_idx=0)


def test_runs_on_the_meta_device_making_nothing_on_the_cpu() -> None:
    q = torch.empty(1, 4, 5, 8, device="meta")
    k = v = torch.empty(1, 2, 12, 8, device="meta")
    pad = torch.ones(1, 1, 5, 12, dtype=torch.bool, device="meta")
    out = masked_attention(LAYER, q, k, v, pad, window=4, sinks=1, sliding_window=6)
    assert out.device.type == "meta" and tuple(out.shape) == (1, 4, 5, 8)
    mask = allowed_mask(5, 12, q.device, pad, 6, 4, 1)
    assert mask.device.type == "meta"


@pytest.mark.parametrize(("native", "window", "sinks"),
                         [(None, None, 0), (None, 3, 0), (None, 3, 2), (5, None, 0), (5, 2, 1)])
def test_the_mask_is_causal_with_the_model_window_and_sinks(
        native: int | None, window: int | None, sinks: int) -> None:
    lq, lk = 4, 9
    got = allowed_mask(lq, lk, "cpu", None, native, window, sinks).tolist()
    for a in range(lq):
        pos = lk - lq + a
        for j in range(lk):
            want = j <= pos
            if native:
                want = want and j > pos - native
            if window is not None:
                want = want and (j < sinks or j > pos - window)
            assert got[a][j] == want, (a, j)


def test_the_output_is_softmax_attention_over_the_allowed_keys() -> None:
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 2, 3, 4, generator=g)
    k = torch.randn(1, 1, 6, 4, generator=g)
    v = torch.randn(1, 1, 6, 4, generator=g)
    out = masked_attention(LAYER, q, k, v, None, window=2, sinks=1)
    mask = allowed_mask(3, 6, "cpu", None, None, 2, 1)
    for h in range(2):
        for a in range(3):
            s = [(q[0, h, a] @ k[0, 0, j]).item() / math.sqrt(4) if mask[a, j] else -math.inf
                 for j in range(6)]
            w = torch.softmax(torch.tensor(s), -1)
            assert torch.allclose(out[0, h, a], w @ v[0, 0], atol=1e-5)


def test_features_a_mask_cannot_reproduce_are_one_line_errors() -> None:
    q = torch.zeros(1, 1, 2, 4)
    with pytest.raises(ReplayError, match="head replay does not support logit softcapping"):
        masked_attention(LAYER, q, q, q, None, softcap=30.0, what="head replay")
    with pytest.raises(ReplayError, match="learned attention sinks"):
        masked_attention(SimpleNamespace(layer_idx=0, sinks=torch.zeros(1)), q, q, q, None)
