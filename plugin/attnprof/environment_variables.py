"""Every ``ATTNPROF_*`` environment variable: name, type, default and meaning.

This module is the single source of truth. ``attnprof.config`` parses these,
``attnprof env-doc`` prints the README table from it, and a test checks the README
against it.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["VARIABLES", "EnvVar", "by_name", "markdown_table"]


@dataclass(frozen=True)
class EnvVar:
    name: str
    type: str
    default: str
    help: str


VARIABLES: tuple[EnvVar, ...] = (
    EnvVar(
        "ATTNPROF_ENABLED", "bool", "0",
        "Turn attnprof on inside vLLM. Installed but disabled, the plugins do nothing at all.",
    ),
    EnvVar(
        "ATTNPROF_SAMPLE_RATE", "float in [0, 1]", "0.05",
        "Fraction of model steps profiled (geometric gaps, so sampling never locks onto "
        "periodic work). 0 disables capture; 1 profiles every step.",
    ),
    EnvVar(
        "ATTNPROF_OVERHEAD_BUDGET", "float in (0, 1]", "0.01",
        "Ceiling on attnprof's own time as a fraction of wall time; when exceeded the "
        "effective sample rate is lowered adaptively (and raised again when under).",
    ),
    EnvVar(
        "ATTNPROF_LONG_PREFILL_TOKENS", "int in [1, 16777216]", "1024",
        "Steps that schedule at least this many tokens (prompt chunks plus decode tokens) form "
        "their own stratum, sampled at ATTNPROF_LONG_PREFILL_RATE, so rare long prompts are "
        "not drowned by decode steps.",
    ),
    EnvVar(
        "ATTNPROF_LONG_PREFILL_RATE", "float in [0, 1]", "0.5",
        "Sample rate of the long-prefill stratum (also subject to the overhead budget).",
    ),
    EnvVar(
        "ATTNPROF_HEAD_STATS_RATE", "float in [0, 1]", "0.1",
        "Fraction of sampled steps on which per-head attention statistics (sink mass, window "
        "coverage, entropy) are computed for prompt queries (whole, chunked or prefix-cached "
        "prompts) and a few decode queries; 0 turns them off.",
    ),
    EnvVar(
        "ATTNPROF_HEAD_STATS_MIN_TOKENS", "int in [1, 16777216]", "256",
        "Lower edge of the head statistics' first context bucket: shorter prompts are folded "
        "into their own bucket 0 (\"short\"; no window could bind there).",
    ),
    EnvVar(
        "ATTNPROF_HEAD_STATS_QUEUE_MB", "int in [8, 16384]", "64",
        "MiB of copied queries and keys (fp32) the head statistics' worker thread may hold on "
        "a CPU server; a sampled step that finds half of it taken leaves its statistics out "
        "(counted, reason head_stats_worker_busy). One sampled step of a long prompt copies "
        "layers x its keys x KV heads x head size x 4 B: raise it to fold long prompts.",
    ),
    EnvVar(
        "ATTNPROF_HEAD_STATS_INLINE", "bool", "0",
        "Fold head statistics on the engine's thread instead of the worker thread: every "
        "sampled step's statistics are kept, and the step waits for them (offline runs, "
        "`attnprof demo`; on a GPU it also waits for the device). Not for serving.",
    ),
    EnvVar(
        "ATTNPROF_ADVICE_INTERVAL_S", "0 or float in [0.5, 86400]", "60",
        "Seconds between refreshes of the window-advice metrics in the API server (head "
        "statistics gathered from workers + traffic lengths); 0 refreshes only on snapshots. "
        "Otherwise snapshots serve the loop's latest advice, so polling the route never "
        "recomputes it.",
    ),
    EnvVar(
        "ATTNPROF_SEED", "int in [0, 18446744073709551615]", "(the server's instance id)",
        "Seed of the sampler; set it for deterministic runs and tests. Unset, all processes "
        "of one vLLM server share a seed from its instance id, so tensor-parallel ranks "
        "sample the same steps.",
    ),
    EnvVar(
        "ATTNPROF_MAX_ERRORS", "int in [1, 1000000]", "100",
        "After this many internal errors in one area of one process (capture, stat_logger, "
        "endpoint, advice, export) that area switches itself off there, shown by "
        "attnprof_capture_disabled{place} (errors are always counted, never raised into vLLM).",
    ),
    EnvVar(
        "ATTNPROF_HOME", "path", "~/.cache/attnprof",
        "Cache directory for the embedded default model and run files.",
    ),
    EnvVar(
        "ATTNPROF_MODEL_LABEL", "str", "(served model name)",
        "Value of the `model` label on every attnprof metric.",
    ),
    EnvVar(
        "ATTNPROF_PROBE", "bool", "0",
        "Measure the worker's peak memory bandwidth and matmul FLOP/s once, in a background "
        "thread at the worker's first idle second after it has served (after 120 s without "
        "one it probes under load and its note says so; the thread's own torch threads, "
        "never retuning the host's; a few seconds of reads, copies and GEMMs; `attnprof "
        "probe` runs the same). Adds the probe and the roofline (decode bandwidth and "
        "prefill compute utilisation, arithmetic intensity) to snapshots and metrics.",
    ),
    EnvVar(
        "ATTNPROF_RUN_DIR", "path", "(unset)",
        "Directory where each process the plugin is live in leaves a small JSON note "
        "(role, pid); `attnprof serve` sets it.",
    ),
    EnvVar(
        "ATTNPROF_FAULT_INJECT",
        "comma list of capture, step, stat_logger, endpoint, advice, flusher, otlp_export",
        "(unset)",
        "Testing only: raise an exception inside attnprof at those places, to prove errors are "
        "counted in attnprof_internal_errors_total, trip the place's breaker "
        "(attnprof_capture_disabled) and never reach vLLM or a request.",
    ),
    EnvVar(
        "ATTNPROF_API_KEY", "str", "(unset)",
        "The monitoring key: when set, the only bearer token the /attnprof/* routes accept "
        "(vLLM's inference keys get 401); use a key of its own, not a tenant's. Unset: vLLM's "
        "`--api-key` (or VLLM_API_KEY) opens them, with a start-up warning; no key at all: "
        "/attnprof/snapshot answers only what /metrics shows, the rest is off (403).",
    ),
    EnvVar(
        "ATTNPROF_SNAPSHOT_MAX_AGE_S", "float in [0, 3600]", "2",
        "The API server answers /attnprof/snapshot from a cache at most this old; at most one "
        "refresh (one collective RPC) is in flight, whatever the number of clients.",
    ),
    EnvVar(
        "ATTNPROF_RPC_TIMEOUT_S", "float in [0.1, 600]", "10",
        "Longest wait of the API server for the workers' answer to an attnprof RPC (snapshot "
        "refresh, trace, sampling switch); past it the last cached snapshot is served with its "
        "age (the RPC itself is never started twice). Never handed to vLLM's executor: the "
        "engine waits for the answer, which attnprof's worker methods keep short.",
    ),
    EnvVar(
        "ATTNPROF_SNAPSHOT_MAX_BYTES", "int in [4096, 536870912]", "67108864",
        "Largest /attnprof/snapshot body; a larger one is served without head statistics "
        "and says so (`truncated`; suggest-window --url then stops with one line). Head "
        "statistics of an 80-layer, 64-head model are about 17 MB.",
    ),
    EnvVar(
        "ATTNPROF_OTLP_HISTOGRAM", "explicit or exponential", "explicit",
        "How histograms are sent over OTLP (only when an OTEL_EXPORTER_OTLP_*ENDPOINT is set): "
        "`explicit` uses the same bucket bounds, counts and sum as Prometheus; `exponential` "
        "sends base-2 exponential histograms, converted exactly from bounds that are powers of "
        "two (other bounds stay explicit, with one warning); the request histograms then use "
        "power-of-two bounds, on /metrics too.",
    ),
    EnvVar(
        "ATTNPROF_OTLP_SPANS", "bool", "0",
        "Send every sampled step as an OpenTelemetry span (per-layer attention as child spans: "
        "backend, kernel, phase, tokens, sequence lengths; never prompt text, token ids or "
        "request ids) to the metrics' OTLP endpoint (or OTEL_EXPORTER_OTLP_TRACES_ENDPOINT). "
        "Built after the fact on each worker's export thread, never on the serving path. "
        "Needs an OTLP endpoint; set without one, start-up fails with one line.",
    ),
    EnvVar(
        "ATTNPROF_TRACE_OPEN", "bool", "0",
        "Let `GET /attnprof/trace` answer when no API key is configured at all (by default it "
        "then answers 403, like `POST /attnprof/sampling`: a trace shows per-step batch sizes "
        "and sequence lengths, which with one request in a batch are one user's).",
    ),
    EnvVar(
        "ATTNPROF_TRACE_MAX_RANGES", "int in [1, 500000]", "150000",
        "Most layer ranges (one per sampled attention call) in one live trace, all workers "
        "together; later steps are left out and `truncated` says so. The default keeps an "
        "80-layer x 8-rank trace under 64 MB of JSON.",
    ),
    EnvVar(
        "ATTNPROF_TRACE_MAX_RANGES_PER_WORKER", "int in [1, 200000]", "40000",
        "Most layer ranges one worker keeps for one live trace (its memory bound while the "
        "trace records); the worker stops recording there and says so.",
    ),
    EnvVar(
        "ATTNPROF_RANK_SYNC", "one of auto, file, rpc", "auto",
        "How tensor-parallel ranks agree on the overhead budget's scale, so they sample the "
        "same steps: `file`, the first rank's announcements in a node-local file; `rpc`, "
        "carried by the API server's poll and applied by every rank at that RPC (ranks on "
        "other nodes; it throttles only once the API server's poll carries a scale); `auto`, "
        "`rpc` when vLLM's parallel config spans several nodes (`--nnodes`), else `file` "
        "(set `rpc` by hand for Ray across nodes).",
    ),
    EnvVar(
        "ATTNPROF_FAULT_DELAY_S", "float in [0, 60]", "0",
        "Testing only: every attnprof_* worker method first sleeps this long, to prove a "
        "worker answer later than ATTNPROF_RPC_TIMEOUT_S leaves the engine serving.",
    ),
)


def by_name(name: str) -> EnvVar:
    for var in VARIABLES:
        if var.name == name:
            return var
    raise KeyError(name)


def markdown_table() -> str:
    """The README's configuration table, generated (and checked by a test)."""
    lines = ["| variable | type | default | meaning |", "|---|---|---|---|"]
    for v in VARIABLES:
        lines.append(f"| `{v.name}` | {v.type} | `{v.default}` | {v.help} |")
    return "\n".join(lines)
