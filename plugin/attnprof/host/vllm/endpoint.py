"""vLLM endpoint plugin (API server): the ``/attnprof/*`` routes.

Loaded by vLLM only when ``attnprof_http`` is named in ``VLLM_PLUGINS`` (``attnprof serve``
does that). Every route is a guest on the host's port, so:

- **one monitoring key:** a bearer token, ``ATTNPROF_API_KEY`` alone when it is set (vLLM's
  inference keys then get 401: a tenant cannot read other tenants' lengths and timing),
  else vLLM's own ``--api-key`` / ``VLLM_API_KEY`` with a start-up warning
  (:func:`attnprof.config.api_tokens`); vLLM's middleware guards only ``/v1``-style
  prefixes, so attnprof checks its own routes;
- **closed by default:** with no key anywhere, the snapshot answers what ``/metrics`` shows
  plus operational facts it has no series for (pids, process names, rejected backends'
  reasons, sampler and pull counters: the allow-list of
  :mod:`attnprof.exporters.snapshot_public`) and says how to open the rest;
  ``?head_stats=1``, the trace and the sampling switch answer 403;
- **never stalls the engine on demand:** answers come from
  :class:`~attnprof.host.vllm.live_view.LiveView`, a cache refreshed at most every
  ``ATTNPROF_SNAPSHOT_MAX_AGE_S``, with at most one collective RPC in flight (however many
  clients), a timeout, and a bounded body. A disabled attnprof answers without any RPC;
- **nothing large on the event loop:** workers send compact head-statistics deltas
  (:meth:`HeadStatsAccumulator.take_bytes`), merged in a thread; rendering and JSON
  (NaN-safe, :mod:`attnprof.exporters.snapshot_json`) happen in a thread too;
- **fail-open with a visible breaker:** errors are counted under ``endpoint`` / ``advice``;
  past ``ATTNPROF_MAX_ERRORS`` the route answers 503 and the advice loop stops.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import math
import os
import time
from collections.abc import AsyncIterator
from hmac import compare_digest
from typing import Any

# FastAPI resolves the handlers' ``Request`` annotation by name in this module's globals
# (annotations are strings here), so it is imported at module level; this module is loaded
# only inside vLLM's API server, which has FastAPI.
from fastapi import Request

from attnprof._safety import fault_point
from attnprof.capture.vllm.rank_sync import sync_mode
from attnprof.config import Config, api_tokens
from attnprof.contracts.snapshot import Snapshot
from attnprof.host.vllm import runtime, start
from attnprof.host.vllm.live_trace import LiveTrace, TraceBusy, trace_params
from attnprof.host.vllm.live_view import LiveView

__all__ = ["OPEN_HINT", "SAMPLING_MAX_BODY", "SCHEMA_VERSION", "AttnProfEndpoint",
           "SamplingGate", "TokenCheck", "sampling_body"]

logger = logging.getLogger("attnprof")
SCHEMA_VERSION = Snapshot.version_tag()


OPEN_HINT = ("set ATTNPROF_API_KEY on the server to a monitoring key (not a tenant's "
             "inference key) and send it as 'Authorization: Bearer <key>' (attnprof snapshot "
             "reads $ATTNPROF_API_KEY)")
"""How to read what a server with no key withholds (in its answers and start-up log)."""


PUBLIC_NOTE = ("no API key is configured on this server, so this answer holds only what "
               "/metrics shows and the processes' operational facts (pids, backends, "
               "counters; no exact request lengths, per-step lengths or timings, head "
               f"statistics, provenance or error text); {OPEN_HINT}")
"""The keyless snapshot's ``restricted`` note."""


class TokenCheck:
    """Bearer-token check, as vLLM's ``AuthenticationMiddleware`` does it: sha256 digests
    (one length whatever the key) compared in constant time against every configured key,
    no early exit. No tokens configured: every request passes."""

    def __init__(self, tokens: list[str]) -> None:
        self._digests = [hashlib.sha256(t.encode()).digest() for t in tokens]

    @property
    def required(self) -> bool:
        return bool(self._digests)

    def ok(self, authorization: str | None) -> bool:
        if not self._digests:
            return True
        scheme, _, param = (authorization or "").partition(" ")
        if scheme.lower() != "bearer":
            return False
        got = hashlib.sha256(param.strip().encode()).digest()
        match = False
        for d in self._digests:
            match |= compare_digest(got, d)
        return match


SAMPLING_MAX_BODY = 1024
"""Largest body ``POST /attnprof/sampling`` reads (a valid one is under 60 bytes)."""
SAMPLING_MIN_INTERVAL_S = 1.0
"""At most one sampling switch per this many seconds per API server (429 beyond)."""
_SAMPLING_KEYS = ("sample_rate", "head_stats_rate")


