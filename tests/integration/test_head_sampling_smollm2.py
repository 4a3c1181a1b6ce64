"""Window decisions agree with all-query truth on a real English text, through the offline path.

SmolLM2 reads the first 1,484 tokens of the Apache License 2.0 that ships with transformers
(present on every install). For every layer, the post-RoPE q/k are captured once; the exact
coverage C_i(s=4, w) of every query is computed in float64 and decides each KV head (all its
query heads keep the 0.05-quantile of coverage >= 0.9 over eligible queries). The offline
path (``collect_head_stats`` then ``refine_head_stats``, as ``attnprof suggest-window
--collect-stats`` runs it) decides the same: a sampled pass with three-valued decisions
(pass / fail / undecided), then the layers holding undecided KV heads rerun on every query.
Required: after refinement, decisions agree with all queries for >= 95% of the 90 KV heads
at every grid window with eligible queries and never pass a head that fails on all queries;
the sampled pass alone never passes such a head either (undecided heads count apart).
"""

from __future__ import annotations

import importlib.metadata
import math
from typing import Any

import numpy as np
import pytest
import torch

from attnprof.aggregate.head_stats import HeadStatsAccumulator
from attnprof.analyze.sparsity.classify import Thresholds, kv_decisions, window_decisions

pytestmark = [pytest.mark.smollm2, pytest.mark.slow]

TOKENS = 1484
WINDOWS = (128, 256, 512, 1024)
TH = Thresholds()  # tau 0.9, quantile 0.05, 4 sinks, Wilson z = 1


def license_text() -> str:
    dist = importlib.metadata.distribution("transformers")
    files = [f for f in dist.files or [] if str(f).rsplit("/", 1)[-1] == "LICENSE"]
    assert files, "transformers ships its LICENSE"
    return files[0].read_text()


def capture() -> tuple[list[tuple[Any, Any, float]], dict[str, Any]]:
    """Post-RoPE (q, k, scale) of every layer for the text's first TOKENS tokens."""
    from attnprof.capture.transformers import instrument
    from attnprof.tools.replay import load_model

    model, tok, _ = load_model("smollm2")
    ids = tok(license_text(), return_tensors="pt")["input_ids"][:, :TOKENS]
    assert ids.shape[1] == TOKENS
    got: list[tuple[Any, Any, float]] = []

    def grab(ev: Any) -> None:
        got.append((ev.query.detach().clone(), ev.key.detach().clone(),
                    float(ev.kwargs.get("scaling") or ev.module.scaling)))

    prof = instrument(model, on_call=grab, explain=False, keep_records=False)
    with torch.no_grad():
        model(input_ids=ids, use_cache=False)
    prof.uninstrument()
    return got, model.config.to_dict()


