"""Parsed, validated attnprof configuration.

Start-up is the only place attnprof is allowed to fail loudly: a bad value raises
:class:`ConfigError` whose message is one line naming the variable.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import overload

__all__ = ["OTLP_HISTOGRAMS", "RANK_SYNC", "Config", "ConfigError", "api_tokens",
           "default_home", "otlp_histogram", "otlp_spans"]

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}


class ConfigError(ValueError):
    """A bad ``ATTNPROF_*`` value; ``str(err)`` is one line naming the variable."""


def _bool(env: Mapping[str, str], name: str, default: bool) -> bool:
    raw = env.get(name)
    if raw is None:
        return default
    low = raw.strip().lower()
    if low in _TRUE:
        return True
    if low in _FALSE:
        return False
    raise ConfigError(f"{name}={raw!r} is not a boolean (use 1/0, true/false, on/off)")


def _float(env: Mapping[str, str], name: str, default: float, lo: float, hi: float,
           lo_open: bool = False, zero_off: bool = False) -> float:
    """A float in [lo, hi] (``lo_open``: (lo, hi]); ``zero_off``: 0 also accepted (the knob's
    "off"), so a tiny positive value cannot turn a loop into a busy one."""
    raw = env.get(name)
    if raw is None or raw.strip() == "":
        return default
    try:
        val = float(raw)
    except ValueError:
        raise ConfigError(f"{name}={raw!r} is not a number") from None
    if zero_off and val == 0.0:
        return val
    if val != val or val < lo or val > hi or (lo_open and val == lo):
        bracket = "(" if lo_open else "["
        zero = "0 or " if zero_off else ""
        raise ConfigError(f"{name}={raw!r} is out of range {zero}{bracket}{lo:g}, {hi:g}]")
    return val


@overload
def _int(env: Mapping[str, str], name: str, default: int, lo: int, hi: int) -> int: ...


@overload
def _int(env: Mapping[str, str], name: str, default: None, lo: int, hi: int) -> int | None: ...


def _int(env: Mapping[str, str], name: str, default: int | None, lo: int, hi: int
         ) -> int | None:
    """An integer in [lo, hi]: every count attnprof reads has a ceiling, so no value can
    ask a worker or the API server for unbounded memory or work."""
    raw = env.get(name)
    if raw is None or raw.strip() == "":
        return default
    try:
        val = int(raw)
    except ValueError:
        raise ConfigError(f"{name}={raw!r} is not an integer") from None
    if not lo <= val <= hi:
        raise ConfigError(f"{name}={raw!r} is out of range [{lo}, {hi}]")
    return val


def _faults(env: Mapping[str, str]) -> tuple[str, ...]:
    """``ATTNPROF_FAULT_INJECT``: a comma-separated list of fault places (tests only)."""
    from attnprof._safety import FAULT_PLACES

    raw = env.get("ATTNPROF_FAULT_INJECT")
    if raw is None or raw.strip() == "":
        return ()
    places = tuple(p.strip() for p in raw.split(",") if p.strip())
    bad = [p for p in places if p not in FAULT_PLACES]
    if bad or not places:
        raise ConfigError(f"ATTNPROF_FAULT_INJECT={raw!r} must be a comma-separated list of "
                          f"{', '.join(FAULT_PLACES)}")
    return places


def _choice(env: Mapping[str, str], name: str, choices: tuple[str, ...]) -> str | None:
    raw = env.get(name)
    if raw is None or raw.strip() == "":
        return None
    if raw not in choices:
        raise ConfigError(f"{name}={raw!r} must be one of {', '.join(choices)}")
    return raw


OTLP_HISTOGRAMS = ("explicit", "exponential")
RANK_SYNC = ("auto", "file", "rpc")
"""``ATTNPROF_RANK_SYNC``: how tensor-parallel ranks agree on the sampler's scale."""

# Ranges of the numeric knobs. Each bound keeps a typo or a hostile value from asking a
# worker or the API server for unbounded work, memory or a busy loop; each leaves room far
# past any sensible setting.
MIN_RPC_TIMEOUT_S = 0.1
"""An API-side wait shorter than one model step would serve stale snapshots on every GET
(the engine itself is never given this timeout: see :mod:`attnprof.host.vllm.rpc`)."""
MIN_INTERVAL_S = 0.5
"""Shortest advice-loop period (0 turns the loop off): each round is one poll of every
worker, so 1e-9 would poll in a busy loop."""
MAX_TOKENS = 1 << 24
"""Token thresholds: 16M tokens, past any step's or prompt's length."""
MAX_SEED = (1 << 64) - 1
"""The sampler's hash mixes the seed as a 64-bit word."""
MAX_ERRORS = 1_000_000
"""Errors tolerated per area before its breaker trips (the fault tests use this ceiling)."""
MAX_SNAPSHOT_BYTES = 512 << 20
"""Largest snapshot or trace body the API server builds in memory (head statistics of an
80-layer, 64-head model are about 17 MB; the default is 64 MiB)."""
MAX_TRACE_RANGES = 500_000
"""Layer ranges of one live trace, all workers (~215 MB of JSON; the body stays under
``ATTNPROF_SNAPSHOT_MAX_BYTES`` anyway)."""
MAX_TRACE_RANGES_PER_WORKER = 200_000
"""A worker's hard ceiling for one trace (:data:`attnprof.aggregate.trace.MAX_RANGES`)."""
MAX_FAULT_DELAY_S = 60.0
"""Testing only: the longest injected delay of a worker method."""


