"""``attnprof serve`` never leaves vLLM behind, however the wrapper dies, and never takes a
foreign server on its port for vLLM.

Measured on vLLM 0.32: after a SIGKILL of the API server, EngineCore and its worker keep
running. So the tests walk /proc for the wrapper's whole process tree (and every process of its
process groups) and require all of it gone, and the port free, within a bounded time."""

from __future__ import annotations

import contextlib
import http.server
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.conftest import free_port

LINUX = sys.platform == "linux"
needs_proc = pytest.mark.skipif(not LINUX, reason="walks /proc")

# The cheapest real start: eager, smallest context and KV cache (as the other server tests).
VLLM_ARGS = ["--max-model-len", "128", "--kv-cache-memory-bytes", str(16 << 20),
             "--no-enable-prefix-caching"]
GONE_WITHIN_S = 90.0
"""A hang bound, not a speed goal: VllmServer.stop() alone may wait 20 s + 10 s, and a
loaded CI machine schedules late. How long it took is recorded (``kill_to_gone_s``)."""


def _stat(pid: int) -> list[str] | None:
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return text[text.rfind(")") + 2:].split()


def _all_stats() -> dict[int, list[str]]:
    out = {}
    for d in os.listdir("/proc"):
        if d.isdigit() and (st := _stat(int(d))) is not None:
            out[int(d)] = st
    return out


def _tree(root: int) -> dict[tuple[int, str], str]:
    """(pid, start time) -> cmdline of ``root``'s descendants and of every process sharing a
    process group with one of them (orphans re-parented to init keep their group)."""
    stats = _all_stats()
    kids: dict[int, list[int]] = {}
    for pid, st in stats.items():
        kids.setdefault(int(st[1]), []).append(pid)
    found, todo = set(), [root]
    while todo:
        pid = todo.pop()
        found.add(pid)
        todo += kids.get(pid, [])
    groups = {int(stats[p][2]) for p in found if p in stats} - {os.getpgrp()}
    found |= {pid for pid, st in stats.items() if int(st[2]) in groups}
    found.discard(root)
    out = {}
    for pid in found:
        if pid in stats:
            with contextlib.suppress(OSError):
                cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
                out[(pid, stats[pid][19])] = cmd.strip()
    return out


def _running(procs: dict[tuple[int, str], str]) -> dict[tuple[int, str], str]:
    """Those still running: same pid and start time, not a zombie (a zombie runs no code and
    holds no port; init reaps orphans)."""
    left = {}
    for (pid, start), cmd in procs.items():
        st = _stat(pid)
        if st is not None and st[19] == start and st[0] not in "ZX":
            left[(pid, start)] = cmd
    return left


def _port_free(port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _kill_all(procs: dict[tuple[int, str], str]) -> None:
    """Test hygiene: a failing test must not leave vLLM running."""
    for pid, _ in _running(procs):
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)


def _wait_gone(procs: dict[tuple[int, str], str], port: int | None, limit: float) -> float:
    t0 = time.monotonic()
    while _running(procs) or (port is not None and not _port_free(port)):
        if time.monotonic() - t0 > limit:
            left = _running(procs)
            _kill_all(procs)
            raise AssertionError(f"still running {limit:.0f} s after the wrapper died "
                                 f"(port free: {port is None or _port_free(port)}): "
                                 f"{sorted(left.values())}")
        time.sleep(0.1)
    return time.monotonic() - t0


# --- port checks (fast, no vLLM) ---------------------------------------------------------

