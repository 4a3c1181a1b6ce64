"""Underused heads on a tiny Llama whose weights are built to have exactly one dormant head
(layer 1, head 3) and one pair of twins (layer 0, heads 0 and 1); every other head attends
sharply and differently."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from attnprof.aggregate.head_stats import HeadStatsAccumulator  # noqa: E402
from attnprof.analyze.sparsity.savings import LengthDistribution  # noqa: E402
from attnprof.analyze.sparsity.underused import (  # noqa: E402
    UnderusedThresholds,
    find_underused,
    kv_shares,
)
from attnprof.capture import head_rows  # noqa: E402
from attnprof.facts.shape import AttentionShape  # noqa: E402

BOS = 1
DORMANT = (1, 3)
TWINS = (0, 0, 1)  # layer, kept head, its twin
HEAD_DIM = 16


def build_model(out: Path | None = None) -> Any:
    """2 layers, 4 query / 2 KV heads of dim 16, biases on q/k/v/o.

    Hidden dimension 0 is a BOS marker: only BOS's embedding has it, and no o_proj or
    down_proj row writes it, so it stays BOS-only in every layer. The dormant head's query
    is a constant (its bias) in the lowest-frequency RoPE pair (dims 7 and 15: 3e-4 rad per
    token, so the rotation barely moves it over a prompt), and its KV head's key reads the
    BOS marker into that same pair: the query meets a large key at position 0 and a zero
    key everywhere else. The other heads' queries and keys ignore the marker and that pair
    and have large random weights (sharp, position-dependent attention). The twins share a
    KV head and have the same query rows."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=128,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      head_dim=HEAD_DIM, attention_bias=True, max_position_embeddings=512,
                      bos_token_id=BOS, eos_token_id=2, tie_word_embeddings=False)
    model = LlamaForCausalLM(cfg).eval()
    pair = (HEAD_DIM // 2 - 1, HEAD_DIM - 1)
    with torch.no_grad():
        emb = model.model.embed_tokens.weight
        emb.normal_(0, 1)
        emb[:, 0] = 0.0
        emb[BOS, 0] = 8.0
        for layer, blk in enumerate(model.model.layers):
            at = blk.self_attn
            at.o_proj.weight[0] = 0.0
            at.o_proj.bias.zero_()
            blk.mlp.down_proj.weight[0] = 0.0
            at.q_proj.weight.normal_(0, 0.5)
            at.k_proj.weight.normal_(0, 0.5)
            at.q_proj.bias.zero_()
            at.k_proj.bias.zero_()
            at.q_proj.weight[:, 0] = 0.0  # no head reads the BOS marker ...
            at.k_proj.weight[:, 0] = 0.0
            for h in range(4):  # ... nor the low-frequency pair
                for d in pair:
                    at.q_proj.weight[h * HEAD_DIM + d] = 0.0
            for kv in range(2):
                for d in pair:
                    at.k_proj.weight[kv * HEAD_DIM + d] = 0.0
            if layer == DORMANT[0]:
                h = DORMANT[1]
                at.q_proj.weight[h * HEAD_DIM:(h + 1) * HEAD_DIM] = 0.0
                at.q_proj.bias[h * HEAD_DIM + pair[0]] = 10.0
                kv = h // 2
                at.k_proj.weight[kv * HEAD_DIM + pair[0], 0] = 4.0
            if layer == TWINS[0]:
                a, b = TWINS[1], TWINS[2]
                at.q_proj.weight[b * HEAD_DIM:(b + 1) * HEAD_DIM] = \
                    at.q_proj.weight[a * HEAD_DIM:(a + 1) * HEAD_DIM]
    if out is not None:
        model.save_pretrained(out)
    return model


def prompts(n: int = 6, length: int = 160, seed: int = 1) -> list[Any]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        ids = torch.randint(3, 64, (1, length), generator=g)
        ids[0, 0] = BOS
        out.append(ids)
    return out


@pytest.fixture(scope="module")
def built() -> tuple[Any, HeadStatsAccumulator]:
    from attnprof.tools.replay import collect_head_stats

    model = build_model()
    acc = collect_head_stats(model, None, prompts())
    return model, acc


def test_built_heads_are_found_exactly(built: tuple[Any, HeadStatsAccumulator]) -> None:
    _, acc = built
    res = find_underused(acc)
    got = sorted((f["kind"], f["layer"], f["head"], f["twin"]) for f in res["findings"])
    assert got == [("dormant", *DORMANT, None), ("redundant", TWINS[0], TWINS[2], TWINS[1])]
    assert res["counts"] == {"dormant": 1, "near_uniform": 0, "redundant": 1}
    dormant = next(f for f in res["findings"] if f["kind"] == "dormant")
    assert dormant["evidence"]["sink_bound_share"] == 1.0
    assert dormant["queries"] >= UnderusedThresholds().min_queries
    twin = next(f for f in res["findings"] if f["kind"] == "redundant")
    assert twin["evidence"]["js_distance"] < 1e-4
    # every other pair of the layer is far apart: the twin is not a near miss of a threshold
    js = acc.js_mean()
    others = [js[layer, a, b] for layer in range(2) for a in range(4) for b in range(a + 1, 4)
              if (layer, a, b) != TWINS and DORMANT[1] not in (a, b)]
    assert min(others) > 0.3
    # 2 layers x 2 KV heads of the same size: a KV head holds 1/4, a query head 1/8
    assert dormant["kv_head_share"] == pytest.approx(0.25)
    assert dormant["kv_share"] == pytest.approx(0.125)


def test_random_heads_are_not_findings() -> None:
    """The same model without the built heads (fresh random weights everywhere): nothing."""
    from attnprof.tools.replay import collect_head_stats

    model = build_model()
    with torch.no_grad():
        for blk in model.model.layers:
            blk.self_attn.q_proj.weight.normal_(0, 0.5)
            blk.self_attn.q_proj.weight[:, 0] = 0.0
            blk.self_attn.q_proj.bias.zero_()
    acc = collect_head_stats(model, None, prompts(n=4))
    assert find_underused(acc)["findings"] == []


def test_replay_marks_the_built_heads_safe(built: tuple[Any, HeadStatsAccumulator]) -> None:
    from attnprof.tools.validate_heads import HeadEdit, edits_from_findings, replay_heads

    model, acc = built
    edits = edits_from_findings(find_underused(acc)["findings"])
    # a sharp random head replaced by its mean must change the output measurably
    edits.append(HeadEdit(0, 2, None, "given"))
    res = replay_heads(model, prompts(n=3, seed=7), edits)
    by = {(r["layer"], r["head"]): r for r in res["results"]}
    twin = by[(TWINS[0], TWINS[2])]
    assert twin["agreement"] == 1.0 and twin["mean_kl"] < 1e-9 and twin["safe"]
    dormant = by[DORMANT]
    assert dormant["safe"] and dormant["mean_kl"] < 1e-4
    sharp = by[(0, 2)]
    assert sharp["mean_kl"] > 100 * max(dormant["mean_kl"], 1e-9)
    assert res["positions"] == 3 * 160
    assert res["combined"] is not None and res["combined"]["safe"]


def test_accumulator_pairs_merge_and_serialize(built: tuple[Any, HeadStatsAccumulator]
                                               ) -> None:
    _, acc = built
    again = HeadStatsAccumulator.from_dict(acc.to_dict())
    assert np.array_equal(again.js_sum, acc.js_sum) and np.array_equal(again.sink_hist,
                                                                       acc.sink_hist)
    back = HeadStatsAccumulator.from_bytes(HeadStatsAccumulator.from_dict(acc.to_dict())
                                           .take_bytes())
    assert np.array_equal(back.js_n, acc.js_n)
    two = HeadStatsAccumulator.from_dict(acc.to_dict()).merge(again)
    assert np.allclose(two.js_mean(), acc.js_mean(), equal_nan=True)
    assert np.array_equal(two.sink_hist, 2 * acc.sink_hist)
    # tensor parallel: two ranks of one KV head each; pairs across ranks stay unmeasured
    glob = HeadStatsAccumulator(acc.num_layers, 2, 2)
    for r in range(2):
        part = HeadStatsAccumulator(acc.num_layers, 1, 2)
        part.js_sum[:] = acc.js_sum[:, 2 * r:2 * r + 2, 2 * r:2 * r + 2]
        part.js_n[:] = acc.js_n[:, 2 * r:2 * r + 2, 2 * r:2 * r + 2]
        glob.add_at(part, q_offset=2 * r, count_requests=r == 0)
    assert glob.js_n[0, 0, 1] == acc.js_n[0, 0, 1] and glob.js_n[0, 0, 2] == 0
    assert np.isnan(glob.js_mean()[0, 0, 2])


def test_kv_share_weights_sliding_layers_by_traffic() -> None:
    arch = AttentionShape(num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
                          layer_windows=(128, None))
    dist = LengthDistribution.from_lengths([1024])
    share, basis = kv_shares(2, 2, arch, dist)
    # the sliding layer holds 128 tokens, the full one 1024, per KV head
    assert share == pytest.approx([128 / (2 * 1152), 1024 / (2 * 1152)])
    assert "traffic" in basis
    assert kv_shares(2, 2)[0] == pytest.approx([0.25, 0.25])


def test_thresholds_are_checked() -> None:
    acc = HeadStatsAccumulator(1, 1, 1)
    with pytest.raises(ValueError):
        find_underused(acc, UnderusedThresholds(dormant_mass=0.93))
    with pytest.raises(ValueError):
        find_underused(acc, UnderusedThresholds(sinks=5))
    assert find_underused(acc)["findings"] == []


def test_findings_reach_the_window_advice(built: tuple[Any, HeadStatsAccumulator]) -> None:
    """The live path (recommend -> export_summary, as the endpoint's advice loop runs it)
    and the snapshot wire form carry the findings with their KV shares, not validated."""
    from attnprof.analyze.sparsity.recommend import export_summary, recommend
    from attnprof.contracts.advice import WindowAdvice
    from attnprof.exporters.terminal_suggest import render

    _, acc = built
    arch = AttentionShape(num_layers=2, num_heads=4, num_kv_heads=2, head_dim=HEAD_DIM)
    rec = recommend(LengthDistribution.from_lengths([160] * 3), arch, acc)
    adv = WindowAdvice.from_json(export_summary(rec).to_json())
    got = sorted((h.kind, h.layer, h.head, h.twin) for h in adv.underused_heads or [])
    assert got == [("dormant", *DORMANT, None), ("redundant", TWINS[0], TWINS[2], TWINS[1])]
    assert all(h.kv_share == pytest.approx(0.125) and not h.safe
               for h in adv.underused_heads or [])
    text = render(rec.to_json() | {"replay": None})
    assert "underused heads: 1 dormant, 0 near-uniform, 1 redundant of 8 query heads" in text
    assert recommend(LengthDistribution.from_lengths([160]), arch).underused_heads is None


def test_replay_mask_is_built_on_the_query_device() -> None:
    """The replay's causal/window mask lives where q is (CUDA in real use; the meta device
    here, which refuses to mix with a CPU mask exactly as CUDA does)."""
    from types import SimpleNamespace

    from transformers.modeling_utils import AttentionInterface

    from attnprof.tools.validate_heads import _IMPL, _register, _State

    _register(_State())
    attn = AttentionInterface()[_IMPL]
    q = torch.empty(1, 4, 6, HEAD_DIM, device="meta")
    kv = torch.empty(1, 2, 6, HEAD_DIM, device="meta")
    out, _ = attn(SimpleNamespace(layer_idx=0), q, kv, kv, None, sliding_window=3)
    assert out.device == q.device and out.shape == (1, 6, 4, HEAD_DIM)


def _pair_js_loop(p: Any) -> np.ndarray:
    """The per-head loop pair_js ran before it was batched (the reference)."""
    import math

    hq = p.shape[0]
    out = np.zeros((hq, hq))
    for a in range(hq - 1):
        pa, pb = p[a:a + 1], p[a + 1:]
        m = (pa + pb).clamp(min=1e-38)
        js = 0.5 * (torch.xlogy(pa, 2 * pa / m) + torch.xlogy(pb, 2 * pb / m)).sum(-1)
        out[a, a + 1:] = (js.clamp(min=0) / math.log(2)).clamp(max=1).sqrt().double().numpy()
    return out


class _CountingTensor(torch.Tensor):
    """Counts device-to-host reads (``.cpu()``, ``.tolist()``, ``.item()``; ``.numpy()``
    needs a CPU tensor): one per detail query is the goal, not one per head."""

    reads = 0

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None
                           ) -> Any:
        if func in (torch.Tensor.cpu, torch.Tensor.tolist, torch.Tensor.item):
            cls.reads += 1
        return super().__torch_function__(func, types, args, kwargs or {})


