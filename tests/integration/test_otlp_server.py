"""OTLP from a real vLLM server with attnprof inside, to a loopback receiver that decodes the
official OTLP protobufs: the same counters as the same server's /metrics, exactly, and (with
ATTNPROF_OTLP_SPANS=1) one span per sampled step with its layers' attention as children."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from attnprof.exporters.catalog import CATALOG, spec
from attnprof.tools.http import post_json
from attnprof.tools.server import VllmServer
from tests.conftest import poll_metrics, running_tiny_server
from tests.otlp_receiver import OtlpReceiver

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

# Counters both sides agree on only once traffic has stopped and both have flushed.
_COUNTERS = [m.name for m in CATALOG if m.kind == "counter"]


@pytest.fixture(scope="module", params=["http/protobuf", "grpc"])
def otlp_server(request: pytest.FixtureRequest, tiny_model: Path,
                tmp_path_factory: pytest.TempPathFactory
                ) -> Iterator[tuple[VllmServer, OtlpReceiver]]:
    with OtlpReceiver(protocol=request.param) as rx, running_tiny_server(
            tiny_model, tmp_path_factory, f"otlp-{request.param.split('/')[0]}.log",
            {"ATTNPROF_SAMPLE_RATE": "1.0", "ATTNPROF_SEED": "0",
             "ATTNPROF_OVERHEAD_BUDGET": "1.0",
             "OTEL_EXPORTER_OTLP_METRICS_ENDPOINT": rx.endpoint,
             "OTEL_EXPORTER_OTLP_METRICS_PROTOCOL": request.param,
             "OTEL_METRIC_EXPORT_INTERVAL": "500",
             "OTEL_SERVICE_NAME": "attnprof-test",
             "OTEL_RESOURCE_ATTRIBUTES": "deployment.environment=ci",
             "ATTNPROF_OTLP_SPANS": "1"},
            max_model_len=256, kv_bytes=32 << 20) as srv:
        yield srv, rx


def _prom_counters(text: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    from prometheus_client.parser import text_string_to_metric_families

    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name in _COUNTERS:
                out[(s.name, frozenset(s.labels.items()))] = s.value
    return out


def _otlp_latest(rx: OtlpReceiver) -> tuple[dict[tuple[str, frozenset[tuple[str, str]]], float],
                                            list[dict[str, Any]], dict[str, str]]:
    """Latest cumulative value per (process, metric, attributes), summed over processes
    (as /metrics sums the processes' multiprocess files); resources; units by name."""
    per_proc: dict[tuple[str, str, frozenset[tuple[str, str]]], float] = {}
    resources: dict[str, dict[str, Any]] = {}
    units: dict[str, str] = {}
    for req in list(rx.requests):
        for rm in req.resource_metrics:
            res = {a.key: _any(a.value) for a in rm.resource.attributes}
            inst = str(res.get("service.instance.id"))
            resources[inst] = res
            for sm in rm.scope_metrics:
                for m in sm.metrics:
                    units[m.name] = m.unit
                    if m.WhichOneof("data") != "sum":
                        continue
                    assert m.sum.is_monotonic
                    for dp in m.sum.data_points:
                        attrs = frozenset((a.key, str(_any(a.value))) for a in dp.attributes)
                        # One point type per metric (as_double): a flip to as_int between
                        # exports would break backends that key series by type.
                        assert dp.HasField("as_double"), m.name
                        per_proc[(inst, m.name, attrs)] = dp.as_double
    summed: dict[tuple[str, frozenset[tuple[str, str]]], float] = {}
    for (_inst, name, attrs), v in per_proc.items():
        summed[(name, attrs)] = summed.get((name, attrs), 0.0) + v
    return summed, list(resources.values()), units


def _any(v: Any) -> Any:
    return getattr(v, v.WhichOneof("value")) if v.WhichOneof("value") else None


def _to_otel(key: tuple[str, frozenset[tuple[str, str]]]) -> tuple[str, frozenset[
        tuple[str, str]]]:
    from attnprof.exporters.otlp import attributes

    name, labels = key
    return spec(name).otel_name, frozenset(
        (k, str(v)) for k, v in attributes(tuple(sorted(labels))).items())


def test_otlp_counters_equal_metrics_exactly(otlp_server: tuple[VllmServer, OtlpReceiver]
                                             ) -> None:
    srv, rx = otlp_server
    for i in range(3):
        out: Any = post_json(srv.base_url + "/v1/completions",
                                  {"model": "tiny", "prompt": "the model request " * (i + 2),
                                   "max_tokens": 5, "ignore_eos": True, "temperature": 0.0})
        assert out["usage"]["completion_tokens"] == 5
    # Traffic stopped: wait until both sides have flushed the final totals and agree. The
    # OTLP side compared is the one read beside that /metrics text: the receiver's threads
    # keep adding exports (every 0.5 s), so a second read could be a later one.
    seen: list[Any] = []

    def agree(text: str) -> bool:
        prom = _prom_counters(text)
        seen[:] = [_otlp_latest(rx)]
        otlp = seen[0][0]
        return (any(k[0] == "attnprof_attention_calls_total" for k in prom)
                and all(otlp.get(_to_otel(k)) == v for k, v in prom.items()))

    prom = _prom_counters(poll_metrics(srv.base_url, agree))
    otlp, resources, units = seen[0]
    missing = {k: (v, otlp.get(_to_otel(k))) for k, v in prom.items() if otlp.get(_to_otel(k)) != v}
    assert not missing, f"OTLP disagrees with /metrics: {list(missing.items())[:8]}"
    calls = [k for k in prom if k[0] == "attnprof_attention_calls_total"]
    assert len(calls) >= 2  # both layers, at least one phase each
    # Units (UCUM), names and resource.
    assert units[spec("attnprof_attention_time_seconds_total").otel_name] == "s"
    assert units[spec("attnprof_attention_bytes_total").otel_name] == "By"
    roles = {r.get("attnprof.process.role") for r in resources}
    assert {"api_server", "worker"} <= roles, resources
    for r in resources:
        assert r["service.name"] == "attnprof-test"
        assert r["deployment.environment"] == "ci"
        assert isinstance(r["process.pid"], int) and r.get("host.name")
        assert r.get("service.version") or r.get("attnprof.version")
    assert len({r["process.pid"] for r in resources}) == len(resources)  # one per process
    # GenAI attribute names: the model label travels as gen_ai.request.model.
    _name, attrs = _to_otel(calls[0])
    assert ("gen_ai.request.model", "tiny") in attrs


def test_sampled_steps_arrive_as_spans_with_layer_children(
        otlp_server: tuple[VllmServer, OtlpReceiver]) -> None:
    srv, rx = otlp_server
    canary = "giraffecanary"
    post_json(srv.base_url + "/v1/completions",
                   {"model": "tiny", "prompt": f"{canary} spans please " * 3, "max_tokens": 4,
                    "ignore_eos": True, "temperature": 0.0})

    def complete(spans: list[tuple[dict[str, Any], Any]]) -> bool:
        steps = [sp for _, sp in spans if sp.name == "attnprof.step"]
        kids = [sp for _, sp in spans if sp.name == "attnprof.attention"]
        return len(steps) >= 4 and all(
            sum(k.parent_span_id == s.span_id for k in kids) == 2 for s in steps)

    spans = rx.wait_for_spans(complete, timeout=30)
    steps = [sp for _, sp in spans if sp.name == "attnprof.step"]
    by_parent: dict[bytes, list[Any]] = {}
    for _, sp in spans:
        if sp.name == "attnprof.attention":
            by_parent.setdefault(sp.parent_span_id, []).append(sp)
    for st in steps:
        kids = by_parent[st.span_id]
        assert sorted(_attrs(k)["attnprof.layer"] for k in kids) == [0, 1]
        for k in kids:
            assert k.trace_id == st.trace_id
            assert st.start_time_unix_nano <= k.start_time_unix_nano
            assert k.end_time_unix_nano <= st.end_time_unix_nano
            assert _attrs(k)["attnprof.backend"] == "CPU_ATTN"
        a = _attrs(st)
        assert a["attnprof.phase"] in ("prefill", "decode", "mixed")
        assert a["attnprof.tokens"] > 0 and a["attnprof.effective_sample_rate"] == 1.0
        assert a["gen_ai.request.model"] == "tiny"
    roles = {res.get("attnprof.process.role") for res, _ in spans}
    assert roles == {"worker"}  # steps happen in workers only
    for _, sp in spans:  # shapes and times only: nothing of the request itself
        for key, value in _attrs(sp).items():
            assert not any(w in key for w in ("prompt", "token_id", "request_id")), key
            assert canary not in str(value)


def _attrs(span: Any) -> dict[str, Any]:
    return {a.key: _any(a.value) for a in span.attributes}