@pytest.mark.parametrize("foreign_host", ["127.0.0.1", "0.0.0.0"])
def test_port_in_use_is_one_line_before_vllm_starts(tmp_path: Path, foreign_host: str) -> None:
    (tmp_path / "config.json").write_text("{}")  # passes model resolution; vLLM never sees it
    with socket.socket() as taken:
        taken.bind((foreign_host, 0))
        taken.listen()
        port = taken.getsockname()[1]
        r = subprocess.run([sys.executable, "-m", "attnprof.cli", "serve", "--model",
                            str(tmp_path), "--port", str(port)],
                           capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, (r.returncode, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert lines == [f"attnprof: error: port {port} on 127.0.0.1 is already in use (another "
                     f"server is listening there); stop it or pick another --port"], r.stderr
    # that one line is all: no "attnprof: starting vLLM" (the check came before any start)


class _Foreign(http.server.BaseHTTPRequestHandler):
    """Answers 200 to everything, with the body a vLLM /v1/models would have."""

    body = json.dumps({"object": "list", "data": [{"id": "tiny"}]}).encode()

    def do_GET(self) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(self.body)))
        self.end_headers()
        self.wfile.write(self.body)

    def log_message(self, *args: object) -> None:
        pass


@contextlib.contextmanager
def _foreign_server(body: bytes | None = None) -> Iterator[str]:
    handler = type("H", (_Foreign,), {"body": body}) if body is not None else _Foreign
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    try:
        yield f"http://127.0.0.1:{srv.server_address[1]}"
    finally:
        srv.shutdown()
        srv.server_close()


@contextlib.contextmanager
def _other_group() -> Iterator[int]:
    """A live process group that is not ours (stands for the vLLM we started)."""
    p = subprocess.Popen(["sleep", "60"], start_new_session=True)
    try:
        yield p.pid
    finally:
        p.kill()
        p.wait()


def test_foreign_http_server_is_not_taken_for_vllm() -> None:
    from attnprof.tools.server import is_our_vllm

    with _foreign_server() as url, _other_group() as pgid:
        if LINUX:  # the listener belongs to this test process, not to the vLLM group
            assert not is_our_vllm(url, "tiny", pgid)
        assert is_our_vllm(url, "tiny", os.getpgrp())  # the check can pass: it is ours
        assert not is_our_vllm(url, "another-model", os.getpgrp())
    with _foreign_server(b"OK") as url:  # 200 everywhere, but no model list
        assert not is_our_vllm(url, None, os.getpgrp())
    assert not is_our_vllm(f"http://127.0.0.1:{free_port()}", None, None)  # nobody there


class _Guarded(_Foreign):
    """/v1 wants a bearer token, as vLLM with --api-key."""

    def do_GET(self) -> None:
        if self.path.startswith("/v1") and self.headers.get("Authorization") != "Bearer k":
            self.send_response(401)
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        super().do_GET()


def test_api_key_guarded_models_list() -> None:
    from attnprof.tools.server import is_our_vllm

    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Guarded)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{srv.server_address[1]}"
    try:
        assert is_our_vllm(url, "tiny", os.getpgrp(), api_key="k")
        assert not is_our_vllm(url, "other", os.getpgrp(), api_key="k")
        if LINUX:  # without the key, only the listener's owner can vouch for it
            assert is_our_vllm(url, "tiny", os.getpgrp())
            with _other_group() as pgid:
                assert not is_our_vllm(url, "tiny", pgid)
                assert not is_our_vllm(url, "tiny", pgid, api_key="k")
    finally:
        srv.shutdown()
        srv.server_close()


def test_wait_ready_never_returns_for_a_foreign_server() -> None:
    from attnprof.tools.server import ServerError, VllmServer

    class Stub(VllmServer):
        def command(self) -> list[str]:  # a "vLLM" that never listens
            return [sys.executable, "-c", "import time; time.sleep(60)"]

    with _foreign_server() as url:
        srv = Stub("m", port=int(url.rsplit(":", 1)[1]), served_name="tiny")
        srv.start()
        try:
            with pytest.raises(ServerError, match="not ready"):
                srv.wait_ready(timeout=3)
        finally:
            srv.stop()


