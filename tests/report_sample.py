"""A realistic cost report built by hand (one Llama-8B fleet of 4 replicas on H100s over
24 h), for the renderers' tests and the docs picture; and a headless-Chromium helper that
loads a page, records console errors and every request, and takes a full-page screenshot.

    from tests.report_sample import sample_report, screenshot
    Path("r.html").write_text(render_html(sample_report()))
    screenshot(Path("r.html"), Path("docs/img/report.png"))
"""

from __future__ import annotations

import base64
import json
import math
import os
import select
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from attnprof.contracts.provenance import Hardware, ModelIdentity, Provenance
from attnprof.contracts.report import (
    Apply,
    BackendTime,
    ContextDistribution,
    Drift,
    Fallback,
    FleetSaving,
    KvMemory,
    LayerTime,
    ModelReport,
    Money,
    Report,
    ReportSource,
    TimeBreakdown,
    Traffic,
    UsagePoint,
    WhatIf,
)
from attnprof.exporters.money import saving_lines

__all__ = ["CHROMIUM", "PageLoad", "load_page", "sample_report", "screenshot"]

START = 1748736000.0  # 2025-06-01 00:00 UTC
DAY = 86400.0
MODEL = "meta-llama/Llama-3.1-8B-Instruct"
HOURS_PER_MONTH = 730.0
MEAN_REPLICAS = 3.1
"""The fleet's mean replicas over the day (of 4 counted): the autoscaled figures' base."""