class _TooLarge(ValueError):
    pass


async def _read_capped(request: Any, limit: int) -> bytes:
    """The request body, refused past ``limit`` bytes as it arrives (never buffered whole)."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.strip().isdigit() and int(declared) > limit:
        raise _TooLarge
    got = bytearray()
    async for piece in request.stream():
        got += piece
        if len(got) > limit:
            raise _TooLarge
    return bytes(got)


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a number in [0, 1]")


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in pairs:
        if k in out:
            raise ValueError(f"key {k!r} given twice")
        out[k] = v
    return out


def sampling_body(raw: bytes) -> tuple[float | None, float | None]:
    """``(sample_rate, head_stats_rate)`` from a sampling switch's body, each None when left
    out. ``ValueError`` with one line for anything else: not UTF-8 JSON, not an object, no
    known key, an unknown key, a key twice, a value that is not a number in [0, 1] (booleans,
    null, strings, NaN, infinities, nested values)."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise ValueError("the body must be UTF-8 JSON") from None
    try:
        body = json.loads(text, parse_constant=_no_constant,
                          object_pairs_hook=_no_duplicates)
    except RecursionError:
        raise ValueError("the body is nested too deeply") from None
    except ValueError as err:
        if str(err).endswith("is not a number in [0, 1]") or "given twice" in str(err):
            raise ValueError(str(err)) from None
        raise ValueError("the body must be a JSON object") from None
    if not isinstance(body, dict):
        raise ValueError("the body must be a JSON object")
    extra = sorted(set(body) - set(_SAMPLING_KEYS))
    if extra:
        raise ValueError(f"unknown key(s) {', '.join(repr(k)[:40] for k in extra[:3])}; "
                         f"allowed: {', '.join(_SAMPLING_KEYS)}")
    if not body:
        raise ValueError(f"give at least one of {', '.join(_SAMPLING_KEYS)}")
    out: list[float | None] = []
    for key in _SAMPLING_KEYS:
        if key not in body:
            out.append(None)
            continue
        v = body[key]
        ok = isinstance(v, (int, float)) and not isinstance(v, bool)
        if ok and isinstance(v, int):
            ok = 0 <= v <= 1  # compared as an int: 10**400 is no float
        elif ok:
            ok = math.isfinite(v) and 0.0 <= v <= 1.0
        if not ok:
            shown = repr(v) if isinstance(v, (int, float, bool)) or v is None else \
                type(v).__name__
            raise ValueError(f"{key} must be a number in [0, 1], got {shown[:40]}")
        out.append(float(v))
    return out[0], out[1]


class SamplingGate:
    """One sampling switch in flight and one per ``SAMPLING_MIN_INTERVAL_S`` (per API
    server): each switch is an RPC that pauses the engine, so a key holder cannot make it
    pause the engine more often than that."""

    def __init__(self, min_interval: float = SAMPLING_MIN_INTERVAL_S) -> None:
        self.min_interval = min_interval
        self._last = -math.inf
        self._in_flight = False

    def wait_s(self) -> float | None:
        """None: a switch may start now; else the seconds to wait."""
        if self._in_flight:
            return self.min_interval
        left = self._last + self.min_interval - time.monotonic()
        return left if left > 0 else None

    def __enter__(self) -> SamplingGate:
        self._in_flight = True
        self._last = time.monotonic()
        return self

    def __exit__(self, *exc: object) -> None:
        self._in_flight = False


