"""Per-process attnprof state inside vLLM, created once by :func:`start`."""

from __future__ import annotations

import atexit
import functools
import json
import logging
import multiprocessing
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from attnprof._private_files import read_private, write_private
from attnprof._safety import ErrorBook, Once, pid_alive, set_faults
from attnprof.config import Config
from attnprof.contracts.snapshot import ProcessNote

__all__ = ["STATE", "State", "pid_alive", "role_of_process", "start"]

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
    hub: Any = None  # attnprof.exporters.hub.ExportHub, created by start()
    capture: Any = None  # hooks.Capture in a vLLM worker (the Python API's sampling switch)
    otlp: Any = None  # attnprof.exporters.otlp.OtlpConfig when an OTLP endpoint is set
    requests: Any = None  # aggregate.requests.RequestAggregates in the API server
    advice: dict[str, Any] | None = None  # latest window advice (API server)
    coverage: dict[str, Any] | None = None  # latest coverage section (API server)
    model_label: str = "unknown"
    model_path: str | None = None
    probe: Any = None  # contracts.roofline.MemoryProbe once the start-up probe ran (a worker)
    _once: Once = field(default_factory=Once)

    @property
    def enabled(self) -> bool:
        return self.config is not None and self.config.enabled

    def get_hub(self) -> Any:
        """This process's export loop (Prometheus always; OTLP when configured)."""
        if self.hub is None:
            from attnprof.exporters.hub import ExportHub
            from attnprof.exporters.otlp import OtlpSink
            from attnprof.exporters.prometheus import PrometheusSink

            # A failing sample source is attnprof's own bug and counts towards the breaker;
            # a failing exporter (collector down) never switches profiling off.
            hub = ExportHub(on_error=self.errors.record, on_sink_error=self.errors.note,
                            degraded=lambda: self.errors.is_off("export"))
            hub.add_sink(PrometheusSink())
            if self.otlp is not None:
                hub.add_sink(OtlpSink(self.otlp, role=role_of_process(),
                                      on_error=self.errors.note))
            self.hub = hub
        return self.hub

    def _process_samples(self) -> list[Any]:
        from attnprof.exporters.samples import error_samples

        by_place, dropped, tripped = self.errors.view()
        return error_samples(self.model_label, by_place, dropped, self.roles, tripped,
                             _areas(self.roles))

    def export_source(self, name: str, fn: Any) -> None:
        """Register a sample source with this process's export loop and make sure it runs."""
        try:
            hub = self.get_hub()
            hub.add_source(name, fn)
            hub.start()
        except Exception as exc:
            self.errors.record("export", exc)

    def flush(self) -> None:
        """Export now (snapshots, error paths); never raises."""
        try:
            self.get_hub().flush()
        except Exception as exc:
            self.errors.record("export", exc)

    def backend_fallback(self, out: dict[str, Any], cc: tuple[int, int], lay: Any,
                         installed: str | None) -> None:
        """The derived matrix answers where vLLM cannot be asked (the hooks' kernel map)."""
        from attnprof.analyze.vllm_backends import from_matrix

        from_matrix(out, cc, lay, installed)

    def worker_live(self, cap: Any, start_spans: bool) -> None:
        """The hooks wrapped a layer: this process is a worker. Its samples join the export
        loop (and, with ``start_spans``, its OTLP spans); never raises (counted)."""
        from attnprof.host.vllm import worker_rpc

        self.add_role("worker")
        self.export_source("worker", functools.partial(worker_rpc.samples, cap))
        if start_spans:
            worker_rpc.start_spans(cap, self.get_hub)

    def add_role(self, role: str) -> None:
        """Mark this process as live in ``role`` (gauge + run-dir note), once per role."""
        if role in self.roles:
            return
        self.roles.add(role)
        cfg = self.config
        if cfg is not None and cfg.run_dir is not None:
            try:
                note = {"role": role, "pid": os.getpid(),
                        "process": multiprocessing.current_process().name,
                        "started_at": self.started_at}
                # Never through a planted link, never half-written (_private_files).
                write_private(cfg.run_dir, f"{role}-{os.getpid()}.json",
                              json.dumps(note).encode())
            except Exception as exc:  # start-up only, but still a guest: count it
                self.errors.record("run_dir", exc)


STATE = State()

# The breakers each role runs (a worker's capture, the API server's routes and loggers).
_ROLE_AREAS = {"worker": ("capture", "export"), "engine_core": ("capture", "export"),
               "api_server": ("stat_logger", "endpoint", "advice", "export")}


def _areas(roles: set[str]) -> list[str]:
    return sorted({a for r in roles for a in _ROLE_AREAS.get(r, ("export",))})