def sample_report(price: float | None = 2.5) -> Report:
    """A full report: 32 layers (L30-L31 on an unfused fallback), four what-ifs (fp8 KV
    replay-validated; a sliding window the installed vLLM does not support; a head split
    that needs a kernel change; the fallback fix), 48 usage points, money priced at
    ``price`` per GPU-hour or, with None, GPU-hours only."""
    requests = 182_400.0
    prompt, gen = requests * 1980, requests * 320
    tok_s = (prompt + gen) / DAY
    replicas, gpus = 4, 1.0
    gph_mtok = replicas * gpus / (tok_s * 3600 / 1e6)
    monthly_gph = replicas * gpus * HOURS_PER_MONTH

    def cost(g: float | None) -> float | None:
        return None if price is None or g is None else g * price

    bounds = [128.0 * 2**i for i in range(11)]  # 128 .. 131072
    counts = [2100.0, 5800, 14800, 38900, 52300, 38200, 19400, 7300, 2800, 700, 100, 0]
    ctx = ContextDistribution(bounds=bounds, counts=counts, p50=1650.0, p90=6100.0,
                              p99=21500.0, p999=48200.0, max=97800.0,
                              estimated_from_buckets=True)
    traffic = Traffic(requests=requests, requests_per_s=requests / DAY, tokens_per_s=tok_s,
                      prompt_tokens=prompt, generation_tokens=gen, max_model_len=131072,
                      context=ctx,
                      drift=Drift(first_p50=1540.0, second_p50=1760.0, first_p99=19800.0,
                                  second_p99=23400.0,
                                  shift="Contexts grew in the second half: p50 +14%, "
                                        "p99 +18%."))

    per_layer_t = [48.0 + 4.0 * math.sin(i / 3.0) for i in range(30)] + [101.0, 104.0]
    total_attn = sum(per_layer_t)
    per_layer = [LayerTime(layer=f"L{i}", backend="TRITON_ATTN" if i >= 30 else "FLASH_ATTN",
                           fused=i < 30, time_s=t, share=t / total_attn)
                 for i, t in enumerate(per_layer_t)]
    fused_t = sum(per_layer_t[:30])
    fb_t = total_attn - fused_t
    by_backend = [
        BackendTime(backend="FLASH_ATTN", phase="prefill", time_s=fused_t * 0.29,
                    share=fused_t * 0.29 / total_attn),
        BackendTime(backend="FLASH_ATTN", phase="decode", time_s=fused_t * 0.71,
                    share=fused_t * 0.71 / total_attn),
        BackendTime(backend="TRITON_ATTN", phase="prefill", time_s=fb_t * 0.3,
                    share=fb_t * 0.3 / total_attn),
        BackendTime(backend="TRITON_ATTN", phase="decode", time_s=fb_t * 0.7,
                    share=fb_t * 0.7 / total_attn),
    ]
    tb = TimeBreakdown(
        attention_share={"prefill": 0.28, "decode": 0.43},
        model_time_s={"prefill": 1260.0, "decode": 3140.0},
        by_backend=by_backend, per_layer=per_layer,
        fallbacks=[Fallback(layers=["L30", "L31"], backend="TRITON_ATTN",
                            reason="attention sinks on these layers; the installed "
                                   "FLASH_ATTN build has no sink support",
                            fix="--attention-backend=FLASHINFER",
                            gain="2.1x faster per call on these layers (measured: the "
                                 "server ran both paths)")],
        overall_share=(0.28 * 1260 + 0.43 * 3140) / 4400)

    cap_tokens = 4 * 425_984.0
    usage = [UsagePoint(t=START + 1800.0 * k,
                        usage=round(min(0.97, max(0.08, 0.55 - 0.38 * math.cos(
                            2 * math.pi * k / 48) + 0.04 * math.sin(k))), 4))
             for k in range(48)]
    kv = KvMemory(bytes_per_token=131072.0, kv_dtype="bfloat16", capacity_tokens=cap_tokens,
                  capacity_sequences={"p50": cap_tokens / 1650, "p99": cap_tokens / 21500},
                  usage_p95=0.88, usage_peak=0.97, above_90_fraction=0.062, preemptions=412.0,
                  waiting_fraction=0.041, verdict="KV-bound at peak",
                  verdict_evidence=["usage above 90% for 6.2% of the window",
                                    "412 preemptions, all between 13:00 and 16:00 UTC",
                                    "requests waited 4.1% of the time while compute was "
                                    "below 60%"],
                  source="vllm", usage_over_time=usage, peak_concurrency=212.0,
                  peak_concurrency_basis="max of sum(vllm:num_requests_running)")

    def whatif(**kw: Any) -> WhatIf:
        base: dict[str, Any] = dict(
            inputs={}, attention_flop_saving=None, kv_saving=None,
            kv_bytes_freed_per_token=None, extra_sequences=None, replicas_now=None,
            replicas_after=None, time_saving=None, gpu_hours_per_mtok_after=None,
            cost_per_mtok_after=None, monthly_saving=None, monthly_gpu_hours_saved=None,
            notes=[])
        base.update(kw)
        return WhatIf(**base)

    mean_gph = MEAN_REPLICAS * gpus * HOURS_PER_MONTH
    fp8_after = gph_mtok * 3 / 4
    fb_saving = 0.012
    fb_after = gph_mtok * (1 - fb_saving)
    what_ifs = [
        whatif(id="fp8_kv", title="FP8 KV cache",
               formula="kv_saving = 1 - bytes(fp8) / bytes(kv_dtype); replicas_after = "
                       "ceil(peak_concurrency / (capacity_sequences_p50 / (1 - kv_saving)"
                       " / replicas))",
               inputs={"bytes_per_token": 131072.0, "kv_dtype": "bfloat16",
                       "peak_concurrency": 212.0, "p50_context": 1650.0},
               kv_saving=0.5, kv_bytes_freed_per_token=65536.0, extra_sequences=1032.7,
               replicas_now=4, replicas_after=3, gpu_hours_per_mtok_after=fp8_after,
               cost_per_mtok_after=cost(fp8_after),
               monthly_saving=None if price is None else HOURS_PER_MONTH * price,
               monthly_gpu_hours_saved=HOURS_PER_MONTH,
               # Measured: the money banks the time saving's lower bound, interval printed.
               time_saving=0.062, time_saving_low=0.021, time_saving_high=0.098,
               banked_time_saving=0.021, verdict="confirmed", compute_floor=2,
               evidence="measured",
               evidence_detail="measured on real vLLM servers: throughput +6.6% [+2.1%, "
                               "+10.9%] over 12 paired rounds on 3 instance pairs, KV "
                               "capacity 851,968 vs 425,984 tokens (vLLM's figures)",
               confidence="high", replicas_removed=1,
               autoscaled=FleetSaving(
                   share=0.5, monthly_gpu_hours_saved=mean_gph * 0.5,
                   monthly_saving=cost(mean_gph * 0.5),
                   gpu_hours_per_mtok_after=gph_mtok * 0.5,
                   cost_per_mtok_after=cost(gph_mtok * 0.5),
                   assumes="replicas follow load and memory sizes the fleet (KV-bound): the "
                           "KV saving is the share of GPU-hours saved; base: 3.10 mean "
                           "replicas (mean of Prometheus' replica count over the range)",
                   gpu_hours_saved_per_replica_month=gpus * HOURS_PER_MONTH * 0.5),
               apply=Apply(flags=["--kv-cache-dtype=fp8"], supported=True,
                           needs_change=None, checked_against="vllm 0.32.0")),
        whatif(id="window", title="Sliding window of 4K tokens on 24 of 32 layers",
               formula="attention_flop_saving = layers_windowed / layers x (1 - E[min(ctx, "
                       "w)] / E[ctx])",
               inputs={"window": 4096.0, "layers_windowed": 24.0, "mean_context": 2300.0},
               attention_flop_saving=0.19, kv_saving=0.21, kv_bytes_freed_per_token=27525.0,
               extra_sequences=274.0, time_saving=0.067,
               evidence="estimated", confidence="low", alternative_to=["head_split"],
               apply=Apply(flags=['--hf-overrides={"sliding_window": 4096, '
                                  '"max_window_layers": 8}'],
                           supported=False, needs_change=None,
                           checked_against="vllm 0.32.0 (LlamaForCausalLM ignores "
                                           "sliding_window)"),
               notes=["Quality impact not measured: run a replay with the window before "
                      "applying."]),
        whatif(id="head_split", title="Streaming heads: 20 of 32 KV heads on a 512-token window",
               formula="kv_saving = streaming_heads / kv_heads x (1 - 512 / E[ctx])",
               inputs={"streaming_heads": 20.0, "kv_heads": 32.0, "sink_tokens": 4.0},
               attention_flop_saving=0.41, kv_saving=0.38, kv_bytes_freed_per_token=49807.0,
               extra_sequences=632.0, replicas_now=4, replicas_after=3, time_saving=0.11,
               evidence="estimated", confidence="medium", alternative_to=["window"],
               apply=Apply(flags=[], supported=False,
                           needs_change="a kernel that runs some heads with a short window "
                                        "and others in full (DuoAttention-style); no vLLM "
                                        "flag gives it",
                           checked_against="vllm 0.32.0")),
        whatif(id="fallback", title="Fix the TRITON_ATTN fallback on L30-L31",
               formula="time_saving = sum_phase attention_share x fallback_share x "
                       "(1 - 1 / speedup)",
               inputs={"speedup": 2.1, "fallback_share": 0.061},
               # 1.2% of 4 replicas removes none whole: fixed 0, autoscaled 1.2%.
               time_saving=fb_saving, gpu_hours_per_mtok_after=gph_mtok,
               cost_per_mtok_after=cost(gph_mtok),
               monthly_saving=None if price is None else 0.0,
               monthly_gpu_hours_saved=0.0, replicas_removed=0,
               autoscaled=FleetSaving(
                   share=fb_saving, monthly_gpu_hours_saved=mean_gph * fb_saving,
                   monthly_saving=cost(mean_gph * fb_saving),
                   gpu_hours_per_mtok_after=fb_after, cost_per_mtok_after=cost(fb_after),
                   assumes="replicas follow load and compute sizes the fleet: the time "
                           "saving is the share of GPU-hours saved",
                   gpu_hours_saved_per_replica_month=gpus * HOURS_PER_MONTH * fb_saving),
               evidence="measured", evidence_detail="the server ran both paths",
               confidence="high",
               apply=Apply(flags=["--attention-backend=FLASHINFER"], supported=True,
                           needs_change=None, checked_against="vllm 0.32.0")),
    ]
    money = Money(gpu_hour_price=price, replicas=replicas,
                  replicas_basis="counted from Prometheus", gpus_per_replica=gpus,
                  gpu_hours_per_mtok=gph_mtok, cost_per_mtok=cost(gph_mtok),
                  monthly_gpu_hours=monthly_gph,
                  monthly_cost=None if price is None else monthly_gph * price,
                  hours_per_month=HOURS_PER_MONTH, mean_replicas=MEAN_REPLICAS,
                  mean_replicas_basis="mean of Prometheus' replica count over the range "
                                      "(24.0 h)")
    model = ModelReport(model=MODEL, traffic=traffic, time=tb, kv=kv, what_ifs=what_ifs,
                        money=money, ranking=["fp8_kv", "fallback"],
                        warnings=["2 of 4 replicas restarted during the window; their "
                                  "counters were joined at the reset."])
    model.savings = saving_lines(model)  # rendered as attnprof report renders them
    return Report(
        generated_at=START + DAY + 300,
        source=ReportSource(kind="prometheus", where=["http://prometheus.monitoring:9090"],
                            start=START, end=START + DAY, duration_s=DAY, range="24h"),
        models=[model],
        formulas={
            "gpu_hours_per_mtok": "replicas x gpus_per_replica / (tokens_per_s x 3600 / 1e6)",
            "cost_per_mtok": "gpu_hours_per_mtok x gpu_hour_price",
            "monthly_gpu_hours": "replicas x gpus_per_replica x hours_per_month",
            "time_saving": "sum_phase attention_share[phase] x attention_saving x "
                           "model_time_s[phase] / sum(model_time_s)",
            "monthly_saving": "monthly_gpu_hours_saved x gpu_hour_price",
        },
        versions={"attnprof": "0.9.0", "vllm": "0.32.0", "torch": "2.13.0",
                  "transformers": None},
        provenance=Provenance(attnprof="0.9.0", python="3.12.3", torch="2.13.0",
                              transformers="4.58.0", vllm="0.32.0",
                              hardware=Hardware(type="cuda", gpu_name="NVIDIA H100 80GB HBM3",
                                                compute_capability="9.0", driver="570.86"),
                              model=ModelIdentity(name=MODEL, config_sha256="ab" * 32),
                              command=["attnprof", "report", "--prometheus",
                                       "http://prometheus.monitoring:9090", "--range", "24h"],
                              time=START + DAY + 290, time_iso="2025-06-02T00:04:50Z"),
        report_seconds=3.4)