class AttnProfEndpoint:
    name = "attnprof_http"
    required_tasks = None

    def __init__(self) -> None:
        self.engine_client: Any = None
        self.view = LiveView(None)
        self.trace = LiveTrace(None)
        self.auth = TokenCheck(api_tokens())
        self.gate = SamplingGate()
        self._task: asyncio.Task[None] | None = None

    def attach_router(self, app: Any) -> None:
        from fastapi.responses import JSONResponse, Response, StreamingResponse

        plugin = self

        def refuse(request: Request) -> Any:
            if plugin.auth.ok(request.headers.get("authorization")):
                return None
            return JSONResponse({"error": "attnprof: a bearer token is required "
                                          "(ATTNPROF_API_KEY, the monitoring key; vLLM's "
                                          "--api-key only where that is not set)"},
                                status_code=401, headers={"WWW-Authenticate": "Bearer"})

        def tripped() -> Any:
            st = runtime.STATE
            if not st.errors.is_off("endpoint"):
                return None
            return JSONResponse({"error": "attnprof: routes disabled after internal errors "
                                          "(attnprof_capture_disabled{place=\"endpoint\"})"},
                                status_code=503)

        def failed(exc: Exception) -> Any:
            # Counted against the endpoint's breaker; the client sees the type, not details.
            runtime.STATE.errors.record("endpoint", exc)
            return JSONResponse({"error": f"attnprof: internal error (counted): "
                                          f"{type(exc).__name__}"}, status_code=500)

        @app.get("/attnprof/snapshot")  # type: ignore[untyped-decorator]
        async def attnprof_snapshot(request: Request) -> Any:
            if (denied := refuse(request)) is not None:
                return denied
            if (off := tripped()) is not None:
                return off
            st = runtime.STATE
            want = request.query_params.get("head_stats", "") in ("1", "true", "yes")
            if want and not plugin.auth.required:
                # Statistics of attention weights derived from content: only behind a key.
                return needs_key("?head_stats=1")
            try:
                fault_point("endpoint")
                cfg = st.config or Config()
                # No key: the answer is cut to what /metrics shows, rendered and cached as a
                # variant of its own (shared by every keyless client of one refresh).
                body, age = await plugin.view.body(
                    want, cfg.snapshot_max_age_s, cfg.rpc_timeout_s, cfg.snapshot_max_bytes,
                    None if plugin.auth.required else PUBLIC_NOTE)
                return Response(body, media_type="application/json",
                                headers={"Age": str(int(age)), "Cache-Control": "no-store"})
            except Exception as exc:
                return failed(exc)

        def needs_key(what: str, alternative: str = "") -> Any:
            # 403, not 401: the server has no key to check, so no client key can help.
            return JSONResponse({"error": f"attnprof: {what} is off until the server has an "
                                          "API key (ATTNPROF_API_KEY, as 'restricted' says)"
                                          f"{alternative}",
                                 "restricted": OPEN_HINT}, status_code=403)

        @app.get("/attnprof/trace")  # type: ignore[untyped-decorator]
        async def attnprof_trace(request: Request) -> Any:
            """The next ``steps`` sampled steps of every worker as a Chrome/Perfetto trace,
            waiting at most ``timeout`` seconds (``?steps=8&timeout=30``)."""
            if (denied := refuse(request)) is not None:
                return denied
            st = runtime.STATE
            cfg = st.config or Config()
            if not plugin.auth.required and not cfg.trace_open:
                # Per-step batch sizes and sequence lengths: with one request in a batch,
                # one user's length and timing. Never open by default, even where /metrics is.
                return needs_key("the live trace", ", or ATTNPROF_TRACE_OPEN=1 opens it to "
                                 "anyone who can reach this port")
            if (off := tripped()) is not None:
                return off
            try:
                steps, timeout = trace_params(request.query_params)
            except ValueError as err:
                return JSONResponse({"error": f"attnprof: {err}"}, status_code=400)
            if not st.enabled:
                return JSONResponse({"traceEvents": [], "otherData": {"attnprof": {
                    "kind": "attnprof.trace", "enabled": False, "model": st.model_label}}})
            try:
                fault_point("endpoint")
                chunks = await plugin.trace.record(
                    steps, timeout, cfg.rpc_timeout_s, cfg.snapshot_max_bytes,
                    request.is_disconnected, cfg.trace_max_ranges,
                    cfg.trace_max_ranges_per_worker)
            except TraceBusy as busy:
                wait = busy.remaining_s
                return JSONResponse({"error": "attnprof: a trace is already being recorded "
                                              f"on this server; retry in {wait:.1f} s",
                                     "retry_after_s": round(wait, 1)}, status_code=409,
                                    headers={"Retry-After": str(max(1, math.ceil(wait)))})
            except TimeoutError as exc:  # slow workers are not attnprof's bug: no breaker
                st.errors.note("trace_timeout", exc)
                return JSONResponse({"error": "attnprof: the workers did not answer the trace "
                                              "RPC within ATTNPROF_RPC_TIMEOUT_S"},
                                    status_code=504)
            except Exception as exc:
                return failed(exc)

            async def stream() -> AsyncIterator[bytes]:
                for c in chunks:  # rendered in a thread; here only handed to the socket
                    yield c

            return StreamingResponse(stream(), media_type="application/json",
                                     headers={"Cache-Control": "no-store"})

        @app.post("/attnprof/sampling")  # type: ignore[untyped-decorator]
        async def attnprof_sampling(request: Request) -> Any:
            """Switch the step sample rate and/or head-statistics rate in every worker:
            ``{"sample_rate": 0.05, "head_stats_rate": 0.1}`` (either key may be left out).
            One switch in flight at most and one a second (429 beyond)."""
            if (denied := refuse(request)) is not None:
                return denied
            if not plugin.auth.required:
                # The one route that raises attnprof's cost: never open to anyone who can
                # reach the port, even where vLLM's own routes are.
                return needs_key("the sampling switch")
            if (off := tripped()) is not None:
                return off
            st = runtime.STATE
            if not st.enabled:
                return JSONResponse({"error": "attnprof is disabled (ATTNPROF_ENABLED)"},
                                    status_code=409)
            try:
                raw = await _read_capped(request, SAMPLING_MAX_BODY)
            except _TooLarge:
                return JSONResponse({"error": f"attnprof: the body must be at most "
                                              f"{SAMPLING_MAX_BODY} bytes"}, status_code=413)
            try:
                rate, hs = sampling_body(raw)
            except ValueError as err:
                return JSONResponse({"error": f"attnprof: {err}"}, status_code=400)
            wait = plugin.gate.wait_s()
            if wait is not None:
                return JSONResponse({"error": f"attnprof: one sampling switch a second at "
                                              f"most; retry in {wait:.1f} s",
                                     "retry_after_s": round(wait, 1)}, status_code=429,
                                    headers={"Retry-After": str(max(1, math.ceil(wait)))})
            timeout = (st.config or Config()).rpc_timeout_s
            try:
                fault_point("endpoint")
                with plugin.gate:
                    workers = await plugin.view.set_sampling(rate, hs, timeout)
                return JSONResponse({"workers": workers})
            except TimeoutError as exc:
                # The engine's state, not attnprof's bug: counted, never a breaker, so a
                # flood of switches cannot take the read-only routes down.
                st.errors.note("sampling_timeout", exc)
                return JSONResponse({"error": "attnprof: the workers did not take the switch "
                                              "within ATTNPROF_RPC_TIMEOUT_S"},
                                    status_code=504)
            except Exception as exc:
                st.errors.record("sampling_switch", exc)
                return JSONResponse({"error": f"attnprof: sampling switch failed: "
                                              f"{type(exc).__name__}"}, status_code=500)

    async def init_state(self, engine_client: Any, state: Any, args: Any) -> None:
        self.engine_client = engine_client
        self.view = LiveView(engine_client)
        self.trace = LiveTrace(engine_client)
        vllm_key = getattr(args, "api_key", None)
        self.auth = TokenCheck(api_tokens(vllm_api_key=vllm_key))
        own = os.environ.get("ATTNPROF_API_KEY", "")
        tenants = api_tokens({k: v for k, v in os.environ.items() if k != "ATTNPROF_API_KEY"},
                             vllm_api_key=vllm_key)
        _log_key_mode(self.auth.required, bool(own), bool(own) and own in tenants)
        cfg, otlp = runtime.config_from_env()
        if cfg.enabled:
            start(cfg, otlp)
            # Polled only where the workers chose the RPC channel (the same decision from
            # the same parallel config as model_info.sync_ranks): a one-node server is not
            # polled (a server nobody reads pays nothing).
            pc = getattr(getattr(engine_client, "vllm_config", None), "parallel_config", None)
            if sync_mode(cfg.rank_sync, pc) == "rpc":
                self.view.start_rate_sync()
            if cfg.advice_interval_s > 0 and engine_client is not None:
                self._task = asyncio.get_running_loop().create_task(
                    _advice_loop(self.view, cfg.advice_interval_s, cfg.rpc_timeout_s))


