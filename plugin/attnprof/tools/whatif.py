"""Run measured what-ifs: a baseline vLLM server and, one at a time, a variant server with a
what-if's flags beside it on the same machine, replaying one traffic shape in alternating
paired rounds (baseline first in even rounds, variant first in odd ones, so a drift of the
machine cancels), as ``benchmarks/serving_safety.py`` does.

Per arm and round: prompt + generated tokens per second of wall time, time to first token
and inter-token gaps (p50, p99) from streamed completions, requests refused, and vLLM's
preemption counter. Per variant: vLLM's own KV capacity (its log line), and where outputs can
change, greedy agreement and KL against the baseline on a held-out sample. Both servers run
without attnprof (the plugin off): what is measured is vLLM with and without the flag.

Prompts are slices of real English prose (the Python reference manual that ships with
CPython, as the demo's documents), never recorded text: only the recorded lengths are used.
"""

from __future__ import annotations

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
from attnprof.analyze.whatif import draw_lengths, paired_interval
from attnprof.contracts.redact import redact_argv, redact_value
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

__all__ = ["Corpus", "Request", "RoundResult", "RunConfig", "Variant", "WhatifError",
           "draw_requests", "run_round", "run_whatifs", "shown_flags", "variant_args"]

SERVED = "whatif"
_PREEMPT = re.compile(r"^vllm:num_preemptions_total(?:\{[^}]*\})? ([0-9.eE+-]+)$", re.M)


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
    out = []
    for f in flags:
        try:
            words = shlex.split(f)
        except ValueError:
            out.append(redact_value(f))
            continue
        clean = redact_argv(words)
        out.append(f if clean == words else shlex.join(clean))
    return out


@dataclass
class RunConfig:
    model_dir: Path
    baseline_args: list[str]
    rounds: int = 4
    duration_s: float = 8.0
    seed: int = 0
    log_dir: Path | None = None
    agreement_samples: int = 6
    agreement_tokens: int = 16
    top_k: int = 5
    ready_timeout_s: float = 600.0
    eager: bool = True
    max_requests_per_round: int = 200


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
    preemptions: float | None = 0.0

    def stats(self) -> ArmStats:
        return ArmStats(requests=self.requests, refused=self.refused,
                        tokens_per_s=self.tokens_per_s, ttft_p50_s=self.ttft_p50,
                        ttft_p99_s=self.ttft_p99, itl_p50_s=self.itl_p50,
                        itl_p99_s=self.itl_p99, preemptions=self.preemptions)


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

    def start(self, stop: Callable[[], bool] | None) -> str | None:
        """None once ready, else vLLM's one-line reason."""
        from attnprof.tools.server import ServerError, StopRequested

        self.srv.start()
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
            if any(c.get("text") for c in choices if isinstance(c, dict)):
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


def _run_arm(server: _Server, reqs: list[Request], concurrency: int, arm: _Arm) -> str | None:
    """One arm's round; None, or the one-line error that failed it."""
    before = server.preemptions()
    rr = run_round(server.srv.base_url, reqs, concurrency, server.srv.api_key)
    if rr.error is not None:
        return rr.error
    arm.requests += rr.requests
    arm.refused += rr.refused
    arm.tokens_per_s.append(rr.tokens_per_s)
    ttft = [x for x in rr.ttft_s if x is not None]
    arm.ttft_p50.append(_pct(ttft, 0.5))
    arm.ttft_p99.append(_pct(ttft, 0.99))
    arm.itl_p50.append(_pct([x for x in rr.itl_s if x is not None], 0.5))
    arm.itl_p99.append(_pct([x for x in rr.itl_s if x is not None], 0.99))
    after = server.preemptions()
    if before is None or after is None or arm.preemptions is None:
        arm.preemptions = None
    else:
        arm.preemptions += after - before
    return None


def _topk(server: _Server, prompt: str, n: int, k: int) -> tuple[list[str], list[dict[str, float]]]:
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


