"""The report's "memory held at the peak" query on a real Prometheus, over two replicas whose
KV peaks do not coincide: history written with promtool's backfill (no vLLM needed), so the
answer is known exactly and is not 0 (the live fleet test's short requests leave usage at 0
at every scrape)."""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import pytest

from attnprof.tools.report_queries import by_name, render
from tests.conftest import PrometheusServer, free_port

pytestmark = [pytest.mark.prometheus, pytest.mark.slow]

STEP_S = 15
CAPACITY = 1000  # tokens per replica
# Replica a peaks at 80% at step 5, replica b at 60% at step 15; otherwise 10% and 20%.
USAGE = {"a": {5: 0.8}, "b": {15: 0.6}}
BASE = {"a": 0.1, "b": 0.2}
STEPS = 20


def _openmetrics(t0: int) -> str:
    lines = ["# TYPE attnprof_kv_cache_usage_ratio gauge"]
    for inst in ("a", "b"):
        for k in range(STEPS):
            lines.append(f'attnprof_kv_cache_usage_ratio{{model="m",instance="{inst}"}} '
                         f"{USAGE[inst].get(k, BASE[inst])} {t0 + k * STEP_S}")
    lines.append("# TYPE attnprof_kv_capacity_tokens gauge")
    for inst in ("a", "b"):
        for k in range(STEPS):
            lines.append(f'attnprof_kv_capacity_tokens{{model="m",instance="{inst}"}} '
                         f"{CAPACITY} {t0 + k * STEP_S}")
    return "\n".join(lines) + "\n# EOF\n"


def test_memory_held_at_the_peak_is_the_fleets_sum_at_its_busiest_instant(tmp_path: Path
                                                                         ) -> None:
    t0 = int(time.time()) - 3 * 3600  # older than the head block: loaded as history
    src = tmp_path / "history.om"
    src.write_text(_openmetrics(t0))
    data = tmp_path / "prom" / "data"
    data.mkdir(parents=True)
    subprocess.run(["promtool", "tsdb", "create-blocks-from", "openmetrics", str(src),
                    str(data)], check=True, capture_output=True, timeout=120)
    prom = PrometheusServer([f"127.0.0.1:{free_port()}"], tmp_path / "prom")
    try:
        end = t0 + (STEPS - 1) * STEP_S + 1
        sel = 'model="m"'

        def at_end(name: str) -> float:
            expr = render(by_name(name), sel=sel, r=f"{STEPS * STEP_S}s")
            (row,) = prom.wait_for(expr, timeout=120, at=end)
            return float(row["value"][1])  # type: ignore[index]

        held = at_end("kv_held_peak_tokens")
        peak = at_end("kv_usage_peak")
    finally:
        prom.stop()
    # The sum at each instant: 0.8 x 1000 + 0.2 x 1000 at step 5 is the busiest; the old
    # bound, the busiest replica's peak x both capacities, would read 0.8 x 2000.
    assert held == pytest.approx(1000.0), json.dumps({"held": held, "peak": peak})
    assert peak == pytest.approx(0.8)
    assert held < peak * 2 * CAPACITY