# ---------------------------------------------------------------------------------------
# Headless Chromium over the DevTools protocol (stdlib only: --remote-debugging-pipe)

CHROMIUM = "chromium"
WIDTH = 1280


@dataclass
class PageLoad:
    """What a page load did: console errors (console.error/assert, uncaught exceptions,
    error-level log entries such as "Failed to load resource"), failed requests and every
    request URL after the page itself."""

    console_errors: list[str] = field(default_factory=list)
    failed_requests: list[str] = field(default_factory=list)
    requests: list[str] = field(default_factory=list)
    height: int = 0
    """The page's full height in CSS pixels at 1280 wide."""
    png: bytes | None = None


class _Pipe:
    """A DevTools session over Chromium's fds 3 (commands in) and 4 (replies out), each
    message NUL-terminated JSON."""

    def __init__(self, proc: subprocess.Popen[bytes], w: int, r: int) -> None:
        self.proc, self.w, self.r = proc, w, r
        self.buf = b""
        self.next_id = 0
        self.events: list[dict[str, Any]] = []

    def _read(self, timeout: float) -> list[dict[str, Any]]:
        ready, _, _ = select.select([self.r], [], [], timeout)
        if not ready:
            return []
        chunk = os.read(self.r, 1 << 20)
        if not chunk:
            raise RuntimeError(f"chromium closed the DevTools pipe (exit {self.proc.poll()})")
        self.buf += chunk
        out = []
        while b"\0" in self.buf:
            msg, _, self.buf = self.buf.partition(b"\0")
            out.append(json.loads(msg))
        return out

    def call(self, method: str, params: dict[str, Any] | None = None,
             session: str | None = None, timeout: float = 60.0) -> dict[str, Any]:
        self.next_id += 1
        msg: dict[str, Any] = {"id": self.next_id, "method": method, "params": params or {}}
        if session:
            msg["sessionId"] = session
        os.write(self.w, json.dumps(msg).encode() + b"\0")
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            for m in self._read(0.2):
                if m.get("id") == self.next_id:
                    if "error" in m:
                        raise RuntimeError(f"{method}: {m['error']}")
                    return dict(m.get("result", {}))
                self.events.append(m)
        raise TimeoutError(f"chromium did not answer {method} in {timeout:.0f} s")

    def wait_for(self, method: str, timeout: float = 60.0) -> None:
        end = time.monotonic() + timeout
        while not any(e.get("method") == method for e in self.events):
            if time.monotonic() > end:
                raise TimeoutError(f"no {method} in {timeout:.0f} s")
            self.events.extend(self._read(0.2))

    def drain(self, seconds: float) -> None:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            self.events.extend(self._read(0.05))