def config_from_env(check_otlp: bool = False) -> tuple[Config, Any]:
    """attnprof's settings and the OTLP ones (an ``OtlpConfig``, None without an endpoint),
    read and checked together wherever attnprof starts, so a bad ``ATTNPROF_*`` or ``OTEL_*``
    value raises ``ConfigError`` at start-up. OTLP is read only when attnprof is enabled (or
    ``check_otlp``: the CLI checking a server's environment before launching it)."""
    cfg = Config.from_env()
    if not (cfg.enabled or check_otlp):
        return cfg, None
    from attnprof.exporters.otlp import otlp_config_from_env

    return cfg, otlp_config_from_env(os.environ)


def start(cfg: Config, install: Callable[[State], Any] | None = None, otlp: Any = None) -> None:
    """Set this process up once (later calls do nothing); ``install`` patches the host."""

    def _start() -> None:
        STATE.config = cfg
        STATE.otlp = otlp
        STATE.errors = ErrorBook(cfg.max_errors)
        set_faults(cfg.fault_inject)
        STATE.started_at = time.time()
        if cfg.model_label:
            STATE.model_label = cfg.model_label
        STATE.add_role(role_of_process())
        STATE.export_source("process", STATE._process_samples)
        atexit.register(_mark_dead)
        if install is not None:
            install(STATE)
        if cfg.probe:
            _start_probe(STATE)
        logger.info("attnprof: enabled in %s (pid %d), sample rate %.3g",
                    multiprocessing.current_process().name, os.getpid(), cfg.sample_rate)

    STATE._once.do(_start)


def _start_probe(state: State) -> None:
    """ATTNPROF_PROBE: once this process has built a model (it is a worker), measure its
    peaks in a background thread, in the model's dtype; keep the result and export the
    roofline gauges. Processes without a model (the API server) never probe."""
    from attnprof.tools.probe import start_background

    def model_dtype() -> str | None:
        # Only once a decode step has been recorded: the server is then serving, past vLLM's
        # memory profiling and CUDA-graph capture, which GPU work from another thread could
        # disturb (a capture refuses foreign kernels; a transient 3 GiB skews KV sizing).
        aggs = getattr(state.capture, "aggs", None)
        if aggs is None or not any(ph == "decode" for _i, ph in list(aggs.agg)):
            return None
        layers = list(aggs.layers.values())
        return str(layers[0].dtype) if layers else None

    def done(result: Any) -> None:
        state.probe = result
        state.export_source("roofline", lambda: _roofline_samples(state))

    try:
        start_background(done, lambda exc: state.errors.note("probe", exc), model_dtype,
                         steps=lambda: int(getattr(state.capture, "seen", 0)))
    except Exception as exc:  # a thread that cannot start: counted, never raised
        state.errors.note("probe", exc)


def _roofline_samples(state: State) -> list[Any]:
    from attnprof.analyze.roofline import roofline, work_from_layers
    from attnprof.exporters.samples import roofline_samples

    cap = state.capture
    rl = None
    if cap is not None and state.probe is not None:
        rl = roofline(work_from_layers(cap.aggs.layer_profiles()), state.probe)
    return roofline_samples(state.model_label, state.probe, rl)


def _mark_dead() -> None:
    """Drop this process's live gauges and note so short-lived helpers do not linger."""
    try:
        hub = STATE.hub
        if hub is not None:
            hub.stop(final_flush=True)
            prom = hub.sink("prometheus")
            if prom is not None:
                prom.mark_process_dead(os.getpid())
        cfg = STATE.config
        if cfg is not None and cfg.run_dir is not None:
            for role in STATE.roles:
                (cfg.run_dir / f"{role}-{os.getpid()}.json").unlink(missing_ok=True)
    except Exception:
        pass


NOTE_MAX_BYTES = 4096
"""A liveness note is ~120 bytes; a larger file in the run dir is not one of ours."""


def processes_from_run_dir(cfg: Config | None) -> list[ProcessNote]:
    """Liveness notes left by every process (API-server side, for the snapshot). A note still
    being written is skipped; a malformed one (not an object, wrong fields) is counted in the
    errors, never fatal to the snapshot."""
    if cfg is None or cfg.run_dir is None or not cfg.run_dir.is_dir():
        return []
    out: list[ProcessNote] = []
    for p in sorted(cfg.run_dir.glob("*.json")):
        try:
            raw = json.loads(read_private(p, NOTE_MAX_BYTES))
        except (OSError, ValueError):  # a link, a huge file, half a note: skipped
            continue
        try:
            pid = raw.get("pid")
            out.append(ProcessNote.from_json(
                {**raw, "alive": isinstance(pid, int) and pid_alive(pid)}))
        except Exception as exc:
            STATE.errors.record("snapshot_parse", exc)  # API server: the endpoint's area
    return out