def test_wait_ready_ends_early_when_asked_to_stop() -> None:
    from attnprof.tools.server import StopRequested, VllmServer

    class Stub(VllmServer):
        def command(self) -> list[str]:  # a "vLLM" that never listens
            return [sys.executable, "-c", "import time; time.sleep(60)"]

    asked = threading.Event()
    srv = Stub("m", port=free_port(), served_name="tiny")
    srv.start()
    try:
        threading.Timer(0.3, asked.set).start()
        t0 = time.monotonic()
        with pytest.raises(StopRequested):
            srv.wait_ready(timeout=60, stop=asked.is_set)
        assert time.monotonic() - t0 < 60  # ended by the flag, not by the timeout
    finally:
        srv.stop()


# --- process lifecycle with a stand-in tree (fast, no vLLM) ------------------------------

# Like vLLM: the API server spawns a child it does not stop on its own death (EngineCore).
# With ignore_term the child shrugs off SIGTERM, so only the SIGKILL escalation ends it.
_TREE = """\
import subprocess, sys, time
subprocess.Popen([sys.executable, '-c', 'import signal, sys, time\\n'
                  'if sys.argv[1] == "1": signal.signal(signal.SIGTERM, signal.SIG_IGN)\\n'
                  'print("child up", flush=True)\\n'
                  'time.sleep(600)', sys.argv[1]])
time.sleep(600)
"""

_OWNER = """\
import sys, time
from attnprof.tools.server import VllmServer

class Stand(VllmServer):
    kill_grace_s = 1.0
    def command(self):
        return [sys.executable, '-c', sys.argv[1], sys.argv[2]]

s = Stand('m', port=1)
s.start()
print(s.proc.pid, s.watchdog.pid, s._tmp, flush=True)
time.sleep(600)
"""


def _start_owner(ignore_term: bool) -> tuple[subprocess.Popen[str], int, int, Path]:
    owner = subprocess.Popen([sys.executable, "-c", _OWNER, _TREE, "1" if ignore_term else "0"],
                             stdout=subprocess.PIPE, text=True)
    assert owner.stdout is not None
    # the stand-in's child shares the owner's stdout: its "child up" may come first
    line = owner.stdout.readline().split()
    while line == ["child", "up"]:
        line = owner.stdout.readline().split()
    api, watchdog, tmp = line
    deadline = time.monotonic() + 30
    while len(_running(_tree(owner.pid))) < 3:  # API stand-in, its child, the watchdog
        assert time.monotonic() < deadline, _tree(owner.pid)
        time.sleep(0.05)
    return owner, int(api), int(watchdog), Path(tmp)


@needs_proc
@pytest.mark.parametrize("ignore_term", [False, True], ids=["child-obeys-term",
                                                            "child-ignores-term"])
def test_owner_sigkill_watchdog_ends_the_whole_group(
        ignore_term: bool, record_property: Callable[[str, object], None]) -> None:
    owner, _, _, tmp = _start_owner(ignore_term)
    procs = _tree(owner.pid)
    assert tmp.is_dir()
    owner.kill()
    owner.wait()
    # A hang bound (grace 1 s + polling; a loaded CI machine schedules late), not a speed
    # goal. With ignore_term the child shrugs off SIGTERM: its being gone at all proves the
    # SIGKILL escalation (the stand-in tree would otherwise sleep 600 s).
    took = _wait_gone(procs, None, 60.0)
    record_property("owner_kill_to_gone_s", round(took, 2))
    assert not tmp.exists()  # the run directory (metrics files) goes too


@needs_proc
def test_owner_and_watchdog_sigkilled_api_server_gets_parent_death_signal() -> None:
    owner, api, watchdog, _ = _start_owner(False)
    procs = _tree(owner.pid)
    os.kill(watchdog, signal.SIGKILL)
    owner.kill()
    owner.wait()
    api_proc = {k: v for k, v in procs.items() if k[0] == api}
    assert api_proc
    _wait_gone(api_proc, None, 60.0)  # PR_SET_PDEATHSIG; the real API server takes EngineCore
    _kill_all(procs)


# --- the real thing: attnprof serve on a tiny model, one vLLM start per case -------------