@pytest.mark.parametrize("chunk", [None, 7 * 33])
def test_pair_js_is_batched_and_matches_the_loop(chunk: int | None) -> None:
    """Random rows (some identical, some with zeros) of one detail query: the batched [hq,
    hq] matrix equals the old per-head loop's, identical rows give exactly 0, and the device
    is read once for all pairs, whether or not the pairs are chunked."""
    rng = np.random.default_rng(5)
    hq, n = 9, 33
    x = rng.random((hq, n)) ** 4
    x[:, rng.random(n) < 0.2] = 0.0
    x[4] = x[1]  # twins
    p = torch.from_numpy(x / x.sum(-1, keepdims=True)).float()
    ref = _pair_js_loop(p)
    acc = HeadStatsAccumulator(3, 3, 3)
    kw = {} if chunk is None else {"chunk_elements": chunk}
    _CountingTensor.reads = 0
    acc.fold_pairs(2, head_rows.pair_js(p.as_subclass(_CountingTensor), **kw), 0.5)
    assert _CountingTensor.reads == 1
    iu = np.triu_indices(hq, 1)
    np.testing.assert_array_equal(acc.js_sum[2][iu], 0.5 * ref[iu])  # same ops, same order
    assert acc.js_sum[2][1, 4] == 0.0 and (acc.js_sum[2][iu] > 0).sum() == len(iu[0]) - 1
    assert (acc.js_n[2][iu] == 0.5).all() and (acc.js_k[2][iu] == 1).all()
    assert not acc.js_sum[:2].any() and not np.tril(acc.js_n[2]).any()
