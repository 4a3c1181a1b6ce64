from __future__ import annotations

import os
import re
from typing import Any

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from attnprof.aggregate.histogram import BucketHistogram
from attnprof.exporters import catalog as cat
from attnprof.exporters.catalog import CATALOG, MetricSpec, spec
from attnprof.exporters.prometheus import PrometheusSink
from attnprof.exporters.samples import HistogramSample, MetricSample, Sample, s

_NAME = re.compile(r"^attnprof_[a-z0-9_]+$")
_FORBIDDEN_LABELS = {"request_id", "prompt", "text", "token", "token_id", "user", "length"}


def test_names_follow_conventions() -> None:
    names = [m.name for m in CATALOG]
    assert len(names) == len(set(names))
    for m in CATALOG:
        assert _NAME.match(m.name), m.name
        assert ":" not in m.name
        assert (m.kind == "counter") == m.name.endswith("_total"), m.name
        assert not set(m.labels) & _FORBIDDEN_LABELS
        assert m.help.endswith(".")


def test_context_histogram_name_is_the_contract() -> None:
    assert spec("attnprof_request_context_tokens").kind == "histogram"


def _every_metric_samples(counter_total: float = 2.0) -> list[MetricSample]:
    out: list[MetricSample] = []
    for m in CATALOG:
        labels = tuple((lab, "x") for lab in m.labels)
        if m.kind == "histogram":
            h = BucketHistogram([1, 10, 100])
            h.observe(5)
            out.append(HistogramSample(m, labels, h.state()))
        else:
            out.append(Sample(m, labels, counter_total if m.kind == "counter" else 3.0))
    return out


CREATED = 1700000000.5


@pytest.fixture
def frozen_clock(monkeypatch: pytest.MonkeyPatch) -> None:
    """``_created`` series read the clock: fix it so the exposition is exact text."""
    import time

    monkeypatch.setattr(time, "time", lambda: CREATED)


def _expected(m: MetricSpec) -> list[str]:
    """Exposition lines of one catalog metric after :func:`_every_metric_samples`, spelled
    out the way the Prometheus text format (0.0.4) writes them."""
    lab = ",".join(f'{k}="x"' for k in sorted(m.labels))
    name = m.base_name

    def series(suffix: str, value: str, extra: str = "") -> str:
        inner = ",".join(x for x in (extra, lab) if x) if extra.startswith("le") else lab
        if extra and not extra.startswith("le"):
            inner = extra
        return f"{name}{suffix}{{{inner}}} {value}" if inner else f"{name}{suffix} {value}"

    created = [f"# HELP {name}_created {m.help}", f"# TYPE {name}_created gauge",
               series("_created", "1.7000000005e+09")]
    if m.kind == "gauge":
        return [f"# HELP {name} {m.help}", f"# TYPE {name} gauge", series("", "3.0")]
    if m.kind == "counter":
        return [f"# HELP {name}_total {m.help}", f"# TYPE {name}_total counter",
                series("_total", "2.0"), *created]
    buckets = [f'{name}_bucket{{le="{le}",{lab}}} {v}'
               for le, v in (("1.0", "0.0"), ("10.0", "1.0"), ("100.0", "1.0"), ("+Inf", "1.0"))]
    return [f"# HELP {name} {m.help}", f"# TYPE {name} histogram", *buckets,
            series("_count", "1.0"), series("_sum", "5.0"), *created]


def test_sink_renders_every_metric_exactly(frozen_clock: None) -> None:
    reg = CollectorRegistry()
    sink = PrometheusSink(registry=reg)
    sink.export(_every_metric_samples())
    want = [ln for m in CATALOG for ln in _expected(m)]
    assert generate_latest(reg).decode().splitlines() == want


def test_sink_exposition_reads_as_written(frozen_clock: None) -> None:
    """The exact text for one counter, one labelled gauge and one histogram, written out by
    hand (as prometheus/client_python's own tests pin theirs)."""
    reg = CollectorRegistry()
    sink = PrometheusSink(registry=reg)
    h = BucketHistogram([10, 100])
    for v in (3, 40, 40, 700):
        h.observe(v)
    sink.export([
        s(cat.SELF_TIME_SECONDS_TOTAL, 1.25, model="m"),
        s(cat.PLUGIN_PROCESSES, 1, role="worker"),
        s(cat.PLUGIN_PROCESSES, 2, role="api_server"),
        HistogramSample(cat.REQUEST_PROMPT_TOKENS, (("model", "m"),), h.state()),
    ])
    assert generate_latest(reg).decode() == """\
# HELP attnprof_self_time_seconds_total attnprof's own time spent on sampled steps.
# TYPE attnprof_self_time_seconds_total counter
attnprof_self_time_seconds_total{model="m"} 1.25
# HELP attnprof_self_time_seconds_created attnprof's own time spent on sampled steps.
# TYPE attnprof_self_time_seconds_created gauge
attnprof_self_time_seconds_created{model="m"} 1.7000000005e+09
# HELP attnprof_plugin_processes Processes the attnprof plugin is live in, by role.
# TYPE attnprof_plugin_processes gauge
attnprof_plugin_processes{role="worker"} 1.0
attnprof_plugin_processes{role="api_server"} 2.0
# HELP attnprof_request_prompt_tokens Prompt tokens of finished requests.
# TYPE attnprof_request_prompt_tokens histogram
attnprof_request_prompt_tokens_bucket{le="10.0",model="m"} 1.0
attnprof_request_prompt_tokens_bucket{le="100.0",model="m"} 3.0
attnprof_request_prompt_tokens_bucket{le="+Inf",model="m"} 4.0
attnprof_request_prompt_tokens_count{model="m"} 4.0
attnprof_request_prompt_tokens_sum{model="m"} 783.0
# HELP attnprof_request_prompt_tokens_created Prompt tokens of finished requests.
# TYPE attnprof_request_prompt_tokens_created gauge
attnprof_request_prompt_tokens_created{model="m"} 1.7000000005e+09
"""


