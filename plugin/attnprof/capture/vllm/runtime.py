"""Per-process attnprof state inside vLLM, created once by :func:`start`."""

from __future__ import annotations

import atexit
import json
import logging
import multiprocessing
import os
import time
from dataclasses import dataclass, field
from typing import Any

from attnprof._safety import ErrorBook, Once
from attnprof.config import Config

__all__ = ["STATE", "State", "role_of_process", "start"]

logger = logging.getLogger("attnprof")


def role_of_process(name: str | None = None) -> str:
    name = multiprocessing.current_process().name if name is None else name
    if name.startswith(("EngineCore", "DPEngineCore")):
        return "engine_core"
    if "Worker" in name:
        return "worker"
    return "api_server"


@dataclass
class State:
    config: Config | None = None
    errors: ErrorBook = field(default_factory=ErrorBook)
    roles: set[str] = field(default_factory=set)
    started_at: float = 0.0
    sink: Any = None  # attnprof.exporters.prometheus.PrometheusSink, created lazily
    requests: Any = None  # stat_logger.RequestStats in the API server
    model_label: str = "unknown"
    model_path: str | None = None
    _once: Once = field(default_factory=Once)

    @property
    def enabled(self) -> bool:
        return self.config is not None and self.config.enabled

    def get_sink(self) -> Any:
        if self.sink is None:
            from attnprof.exporters.prometheus import PrometheusSink

            self.sink = PrometheusSink()
        return self.sink

    def export_errors(self) -> None:
        """Push this process's error and drop counts to Prometheus (idempotent: the sink
        exports each running total once, whoever calls)."""
        try:
            sink = self.get_sink()
            for place, n in list(self.errors.by_place.items()):
                sink.inc_to("attnprof_internal_errors_total", n, model=self.model_label,
                            place=place)
            for reason, n in list(self.errors.dropped.items()):
                sink.inc_to("attnprof_dropped_samples_total", n, model=self.model_label,
                            reason=reason)
        except Exception:
            pass  # exporting errors must not become an error

    def add_role(self, role: str) -> None:
        """Mark this process as live in ``role`` (gauge + run-dir note), once per role."""
        if role in self.roles:
            return
        self.roles.add(role)
        try:
            self.get_sink().metric("attnprof_plugin_processes").labels(role=role).set(1)
        except Exception as exc:
            self.errors.record("metrics", exc)
        cfg = self.config
        if cfg is not None and cfg.run_dir is not None:
            try:
                cfg.run_dir.mkdir(parents=True, exist_ok=True)
                note = {"role": role, "pid": os.getpid(),
                        "process": multiprocessing.current_process().name,
                        "started_at": self.started_at}
                tmp = cfg.run_dir / f".{role}-{os.getpid()}.json.tmp"
                tmp.write_text(json.dumps(note))
                tmp.replace(cfg.run_dir / f"{role}-{os.getpid()}.json")
            except Exception as exc:  # start-up only, but still a guest: count it
                self.errors.record("run_dir", exc)


STATE = State()


def start(cfg: Config) -> None:
    def _start() -> None:
        STATE.config = cfg
        STATE.errors = ErrorBook(cfg.max_errors)
        STATE.started_at = time.time()
        if cfg.model_label:
            STATE.model_label = cfg.model_label
        STATE.add_role(role_of_process())
        atexit.register(_mark_dead)
        from attnprof.capture.vllm import hooks

        hooks.install(STATE)
        logger.info("attnprof: enabled in %s (pid %d), sample rate %.3g",
                    multiprocessing.current_process().name, os.getpid(), cfg.sample_rate)

    STATE._once.do(_start)


def _mark_dead() -> None:
    """Drop this process's live gauges and note so short-lived helpers do not linger."""
    try:
        if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
            from prometheus_client import multiprocess

            multiprocess.mark_process_dead(os.getpid())
        cfg = STATE.config
        if cfg is not None and cfg.run_dir is not None:
            for role in STATE.roles:
                (cfg.run_dir / f"{role}-{os.getpid()}.json").unlink(missing_ok=True)
    except Exception:
        pass


def processes_from_run_dir(cfg: Config | None) -> list[dict[str, Any]]:
    """Liveness notes left by every process (API-server side, for the snapshot)."""
    if cfg is None or cfg.run_dir is None or not cfg.run_dir.is_dir():
        return []
    out: list[dict[str, Any]] = []
    for p in sorted(cfg.run_dir.glob("*.json")):
        try:
            note = json.loads(p.read_text())
        except (OSError, ValueError):
            continue
        pid = note.get("pid")
        note["alive"] = isinstance(pid, int) and pid_alive(pid)
        out.append(note)
    return out


def pid_alive(pid: int) -> bool:
    """True for a running process; a zombie (exited, not yet reaped) counts as dead."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[-1].split()[0] != "Z"
    except OSError:
        return True  # no /proc (not Linux): kill(0) said it exists