def otlp_histogram(env: Mapping[str, str]) -> str:
    """``ATTNPROF_OTLP_HISTOGRAM``: how request histograms go out over OTLP."""
    return _choice(env, "ATTNPROF_OTLP_HISTOGRAM", OTLP_HISTOGRAMS) or Config.otlp_histogram


def otlp_spans(env: Mapping[str, str]) -> bool:
    """``ATTNPROF_OTLP_SPANS``: send sampled steps as OpenTelemetry spans (off by default)."""
    return _bool(env, "ATTNPROF_OTLP_SPANS", Config.otlp_spans)


def default_home(env: Mapping[str, str] | None = None) -> Path:
    env = os.environ if env is None else env
    raw = env.get("ATTNPROF_HOME")
    if not raw:
        return Config.home
    try:
        return Path(raw).expanduser()
    except RuntimeError:  # ~user of a user this system does not know
        raise ConfigError(f"ATTNPROF_HOME={raw!r}: cannot expand its ~ (no such user or no "
                          "home directory)") from None


def api_tokens(env: Mapping[str, str] | None = None, vllm_api_key: object = None) -> list[str]:
    """Bearer tokens that open the ``/attnprof/*`` routes. ``ATTNPROF_API_KEY``, when set, is
    the only one (a monitoring key: vLLM's inference keys then get 401, so one tenant cannot
    read another's request lengths or start RPCs). Without it, vLLM's own keys
    (``--api-key``, one string or a list, else ``VLLM_API_KEY``, as vLLM reads them) are the
    fallback (the endpoint warns at start-up). Empty: no key anywhere, and the snapshot
    answers only what ``/metrics`` shows. :class:`ConfigError` for an ``ATTNPROF_API_KEY``
    that a bearer header cannot carry (spaces, control or non-ASCII characters: a key file's
    trailing newline would otherwise lock every client out)."""
    env = os.environ if env is None else env
    own = env.get("ATTNPROF_API_KEY", "")
    if own:
        if not all(0x20 < ord(c) < 0x7F for c in own):
            raise ConfigError("ATTNPROF_API_KEY holds spaces, control or non-ASCII characters "
                              "(a trailing newline?); an HTTP bearer token cannot carry them")
        return [own]
    keys: list[str] = []
    if isinstance(vllm_api_key, str):
        keys.append(vllm_api_key)
    elif isinstance(vllm_api_key, (list, tuple)):
        keys += [k for k in vllm_api_key if isinstance(k, str)]
    if not keys:
        keys.append(env.get("VLLM_API_KEY", ""))
    return [k for k in dict.fromkeys(keys) if k]