def _serve_until_ready(model: Path, port: int, log: Path) -> subprocess.Popen[bytes]:
    with log.open("wb") as out:
        wrapper = subprocess.Popen([sys.executable, "-m", "attnprof.cli", "serve", "--model",
                                    str(model), "--port", str(port), "--eager", "--",
                                    *VLLM_ARGS],
                                   stdout=out, stderr=subprocess.STDOUT,
                                   stdin=subprocess.DEVNULL)
    deadline = time.monotonic() + 300
    while "attnprof: ready in" not in log.read_text(errors="replace"):
        if wrapper.poll() is not None or time.monotonic() > deadline:
            _kill_all(_tree(wrapper.pid))
            wrapper.kill()
            tail = "\n".join(log.read_text(errors="replace").splitlines()[-15:])
            pytest.fail(f"attnprof serve did not get ready:\n{tail}")
        time.sleep(0.5)
    return wrapper


@pytest.mark.vllm
@pytest.mark.slow
@needs_proc
def test_serve_stopped_while_starting_leaves_no_vllm_behind(tiny_model: Path,
                                                            tmp_path: Path) -> None:
    """SIGTERM while vLLM is still loading: the wrapper stops it and exits 0 (the stop is a
    flag the ready-wait reads, so it cannot be lost the way a raised exception can)."""
    port = free_port()
    log = tmp_path / "serve.log"
    with log.open("wb") as out:
        wrapper = subprocess.Popen([sys.executable, "-m", "attnprof.cli", "serve", "--model",
                                    str(tiny_model), "--port", str(port), "--eager", "--",
                                    *VLLM_ARGS], stdout=out, stderr=subprocess.STDOUT,
                                   stdin=subprocess.DEVNULL)
    procs: dict[tuple[int, str], str] = {}
    try:
        deadline = time.monotonic() + 120
        # vLLM's API server has been spawned (its group is more than the wrapper) and is
        # not ready yet.
        while len(procs := _tree(wrapper.pid)) < 2 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert len(procs) >= 2 and "attnprof: ready in" not in log.read_text()
        os.kill(wrapper.pid, signal.SIGTERM)
        rc = wrapper.wait(GONE_WITHIN_S + 30)
        _wait_gone(_tree(wrapper.pid) | procs, port, GONE_WITHIN_S)
        text = log.read_text(errors="replace")
        assert rc == 0 and "attnprof: stopping vLLM" in text, text[-2000:]
    finally:
        _kill_all(procs)
        if wrapper.poll() is None:
            wrapper.kill()


@pytest.mark.vllm
@pytest.mark.slow
@needs_proc
@pytest.mark.parametrize("how", ["SIGTERM", "SIGINT", "SIGKILL", "SIGKILL+watchdog"])
def test_serve_leaves_no_vllm_behind(how: str, tiny_model: Path, tmp_path: Path,
                                     record_property: Callable[[str, object], None]) -> None:
    port = free_port()
    log = tmp_path / "serve.log"
    wrapper = _serve_until_ready(tiny_model, port, log)
    procs = _tree(wrapper.pid)
    try:
        names = " | ".join(procs.values())
        assert "VLLM::EngineCore" in names and "VLLM::Worker" in names, names
        assert not _port_free(port)
        if how == "SIGKILL+watchdog":  # the parent-death signal alone must do it
            for (pid, _), cmd in procs.items():
                if "select.select" in cmd:  # the watchdog's inline source
                    os.kill(pid, signal.SIGKILL)
        t0 = time.monotonic()
        os.kill(wrapper.pid, getattr(signal, how.split("+")[0]))
        rc = wrapper.wait(GONE_WITHIN_S)
        _wait_gone(procs, port, GONE_WITHIN_S)
        took = time.monotonic() - t0
        record_property("kill_to_gone_s", round(took, 2))
        print(f"{how}: every vLLM process gone and port free {took:.2f} s after the signal")
        if how in ("SIGTERM", "SIGINT"):
            assert rc == 0 and "attnprof: stopping vLLM" in log.read_text(), rc
        else:
            assert rc == -signal.SIGKILL
    finally:
        _kill_all(procs)
        if wrapper.poll() is None:
            wrapper.kill()
