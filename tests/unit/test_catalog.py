from __future__ import annotations

import re

from prometheus_client import CollectorRegistry, generate_latest

from attnprof.exporters.catalog import CATALOG, spec
from attnprof.exporters.prometheus import PrometheusSink

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


def test_sink_renders_every_metric_with_fresh_registry() -> None:
    reg = CollectorRegistry()
    sink = PrometheusSink(registry=reg, buckets={"attnprof_request_context_tokens": [1, 10, 100]})
    for m in CATALOG:
        metric = sink.metric(m.name)
        child = metric.labels(**{lab: "x" for lab in m.labels}) if m.labels else metric
        if m.kind == "counter":
            child.inc(2)
        elif m.kind == "gauge":
            child.set(3)
        else:
            child.observe(5)
    text = generate_latest(reg).decode()
    for m in CATALOG:
        assert m.name in text or f"{m.name}_bucket" in text, m.name
    assert 'attnprof_request_context_tokens_bucket{le="10.0",model="x"} 1.0' in text


def test_sink_is_idempotent_per_registry() -> None:
    reg = CollectorRegistry()
    a = PrometheusSink(registry=reg).metric("attnprof_attention_calls_total")
    b = PrometheusSink(registry=reg).metric("attnprof_attention_calls_total")
    assert a is b


def test_otel_names_are_dotted_without_units() -> None:
    assert spec("attnprof_attention_time_seconds_total").otel_name == "attnprof.attention.time"
    assert spec("attnprof_request_context_tokens").otel_name == "attnprof.request.context"


def test_docs_metric_table_is_generated_from_catalog() -> None:
    from pathlib import Path

    from attnprof.exporters.catalog import markdown_table

    doc = (Path(__file__).resolve().parents[2] / "docs" / "metrics.md").read_text()
    assert markdown_table() in doc, "regenerate: python -m attnprof.exporters.catalog"


def test_inc_to_exports_each_running_total_once() -> None:
    reg = CollectorRegistry()
    sink = PrometheusSink(registry=reg)
    name = "attnprof_internal_errors_total"
    for total in (2, 2, 5, 3):  # repeated and stale totals add nothing
        sink.inc_to(name, total, model="m", place="capture")
    sink.inc_to(name, 1, model="m", place="metrics")
    assert reg.get_sample_value(name, {"model": "m", "place": "capture"}) == 5
    assert reg.get_sample_value(name, {"model": "m", "place": "metrics"}) == 1
