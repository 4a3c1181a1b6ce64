"""Deterministic synthetic traffic: short chats and long documents (demo and benchmarks).

No data sets can be downloaded here, so documents are pseudo-English built from a fixed
word list with a seeded RNG; lengths are hit exactly by counting with the model's
tokenizer. Only lengths matter to attnprof, never the text.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from attnprof.tools.http import post_json

__all__ = ["Request", "Result", "build_chat_mix", "build_long_document_mix", "build_mix",
           "document", "run_traffic"]

_WORDS = (
    "the", "a", "system", "model", "request", "server", "memory", "cache", "token", "layer",
    "attention", "window", "head", "latency", "throughput", "engineer", "traffic", "budget",
    "cost", "report", "batch", "prefill", "decode", "length", "context", "kernel", "fused",
    "fallback", "metric", "alert", "dashboard", "sample", "profile", "budget", "river",
    "mountain", "city", "market", "history", "science", "music", "garden", "letter", "morning",
    "evening", "question", "answer", "problem", "solution", "reason", "result", "example",
    "number", "value", "table", "chapter", "story", "people", "water", "light", "power",
    "energy", "time", "year", "world", "hand", "place", "case", "week", "company", "group",
    "because", "while", "after", "before", "during", "within", "across", "through", "between",
    "under", "over", "about",
)
_TOPICS = ("cooking", "astronomy", "gardening", "databases", "history of Rome", "music theory",
           "networking", "sailing", "chess openings", "bird migration")


@dataclass
class Request:
    kind: str  # "chat" | "document"
    max_tokens: int
    messages: list[dict[str, str]] | None = None
    prompt: str | None = None
    target_prompt_tokens: int = 0
    ignore_eos: bool = False
    """Generate exactly ``max_tokens`` (vLLM's extra parameter): the KV a request holds
    then does not depend on when a random-weight model happens to emit EOS."""


@dataclass
class Result:
    kind: str
    ok: bool
    latency_s: float
    prompt_tokens: int = 0
    completion_tokens: int = 0
    error: str = ""
    extra: dict[str, Any] = field(default_factory=dict)


def pseudo_text(rng: random.Random, tok: Any, n_tokens: int) -> str:
    """Pseudo-English text of exactly ``n_tokens`` tokens (when the tokenizer allows)."""
    words: list[str] = []
    while True:
        sent = [rng.choice(_WORDS) for _ in range(rng.randint(6, 16))]
        words.append(" ".join(sent).capitalize() + ".")
        if len(words) % 8 == 0 and len(tok.encode(" ".join(words))) >= n_tokens:
            break
    ids = tok.encode(" ".join(words), add_special_tokens=False)[:n_tokens]
    return str(tok.decode(ids))


def document(rng: random.Random, tok: Any, n_tokens: int) -> str:
    """Real English technical prose of exactly ``n_tokens`` tokens.

    Drawn from the Python reference manual that ships with every CPython
    (``pydoc_data.topics``): deterministic for a seed and Python version, and with the
    attention structure of real documents (word salad has none), which the window advice
    depends on.
    """
    from pydoc_data.topics import topics

    names = sorted(topics)
    parts: list[str] = []
    while True:
        parts.append(topics[rng.choice(names)])
        text = "\n\n".join(parts)
        ids = tok.encode(text, add_special_tokens=False)
        if len(ids) >= n_tokens:
            return str(tok.decode(ids[:n_tokens]))


def build_mix(tokenizer: Any, seed: int = 0, chats: int = 16, doc_lengths: Sequence[int] = (
        600, 1200, 2000, 2900), chat_max_tokens: int = 24, doc_max_tokens: int = 8
              ) -> list[Request]:
    """Short chats (20-120 token questions) and long documents, shuffled with ``seed``."""
    rng = random.Random(seed)
    reqs: list[Request] = []
    for _ in range(chats):
        topic = rng.choice(_TOPICS)
        q = f"Tell me one fact about {topic}. " + pseudo_text(rng, tokenizer, rng.randint(10, 100))
        reqs.append(Request("chat", chat_max_tokens, messages=[{"role": "user", "content": q}]))
    for n in doc_lengths:
        body = document(rng, tokenizer, n)
        reqs.append(Request("document", doc_max_tokens,
                            prompt=f"Summarize the following document.\n\n{body}\n\nSummary:",
                            target_prompt_tokens=n))
    rng.shuffle(reqs)
    return reqs


def build_chat_mix(tokenizer: Any, n: int = 24, seed: int = 0, max_tokens: int = 24,
                   ignore_eos: bool = False) -> list[Request]:
    """Short chats only (20-120 token questions): the mix that should never be KV-bound."""
    reqs = build_mix(tokenizer, seed=seed, chats=n, doc_lengths=(), chat_max_tokens=max_tokens)
    for r in reqs:
        r.ignore_eos = ignore_eos
    return reqs


def build_long_document_mix(tokenizer: Any, n: int, prompt_tokens: int, max_tokens: int,
                            seed: int = 0) -> list[Request]:
    """``n`` documents of ``prompt_tokens`` tokens, each generating exactly ``max_tokens``:
    at high concurrency their KV outgrows the cache (docs/kv-pressure.md sizes it for the
    demo's 1 GiB cache), so vLLM queues and preempts."""
    rng = random.Random(seed)
    return [Request("document", max_tokens, prompt=document(rng, tokenizer, prompt_tokens),
                    target_prompt_tokens=prompt_tokens, ignore_eos=True) for _ in range(n)]


def _send(base_url: str, model: str, r: Request) -> Result:
    t0 = time.monotonic()
    try:
        if r.kind == "chat":
            body: dict[str, Any] = {"model": model, "messages": r.messages,
                                    "max_tokens": r.max_tokens, "temperature": 0.0}
            if r.ignore_eos:
                body["ignore_eos"] = True
            resp = post_json(base_url + "/v1/chat/completions", body)
        else:
            body = {"model": model, "prompt": r.prompt, "max_tokens": r.max_tokens,
                    "temperature": 0.0}
            if r.ignore_eos:
                body["ignore_eos"] = True
            resp = post_json(base_url + "/v1/completions", body)
        u = resp.get("usage") or {}
        return Result(r.kind, True, time.monotonic() - t0, int(u.get("prompt_tokens", 0)),
                      int(u.get("completion_tokens", 0)))
    except Exception as exc:
        return Result(r.kind, False, time.monotonic() - t0, error=f"{type(exc).__name__}: {exc}")


def run_traffic(base_url: str, model: str, reqs: Sequence[Request], concurrency: int = 4,
                on_done: Callable[[Result], None] | None = None) -> list[Result]:
    results: list[Result] = []
    lock = threading.Lock()

    def one(r: Request) -> None:
        res = _send(base_url, model, r)
        with lock:
            results.append(res)
            if on_done is not None:
                on_done(res)

    with ThreadPoolExecutor(max_workers=max(1, concurrency)) as ex:
        list(ex.map(one, reqs))
    return results