def _agreement(base: _Server, var: _Server, prompts: list[str], cfg: RunConfig) -> Agreement:
    positions = agree = 0
    kls: list[float] = []
    for prompt in prompts:
        bt, bl = _topk(base, prompt, cfg.agreement_tokens, cfg.top_k)
        vt, vl = _topk(var, prompt, cfg.agreement_tokens, cfg.top_k)
        for i in range(min(len(bt), len(vt))):
            positions += 1
            if i < len(bl) and i < len(vl):
                kls.append(_kl_lumped(bl[i], vl[i]))
            if bt[i] != vt[i]:
                break
            agree += 1
    return Agreement(samples=len(prompts), positions=positions,
                     greedy_agreement=agree / positions if positions else 0.0,
                     mean_kl=statistics.fmean(kls) if kls else None, top_k=cfg.top_k)


def _int_arg(args: Sequence[str], flag: str) -> int | None:
    """The last value ``flag`` takes in ``args`` (as argparse reads it), as an integer."""
    found = None
    for i, a in enumerate(args):
        if a.startswith(flag + "="):
            found = a.split("=", 1)[1]
        elif a == flag and i + 1 < len(args):
            found = args[i + 1]
    try:
        return int(found) if found is not None else None
    except ValueError:
        return None


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


def run_whatifs(cfg: RunConfig, shape: TrafficShape, variants: Sequence[Variant],
                tokenizer: Any, *, progress: Callable[[str], None] | None = None,
                stop: Callable[[], bool] | None = None) -> WhatifRun:
    """Measure every variant against one baseline server. ``progress`` is called once per
    unit of work (a server start, an arm's round, an agreement sample); :class:`WhatifError`
    when the baseline cannot start or a stop is asked."""
    t_run = time.monotonic()
    tick = progress or (lambda _msg: None)
    corpus = Corpus(tokenizer, max(8192, shape.max_prompt_tokens * 4), cfg.seed)

    def requests(seed: int, n: int) -> list[Request]:
        return draw_requests(corpus, shape, seed, n)

    warm = requests(cfg.seed + 10_000, max(2, shape.concurrency * 2))
    held_out = [Request(corpus.text(random.Random(cfg.seed + 20_000 + i), x), 0)
                for i, x in enumerate(sorted(draw_lengths(shape, cfg.agreement_samples,
                                                          cfg.seed + 20_000)))]
    base = _Server(cfg, list(cfg.baseline_args), "baseline")
    reason = base.start(stop)
    tick("baseline started")
    if reason is not None:
        raise WhatifError(f"the baseline server could not start: {reason}")
    results: list[VariantResult] = []
    try:
        scratch = _Arm()
        t0 = time.monotonic()
        err = _run_arm(base, warm, shape.concurrency, scratch)
        if err is not None:
            raise WhatifError(f"the baseline failed its warm-up: {err}")
        per_s = (len(warm) / max(1e-9, time.monotonic() - t0))
        n = int(min(cfg.max_requests_per_round,
                    max(shape.concurrency, math.ceil(cfg.duration_s * per_s))))
        ctx = _Context(cfg, shape, base, base.kv_tokens(), warm, n, requests, held_out, stop)
        for i, v in enumerate(variants):
            if stop is not None and stop():
                raise WhatifError("stopped")
            # Fresh prompts for every variant: the baseline serves all of them, and a prompt
            # it saw before would hit its prefix cache while the new variant's is cold.
            results.append(_measure(ctx, v, cfg.seed + 1000 * (i + 1), tick))
    finally:
        base.stop()
    return WhatifRun(time=time.time(), model=cfg.model_dir.name,
                     max_model_len=_int_arg(cfg.baseline_args, "--max-model-len"),
                     in_flight_tokens=_int_arg(cfg.baseline_args, "--max-num-batched-tokens")
                     or _vllm_default("max_num_batched_tokens"),
                     block_size=_int_arg(cfg.baseline_args, "--block-size")
                     or _vllm_default("block_size"),
                     baseline_flags=redact_argv(cfg.baseline_args), traffic=shape,
                     rounds=cfg.rounds, duration_s=cfg.duration_s, variants=results,
                     seconds=time.monotonic() - t_run)