def _require_chromium() -> str:
    path = shutil.which(CHROMIUM)
    if path is None:
        raise RuntimeError("chromium is not installed: `make test` installs it "
                           "(apt-get install chromium)")
    return path


def load_page(html_path: Path, *, screenshot: bool = True, settle_s: float = 0.3) -> PageLoad:
    """Load ``file://html_path`` in headless Chromium at 1280 px wide and return what
    happened (console errors, failed and all requests, the page height) and, with
    ``screenshot``, a full-page PNG. Raises RuntimeError when chromium is missing; never
    touches the network itself (the page may try: its requests are recorded)."""
    exe = _require_chromium()
    url = html_path.resolve().as_uri()
    to_r, to_w = os.pipe()
    from_r, from_w = os.pipe()

    def child_fds() -> None:  # Chromium reads commands on fd 3 and writes replies on fd 4
        os.dup2(to_r, 3)
        os.dup2(from_w, 4)

    with tempfile.TemporaryDirectory(prefix="attnprof-chromium-") as profile:
        proc = subprocess.Popen(
            [exe, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
             f"--window-size={WIDTH},900", "--remote-debugging-pipe", "--no-first-run",
             f"--user-data-dir={profile}", "about:blank"],
            preexec_fn=child_fds, pass_fds=(3, 4), stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        os.close(to_r)
        os.close(from_w)
        pipe = _Pipe(proc, to_w, from_r)
        try:
            target = pipe.call("Target.createTarget", {"url": "about:blank"})["targetId"]
            s = pipe.call("Target.attachToTarget", {"targetId": target, "flatten": True}
                          )["sessionId"]
            for domain in ("Page", "Runtime", "Log", "Network"):
                pipe.call(f"{domain}.enable", session=s)
            pipe.call("Emulation.setDeviceMetricsOverride",
                      {"width": WIDTH, "height": 900, "deviceScaleFactor": 1, "mobile": False},
                      session=s)
            pipe.call("Page.navigate", {"url": url}, session=s)
            pipe.wait_for("Page.loadEventFired")
            pipe.drain(settle_s)  # late console messages and failed loads
            metrics = pipe.call("Page.getLayoutMetrics", session=s)
            height = math.ceil(metrics["cssContentSize"]["height"])
            png = None
            if screenshot:
                shot = pipe.call("Page.captureScreenshot",
                                 {"format": "png", "captureBeyondViewport": True,
                                  "clip": {"x": 0, "y": 0, "width": WIDTH, "height": height,
                                           "scale": 1}}, session=s)
                png = base64.b64decode(shot["data"])
            events = list(pipe.events)
            try:
                pipe.call("Browser.close", timeout=5)
            except (RuntimeError, TimeoutError):
                pass
        finally:
            os.close(to_w)
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            os.close(from_r)
    return _summarise(events, url, height, png)


def _summarise(events: list[dict[str, Any]], url: str, height: int,
               png: bytes | None) -> PageLoad:
    out = PageLoad(height=height, png=png)
    urls: dict[str, str] = {}
    for e in events:
        method, p = e.get("method"), e.get("params", {})
        if method == "Runtime.consoleAPICalled" and p.get("type") in ("error", "assert"):
            text = " ".join(str(a.get("value", a.get("description", ""))) for a in p["args"])
            out.console_errors.append(f"console.{p['type']}: {text}")
        elif method == "Runtime.exceptionThrown":
            d = p.get("exceptionDetails", {})
            out.console_errors.append("exception: " + str(
                d.get("exception", {}).get("description", d.get("text", ""))))
        elif method == "Log.entryAdded" and p["entry"].get("level") == "error":
            ent = p["entry"]
            out.console_errors.append(f"{ent.get('source')}: {ent.get('text')} "
                                      f"{ent.get('url', '')}".strip())
        elif method == "Network.requestWillBeSent":
            req_url = p["request"]["url"]
            urls[p["requestId"]] = req_url
            if req_url != url:
                out.requests.append(req_url)
        elif method == "Network.loadingFailed":
            out.failed_requests.append(f"{urls.get(p['requestId'], '?')}: {p.get('errorText')}")
    return out


def screenshot(html_path: Path, png_path: Path) -> PageLoad:
    """Write a full-page 1280 px wide PNG of ``html_path`` to ``png_path`` (e.g.
    docs/img/report.png) and return the page load's record. Raises RuntimeError when
    chromium is missing."""
    res = load_page(html_path, screenshot=True)
    assert res.png is not None
    png_path.parent.mkdir(parents=True, exist_ok=True)
    png_path.write_bytes(res.png)
    return res