@dataclass(frozen=True)
class Config:
    enabled: bool = False
    """Master switch (``ATTNPROF_ENABLED``)."""
    sample_rate: float = 0.05
    """Base probability that a model step is profiled."""
    overhead_budget: float = 0.01
    """attnprof self time / wall time ceiling."""
    long_prefill_tokens: int = 1024
    """Prefill size that puts a step into the long-prefill stratum."""
    long_prefill_rate: float = 0.5
    """Sample rate of the long-prefill stratum."""
    head_stats_rate: float = 0.1
    """Share of sampled steps that also compute per-head statistics."""
    head_stats_min_tokens: int = 256
    """Shortest prompt used for head statistics."""
    head_stats_queue_mb: int = 64
    """MiB of copied queries and keys the statistics' worker may hold (CPU)."""
    head_stats_inline: bool = False
    """Fold head statistics on the engine's thread (offline runs, the demo)."""
    advice_interval_s: float = 60.0
    """Seconds between window-advice refreshes in the API server (0: only on snapshots)."""
    seed: int | None = None
    """Sampler seed; None draws one from the OS."""
    max_errors: int = 100
    """Internal errors tolerated per process before capture stops."""
    home: Path = Path.home() / ".cache" / "attnprof"
    """Cache directory."""
    model_label: str | None = None
    """Override for the ``model`` metric label."""
    run_dir: Path | None = None
    """Where processes leave their liveness notes."""
    fault_inject: tuple[str, ...] = ()
    """Testing only: raise inside attnprof at these places to prove each is contained."""
    snapshot_max_age_s: float = 2.0
    """The API server answers snapshots from a cache at most this old."""
    rpc_timeout_s: float = 10.0
    """Longest wait for the workers' answer to a snapshot RPC (one in flight at most)."""
    snapshot_max_bytes: int = 64 << 20
    """Largest snapshot body served; beyond it head statistics are left out."""
    otlp_histogram: str = "explicit"
    """OTLP histogram encoding: ``explicit`` (same buckets as Prometheus) or ``exponential``."""
    otlp_spans: bool = False
    """Send every sampled step (with per-layer child spans) as OTLP spans."""
    probe: bool = False
    """Measure peak bandwidth and matmul FLOP/s once per worker after start-up (roofline)."""
    trace_open: bool = False
    """``GET /attnprof/trace`` answers without an API key when none is configured."""
    trace_max_ranges: int = 150_000
    """Most layer ranges in one live trace, all workers together (80 layers x 8 ranks:
    under 64 MB of JSON)."""
    trace_max_ranges_per_worker: int = 40_000
    """Most layer ranges one worker keeps for one live trace (its memory bound)."""

    rank_sync: str = "auto"
    """How tensor-parallel ranks agree on the budget's scale: ``file`` (a node-local
    announcement file), ``rpc`` (carried by the API server's poll: ranks on other nodes) or
    ``auto`` (``rpc`` when vLLM's parallel config spans nodes, else ``file``)."""
    fault_delay_s: float = 0.0
    """Testing only: every ``attnprof_*`` worker method first sleeps this long."""

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> Config:
        env = os.environ if env is None else env
        run_dir = env.get("ATTNPROF_RUN_DIR")
        d = cls()  # the defaults are the fields' (written once, above)
        flt, num = _float, _int
        return cls(
            enabled=_bool(env, "ATTNPROF_ENABLED", d.enabled),
            sample_rate=flt(env, "ATTNPROF_SAMPLE_RATE", d.sample_rate, 0.0, 1.0),
            overhead_budget=flt(env, "ATTNPROF_OVERHEAD_BUDGET", d.overhead_budget, 0.0, 1.0,
                                lo_open=True),
            long_prefill_tokens=num(env, "ATTNPROF_LONG_PREFILL_TOKENS", d.long_prefill_tokens,
                                    1, MAX_TOKENS),
            long_prefill_rate=flt(env, "ATTNPROF_LONG_PREFILL_RATE", d.long_prefill_rate, 0.0,
                                  1.0),
            head_stats_rate=flt(env, "ATTNPROF_HEAD_STATS_RATE", d.head_stats_rate, 0.0, 1.0),
            head_stats_min_tokens=num(env, "ATTNPROF_HEAD_STATS_MIN_TOKENS",
                                      d.head_stats_min_tokens, 1, MAX_TOKENS),
            head_stats_queue_mb=num(env, "ATTNPROF_HEAD_STATS_QUEUE_MB", d.head_stats_queue_mb,
                                    8, 16384),
            head_stats_inline=_bool(env, "ATTNPROF_HEAD_STATS_INLINE", d.head_stats_inline),
            advice_interval_s=flt(env, "ATTNPROF_ADVICE_INTERVAL_S", d.advice_interval_s,
                                  MIN_INTERVAL_S, 86400.0, zero_off=True),
            seed=num(env, "ATTNPROF_SEED", None, 0, MAX_SEED),
            max_errors=num(env, "ATTNPROF_MAX_ERRORS", d.max_errors, 1, MAX_ERRORS),
            home=default_home(env),
            model_label=env.get("ATTNPROF_MODEL_LABEL") or None,
            run_dir=Path(run_dir) if run_dir else None,
            fault_inject=_faults(env),
            snapshot_max_age_s=flt(env, "ATTNPROF_SNAPSHOT_MAX_AGE_S", d.snapshot_max_age_s,
                                   0.0, 3600.0),
            rpc_timeout_s=flt(env, "ATTNPROF_RPC_TIMEOUT_S", d.rpc_timeout_s, MIN_RPC_TIMEOUT_S,
                              600.0),
            snapshot_max_bytes=num(env, "ATTNPROF_SNAPSHOT_MAX_BYTES", d.snapshot_max_bytes,
                                   4096, MAX_SNAPSHOT_BYTES),
            otlp_histogram=otlp_histogram(env),
            otlp_spans=otlp_spans(env),
            probe=_bool(env, "ATTNPROF_PROBE", d.probe),
            trace_open=_bool(env, "ATTNPROF_TRACE_OPEN", d.trace_open),
            trace_max_ranges=num(env, "ATTNPROF_TRACE_MAX_RANGES", d.trace_max_ranges, 1,
                                 MAX_TRACE_RANGES),
            trace_max_ranges_per_worker=num(env, "ATTNPROF_TRACE_MAX_RANGES_PER_WORKER",
                                            d.trace_max_ranges_per_worker, 1,
                                            MAX_TRACE_RANGES_PER_WORKER),
            rank_sync=_choice(env, "ATTNPROF_RANK_SYNC", RANK_SYNC) or d.rank_sync,
            fault_delay_s=flt(env, "ATTNPROF_FAULT_DELAY_S", d.fault_delay_s, 0.0,
                              MAX_FAULT_DELAY_S),
        )
