"""``attnprof report --url`` on a real vLLM server, and the same report from its saved
snapshot: the numbers are the server's own, and the files come out whole."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from attnprof.tools.http import post_json
from tests.conftest import TINY_API_KEY, counted_snapshot, get_snapshot
from tests.report_sample import load_page

pytestmark = [pytest.mark.vllm, pytest.mark.chromium]


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "attnprof.cli", *args], capture_output=True,
                          text=True, timeout=180)


def test_live_report_reads_the_servers_own_numbers(tiny_server: Any, tmp_path: Path) -> None:
    before = get_snapshot(tiny_server.base_url)["requests"]["requests"]
    for n in (1, 4, 9):
        post_json(tiny_server.base_url + "/v1/completions",
                       {"model": "tiny", "prompt": "the model request " * n, "max_tokens": 3,
                        "temperature": 0})
    # once the stat logger counted all three (it counts a little after the answers)
    snap = counted_snapshot(tiny_server.base_url, before + 3)
    out = tmp_path / "live"
    t0 = time.monotonic()
    r = _cli("report", "--url", tiny_server.base_url, "--api-key", TINY_API_KEY,
             "--out", str(out))
    print(f"report from a live server: {time.monotonic() - t0:.1f} s")
    assert r.returncode == 0, r.stderr
    assert f"Cost report: {out / 'report.html'}" in r.stdout
    doc = json.loads((out / "report.json").read_text())
    assert doc["source"]["kind"] == "live" and doc["source"]["where"] == [tiny_server.base_url]
    (m,) = doc["models"]
    req = snap["requests"]
    # The stat logger may finish another test's request between the two reads: never fewer.
    assert m["traffic"]["requests"] >= req["requests"] >= before + 3
    assert m["traffic"]["max_model_len"] == req["max_model_len"] == 512
    assert sum(m["traffic"]["context"]["counts"]) == m["traffic"]["requests"]
    kv = snap["requests"]["kv_pressure"]
    assert m["kv"]["bytes_per_token"] == pytest.approx(sum(lay["bytes_per_token"]
                                                          for lay in kv["layers"]))
    assert m["kv"]["kv_dtype"] == kv["kv_dtype"]
    assert len(m["time"]["per_layer"]) == len(snap["workers"][0]["layers"]) == 2
    # No price: GPU-hours, never a currency.
    assert m["money"]["cost_per_mtok"] is None and m["money"]["monthly_gpu_hours"] == 730.0
    html = (out / "report.html").read_text()
    assert "GPU-hours" in html and "$" not in "".join(m["savings"])
    # The real report, as a person sees it: no console error, no request but the page.
    page = load_page(out / "report.html")
    assert page.console_errors == [] and page.failed_requests == [] and page.requests == []
    assert page.png is not None and page.height > 1500
    # Privacy: no prompt text reaches any of the three files.
    for name in ("report.html", "report.md", "report.json"):
        assert "the model request" not in (out / name).read_text()

    # The same server's snapshot saved to a file gives the same traffic.
    saved = tmp_path / "snap.json"
    r = _cli("snapshot", "--url", tiny_server.base_url, "--api-key", TINY_API_KEY, "--json")
    assert r.returncode == 0, r.stderr
    saved.write_text(r.stdout)
    r = _cli("report", str(saved), "--out", str(tmp_path / "files"), "--replicas", "3")
    assert r.returncode == 0, r.stderr
    fdoc = json.loads((tmp_path / "files" / "report.json").read_text())
    assert fdoc["source"]["kind"] == "files"
    assert fdoc["models"][0]["traffic"]["requests"] == json.loads(saved.read_text())[
        "requests"]["requests"]
    assert fdoc["models"][0]["money"]["replicas"] == 3

    # What the window advice stands on: the saved snapshot's coverage, bucket by bucket,
    # prefill and decode side by side, with the traffic's KV block-seconds per bucket.
    snap_saved = json.loads(saved.read_text())
    cov, basis = snap_saved["coverage"], fdoc["models"][0]["advice_basis"]
    assert cov is not None and basis["available"], basis
    print("what the advice stands on:", basis["stands_on"])
    rows = {(r["phase"], r["bucket"]): r for r in cov["buckets"]}
    assert [b["bucket"] for b in basis["buckets"]] == sorted({lo for _, lo in rows})
    assert any(b["prefill"] and b["prefill"]["folded_requests"] for b in basis["buckets"])
    cb = snap_saved["requests"]["context_buckets"]
    for b in basis["buckets"]:
        for phase in ("prefill", "decode"):
            r, got = rows.get((phase, b["bucket"])), b[phase]
            assert (got is None) == (r is None), (phase, b)
            if r is not None:
                assert (got["folded_requests"], got["traffic_queries"], got["query_share"],
                        b["traffic_requests"]) == (r["folded_requests"], r["traffic_queries"],
                                                   r["query_share"], r["traffic_requests"])
        assert b["kv_block_seconds"] == cb["kv_block_seconds"][cb["edges"].index(b["bucket"])]
    adv = snap_saved["window_advice"]
    if "error" not in adv and adv.get("coverage"):
        c = adv["coverage"]
        assert f"stands on {c['folded_requests']} of {c['traffic_requests']} requests" in \
            basis["stands_on"], basis["stands_on"]
    md = (tmp_path / "files" / "report.md").read_text()
    assert "### What the window advice stands on" in md and basis["stands_on"] in md


def test_live_report_refuses_a_wrong_key_and_writes_nothing(tiny_server: Any,
                                                            tmp_path: Path) -> None:
    out = tmp_path / "never"
    r = _cli("report", "--url", tiny_server.base_url, "--api-key", "wrong", "--out", str(out))
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "API key" in r.stderr
    assert not out.exists()
