"""Every panel of the committed Grafana dashboard shows data from a real Prometheus scraping a
real vLLM server (tests/unit/exporters/test_grafana.py only proves the queries parse and name
catalog metrics; a panel can parse and still never match a series)."""

from __future__ import annotations

import json
import re
import time
from typing import Any

import pytest

from attnprof.tools.http import post_json
from tests.conftest import REPO, get_snapshot

pytestmark = [pytest.mark.vllm, pytest.mark.prometheus]

DASHBOARD = REPO / "grafana" / "dashboards" / "attnprof.json"
# $__rate_interval: holds both rounds of traffic and the scrapes before them (1 s interval),
# and outlasts the test, so rates cannot decay to zero while the panels are polled.
RATE_INTERVAL = "5m"
# Prompts of different lengths (3 tokens per "the model request "): the longer ones pass
# ATTNPROF_HEAD_STATS_MIN_TOKENS (32), so head statistics and the window advice have prefills
# to learn from, and the longest (~240) has queries past sinks + 128, the smallest window of
# the coverage grid (the worst-head coverage panel has no value before that).
PROMPTS = ["the model", "the model request " * 4, "the model request " * 16,
           "the model request " * 80]

# Panels that cannot have data on the tiny server (title -> why). Keep this minimal: a panel
# that should have data and has none is a bug, not an exemption.
NO_DATA: dict[str, str] = {
    "Layers not on a fused kernel": "every layer of the tiny model runs CPU_ATTN, which is "
                                    "fused: the panel is meant to be empty",
    "Attention utilisation of the probed peaks": "roofline: needs ATTNPROF_PROBE=1, off on "
                                                 "the tiny server",
    "Arithmetic intensity by phase": "roofline: needs ATTNPROF_PROBE=1",
    "Probed peak bandwidth": "roofline: needs ATTNPROF_PROBE=1",
    "Probed matmul peak": "roofline: needs ATTNPROF_PROBE=1",
    "Internal errors by place": "a series appears only once attnprof has an internal error",
    "Dropped samples by reason": "a series appears only once a sample is dropped",
}


def panel_targets(dash: dict[str, Any]) -> list[tuple[str, str, str]]:
    """(panel title, refId, expr) of every target, rows' nested panels included."""
    out = []
    for p in dash["panels"]:
        for q in [p, *p.get("panels", [])]:
            out += [(q["title"], t["refId"], t["expr"]) for t in q.get("targets", [])]
    return out


def substitute(expr: str, model_re: str) -> str:
    """Grafana's variables as Grafana would fill them for one selected model."""
    expr = expr.replace("$__rate_interval", RATE_INTERVAL).replace("$model", model_re)
    left = re.findall(r"\$\{?\w+", expr)
    assert not left, f"unhandled dashboard variable(s) {left} in {expr!r}"
    return expr


def complete(base_url: str) -> None:
    for prompt in PROMPTS:
        post_json(base_url + "/v1/completions",
                       {"model": "tiny", "prompt": prompt, "max_tokens": 4, "temperature": 0})


def scraped(prometheus: Any, base_url: str) -> None:
    """Wait until Prometheus holds every finished request and every step the worker has
    seen so far, and the KV tracker's counters exist (each exporter flushes on its own 1 s
    timer). Waiting for the steps, not for any step series: a round's last decode steps
    reach the worker's export a flush after its first, and a panel read before that flush
    was scraped has only one value per decode series (no rate)."""
    snap = get_snapshot(base_url)
    n = snap["requests"]["requests"]
    seen = max(w["sampler"]["seen"] for w in snap["workers"])
    # Generous timeouts: only a loaded 2-core CI box comes near them.
    prometheus.wait_for(f"sum(attnprof_request_context_tokens_count) >= {n}", timeout=120)
    prometheus.wait_for(f"sum(attnprof_steps_total) >= {seen}", timeout=120)
    prometheus.wait_for("sum(attnprof_kv_cache_busy_seconds_total) > 0", timeout=120)


def evidence(prometheus: Any, base_url: str, exprs: list[str]) -> str:
    """What a failure needs to be understood afterwards: each empty panel's raw series over
    the range (values only, last 8 scrapes) and the server's own error counts."""
    lines = []
    for name in sorted({m for e in exprs for m in re.findall(r"attnprof_\w+", e)}):
        for r in prometheus.query(f"{name}[{RATE_INTERVAL}]")[:6]:
            vals = [v[1] for v in r["values"]][-8:]  # type: ignore[index]
            lines.append(f"  {name} {r['metric']}: {vals}")
    snap = get_snapshot(base_url)
    lines.append(f"  errors: {snap.get('errors')}")
    lines += [f"  worker {w['pid']}: errors {w.get('errors')}, sampler {w['sampler']}"
              for w in snap["workers"]]
    return "\n".join(lines)


def test_every_dashboard_panel_has_data(tiny_server: Any, prometheus: Any) -> None:
    dash = json.loads(DASHBOARD.read_text())
    targets = panel_targets(dash)
    titles = {title for title, _, _ in targets}
    assert not set(NO_DATA) - titles, f"exempted panels gone: {set(NO_DATA) - titles}"

    base = tiny_server.base_url
    prometheus.wait_for('up{job="vllm"} == 1')
    # Round 1 creates every series and gets scraped; round 2 then moves every counter, so
    # each rate has a sample before and after an increase inside its range.
    complete(base)
    scraped(prometheus, base)
    complete(base)
    # The tiny server runs no advice loop (ATTNPROF_ADVICE_INTERVAL_S=0): a snapshot
    # computes the window advice the window panels show.
    get_snapshot(base)
    scraped(prometheus, base)

    # $model as the dashboard's variable lists it: label_values(attnprof_layer_info, model).
    models = {r["metric"]["model"]
              for r in prometheus.wait_for("count by (model) (attnprof_layer_info)")}
    assert len(models) == 1, models
    model_re = re.escape(models.pop())

    # Exporters flush independently: poll each panel until it has data, up to one deadline.
    deadline = time.monotonic() + 90
    empty = []
    for title, ref, expr in targets:
        q = substitute(expr, model_re)
        if title in NO_DATA:
            prometheus.query(q)  # must still run (status success), data or not
            continue
        try:
            # A panel after a slow one still gets a few polls, not a single query.
            prometheus.wait_for(q, timeout=max(10.0, deadline - time.monotonic()))
        except AssertionError:
            empty.append(f"{title!r} {ref}: {q}")
    assert not empty, ("panels without data:\n" + "\n".join(empty) + "\n"
                       + evidence(prometheus, base, empty))