def test_sink_is_idempotent_per_registry() -> None:
    reg = CollectorRegistry()
    PrometheusSink(registry=reg).export(_every_metric_samples())
    PrometheusSink(registry=reg).export(_every_metric_samples())  # reuses, never raises
    v = reg.get_sample_value("attnprof_steps_total", {"model": "x", "outcome": "x"})
    assert v == 4.0  # two sinks, each advancing its own running total from 0 to 2


def test_histogram_deltas_are_exact() -> None:
    reg = CollectorRegistry()
    sink = PrometheusSink(registry=reg)
    h = BucketHistogram([10, 100])
    labels = (("model", "m"),)
    for batch in ([3, 10, 11], [], [500, 100]):
        for v in batch:
            h.observe(v)
        sink.export([HistogramSample(cat.REQUEST_PROMPT_TOKENS, labels, h.state())])
    name = "attnprof_request_prompt_tokens"
    get = reg.get_sample_value
    assert get(f"{name}_bucket", {"model": "m", "le": "10.0"}) == 2
    assert get(f"{name}_bucket", {"model": "m", "le": "100.0"}) == 4
    assert get(f"{name}_bucket", {"model": "m", "le": "+Inf"}) == 5
    assert get(f"{name}_count", {"model": "m"}) == 5
    assert get(f"{name}_sum", {"model": "m"}) == 624


def test_otel_names_are_dotted_without_units() -> None:
    assert spec("attnprof_attention_time_seconds_total").otel_name == "attnprof.attention.time"
    assert spec("attnprof_request_context_tokens").otel_name == "attnprof.request.context"


def test_docs_metric_table_is_generated_from_catalog() -> None:
    from pathlib import Path

    from attnprof.exporters.catalog import markdown_table

    doc = (Path(__file__).resolve().parents[3] / "docs" / "metrics.md").read_text()
    assert markdown_table() in doc, "regenerate: python -m attnprof.exporters.catalog"


def test_counter_totals_export_each_increment_once() -> None:
    reg = CollectorRegistry()
    sink = PrometheusSink(registry=reg)
    m = cat.INTERNAL_ERRORS_TOTAL
    name = m.name
    for total in (2, 2, 5, 3):  # repeated and stale totals add nothing
        sink.export([Sample(m, (("model", "m"), ("place", "capture")), total)])
    sink.export([Sample(m, (("model", "m"), ("place", "metrics")), 1)])
    assert reg.get_sample_value(name, {"model": "m", "place": "capture"}) == 5
    assert reg.get_sample_value(name, {"model": "m", "place": "metrics"}) == 1


_FORKED_GAUGE = """
import os, sys
from prometheus_client import CollectorRegistry
from prometheus_client.multiprocess import MultiProcessCollector
from attnprof.exporters import catalog as cat
from attnprof.exporters.prometheus import PrometheusSink
from attnprof.exporters.samples import Sample
sink = PrometheusSink()
live = [Sample(cat.PLUGIN_PROCESSES, (("role", "worker"),), 1)]
sink.export(live)
pid = os.fork()
if pid == 0:
    sink.export(live)  # the same value as the parent's last: still this process's own 1
    os._exit(0)
os.waitpid(pid, 0)
reg = CollectorRegistry()
MultiProcessCollector(reg)
print(reg.get_sample_value("attnprof_plugin_processes", {"role": "worker"}))
"""


@pytest.mark.slow
@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_forked_process_writes_its_own_gauges_in_multiprocess_mode(tmp_path: Any) -> None:
    from tests.conftest import run_py

    r = run_py(_FORKED_GAUGE, env={"PROMETHEUS_MULTIPROC_DIR": str(tmp_path)}, timeout=60)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.split() == ["2.0"]  # livesum over both processes
