"""The terminal (``attnprof snapshot``, the demo's summary) and the cost report print the
same KV figures for the same snapshot: the aggregate's peak and p95, never the last gauge."""

from __future__ import annotations

import json
from typing import Any

from attnprof.analyze.cost_inputs import kv_memory
from attnprof.contracts.snapshot import Snapshot
from attnprof.exporters.terminal import render_snapshot
from tests.golden import DEMO


def _snap() -> dict[str, Any]:
    snap: dict[str, Any] = json.loads(DEMO.read_text())["snapshot"]
    assert snap["requests"] is not None and snap["kv_pressure"] is not None
    return snap


def test_the_terminal_prints_no_stale_last_usage() -> None:
    snap = _snap()
    snap["requests"]["kv_cache_usage"] = 0.0  # idle: the gauge's last value
    snap["kv_pressure"]["peak"], snap["kv_pressure"]["p95"] = 0.625, 0.5
    text = render_snapshot(snap)
    assert "usage (last)" not in text
    assert "62.5%" in text and "50.0%" in text
    kv = kv_memory(Snapshot.from_json(snap))
    assert (kv.usage_peak, kv.usage_p95) == (0.625, 0.5)


def test_a_measured_zero_peak_is_the_reports_peak_too() -> None:
    snap = _snap()
    snap["kv_pressure"]["peak"] = 0.0
    snap["requests"]["kv_pressure"]["peak"] = 0.3
    # The terminal prints the aggregate's 0.0%; the report used to fall back to 30%.
    assert "0.0%" in render_snapshot(snap).split("KV cache:")[1]
    assert kv_memory(Snapshot.from_json(snap)).usage_peak == 0.0