@dataclass
class _Context:
    """What every variant of a run is measured with: the baseline and the traffic."""

    cfg: RunConfig
    shape: TrafficShape
    base: _Server
    base_kv: int | None
    warm: list[Request]
    n: int
    """Requests per arm per round."""
    requests: Callable[[int, int], list[Request]]
    """(seed, count) -> the requests of a round."""
    held_out: list[Request]
    stop: Callable[[], bool] | None


def _measure(ctx: _Context, v: Variant, seed: int, tick: Callable[[str], None]
             ) -> VariantResult:
    """One variant: start it, warm it, run the paired rounds (round r's requests from
    ``seed + r``) and the agreement sample; the progress bar always advances by the units
    planned (1 + 2 x rounds + agreement)."""
    planned = 1 + ctx.cfg.rounds * 2 + int(v.outputs_change)
    done = 0

    def step(msg: str) -> None:
        nonlocal done
        done += 1
        tick(msg)

    try:
        return _measure_steps(ctx, v, seed, step)
    finally:
        while done < planned:
            step(v.what_if)


def _measure_steps(ctx: _Context, v: Variant, seed: int, step: Callable[[str], None]
                   ) -> VariantResult:
    t0 = time.monotonic()
    cfg, base = ctx.cfg, ctx.base
    shown = shown_flags(v.flags)

    def ended(status: VariantStatus, reason: str, **kw: Any) -> VariantResult:
        return VariantResult(what_if=v.what_if, flags=shown, status=status,
                             reason=redact_value(reason), seconds=time.monotonic() - t0, **kw)

    try:
        args = variant_args(v.flags)
    except ValueError as bad:
        return ended("could_not_start", str(bad))
    var = _Server(cfg, [*cfg.baseline_args, *args], v.what_if)
    reason = var.start(ctx.stop)
    step(f"{v.what_if} started")
    if reason is not None:
        return ended("could_not_start", reason, baseline_kv_capacity_tokens=ctx.base_kv)
    b, w = _Arm(), _Arm()
    try:
        _run_arm(var, ctx.warm, ctx.shape.concurrency, _Arm())
        for r in range(cfg.rounds):
            if ctx.stop is not None and ctx.stop():
                raise WhatifError("stopped")
            reqs = ctx.requests(seed + r, ctx.n)
            order = ((base, b), (var, w)) if r % 2 == 0 else ((var, w), (base, b))
            for srv, arm in order:
                err = _run_arm(srv, reqs, ctx.shape.concurrency, arm)
                step(f"{v.what_if} round {r + 1}")
                if err is not None:
                    which = "baseline" if srv is base else "variant"
                    return ended("failed", f"round {r + 1} on the {which}: {err}")
        agreement = None
        if v.outputs_change:
            try:
                agreement = _agreement(base, var, [q.prompt for q in ctx.held_out], cfg)
            except http.HttpError as bad:
                return ended("failed", f"agreement sample: {bad}")
            step(f"{v.what_if} agreement")
        kv = var.kv_tokens()
    finally:
        var.stop()
    changes = {}
    for metric, xb, xv in (("tokens_per_s", b.tokens_per_s, w.tokens_per_s),
                           ("ttft_p50", b.ttft_p50, w.ttft_p50),
                           ("ttft_p99", b.ttft_p99, w.ttft_p99),
                           ("itl_p50", b.itl_p50, w.itl_p50),
                           ("itl_p99", b.itl_p99, w.itl_p99)):
        iv = paired_interval(xb, xv)
        if iv is not None:
            changes[metric] = iv
    return VariantResult(what_if=v.what_if, flags=shown, status="measured",
                         kv_capacity_tokens=kv, baseline_kv_capacity_tokens=ctx.base_kv,
                         rounds=cfg.rounds, baseline=b.stats(), variant=w.stats(),
                         changes=changes, agreement=agreement,
                         seconds=time.monotonic() - t0)
