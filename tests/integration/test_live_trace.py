"""A live trace of the shared tiny vLLM server (sample rate 1, API key) under traffic, through
the real CLI: N steps per worker, each with its 2 layer ranges nested inside, counters, no
prompt text; the route refuses a request without the key."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from attnprof.exporters.chrome_trace import check_trace
from attnprof.tools.http import post_json
from tests.conftest import TINY_API_KEY

pytestmark = [pytest.mark.vllm, pytest.mark.slow]
CANARY = "zebracanary"


def _traffic(base: str, stop: threading.Event) -> None:
    while not stop.is_set():
        post_json(base + "/v1/completions",
                       {"model": "tiny", "prompt": f"{CANARY} the quick request " * 4,
                        "max_tokens": 16, "ignore_eos": True, "temperature": 0.0}, timeout=60)


def test_trace_route_needs_the_key(tiny_server: Any) -> None:
    req = urllib.request.Request(tiny_server.base_url + "/attnprof/trace?steps=2")
    with pytest.raises(urllib.error.HTTPError) as info:
        urllib.request.urlopen(req, timeout=30)
    assert info.value.code == 401


def test_live_trace_of_the_tiny_server_under_traffic(tiny_server: Any, tmp_path: Path) -> None:
    base = tiny_server.base_url
    stop = threading.Event()
    threads = [threading.Thread(target=_traffic, args=(base, stop), daemon=True)
               for _ in range(2)]
    for t in threads:
        t.start()
    out = tmp_path / "trace.json"
    try:
        time.sleep(0.5)  # traffic flowing before the trace is armed
        t0 = time.monotonic()
        r = subprocess.run([sys.executable, "-m", "attnprof.cli", "trace", "--url", base,
                            "--steps", "8", "--timeout", "60", "--api-key", TINY_API_KEY,
                            "--out", str(out)], capture_output=True, text=True, timeout=180)
        wall = time.monotonic() - t0
    finally:
        stop.set()
        for t in threads:
            t.join(60)
    assert r.returncode == 0, r.stderr[-2000:]
    text = out.read_text()
    doc = json.loads(text)
    assert check_trace(doc) == []
    info = doc["otherData"]["attnprof"]
    assert info["complete"] and not info["timed_out"], info
    (pid, n), = info["steps_per_worker"].items()  # one worker
    assert n == 8
    ev = [e for e in doc["traceEvents"] if e.get("pid") == int(pid)]
    steps = [e for e in ev if e.get("cat") == "step"]
    layers = [e for e in ev if e.get("cat") == "attention"]
    assert len(steps) == 8
    for st in steps:
        inside = [e for e in layers if st["ts"] <= e["ts"]
                  and e["ts"] + e["dur"] <= st["ts"] + st["dur"] and e["tid"] == st["tid"]]
        assert sorted(e["args"]["layer"] for e in inside) == [0, 1], st
        assert {e["args"]["backend"] for e in inside} == {"CPU_ATTN"}
        assert st["args"]["tokens"] > 0 and st["args"]["max_seq_len"] > 0
    names = {e["args"]["name"] for e in doc["traceEvents"] if e["name"] == "process_name"}
    assert "vLLM API server" in names and any("Worker" in n for n in names), names
    counters = {e["name"] for e in doc["traceEvents"] if e["ph"] == "C"}
    assert {"KV cache usage", "effective sample rate"} <= counters
    assert CANARY not in text and "prompt" not in text and "request_id" not in text
    print(f"\ntrace of 8 steps: {wall:.2f} s wall via the CLI, {len(text)} bytes")
    assert "wrote" in r.stdout and "8 steps" in r.stdout
