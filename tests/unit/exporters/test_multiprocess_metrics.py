"""Prometheus multiprocess mode: a vLLM worker that dies by ``os._exit`` or SIGKILL (no
``atexit``) must stop counting in ``attnprof_plugin_processes`` and in every gauge, while its
counters stay. Real processes, real prometheus_client files, attnprof's own sink."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import run_py

# Every test here starts processes or runs for seconds: `make test` runs them,
# `make unit` skips them.
pytestmark = pytest.mark.slow

SCRIPT = r'''
import json, multiprocessing as mp, os, signal, sys
from prometheus_client import CollectorRegistry, generate_latest, multiprocess
from attnprof.exporters.prometheus import PrometheusSink
from attnprof.exporters import catalog as cat
from attnprof.exporters.samples import error_samples, s

def export(role, backend, tripped, errors):
    sink = PrometheusSink()
    sink.export(error_samples("m", {"capture": errors}, {}, [role], tripped, ["capture"])
                + [s(cat.LAYER_INFO, 1, model="m", layer="0", backend=backend,
                     impl="X", fused="true")])

def worker(backend, tripped, errors, ready, hold):
    export("worker", backend, tripped, errors)
    ready.send(os.getpid())
    if hold:
        hold.recv()  # alive until the parent says so
    os._exit(0)      # how vLLM's processes end: no atexit, no mark_process_dead

ctx = mp.get_context("fork")
def start(backend, tripped, errors, hold):
    a, b = ctx.Pipe()
    p = ctx.Process(target=worker, args=(backend, tripped, errors, b, hold))
    p.start()
    a.recv()
    return p

def scrape():
    reg = CollectorRegistry()
    multiprocess.MultiProcessCollector(reg)
    return generate_latest(reg).decode()

# A worker whose capture breaker tripped on an old backend, killed; then its restart.
hold_a, hold_b = ctx.Pipe()
dead = start("OLD_BACKEND", ["capture"], 5, hold_b)
os.kill(dead.pid, signal.SIGKILL); dead.join()
exited = start("OLD_BACKEND", ["capture"], 2, None); exited.join()   # os._exit
live_a, live_b = ctx.Pipe()
restarted = start("NEW_BACKEND", [], 1, live_b)
before = scrape()
export("api_server", "NEW_BACKEND", [], 0)   # the API server's export loop sweeps
after = scrape()
live_a.send(1); restarted.join()
print(json.dumps({"before": before, "after": after}))
'''


def _value(text: str, name: str, **labels: str) -> float | None:
    from tests.conftest import metric_value

    return metric_value(text, name, **labels)


def test_dead_workers_stop_counting_but_their_counters_stay(tmp_path: Path) -> None:
    mp_dir = tmp_path / "prom"
    mp_dir.mkdir()
    r = run_py(SCRIPT, env={"PROMETHEUS_MULTIPROC_DIR": str(mp_dir)}, timeout=120)
    assert r.returncode == 0, r.stderr
    res = json.loads(r.stdout.strip().splitlines()[-1])
    before, after = res["before"], res["after"]
    assert "OLD_BACKEND" not in before  # any process's export loop sweeps (here the restart)
    # After: only the restarted worker is live; the old backend and the tripped breaker
    # of a configuration no longer running are gone.
    assert _value(after, "attnprof_plugin_processes", role="worker") == 1
    assert _value(after, "attnprof_plugin_processes", role="api_server") == 1
    assert "OLD_BACKEND" not in after and 'backend="NEW_BACKEND"' in after
    assert _value(after, "attnprof_capture_disabled", model="m", place="capture") == 0
    # Counters of dead processes stay: the errors happened.
    assert _value(after, "attnprof_internal_errors_total", model="m", place="capture") == 8


HISTOGRAM = r'''
from prometheus_client import CollectorRegistry, generate_latest, multiprocess
from attnprof.aggregate.histogram import BucketHistogram
from attnprof.exporters import catalog as cat
from attnprof.exporters.prometheus import PrometheusSink
from attnprof.exporters.samples import HistogramSample
sink = PrometheusSink()
h = BucketHistogram([10, 100])
for batch in ([3, 40], [], [40, 700]):
    for v in batch:
        h.observe(v)
    sink.export([HistogramSample(cat.REQUEST_PROMPT_TOKENS, (("model", "m"),), h.state())])
reg = CollectorRegistry()
multiprocess.MultiProcessCollector(reg)
print(generate_latest(reg).decode())
'''


def test_histogram_deltas_reach_the_multiprocess_files(tmp_path: Path) -> None:
    """Bucket counts and sum advance by their deltas in prometheus_client's files (the one
    place the sink writes its per-bucket values)."""
    r = run_py(HISTOGRAM, env={"PROMETHEUS_MULTIPROC_DIR": str(tmp_path)}, timeout=60)
    assert r.returncode == 0, r.stderr
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("attnprof_")]
    assert lines == [
        'attnprof_request_prompt_tokens_sum{model="m"} 783.0',
        'attnprof_request_prompt_tokens_bucket{le="10.0",model="m"} 1.0',
        'attnprof_request_prompt_tokens_bucket{le="100.0",model="m"} 3.0',
        'attnprof_request_prompt_tokens_bucket{le="+Inf",model="m"} 4.0',
        'attnprof_request_prompt_tokens_count{model="m"} 4.0',
    ]