def _log_key_mode(required: bool, own_key: bool, shared: bool = False) -> None:
    """One start-up line where the routes are not behind a monitoring key of their own
    (``shared``: ATTNPROF_API_KEY is one of vLLM's inference keys, so the separation it
    exists for does not hold: every deploy but Compose's could not check that)."""
    if shared:
        logger.warning("attnprof: ATTNPROF_API_KEY is also one of vLLM's inference keys "
                       "(--api-key / VLLM_API_KEY): whoever holds that tenant key opens "
                       "/attnprof/*; give attnprof a separate monitoring key")
    elif not required:
        logger.info("attnprof: no API key configured: /attnprof/snapshot answers only what "
                    "/metrics shows; the rest is off. To open it: %s", OPEN_HINT)
    elif not own_key:
        logger.warning("attnprof: ATTNPROF_API_KEY is not set, so every vLLM inference key "
                       "(--api-key / VLLM_API_KEY) opens /attnprof/*: any tenant can read "
                       "request lengths and timing and start RPCs; set ATTNPROF_API_KEY to a "
                       "separate monitoring key")


async def _advice_loop(view: LiveView, interval: float, timeout: float) -> None:
    """Keep the advice gauges current for Prometheus and alerts (stops when its breaker
    trips)."""
    st = runtime.STATE
    while not st.errors.is_off("advice"):
        await asyncio.sleep(interval)
        try:
            await view.refresh(timeout)
        except TimeoutError as exc:  # slow workers are not attnprof's bug: no breaker
            st.errors.note("window_advice_timeout", exc)
        except Exception as exc:
            st.errors.record("window_advice", exc)
