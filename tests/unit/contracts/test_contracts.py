"""Contracts: the published schemas are current and valid, real documents validate against
them, to_json/from_json round-trip, and a wrong kind, major version or field type fails in
one line that names the problem."""

from __future__ import annotations

import copy
import json
import math
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import jsonschema
import pytest

from attnprof.capture import head_rows
from attnprof.contracts.advice import AdviceUnavailable, WindowAdvice
from attnprof.contracts.base import ContractError, Document, Record, decode, json_schema
from attnprof.contracts.profile import ProfileReport
from attnprof.contracts.schemas import SCHEMA_DIR, render, schemas, stale
from attnprof.contracts.snapshot import LayerProfile, PhaseStats, RequestStats, Snapshot

REPO = Path(__file__).resolve().parents[3]


def _validate(doc: dict[str, Any], name: str) -> None:
    schema = json.loads((SCHEMA_DIR / name).read_text())
    jsonschema.Draft202012Validator(schema).validate(doc)


def _one_line(err: pytest.ExceptionInfo[ContractError], *needles: str) -> None:
    text = str(err.value)
    assert "\n" not in text, text
    for n in needles:
        assert n in text, text


# ----- schemas -----
@pytest.mark.slow
def test_published_schemas_are_current_and_valid_draft_2020_12() -> None:
    assert SCHEMA_DIR == REPO / "docs" / "schema"
    assert stale() == [], "run: python -m attnprof.contracts"
    for name, schema in schemas().items():
        jsonschema.Draft202012Validator.check_schema(schema)
        assert schema["$schema"] == "https://json-schema.org/draft/2020-12/schema", name
    assert set(schemas()) >= {"snapshot.schema.json", "layer_profile.schema.json",
                              "request_stats.schema.json", "window_advice.schema.json",
                              "profile.schema.json"}


