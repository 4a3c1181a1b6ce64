"""grafana/: the dashboard, the alert rules and the report's recording rules query only catalog
metrics, pass dashboard-lint rules, are valid PromQL (checked by promtool), and both rule files
pass their promtool tests."""

from __future__ import annotations

import copy
import importlib.util
import json
import re
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import yaml

from attnprof.exporters.catalog import CATALOG
from attnprof.tools import report_queries as rq

REPO = Path(__file__).resolve().parents[3]
GRAFANA = REPO / "grafana"
DASHBOARD = GRAFANA / "dashboards" / "attnprof.json"
RULES = GRAFANA / "alerts" / "attnprof-rules.yaml"
RULE_TESTS = GRAFANA / "alerts" / "attnprof-rules.test.yaml"
REC_RULES = GRAFANA / "recording" / "attnprof-report-rules.yaml"
REC_TESTS = GRAFANA / "recording" / "attnprof-report-rules.test.yaml"
DS_UID = "${datasource}"
# The alerts grafana/alerts/attnprof-rules.yaml defines, in its order (grafana/README.md
# documents each): a rule lost or renamed fails the tests, not only a wrong one.
EXPECTED_ALERTS = (
    "AttnProfFusedKernelFallback", "AttnProfCaptureBlind", "AttnProfSampleRateThrottled",
    "AttnProfInternalErrors", "AttnProfCaptureDisabled", "AttnProfPluginMissing",
    "AttnProfKVCacheHigh", "AttnProfKVBound", "AttnProfKVPreemptions",
    "AttnProfContextLongTail",
)

_KINDS = {m.name: m.kind for m in CATALOG}
_KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "and", "or",
             "unless", "bool", "offset", "inf", "nan"}
_IDENT = re.compile(r"[A-Za-z_:][A-Za-z0-9_:]*")


# --- helpers ------------------------------------------------------------------------------

def promtool() -> str:
    path = shutil.which("promtool")
    if path is None:
        pytest.fail("promtool not found on PATH: run `make setup` (installs Debian's prometheus "
                    "package) or `apt-get install prometheus`")
    return path


