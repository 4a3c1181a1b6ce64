"""``attnprof suggest-window --url`` on a live server's stratified statistics: weighted to
the server's per-bucket traffic, and "need more traffic" when a heavy bucket cannot decide."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.bearer_server import BearerJsonServer
from tests.unit.exporters.test_coverage_metrics import CONFIG, thin_snapshot

pytestmark = pytest.mark.slow  # starts a process


def test_suggest_url_reads_strata_and_says_what_it_stands_on(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(CONFIG))
    snap = thin_snapshot()
    srv = BearerJsonServer("k3y", lambda _n: snap)
    try:
        r = subprocess.run([sys.executable, "-m", "attnprof.cli", "suggest-window", "--url",
                            srv.url, "--model", str(tmp_path), "--json"],
                           capture_output=True, text=True, timeout=120,
                           env={**os.environ, "ATTNPROF_API_KEY": "k3y"})
    finally:
        srv.stop()
    assert r.returncode == 0, r.stderr[-2000:]
    out = json.loads(r.stdout)
    assert out["coverage"]["need_more_traffic_above"] == 1024
    assert out["coverage"]["corrected"] and out["coverage"]["traffic_requests"] == 20
    assert out["layers"] == []
