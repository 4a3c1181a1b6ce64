"""``attnprof demo`` (what ``make demo`` runs) ends with the cost report: report.html next to
its JSON, its path and the biggest savings printed; the saved demo.json gives the same report
through ``attnprof report FILE``."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import free_port

pytestmark = [pytest.mark.vllm]


def test_demo_ends_with_the_cost_report(tiny_model: Path, tmp_path: Path) -> None:
    out = tmp_path / "out" / "demo.json"
    r = subprocess.run(
        [sys.executable, "-m", "attnprof.cli", "demo", "--model", str(tiny_model), "--port",
         str(free_port()), "--out", str(out), "--chats", "0", "--doc-lengths", "60,120,200,300,400",
         "--max-model-len", "512", "--no-replay", "--gpu-hour-price", "3"],
        capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    html = out.parent / "report.html"
    assert f"Cost report: {html}" in r.stdout
    # (No chats: the tiny tokenizer has no chat template.) The savings printed are the
    # report's own, biggest first, at most three.
    printed = re.findall(r"^  \d\. \[[^\]]+\] (.+)$", r.stdout, re.M)
    doc = json.loads((out.parent / "report.json").read_text())
    (m,) = doc["models"]
    assert printed == m["savings"][:3] and printed, r.stdout
    assert all("/month" in line and "$" in line for line in printed)
    assert m["traffic"]["requests"] == 5
    assert html.stat().st_size > 5000 and (out.parent / "report.md").exists()
    # The demo's saved JSON is a report source too, with the same traffic.
    again = tmp_path / "again"
    r2 = subprocess.run([sys.executable, "-m", "attnprof.cli", "report", str(out), "--out",
                         str(again)], capture_output=True, text=True, timeout=120)
    assert r2.returncode == 0, r2.stderr
    doc2 = json.loads((again / "report.json").read_text())
    assert doc2["models"][0]["traffic"]["requests"] == 5
    assert doc2["models"][0]["money"]["cost_per_mtok"] is None  # no price given this time