def run_promtool(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([promtool(), *args], capture_output=True, text=True, timeout=60,
                          cwd=cwd)


def load_generator() -> ModuleType:
    sp = importlib.util.spec_from_file_location("attnprof_grafana_generate",
                                                GRAFANA / "generate.py")
    assert sp is not None and sp.loader is not None
    mod = importlib.util.module_from_spec(sp)
    sp.loader.exec_module(mod)
    return mod


def dashboard() -> dict[str, Any]:
    data: dict[str, Any] = json.loads(DASHBOARD.read_text())
    return data


def panels(dash: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """All panels, including those nested in collapsed rows."""
    for p in dash["panels"]:
        yield p
        yield from p.get("panels", [])


def query_panels(dash: dict[str, Any]) -> list[dict[str, Any]]:
    return [p for p in panels(dash) if p["type"] != "row"]


def dashboard_exprs(dash: dict[str, Any]) -> list[tuple[str, str]]:
    """(where, expr) for every panel target."""
    return [(f"panel {p['id']} {p['title']!r} target {t.get('refId')!r}", t["expr"])
            for p in query_panels(dash) for t in p["targets"]]


def alert_rules() -> list[dict[str, Any]]:
    doc = yaml.safe_load(RULES.read_text())
    return [r for g in doc["groups"] for r in g["rules"]]


def recording_rules() -> list[dict[str, Any]]:
    doc = yaml.safe_load(REC_RULES.read_text())
    return [r for g in doc["groups"] for r in g["rules"]]


def metric_names(expr: str) -> set[str]:
    """Metric names a PromQL expression selects (no parser: strip strings, label matchers,
    ranges and grouping clauses, then drop function calls, keywords and numbers)."""
    s = re.sub(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'', '""', expr)
    s = re.sub(r"\{[^}]*\}", " ", s)
    s = re.sub(r"\[[^\]]*\]", " ", s)
    s = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", s)
    names = set()
    for m in _IDENT.finditer(s):
        word, rest = m.group(0), s[m.end():]
        if word.lower() in _KEYWORDS or rest.lstrip().startswith("("):
            continue
        if m.start() > 0 and (s[m.start() - 1].isdigit() or s[m.start() - 1] in ".$"):
            continue  # the "e" of 1e3, or a leftover $variable
        names.add(word)
    return names


def not_in_catalog(expr: str) -> set[str]:
    """Names in ``expr`` that the catalog lacks (histogram series map to their family)."""
    bad = set()
    for name in metric_names(expr):
        if name in _KINDS:
            if _KINDS[name] == "histogram":
                bad.add(name)  # a histogram family is queried as _bucket/_count/_sum
            continue
        base = re.sub(r"_(bucket|count|sum)$", "", name)
        if base == name or _KINDS.get(base) != "histogram":
            bad.add(name)
    return bad


def substitute(expr: str) -> str:
    """Grafana macros and variables -> plain PromQL (as Grafana would send it)."""
    expr = expr.replace("${datasource}", "").replace("$datasource", "")
    expr = re.sub(r"\$__rate_interval\b|\$\{__rate_interval\}", "5m", expr)
    expr = re.sub(r"\$__range\b|\$\{__range\}", "1h", expr)
    expr = re.sub(r"\$__interval\b|\$\{__interval\}", "1m", expr)
    expr = re.sub(r"\$\{?model\}?", "x", expr)
    assert "$" not in expr, f"unsubstituted variable in {expr!r}"
    return expr


# --- (a) every queried metric exists in the catalog ----------------------------------------

def test_name_check_bites() -> None:
    assert metric_names('sum by (le) (rate(attnprof_request_context_tokens_bucket'
                        '{model=~"$model"}[$__rate_interval]))') == {
        "attnprof_request_context_tokens_bucket"}
    assert not_in_catalog("rate(attnprof_internal_errors[5m]) > 0") == {"attnprof_internal_errors"}
    assert not_in_catalog("rate(vllm:num_preemptions[5m])") == {"vllm:num_preemptions"}
    assert not_in_catalog("attnprof_request_context_tokens") == {"attnprof_request_context_tokens"}
    assert not_in_catalog("attnprof_kv_cache_bytes_bucket") == {"attnprof_kv_cache_bytes_bucket"}
    assert not_in_catalog('absent(attnprof_plugin_processes{role="worker"}) or '
                          "sum(attnprof_kv_cache_usage_ratio) == 0") == set()


def test_dashboard_metrics_exist_in_catalog() -> None:
    dash = dashboard()
    seen: set[str] = set()
    for where, expr in dashboard_exprs(dash):
        names = metric_names(expr)
        assert names, f"{where}: no metric in {expr!r}"
        assert not not_in_catalog(expr), f"{where}: not in catalog: {not_in_catalog(expr)}"
        seen |= names
    for var in dash["templating"]["list"]:
        q = var.get("query")
        text = q.get("query", "") if isinstance(q, dict) else str(q or "")
        for name in re.findall(r"label_values\(\s*([A-Za-z_:][A-Za-z0-9_:]*)", text):
            assert name in _KINDS, f"variable {var['name']}: {name} not in catalog"
    assert "attnprof_layer_info" in seen


def check_alert_metrics(rules: list[dict[str, Any]]) -> None:
    assert [r["alert"] for r in rules] == list(EXPECTED_ALERTS)
    for rule in rules:
        assert metric_names(rule["expr"]), rule["alert"]
        assert not not_in_catalog(rule["expr"]), (rule["alert"], not_in_catalog(rule["expr"]))


def test_alert_metrics_exist_in_catalog() -> None:
    check_alert_metrics(alert_rules())


def test_recording_rule_metrics_exist_in_catalog() -> None:
    rules = recording_rules()
    assert rules
    for rule in rules:
        assert metric_names(rule["expr"]), rule["record"]
        assert not not_in_catalog(rule["expr"]), (rule["record"], not_in_catalog(rule["expr"]))


# --- (b) dashboard lint --------------------------------------------------------------------

def test_committed_dashboard_is_generator_output() -> None:
    assert DASHBOARD.read_text() == load_generator().render(), (
        "grafana/dashboards/attnprof.json is stale: run python grafana/generate.py")


def test_dashboard_shape_and_variables() -> None:
    dash = dashboard()
    assert dash["schemaVersion"] >= 39
    assert dash["uid"] and dash["title"]
    variables = {v["name"]: v for v in dash["templating"]["list"]}
    ds = variables["datasource"]
    assert ds["type"] == "datasource" and ds["query"] == "prometheus"
    model = variables["model"]
    assert model["type"] == "query"
    assert model["datasource"]["uid"] == DS_UID
    assert model["query"]["query"] == "label_values(attnprof_layer_info, model)"


def test_panel_ids_unique_and_layout_on_grid() -> None:
    ps = list(panels(dashboard()))
    ids = [p["id"] for p in ps]
    assert all(isinstance(i, int) and i > 0 for i in ids)
    assert len(ids) == len(set(ids)), "duplicate panel ids"
    titles = [p["title"] for p in ps]
    assert all(titles) and len(titles) == len(set(titles))
    for p in ps:
        g = p["gridPos"]
        assert g["x"] >= 0 and g["x"] + g["w"] <= 24 and g["h"] > 0, p["title"]


def test_targets_refids_datasource_units() -> None:
    for p in query_panels(dashboard()):
        assert p["datasource"] == {"type": "prometheus", "uid": DS_UID}, p["title"]
        assert p["fieldConfig"]["defaults"].get("unit"), f"{p['title']}: no unit"
        assert p["targets"], p["title"]
        refs = [t.get("refId") for t in p["targets"]]
        assert all(refs) and len(refs) == len(set(refs)), f"{p['title']}: refIds {refs}"
        for t in p["targets"]:
            assert t["datasource"] == {"type": "prometheus", "uid": DS_UID}, p["title"]
            assert t["expr"].strip(), p["title"]


def test_rates_use_rate_interval_and_divisions_guard_zero() -> None:
    # The Cost row shows the report's own expressions verbatim (the dashboard must show the
    # report's number), so their zero handling is report_queries.py's, not this lint's.
    reported = {rq.render(q, sel='model=~"$model"', r="$__rate_interval") for q in rq.QUERIES}
    for where, expr in dashboard_exprs(dashboard()):
        for rng in re.findall(r"\[([^\]]*)\]", expr):
            assert rng == "$__rate_interval", f"{where}: range [{rng}], use $__rate_interval"
        if re.search(r"\b(rate|irate|increase)\(", expr):
            assert "[$__rate_interval]" in expr, where
        assert "$__interval" not in expr, where
        for rest in re.split(r"\s/\s", expr)[1:]:
            if expr in reported:
                break
            assert rest.startswith("(") and "> 0)" in rest, f"{where}: use a / (b > 0)"
        if "attnprof_plugin_processes" not in expr:  # the one metric without a model label
            assert 'model=~"$model"' in expr, f"{where}: not filtered by $model"


# --- (c) every dashboard expr is valid PromQL -------------------------------------------------

@pytest.mark.slow
def test_dashboard_exprs_are_valid_promql(tmp_path: Path) -> None:
    exprs = dashboard_exprs(dashboard())
    rules = [{"record": f"attnprof_grafana_check:expr_{i}", "expr": substitute(e)}
             for i, (_, e) in enumerate(exprs)]
    f = tmp_path / "dashboard-exprs.yaml"
    f.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    r = run_promtool("check", "rules", str(f))
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"SUCCESS: {len(rules)} rules found" in r.stdout


def test_promql_check_bites(tmp_path: Path) -> None:
    f = tmp_path / "bad.yaml"
    f.write_text(yaml.safe_dump({"groups": [{"name": "g", "rules": [
        {"record": "x:y", "expr": substitute("sum by (le) (rate(attnprof_steps_total[5m])")}]}]}))
    assert run_promtool("check", "rules", str(f)).returncode != 0


# --- (d) alert rules: promtool check + unit tests ----------------------------------------------

def test_alert_rules_are_the_documented_ones() -> None:
    assert [r["alert"] for r in alert_rules()] == list(EXPECTED_ALERTS)
    documented = re.findall(r"^\| `(AttnProf\w+)` \|", (GRAFANA / "README.md").read_text(),
                            re.M)
    assert sorted(documented) == sorted(EXPECTED_ALERTS)


def test_alert_rules_check() -> None:
    r = run_promtool("check", "rules", str(RULES))
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"SUCCESS: {len(EXPECTED_ALERTS)} rules found" in r.stdout, r.stdout


def check_alert_shape(rules: list[dict[str, Any]], tested: dict[str, Any]) -> None:
    names = [r["alert"] for r in rules]
    assert names == list(EXPECTED_ALERTS)
    fired: set[str] = set()
    silent: set[str] = set()
    for t in tested["tests"]:
        for case in t.get("alert_rule_test", []):
            (fired if case.get("exp_alerts") else silent).add(case["alertname"])
    for r in rules:
        assert r["alert"].startswith("AttnProf"), r["alert"]
        assert r["labels"]["severity"] in {"critical", "warning", "info"}, r["alert"]
        assert r["annotations"]["summary"] and r["annotations"]["description"], r["alert"]
        assert "{{" in r["annotations"]["summary"], f"{r['alert']}: summary not templated"
        assert r["alert"] in fired, f"{r['alert']}: no promtool test where it fires"
        assert r["alert"] in silent, f"{r['alert']}: no promtool test where it stays silent"


def test_alert_rules_shape() -> None:
    check_alert_shape(alert_rules(), yaml.safe_load(RULE_TESTS.read_text()))


def test_alert_checks_bite() -> None:
    """The checks above fail on no rules, a missing rule, a renamed one, an untemplated
    summary and a rule no promtool test fires."""
    rules, tested = alert_rules(), yaml.safe_load(RULE_TESTS.read_text())
    renamed = copy.deepcopy(rules)
    renamed[0]["alert"] = "AttnProfSomethingElse"
    flat = copy.deepcopy(rules)
    flat[1]["annotations"]["summary"] = "no template"
    for bad in ([], rules[1:], renamed):
        with pytest.raises(AssertionError):
            check_alert_metrics(bad)
        with pytest.raises(AssertionError):
            check_alert_shape(bad, tested)
    with pytest.raises(AssertionError):
        check_alert_shape(flat, tested)
    untested = {"tests": [dict(t, alert_rule_test=[c for c in t.get("alert_rule_test", [])
                                                   if c["alertname"] != EXPECTED_ALERTS[2]])
                          for t in tested["tests"]]}
    with pytest.raises(AssertionError, match=EXPECTED_ALERTS[2]):
        check_alert_shape(rules, untested)


@pytest.mark.slow
def test_alert_rules_unit_tests() -> None:
    r = run_promtool("test", "rules", RULE_TESTS.name, cwd=RULE_TESTS.parent)
    assert r.returncode == 0, r.stdout + r.stderr


def test_cost_row_is_the_report_queries() -> None:
    """The Cost row runs the report's own queries (raw, so it needs no recording rules)."""
    dash = dashboard()
    by_title = {p["title"]: p for p in panels(dash)}
    assert by_title["Cost"]["type"] == "row"

    def raw(name: str) -> str:
        return rq.render(rq.by_name(name), sel='model=~"$model"', r="$__rate_interval")

    assert [t["expr"] for t in by_title["GPU-hours per million tokens"]["targets"]] == [
        raw("gpu_hours_per_mtok")]
    assert [t["expr"] for t in by_title["KV-bound vs compute-bound"]["targets"]] == [
        raw("kv_verdict")]
    assert [t["expr"] for t in by_title["Window savings"]["targets"]] == [
        raw("window_flop_saving"), raw("window_kv_saving")]


# --- (e) recording rules for attnprof report ---------------------------------------------------

def test_committed_recording_rules_are_generator_output() -> None:
    assert REC_RULES.read_text() == load_generator().render_rules(), (
        "grafana/recording/attnprof-report-rules.yaml is stale: run python grafana/generate.py")


def test_recording_rules_are_the_recorded_report_queries() -> None:
    doc = yaml.safe_load(REC_RULES.read_text())
    assert [(g["name"], g["interval"]) for g in doc["groups"]] == [("attnprof-report", "1m")]
    want = [(q.record, rq.render(q, sel="", r="5m", vsel="")) for q in rq.QUERIES if q.record]
    assert len(want) >= 8
    assert [(r["record"], r["expr"]) for r in recording_rules()] == want


def test_generator_check_detects_stale_files(tmp_path: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    gen = load_generator()
    assert gen.main(["--check"]) == 0
    rules = tmp_path / "rules.yaml"
    monkeypatch.setattr(gen, "OUT", tmp_path / "attnprof.json")
    monkeypatch.setattr(gen, "RULES_OUT", rules)
    assert gen.main([]) == 0 and gen.main(["--check"]) == 0
    rules.write_text(rules.read_text().replace("5m", "10m"))
    assert gen.main(["--check"]) == 1


def test_recording_rules_check() -> None:
    r = run_promtool("check", "rules", str(REC_RULES))
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"SUCCESS: {len(recording_rules())} rules found" in r.stdout


def test_recording_rules_unit_tests() -> None:
    r = run_promtool("test", "rules", REC_TESTS.name, cwd=REC_TESTS.parent)
    assert r.returncode == 0, r.stdout + r.stderr
    tested = {case["expr"] for t in yaml.safe_load(REC_TESTS.read_text())["tests"]
              for case in t.get("promql_expr_test", [])}
    untested = {r["record"] for r in recording_rules()} - tested
    assert not untested, f"recording rules without a promtool test: {sorted(untested)}"


@pytest.mark.slow
def test_recording_rule_tests_bite(tmp_path: Path) -> None:
    """Plausible wrong aggregations make the committed rule tests fail."""
    tests = tmp_path / REC_TESTS.name
    shutil.copy(REC_TESTS, tests)
    mutations = [
        ('attnprof_plugin_processes{role="worker"}', "attnprof_plugin_processes{}"),
        ("max by (model) (sum by (model, instance) (attnprof_kv_bytes_per_token{}))",
         "sum by (model) (attnprof_kv_bytes_per_token{})"),
        ("max by (model, verdict) (attnprof_kv_verdict{}) == 1",
         "max by (model, verdict) (attnprof_kv_verdict{})"),
        ("count by (model) (count by (model, instance) (",
         "count by (model) (count by (model, job) ("),
        ("/ (sum by (model, phase) (rate(attnprof_step_time_seconds_total",
         "/ (max by (model, phase) (rate(attnprof_step_time_seconds_total"),
        ("[5m]", "[1m]"),
    ]
    for old, new in mutations:
        text = REC_RULES.read_text()
        assert old in text, old
        (tmp_path / REC_RULES.name).write_text(text.replace(old, new))
        r = run_promtool("test", "rules", tests.name, cwd=tmp_path)
        assert r.returncode != 0, f"recording rule tests still pass with {new!r}"


@pytest.mark.slow
def test_alert_unit_tests_bite(tmp_path: Path) -> None:
    """A wrong threshold, or a counter queried without _total (vLLM's public alert bug), makes
    the committed rule tests fail."""
    tests = tmp_path / RULE_TESTS.name
    shutil.copy(RULE_TESTS, tests)
    mutations = [
        ("attnprof_kv_cache_usage_ratio > 0.95", "attnprof_kv_cache_usage_ratio > 0.99"),
        ("rate(attnprof_internal_errors_total[5m])", "rate(attnprof_internal_errors[5m])"),
    ]
    for old, new in mutations:
        text = RULES.read_text()
        assert old in text
        (tmp_path / RULES.name).write_text(text.replace(old, new))
        r = run_promtool("test", "rules", tests.name, cwd=tmp_path)
        assert r.returncode != 0, f"rule tests still pass with {new!r}"
    # No rules at all: every test that expects an alert fails.
    (tmp_path / RULES.name).write_text("groups: []\n")
    r = run_promtool("test", "rules", tests.name, cwd=tmp_path)
    assert r.returncode != 0, "rule tests pass with an empty rules file"
