"""KV pressure on a real vLLM server: long documents at high concurrency fill the demo's
1 GiB KV cache; attnprof's peak usage and preemptions agree with vLLM's own /metrics, and the
verdict is KV-bound for that mix and not for short chats.

The cache is the demo's size (``--kv-cache-memory-bytes`` 1 GiB, as tools/server.py gives
the demo) and is filled fast by a tiny random-weight Llama whose token costs a lot of KV:
4 layers x 16 KV heads x head_dim 256 x (K + V) x 4 B (fp32) = 128 KiB per token, so 1 GiB
holds 8,192 tokens (64 of vLLM-CPU's 128-token blocks), with a 64-wide residual stream so
that the projections stay cheap.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from attnprof.aggregate.kv import USAGE_BOUNDS
from attnprof.analyze.window import window_between
from attnprof.contracts.snapshot import Snapshot
from attnprof.facts.kv import blocks_held
from attnprof.tools.http import get_text
from attnprof.tools.server import VllmServer
from attnprof.tools.traffic import build_long_document_mix, run_traffic
from tests.conftest import get_snapshot, metric_value, poll_metrics, running_tiny_server

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

KEY = "kv-pressure-test-key"
KV_BYTES = 1 << 30  # the demo's cache
LAYERS, KV_HEADS, HEAD_DIM = 4, 16, 256
BYTES_PER_TOKEN = 2 * KV_HEADS * HEAD_DIM * 4  # per layer, fp32 K + V


def build_kv_heavy_model(out: Path, tokenizer_dir: Path) -> Path:
    """The tiny model's tokenizer on a Llama with 128 KiB of KV per token (random weights)."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    cfg = LlamaConfig(vocab_size=tok.vocab_size, hidden_size=64, intermediate_size=128,
                      num_hidden_layers=LAYERS, num_attention_heads=KV_HEADS,
                      num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM,
                      max_position_embeddings=2048, bos_token_id=1, eos_token_id=2,
                      tie_word_embeddings=True)
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).save_pretrained(out)
    tok.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def kv_model(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_kv_heavy_model(tmp_path_factory.mktemp("kv-heavy"), tiny_model)


@pytest.fixture(scope="module")
def kv_server(kv_model: Path, tmp_path_factory: pytest.TempPathFactory
              ) -> Iterator[VllmServer]:
    with running_tiny_server(kv_model, tmp_path_factory, "kv-pressure.log",
                             {"ATTNPROF_SAMPLE_RATE": "0.05", "ATTNPROF_API_KEY": KEY,
                              "ATTNPROF_SNAPSHOT_MAX_AGE_S": "0"},
                             max_model_len=2048, kv_bytes=KV_BYTES) as srv:
        yield srv


def _snap(srv: VllmServer) -> Snapshot:
    return Snapshot.from_json(get_snapshot(srv.base_url, key=KEY))


class _GaugePoller:
    """Max of vLLM's ``vllm:kv_cache_usage_perc`` (a current value) polled during a run."""

    def __init__(self, base_url: str) -> None:
        self.url = base_url + "/metrics"
        self.max = 0.0
        self.polls = 0
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        # A scrape that fails or is slow on a loaded machine is counted, not fatal: a dead
        # thread would leave a max of nothing and fail the test for the machine's sake.
        while not self._stop.is_set():
            try:
                v = metric_value(get_text(self.url, timeout=30.0), "vllm:kv_cache_usage_perc")
            except Exception as e:  # recorded and shown by the assertion
                self.errors.append(repr(e))
                v = None
            if v is not None:
                self.max = max(self.max, v)
                self.polls += 1
            time.sleep(0.05)

    def __enter__(self) -> _GaugePoller:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        # Scrapes can take seconds on a loaded machine: the run may end before the second
        # poll. Wait (bounded) for two, so the lower bound stands on at least two readings.
        deadline = time.monotonic() + 60
        while self.polls < 2 and self._thread.is_alive() and time.monotonic() < deadline:
            time.sleep(0.05)
        self._stop.set()
        self._thread.join(60)  # a hang bound; max and polls are read only once it ended
        assert not self._thread.is_alive()


def _bucket(u: float) -> int:
    """Index of the usage-histogram bucket that holds ``u``."""
    return next(i for i, b in enumerate(USAGE_BOUNDS) if u <= b + 1e-12)


def _agrees_with_gauge(peak: float | None, poller: _GaugePoller, steady: bool = True) -> None:
    """attnprof sees every stats batch, a poller of vLLM's gauge only some: the polled max is
    a lower bound. ``steady``: the usage held near its peak for most of the run (the chats),
    so the peak is also in the polled max's histogram bucket or the next one up (a constant
    peak would not be). Not so for the documents' short near-full window, which a poller
    whose scrapes take seconds on a busy machine can miss (there the peak is proven by
    vLLM's preemptions instead)."""
    assert poller.polls >= 2 and peak is not None, (poller.polls, peak, poller.errors[-3:])
    assert poller.max - 1e-9 <= peak <= 1.0, (peak, poller.max)
    if steady:
        assert _bucket(peak) - _bucket(poller.max) <= 1, (peak, poller.max)


def test_long_documents_fill_the_cache_and_agree_with_vllm(kv_server: VllmServer,
                                                          kv_model: Path) -> None:
    from transformers import AutoTokenizer

    t_start = time.monotonic()
    tok = AutoTokenizer.from_pretrained(kv_model)
    url = kv_server.base_url
    s0 = _snap(kv_server)
    # Short chats (40-token prompts, 48 generated: one block each) at concurrency 4: busy
    # long enough (several times MIN_BUSY_S) to be judged on evidence, not "too little traffic".
    short = build_long_document_mix(tok, n=48, prompt_tokens=40, max_tokens=48, seed=1)
    with _GaugePoller(url) as chat_poller:
        assert all(r.ok for r in run_traffic(url, "tiny", short, concurrency=4))
    s1 = _snap(kv_server)
    # Long documents: 16 x (600 prompt + 64 generated) tokens, 16 at once. A prompt takes 5
    # blocks, so 12 fit in the 63 usable blocks (one is vLLM's null block); past token 640
    # each needs a sixth, 3 are free: vLLM preempts.
    docs = build_long_document_mix(tok, n=16, prompt_tokens=600, max_tokens=64, seed=2)
    with _GaugePoller(url) as poller:
        results = run_traffic(url, "tiny", docs, concurrency=16)
    assert all(r.ok for r in results), [r.error for r in results if not r.ok]
    s2 = _snap(kv_server)

    chats = window_between(s0, s1).kv_pressure
    long_docs = window_between(s1, s2).kv_pressure
    assert chats is not None and long_docs is not None
    print("short:", chats.to_json(), "vLLM polled max", chat_poller.max)
    print("long:", long_docs.to_json(), "vLLM polled max", poller.max, "polls", poller.polls)
    assert chats.verdict != "kv_bound", chats.evidence
    assert not any("too little traffic" in e for e in chats.evidence), chats.evidence
    assert chats.busy_seconds > 0 and chats.peak is not None and chats.peak < 0.9
    _agrees_with_gauge(chats.peak, chat_poller)
    assert long_docs.verdict == "kv_bound", long_docs.evidence
    assert long_docs.class_share.get("medium", 0.0) > 0.9

    kv = s2.requests.kv_pressure if s2.requests is not None else None
    assert kv is not None and kv.peak is not None
    # the cache filled: attnprof's peak (vLLM's preemptions, below, say so on their own)
    assert kv.peak >= 0.9 and long_docs.peak is not None and long_docs.peak >= 0.9, \
        (kv.peak, long_docs.peak, poller.max)
    _agrees_with_gauge(kv.peak, poller, steady=False)
    _agrees_with_gauge(long_docs.peak, poller, steady=False)

    def agreed(text: str) -> bool:
        v = metric_value(text, "vllm:num_preemptions_total")
        return v is not None and metric_value(text, "attnprof_kv_preemptions_total") == v

    metrics = poll_metrics(url, agreed)
    vllm_preempted = metric_value(metrics, "vllm:num_preemptions_total")
    print("preemptions: vLLM", vllm_preempted, "attnprof", kv.preemptions,
          "test seconds", round(time.monotonic() - t_start, 1))
    assert vllm_preempted is not None and vllm_preempted > 0
    assert metric_value(metrics, "attnprof_kv_preemptions_total") == vllm_preempted
    assert kv.preemptions == vllm_preempted
    assert metric_value(metrics, "attnprof_kv_cache_usage_peak_ratio") == pytest.approx(kv.peak)
    assert metric_value(metrics, "attnprof_kv_verdict", verdict="kv_bound") == 1.0

    # Capacity from vLLM's own cache size (num_gpu_blocks x block_size), in whole blocks.
    info = _cache_info(metrics)
    a = s2.kv_pressure
    assert a is not None and a.capacity_tokens is not None and info is not None
    blocks, bs = int(info["num_gpu_blocks"]), int(info["block_size"])
    assert a.capacity_tokens == blocks * bs
    assert a.capacity_tokens * LAYERS * BYTES_PER_TOKEN <= KV_BYTES  # the demo's 1 GiB
    assert a.capacity_tokens * LAYERS * BYTES_PER_TOKEN > KV_BYTES * 0.9
    for q in ("p50", "p99"):  # whole blocks of the usable 63
        ctx = a.context_tokens[q]
        assert a.capacity_sequences[q] == (blocks - 1) // blocks_held(ctx, None, bs), q
    assert [lay.bytes_per_token for lay in kv.layers] == [BYTES_PER_TOKEN] * LAYERS


def _cache_info(text: str) -> dict[str, Any] | None:
    from prometheus_client.parser import text_string_to_metric_families

    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == "vllm:cache_config_info" and "num_gpu_blocks" in s.labels:
                return dict(s.labels)
    return None
