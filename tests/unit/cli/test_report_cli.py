"""``attnprof report`` on a saved demo.json: the flags that choose the money basis and the
replica count reach the document, and what it prints says which basis ranked the savings."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from attnprof.cli import main
from tests.golden import DEMO


def _demo(tmp_path: Path) -> Path:
    """The golden demo with 100 s under its counters: the golden file is normalised to one
    instant (server start = snapshot time), which has no rate."""
    doc = json.loads(DEMO.read_text())
    for p in doc["snapshot"]["processes"]:
        p["started_at"] = doc["snapshot"]["time"] - 100.0
    path = tmp_path / "demo.json"
    path.write_text(json.dumps(doc))
    return path


def _report(tmp_path: Path, capsys: Any, *flags: str) -> tuple[dict[str, Any], str]:
    out = tmp_path / "out"
    assert main(["report", str(_demo(tmp_path)), "--out", str(out), *flags]) == 0
    return json.loads((out / "report.json").read_text()), capsys.readouterr().out


def test_replicas_multiply_one_servers_token_rate(tmp_path: Path, capsys: Any) -> None:
    doc, printed = _report(tmp_path, capsys, "--replicas", "8")
    (m,) = doc["models"]
    t = m["traffic"]
    assert t["scope"] == "replica" and m["money"]["replicas"] == 8
    # GPU-hours per 1M tokens = GPUs per replica / (one replica's tok/s x 3600) x 10^6:
    # the same as with one replica, not 8 times it.
    gpr = m["money"]["gpus_per_replica"]
    assert m["money"]["gpu_hours_per_mtok"] == pytest.approx(
        gpr / (t["tokens_per_s"] * 3600) * 1e6)
    one, _ = _report(tmp_path, capsys)
    assert one["models"][0]["money"]["gpu_hours_per_mtok"] == pytest.approx(
        m["money"]["gpu_hours_per_mtok"])
    md = (tmp_path / "out" / "report.md").read_text()
    assert "tok/s (one replica's)" in md
    assert m["ranked_by"] == "fixed_fleet"
    if m["savings"]:
        assert "ranked by what a fixed fleet saves" in printed


def test_autoscaled_flag_ranks_by_the_autoscaled_figure(tmp_path: Path, capsys: Any) -> None:
    doc, printed = _report(tmp_path, capsys, "--autoscaled", "--mean-replicas", "1")
    (m,) = doc["models"]
    assert m["ranked_by"] == "autoscaled"
    assert m["money"]["mean_replicas"] == 1.0
    autos = [w["autoscaled"]["monthly_gpu_hours_saved"] for w in m["what_ifs"]
             if w["autoscaled"] and w["autoscaled"]["monthly_gpu_hours_saved"] > 0]
    assert len(m["savings"]) == len(autos)
    if m["savings"]:
        assert "ranked by what an autoscaled fleet saves" in printed
        assert all("at a fixed fleet" in s and "autoscaled" in s for s in m["savings"])