@pytest.mark.slow
def test_schema_command_check_mode(tmp_path: Path) -> None:
    cmd = [sys.executable, "-m", "attnprof.contracts"]
    r = subprocess.run([*cmd, "--check", "--out", str(tmp_path)], capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 1 and "profile.schema.json is not current" in r.stderr
    r = subprocess.run([*cmd, "--out", str(tmp_path)], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0
    assert (tmp_path / "window_advice.schema.json").read_text() == render(
        schemas()["window_advice.schema.json"])
    r = subprocess.run([*cmd, "--check", "--out", str(tmp_path)], capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0, r.stderr


def test_field_docstrings_become_descriptions() -> None:
    props = schemas()["window_advice.schema.json"]["properties"]
    assert "unchanged" in props["exact_request_fraction"]["description"]
    assert props["attention_flop_saving"]["minimum"] == 0
    assert props["attention_flop_saving"]["maximum"] == 1


# ----- window advice from the real code path -----
def _advice(head_stats: bool) -> WindowAdvice:
    from attnprof.aggregate.head_stats import HeadStatsAccumulator
    from attnprof.analyze.sparsity.recommend import export_summary, recommend
    from attnprof.analyze.sparsity.savings import LengthDistribution
    from attnprof.facts.shape import AttentionShape
    from tests.unit.analyze.test_sparsity_stats import SAMPLE, SCALE, D, build

    arch = AttentionShape(2, 2, 2, D, "float32")
    dist = LengthDistribution.from_lengths([40, 100, 256, 300])
    acc = None
    if head_stats:
        acc = HeadStatsAccumulator(2, 2, 1, sinks_grid=(0, 4), window_grid=(8, 16, 32, 64))
        for layer, kinds in enumerate([[["block"], ["sink"]], [["block"], ["needle"]]]):
            q, k = build(kinds)
            head_rows.update(acc, layer, q, k, SCALE, sample=SAMPLE)
    return export_summary(recommend(dist, arch, acc))


@pytest.mark.slow
@pytest.mark.parametrize("head_stats", [True, False])
def test_window_advice_validates_and_round_trips(head_stats: bool) -> None:
    adv = _advice(head_stats)
    assert isinstance(adv, WindowAdvice)
    assert (adv.per_layer is not None) == head_stats
    doc = json.loads(json.dumps(adv.to_json()))
    assert doc["schema_version"] == "attnprof.window_advice/1.2"
    _validate(doc, "window_advice.schema.json")
    assert WindowAdvice.from_json(doc) == adv
    # Field names of the bounded view that dashboards and exporters read are unchanged.
    assert {"sinks", "window", "layers", "attention_flop_saving", "kv_memory_saving",
            "exact_request_fraction", "heads_at_risk_count", "basis", "traffic", "replay",
            "safe", "summary", "per_layer"} <= set(doc)


@pytest.mark.slow
def test_advice_samples_read_the_wire_form() -> None:
    from attnprof.exporters.samples import advice_samples

    got = {s.name for s in advice_samples("m", _advice(True).to_json())}
    assert {"attnprof_window_sinks_tokens", "attnprof_head_coverage_ratio",
            "attnprof_head_class_heads"} <= got
    assert advice_samples("m", AdviceUnavailable("no requests yet").to_json()) == []


def _snapshot(advice: WindowAdvice | AdviceUnavailable | None) -> Snapshot:
    from attnprof.contracts.snapshot import QuantileSummary, WorkerSnapshot

    lay = LayerProfile(name="model.layers.0.self_attn.attn", index=0, backend="CPU_ATTN",
                       impl="CPUAttentionBackendImpl", num_heads=4, num_kv_heads=2,
                       head_size=16, head_size_v=16, sliding_window=None, dtype="bfloat16",
                       kv_cache_dtype="auto", fused=True,
                       phases={"prefill": PhaseStats(calls=3, time_s=0.01, tokens=96)})
    q = QuantileSummary(p50=40.0, p90=250.0, p99=300.0, mean=120.0, max=300.0, count=4)
    req = RequestStats(requests=4, max_model_len=2048, context_tokens=q, prompt_tokens=q,
                       generation_tokens=QuantileSummary())
    return Snapshot(time=1.7e9, model="tiny", enabled=True,
                    workers=[WorkerSnapshot(pid=1, layers=[lay])], requests=req,
                    window_advice=advice)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["advice", "unavailable", "none"])
def test_snapshot_with_each_advice_state(kind: str) -> None:
    advice = {"advice": _advice(True), "unavailable": AdviceUnavailable("no requests yet"),
              "none": None}[kind]
    snap = _snapshot(advice)
    doc = json.loads(json.dumps(snap.to_json()))
    _validate(doc, "snapshot.schema.json")
    _validate(doc["workers"][0]["layers"][0], "layer_profile.schema.json")
    _validate(doc["requests"], "request_stats.schema.json")
    if kind == "unavailable":
        assert doc["window_advice"] == {"error": "no requests yet"}  # wire form as before
    if kind == "advice":
        assert doc["window_advice"]["schema_version"] == "attnprof.window_advice/1.2"
    back = Snapshot.from_json(doc)
    assert back == snap
    assert type(back.window_advice) is type(advice)


def test_snapshot_written_by_version_1_0_endpoint_reads() -> None:
    doc = _snapshot(AdviceUnavailable("x")).to_json()
    doc["schema_version"] = "attnprof.snapshot/1"
    assert Snapshot.from_json(doc).window_advice == AdviceUnavailable("x")


def test_layer_profile_and_request_stats_round_trip() -> None:
    snap = _snapshot(None)
    lay = snap.workers[0].layers[0]
    assert LayerProfile.from_json(json.loads(json.dumps(lay.to_json()))) == lay
    assert snap.requests is not None
    assert RequestStats.from_json(snap.requests.to_json()) == snap.requests


def test_nested_document_of_another_major_is_refused() -> None:
    doc = _snapshot(_advice(False)).to_json()
    doc["window_advice"]["schema_version"] = "attnprof.window_advice/2.0"
    with pytest.raises(ContractError) as err:
        Snapshot.from_json(doc)
    _one_line(err, "attnprof.window_advice version 2 is not supported")


# ----- profile.json -----
_REASON = {"code": "mask", "backend": "flash", "message": "explicit mask"}
# A profile.json of the oldest fields (1.0): a reader of 1.x still reads it.
PROFILE_1_0: dict[str, Any] = {
    "schema_version": "attnprof.profile/1.0",
    "model": {"name": "tiny", "path": "/tmp/ckpt", "architecture": "Qwen2ForCausalLM",
              "attn_implementation": "eager", "dtype": "float32", "static_bytes": 123456,
              "num_layers": 2, "num_heads": 4, "num_kv_heads": 2, "head_dim": 16,
              "vocab_size": 100, "layer_types": ["full_attention", "sliding_attention"],
              "sliding_window": 16},
    "environment": {"attnprof": "0.1.0", "python": "3.11.7", "torch": "2.13.0+cpu",
                    "transformers": "4.57.0", "vllm": None,
                    "device": {"type": "cpu", "threads": 2, "cpu": "x86_64",
                               "cpu_flags": ["avx2"]},
                    "git_revision": None, "platform": "Linux"},
    "run": {"seq_lens": [32, 64], "batch_size": 1, "repeats": 1,
            "memory_budget_bytes": 67108864, "paths": ["flash_cpu", "math", "eager"],
            "inputs": "random token ids (no text)", "wall_s": 12.5},
    "layers": [{
        "layer": i, "backend": "eager", "kernels": ["eager"], "fused": False,
        "reasons": [_REASON], "sliding_window": [None, 16][i],
        "layer_type": ["full_attention", "sliding_attention"][i],
        "shape_classes": [{"phase": "prefill", "mask": "none", "length_bucket": 32,
                           "kernel": "eager", "fused": False, "tags": {"padded": False}}],
        "timing": {"calls": 4, "total_s": 0.002, "median_s_by_seq_len": {"32": 0.0004}},
        "memory": {"kv_cache_bytes_per_token": 256, "kv_cache_bytes_per_token_per_kv_head": 128,
                   "kv_cache_bytes_per_token_per_query_head": 64,
                   "attention_peak": [{"seq_len": 32, "measured_peak_bytes": 20480,
                                       "analytic_peak_bytes": 20000,
                                       "analytic_score_bytes": 16384, "rel_error": 0.024}]},
    } for i in range(2)],
    "activation_map": [{"layer_idx": 0, "impl": "eager", "phase": "prefill", "mask": "none",
                        "length_bucket": 32, "dtype": "float32", "kernel": "eager",
                        "fused": False, "reasons": [_REASON], "sdpa_args": None,
                        "ops": ["aten::matmul", "aten::softmax"], "calls": 2,
                        "time_s": 0.001, "tags": {"padded": False}, "device": "cpu"}],
    "scaling": {
        "by_seq_len": [{"seq_len": L, "batch_size": 1, "forward_s": 0.01 * L,
                        "attention_s": 0.001 * L, "peak_extra_bytes": 1000 * L,
                        "peak_total_bytes": 123456 + 1000 * L,
                        "kv_cache_bytes_measured": 512 * L,
                        "kv_cache_bytes_analytic": 512 * L} for L in (32, 64)],
        "paths": {"math": {"time_s": {"32": 0.001, "64": 0.003},
                           "peak_bytes": {"32": 40960.0, "64": 163840.0},
                           "analytic_peak_bytes": {"32": 40000, "64": 160000},
                           "skipped": {},
                           "time_fit": {"a": 0.0, "b": 0.0, "c": 7e-7, "r2": 1.0},
                           "memory_fit": {"a": 0.0, "b": 0.0, "c": 40.0, "r2": 1.0},
                           "analytic_vs_measured_max_rel_error": 0.024}},
        "fits": {"model_peak_total_bytes": {"a": 123456.0, "b": 1000.0, "c": 0.0, "r2": 1.0}},
    },
    "oom_prediction": {"memory_budget_bytes": 67108864, "batch_size": 1, "static_bytes": 123456,
                       "method": "fit", "max_seq_len": 66985,
                       "predicted_peak_bytes_at_max": 67108000.0,
                       "max_batch_by_seq_len": {"32": 2093, "64": 1046},
                       "if_attention_path": {"math": {"max_seq_len": 1200}},
                       "validation": {"planned": False, "estimated_forward_s": 670.0,
                                      "skipped": "disabled (--no-validate)"},
                       "extrapolation_factor": 1046.64},
    "advice": [{"reason": "eager", "message": "eager attention", "kernel": "eager",
                "layers": [0, 1], "change": "use sdpa", "target": "flash_cpu",
                "expected_gain": {"at_seq_len": 64, "source": "measured per-path benchmark",
                                  "speedup": 3.1, "attention_peak_bytes_saved": 100000,
                                  "memory_ratio": 8.0}}],
    "errors": [],
    "window_advice": {"sinks": 4, "window": 64, "layers": [0], "attention_flop_saving": 0.5,
                      "kv_memory_saving": 0.4, "exact_request_fraction": 0.75,
                      "heads_at_risk_count": None, "basis": "traffic only",
                      "traffic": {"requests": 7.0, "p50": 100, "p90": 900, "p99": 900,
                                  "max": 900},
                      "replay": None, "safe": False, "summary": "your traffic: ...",
                      "per_layer": None},
    "outputs": {"profile": "profile.json", "trace": "trace.json", "plot": "scaling.png"},
}


def test_profile_1_0_reads_and_rewrites_valid() -> None:
    rep = ProfileReport.from_json(copy.deepcopy(PROFILE_1_0))
    assert rep.model.num_kv_heads == 2 and rep.layers[1].sliding_window == 16
    assert rep.window_advice is not None and rep.window_advice.window == 64
    assert rep.oom_prediction.validation is not None
    assert rep.oom_prediction.validation.skipped == "disabled (--no-validate)"
    doc = json.loads(json.dumps(rep.to_json()))
    assert doc["schema_version"] == "attnprof.profile/1.3"
    _validate(doc, "profile.schema.json")
    _validate(PROFILE_1_0, "profile.schema.json")  # a 1.0 file still validates
    assert ProfileReport.from_json(doc) == rep


def test_newer_minor_with_unknown_fields_reads() -> None:
    doc = copy.deepcopy(PROFILE_1_0) | {"schema_version": "attnprof.profile/1.9",
                                           "something_new": {"x": 1}}
    assert ProfileReport.from_json(doc).model.name == "tiny"


@pytest.mark.parametrize(("tag", "needle"), [
    ("attnprof.profile/2.0", "attnprof.profile version 2 is not supported"),
    (2, "is not of the form 'kind/major.minor'"),
    (1, "is not of the form 'kind/major.minor'"),  # no reader of pre-1.0 integer tags
    ("attnprof.snapshot/1.2", "this is a attnprof.snapshot document, not attnprof.profile"),
    ("attnprof.profile/x", "has no numeric version"),
])
def test_wrong_version_or_kind_is_one_line(tag: Any, needle: str) -> None:
    doc = copy.deepcopy(PROFILE_1_0) | {"schema_version": tag}
    with pytest.raises(ContractError) as err:
        ProfileReport.from_json(doc)
    _one_line(err, needle)


def test_snapshot_given_to_the_profile_reader() -> None:
    with pytest.raises(ContractError) as err:
        ProfileReport.from_json(_snapshot(None).to_json())
    _one_line(err, "attnprof.snapshot document, not attnprof.profile")
    with pytest.raises(ContractError) as err:
        ProfileReport.from_json([1, 2])
    _one_line(err, "expected a JSON object")
    with pytest.raises(ContractError) as err:
        ProfileReport.from_json({"model": {}})
    _one_line(err, "no schema_version")


@pytest.mark.parametrize(("path", "value", "needle"), [
    (("layers", 1, "fused"), "yes", "layers[1].fused: expected true/false, got 'yes'"),
    (("model", "num_layers"), "2", "model.num_layers: expected an integer"),
    (("scaling", "paths", "math", "time_s", "32"), "fast",
     "scaling.paths.math.time_s.32: expected a number"),
    (("environment", "device", "type"), "tpu", "environment.device.type: 'tpu' is not one of"),
    (("window_advice", "traffic"), [1], "window_advice.traffic: expected an object"),
])
def test_wrong_field_type_names_the_field(path: tuple[Any, ...], value: Any,
                                          needle: str) -> None:
    doc = copy.deepcopy(PROFILE_1_0)
    node: Any = doc
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    with pytest.raises(ContractError) as err:
        ProfileReport.from_json(doc)
    _one_line(err, "attnprof.profile: ", needle)


def test_missing_field_is_named() -> None:
    doc = copy.deepcopy(PROFILE_1_0)
    del doc["oom_prediction"]["batch_size"]
    with pytest.raises(ContractError) as err:
        ProfileReport.from_json(doc)
    _one_line(err, "missing field 'batch_size' at oom_prediction")


def test_profile_show_reads_through_the_contract(tmp_path: Path, capsys: Any) -> None:
    from attnprof.cli import main

    good = tmp_path / "profile.json"
    good.write_text(json.dumps(PROFILE_1_0))
    assert main(["profile", "--show", str(good)]) == 0
    out = capsys.readouterr().out
    assert "OOM prediction" in out and "Window advice: your traffic" in out
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(PROFILE_1_0 | {"schema_version": "attnprof.profile/2.0"}))
    assert main(["profile", "--show", str(bad)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("attnprof: error: ")
    assert "attnprof.profile version 2 is not supported" in err[0]


# ----- base edge cases -----
@dataclass
class _Edge(Record):
    pair: tuple[int, str]
    flag: Literal[1, "full"]
    by_len: dict[int, float] = field(default_factory=dict)
    ratio: float = 0.0
    maybe: float | None = None


@dataclass
class _EdgeDoc(Document):
    KIND = "attnprof.test_edge"
    VERSION = (3, 0)

    edge: _Edge


def test_edge_types_round_trip_and_validate() -> None:
    doc = _EdgeDoc(_Edge(pair=(1, "a"), flag="full", by_len={16: 0.5}, ratio=math.nan,
                         maybe=math.inf))
    data = json.loads(json.dumps(doc.to_json(), allow_nan=False))  # NaN/Inf are null
    assert data["edge"] == {"pair": [1, "a"], "flag": "full", "by_len": {"16": 0.5},
                            "ratio": None, "maybe": None}
    jsonschema.Draft202012Validator(json_schema(_EdgeDoc)).validate(data)
    back = _EdgeDoc.from_json(data)
    assert back.edge.pair == (1, "a") and back.edge.by_len == {16: 0.5}
    assert math.isnan(back.edge.ratio) and back.edge.maybe is None


@pytest.mark.parametrize(("value", "needle"), [
    ({"pair": [1], "flag": 1}, "pair: expected 2 items, got 1"),
    ({"pair": [1, "a", 2], "flag": 1}, "pair: expected 2 items, got 3"),
    ({"pair": [1, "a"], "flag": True}, "flag: True is not one of 1, 'full'"),
    ({"pair": [1, "a"], "flag": 1, "by_len": {"x": 1.0}}, "key 'x' is not an integer"),
    ({"pair": [1, "a"], "flag": 1, "ratio": "1"}, "ratio: expected a number"),
])
def test_edge_type_errors(value: dict[str, Any], needle: str) -> None:
    with pytest.raises(ContractError) as err:
        decode(_Edge, value)
    _one_line(err, needle)



@pytest.mark.parametrize(("body", "needle"), [
    ({"schema_version": "attnprof.snapshot/2.0"}, "attnprof.snapshot version 2 is not supported"),
    ({"schema_version": "attnprof.profile/1.1"}, "this is a attnprof.profile document"),
    ([], "expected a JSON object"),
])
def test_snapshot_cli_refuses_other_documents(monkeypatch: pytest.MonkeyPatch, body: Any,
                                              needle: str) -> None:
    from attnprof.cli._common import CliError
    from attnprof.cli.snapshot import fetch_snapshot
    from attnprof.tools import http

    monkeypatch.setattr(http, "get", lambda url, **kw: json.dumps(body).encode())
    with pytest.raises(CliError) as err:
        fetch_snapshot("http://127.0.0.1:1")
    assert "\n" not in str(err.value) and needle in str(err.value)
    one_oh = {"schema_version": "attnprof.snapshot/1", "time": 0, "model": "m", "enabled": True}
    monkeypatch.setattr(http, "get", lambda url, **kw: json.dumps(one_oh).encode())
    assert fetch_snapshot("http://127.0.0.1:1")["schema_version"] == "attnprof.snapshot/1"


# ----- the cost report -----
def test_report_evidence_is_a_kind_and_the_schema_says_which() -> None:
    from attnprof.contracts.report import Report
    from tests.report_sample import sample_report

    doc = sample_report().to_json()
    _validate(doc, "report.schema.json")
    assert Report.from_json(doc).to_json() == doc
    whatif = json.loads((SCHEMA_DIR / "report.schema.json").read_text())["$defs"]["WhatIf"]
    assert whatif["properties"]["evidence"]["enum"] == ["measured", "replay", "estimated"]
    # Version 1's free text ("replay: 99.5% ...") is refused: its text is evidence_detail.
    doc["models"][0]["what_ifs"][0]["evidence"] = "replay: 99.6% token agreement"
    with pytest.raises(ContractError) as err:
        Report.from_json(doc)
    _one_line(err, "attnprof.report: ", "evidence: 'replay: 99.6% token agreement' is not "
              "one of")
    with pytest.raises(jsonschema.ValidationError):
        _validate(doc, "report.schema.json")