def truth_share(q: Any, k: Any, scale: float) -> Any:
    """[q head, window] exact share of eligible queries (those seeing more than s + w keys)
    whose coverage C_i(s, w) is below tau, in float64 over every query of the prompt."""
    q64, k64 = q[0].double(), k[0].double()  # [Hq, L, D], [Hkv, L, D]
    hq, n, _ = q64.shape
    group = hq // k64.shape[0]
    i = torch.arange(n)
    out = np.zeros((hq, len(WINDOWS)))
    for h in range(hq):
        x = (q64[h] @ k64[h // group].T) * scale
        x = x.masked_fill(i[None, :] > i[:, None], -math.inf)
        p = torch.softmax(x, -1)
        cum = torch.cat([torch.zeros(n, 1, dtype=p.dtype), p.cumsum(-1)], -1)  # [n, n+1]
        sink = cum[:, TH.sinks]
        for wi, w in enumerate(WINDOWS):
            first = (i - w + 1).clamp(min=TH.sinks)  # the window's first key past the sinks
            local = cum[i, i + 1] - cum[i, first]
            cov = (sink + local)[i + 1 > TH.sinks + w]
            out[h, wi] = float((cov < TH.tau).double().mean())
    return out


def truth_pass(share: Any, group: int) -> Any:
    """[KV head, window] True where every query head of the group keeps the all-query
    0.05-quantile of coverage >= tau."""
    ok = share <= TH.quantile
    return ok.reshape(-1, group, ok.shape[-1]).all(1)


def kv_decision(acc: HeadStatsAccumulator) -> Any:
    """[layer, KV head, window of WINDOWS] codes: 1 pass, 0 undecided, -1 fail."""
    d = kv_decisions(window_decisions(acc, TH)["decision"], acc.group_size)
    return d[..., [acc.window_grid.index(w) for w in WINDOWS]]


@pytest.fixture(scope="module")
def measured() -> dict[str, Any]:
    """Truth pass [layer, KV head, window], the sampled statistics of one prefill, the same
    statistics after refinement, and the refinement's report."""
    from attnprof.tools.replay import collect_head_stats, load_model, refine_head_stats

    torch.manual_seed(0)
    layers, _ = capture()
    share = np.stack([truth_share(q, k, scale) for q, k, scale in layers])
    del layers
    model, tok, _ = load_model("smollm2")
    ids = tok(license_text(), return_tensors="pt")["input_ids"][:, :TOKENS]
    acc = collect_head_stats(model, tok, [ids])
    sampled = HeadStatsAccumulator.from_dict(acc.to_dict())
    refined = refine_head_stats(model, tok, [ids], acc, TH)
    print(f"refinement: {len(refined['layers'])} layers rerun on every query in "
          f"{refined['seconds']} s; undecided before {refined['undecided_before']}, after "
          f"{refined['undecided_after']}")
    truth = np.stack([truth_pass(x, acc.group_size) for x in share])
    return {"truth": truth, "sampled": sampled, "acc": acc, "refined": refined}


def _report(name: str, got: Any, truth: Any) -> list[tuple[int, int, int, int]]:
    """(agree: decided as all queries decide, false passes, undecided, KV heads) per window,
    printed."""
    out = []
    for wi, w in enumerate(WINDOWS):
        g, t = got[..., wi], truth[..., wi]
        agree = int(((g == 1) & t).sum() + ((g == -1) & ~t).sum())
        over = int(((g == 1) & ~t).sum())
        undecided = int((g == 0).sum())
        print(f"{name} w={w}: {agree} of {t.size} KV heads agree, {over} passed but fail on "
              f"all queries, {undecided} undecided, {int(((g == -1) & t).sum())} failed but "
              f"pass on all queries, {int(t.sum())} pass on all queries")
        out.append((agree, over, undecided, int(t.size)))
    return out


def test_refined_decisions_agree_with_all_queries(measured: dict[str, Any]) -> None:
    acc, truth = measured["acc"], measured["truth"]
    # the grid windows with eligible queries on 1,484 tokens are exactly 128..1024
    si = acc.sinks_grid.index(TH.sinks)
    seen = [w for i, w in enumerate(acc.window_grid) if acc.cov_n[:, :, si, i].min() > 0]
    assert seen == list(WINDOWS)
    for w, (agree, over, undecided, heads) in zip(
            WINDOWS, _report("refined", kv_decision(acc), truth), strict=True):
        assert heads == 90
        assert over == 0, f"w={w}: {over} KV heads pass but fail on all queries"
        assert undecided == 0, f"w={w}: {undecided} KV heads left undecided"
        assert agree >= math.ceil(0.95 * heads), f"w={w}: only {agree} of {heads} agree"
    ref = measured["refined"]
    assert ref["undecided_before"] and not ref["undecided_after"]
    # only the layers holding undecided heads were rerun, and those are marked exact
    und_layers = np.flatnonzero((kv_decision(measured["sampled"]) == 0).any((1, 2)))
    assert ref["layers"] == [int(x) for x in und_layers] and len(ref["layers"]) < 30
    assert acc.exact[ref["layers"]].all() and acc.exact.sum() == len(ref["layers"]) * 9


def test_sampled_pass_never_passes_a_failing_head(measured: dict[str, Any]) -> None:
    """The sampled pass alone: zero false passes; what it cannot decide is undecided, and
    of what it decides at most 10% is decided wrongly (strictly: fail for a passing head)."""
    rows = _report("sampled", kv_decision(measured["sampled"]), measured["truth"])
    for w, (agree, over, undecided, heads) in zip(WINDOWS, rows, strict=True):
        assert over == 0, f"w={w}: {over} KV heads pass on the sample but fail on all queries"
        wrong = heads - agree - undecided
        assert wrong <= 0.1 * (heads - undecided), (w, wrong, undecided)
    assert sum(r[2] for r in rows) > 0  # this text has heads at the threshold (docs)


def test_sampling_error_is_reported(measured: dict[str, Any]) -> None:
    acc = measured["sampled"]
    wi = acc.window_grid.index(1024)
    si = acc.sinks_grid.index(TH.sinks)
    neff = acc.n_eff()[..., si, wi]
    se = acc.coverage_se()[..., si, wi]
    assert np.all(neff >= TH.min_queries) and np.all(np.isfinite(se)) and np.all(se < 0.1)
    ex = measured["acc"]  # exact rows carry no sampling error
    assert np.all(ex.coverage_se()[..., si, wi][ex.exact] == 0)
