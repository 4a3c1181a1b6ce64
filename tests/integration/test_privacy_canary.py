"""Privacy canary: no prompt text, completion text, token id or request id leaves the process
through any attnprof export.

One real vLLM server (the tiny model, attnprof at sample rate 1 with head statistics on every
prompt, an OTLP exporter pushing to a loopback receiver that decodes the official protos)
serves prompts that carry unique canary words, as text and as token ids. Then every way data
leaves attnprof is read back and scanned:

- ``/metrics`` (vLLM's Prometheus text, where attnprof's metrics live, unauthenticated);
- every OTLP request the receiver decoded (resource, scope, metric names, descriptions, units,
  every data point attribute, as a flat list and as the full message in JSON);
- ``GET /attnprof/snapshot`` with and without ``?head_stats=1``, the answer of
  ``POST /attnprof/sampling`` and the 401 answer to a request without the token;
- ``attnprof snapshot --json`` and ``attnprof snapshot`` (table), stdout and stderr;
- an offline ``attnprof profile`` of the tiny model fed with that snapshot (its traffic lengths
  and head statistics): ``profile.json``, ``trace.json``, ``scaling.png`` and its stdout/stderr;
- the files attnprof writes while serving (``PROMETHEUS_MULTIPROC_DIR``, ``ATTNPROF_RUN_DIR``);
- the server's whole log (API server, EngineCore, worker).

How each check would catch a leak (:func:`test_scanner_catches_injected_leaks` injects each of
these into copies and shows the scanner flags it; a clean copy is not flagged):

- a canary word in any label, attribute, JSON string or log line: case-insensitive substring;
- a request id (the completion's ``id``, e.g. ``cmpl-<hex>``; vLLM's internal ids extend it):
  the id and its random part, as substrings;
- token ids: small integers are everywhere (layer indices, counts, lengths), so a single id
  proves nothing; every run of integers separated only by JSON/list punctuation or whitespace
  (``[83, 87, 81]``, ``83 87 81``, ``["83","87"]``) is searched for any 5 consecutive ids of a
  canary's tokenization, which no count or histogram produces by chance.
- completion text: the completions (sampled with a seed, so not one repeated token) are looked
  for as well, their token ids as runs and their text as a substring.

Sanity, so that a passing scan means something: the canary words are in the request bodies
sent; vLLM's own answer (``echo`` and ``return_token_ids``) contains them and the canary's id
runs, which shows the test's tokenization is the server's and the scanner finds them in real
output; and every scanned export is non-empty and carries the data it should (requests
counted, head statistics folded, layers profiled).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import TINY_API_KEY, metric_value, running_tiny_server

# Unique words the tiny BPE (trained on attnprof's traffic words, byte-level) encodes as runs of
# byte and merge tokens: 9 to 13 ids each, none of them a vocabulary word.
CANARY_WORDS = ("quokkafjord", "xylophonequartz", "zebulonmarigold")
WINDOW = 5
"""Consecutive canary token ids that count as a leak (single small ints are everywhere)."""

_SEP = r"[\s,;\"'\[\]()]+"
_INT_RUN = re.compile(rf"(?<![\w.])\d+(?:{_SEP}\d+(?![\w.]))+")


@dataclass
class Canary:
    words: tuple[str, ...]
    id_seqs: dict[str, list[int]] = field(default_factory=dict)
    request_ids: list[str] = field(default_factory=list)
    secrets: tuple[str, ...] = ()
    """Strings that must never appear at all (the API key: SECURITY.md says never echoed)."""


def int_runs(text: str) -> Iterator[str]:
    """Every run of two or more integers separated only by punctuation or whitespace, as
    ``",83,87,81,"`` (integers that are parts of floats or names are not taken)."""
    for m in _INT_RUN.finditer(text):
        yield "," + ",".join(re.split(_SEP, m.group())) + ","


def leaks(text: str, canary: Canary) -> list[str]:
    """What of the canary ``text`` reveals (empty: nothing)."""
    found = []
    low = text.lower()
    found += [f"canary word {w!r}" for w in canary.words if w.lower() in low]
    found += ["the API key" for k in canary.secrets if k and k in text]
    for rid in canary.request_ids:
        for part in {rid, rid.split("-", 1)[-1]}:
            if len(part) >= 8 and part in text:
                found.append(f"request id {part!r}")
    windows = {name: {"," + ",".join(map(str, ids[i:i + WINDOW])) + ","
                      for i in range(max(1, len(ids) - WINDOW + 1))}
               for name, ids in canary.id_seqs.items()}
    runs = list(int_runs(text))
    for name, wins in windows.items():
        hit = next((w for w in wins for r in runs if w in r), None)
        if hit is not None:
            found.append(f"token ids of {name}: [{hit.strip(',')}]")
    return found


def otlp_texts(requests: Iterable[Any]) -> tuple[list[str], str]:
    """Every string an OTLP request carries (resource and data point attribute keys and
    values, scope, metric names, descriptions, units), and all requests in JSON."""
    from google.protobuf.json_format import MessageToJson  # type: ignore[import-untyped]

    flat: list[str] = []

    def any_value(v: Any) -> None:
        kind = v.WhichOneof("value")
        if kind == "array_value":
            for x in v.array_value.values:
                any_value(x)
        elif kind == "kvlist_value":
            attrs(v.kvlist_value.values)
        elif kind is not None:
            flat.append(str(getattr(v, kind)))

    def attrs(kvs: Iterable[Any]) -> None:
        for kv in kvs:
            flat.append(kv.key)
            any_value(kv.value)

    as_json = []
    for req in requests:
        as_json.append(MessageToJson(req))
        for rm in req.resource_metrics:
            attrs(rm.resource.attributes)
            for sm in rm.scope_metrics:
                flat += [sm.scope.name, sm.scope.version]
                attrs(sm.scope.attributes)
                for m in sm.metrics:
                    flat += [m.name, m.description, m.unit]
                    kind = m.WhichOneof("data")
                    for dp in getattr(m, kind).data_points if kind else ():
                        attrs(dp.attributes)
                        for ex in getattr(dp, "exemplars", ()):
                            attrs(ex.filtered_attributes)
    return flat, "\n".join(as_json)


# ----------------------------------------------------------------------------- no server


def test_scanner_catches_the_api_key() -> None:
    assert leaks("Authorization: Bearer s3cr3t-k3y", Canary((), secrets=("s3cr3t-k3y",)))
    assert leaks("no key here", Canary((), secrets=("s3cr3t-k3y",))) == []


def test_scanner_catches_injected_leaks() -> None:
    """Each kind of leak, injected into a copy of a realistic output, is flagged; the clean
    output is not (so the real scans below can fail)."""
    from opentelemetry.proto.collector.metrics.v1 import metrics_service_pb2 as pb

    can = Canary(("quokkafjord",), {"quokkafjord": [223, 83, 87, 81, 77, 77, 331, 76, 263, 70]},
                 ["cmpl-0123456789abcdef0123456789abcdef"])
    prom = ('attnprof_attention_calls_total{backend="CPU_ATTN",layer="0",model="tiny",'
            'phase="prefill"} 3.0\nattnprof_request_context_tokens_bucket{le="64.0",'
            'model="tiny"} 2.0\n')
    snap = json.dumps({"requests": {"values": [12, 40, 77, 83, 87, 263]}, "layers": [0, 1],
                       "counts": [0, 3, 1, 0, 0], "ratio": [0.83, 0.87, 0.81, 0.77, 0.77]})
    assert leaks(prom, can) == [] and leaks(snap, can) == []
    # Text in a label, in an attribute, in JSON, in a log line.
    assert leaks(prom.replace('model="tiny"', 'prompt="a Quokkafjord b"', 1), can)
    assert leaks(snap[:-1] + ', "prompt": "the quokkafjord"}', can)
    # Token ids: a JSON list, compact, quoted (protobuf JSON int64), space-separated, nested.
    for ids in ("[83, 87, 81, 77, 77]", "[223,83,87,81,77,77,331]", '["81", "77", "77", "331",'
                ' "76"]', "ids 87 81 77 77 331 ", "[[83, 87], [81, 77, 77]]"):
        assert leaks(snap[:-1] + f', "x": {ids}}}', can) or leaks(f"log: {ids}\n", can), ids
    # Fewer than WINDOW ids in a row, or the ids inside floats, are not a leak.
    assert leaks('{"x": [83, 87, 81, 77]}', can) == []
    assert leaks('{"x": [83.0, 87.0, 81.0, 77.0, 77.0]}', can) == []
    # A request id, whole or its random part.
    assert leaks("INFO finished cmpl-0123456789abcdef0123456789abcdef-0\n", can)
    assert leaks('{"rid": "0123456789abcdef0123456789abcdef"}', can)
    # OTLP: an attribute value, a nested array attribute, a metric name.
    req = pb.ExportMetricsServiceRequest()
    m = req.resource_metrics.add().scope_metrics.add().metrics.add()
    m.name = "attnprof.attention.calls"
    dp = m.sum.data_points.add()
    dp.as_double = 1.0
    kv = dp.attributes.add()
    kv.key, kv.value.string_value = "gen_ai.request.model", "tiny"
    flat, as_json = otlp_texts([req])
    assert "gen_ai.request.model" in flat and leaks("\n".join(flat) + as_json, can) == []
    kv.value.string_value = "tiny quokkafjord"
    assert all(leaks(t, can) for t in ("\n".join(otlp_texts([req])[0]), otlp_texts([req])[1]))
    kv.value.ClearField("string_value")
    for i in (83, 87, 81, 77, 77):
        kv.value.array_value.values.add().int_value = i
    assert leaks("\n".join(otlp_texts([req])[0]), can)  # an int array attribute, flattened
    dp.attributes.pop()
    m.name = "attnprof.quokkafjord"
    assert leaks("\n".join(otlp_texts([req])[0]), can)


# ----------------------------------------------------------------------------- one server


@pytest.fixture(scope="module")
def canary_server(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory
                  ) -> Iterator[tuple[Any, Any, Path]]:
    """The one server this module starts: head statistics on every prompt, OTLP to a loopback
    receiver, the API key required, and attnprof's run files in a directory the test reads."""
    from tests.otlp_receiver import OtlpReceiver

    files = tmp_path_factory.mktemp("canary-files")
    (files / "prometheus").mkdir()
    with OtlpReceiver(protocol="http/protobuf") as rx, running_tiny_server(
            tiny_model, tmp_path_factory, "privacy-canary.log",
            {"ATTNPROF_SAMPLE_RATE": "1.0", "ATTNPROF_SEED": "0",
             "ATTNPROF_HEAD_STATS_RATE": "1.0", "ATTNPROF_HEAD_STATS_MIN_TOKENS": "32",
             "ATTNPROF_OVERHEAD_BUDGET": "1.0", "ATTNPROF_SNAPSHOT_MAX_AGE_S": "0",
             "ATTNPROF_API_KEY": TINY_API_KEY,
             "PROMETHEUS_MULTIPROC_DIR": str(files / "prometheus"),
             "ATTNPROF_RUN_DIR": str(files / "run"),
             "OTEL_EXPORTER_OTLP_METRICS_ENDPOINT": rx.endpoint,
             "OTEL_EXPORTER_OTLP_METRICS_PROTOCOL": "http/protobuf",
             "OTEL_METRIC_EXPORT_INTERVAL": "500",
             # Spans of sampled steps too (to the same receiver's /v1/traces).
             "ATTNPROF_OTLP_SPANS": "1",
             "OTEL_SERVICE_NAME": "attnprof-canary"},
            max_model_len=512, kv_bytes=64 << 20) as srv:
        yield srv, rx, files


def _post(url: str, body: Mapping[str, Any], key: str | None = None) -> tuple[int, str]:
    headers = {"Content-Type": "application/json"}
    if key:
        headers["Authorization"] = f"Bearer {key}"
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers=headers,
                                 method="POST")
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as err:
        return err.code, err.read().decode()


def _get(url: str, key: str | None = None) -> tuple[int, str]:
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {key}"} if key else {})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as err:
        return err.code, err.read().decode()


def _cli(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ATTNPROF_", "VLLM_"))}
    env.update({"ATTNPROF_API_KEY": TINY_API_KEY, "HF_HUB_OFFLINE": "1",
                "VLLM_NO_USAGE_STATS": "1"})
    return subprocess.run([sys.executable, "-m", "attnprof.cli", *args], env=env,
                          capture_output=True, text=True, timeout=timeout)


def _read_tree(root: Path) -> dict[str, str]:
    """Every file under ``root`` as text (binary files as latin-1: strings inside show)."""
    return {str(p.relative_to(root)): p.read_bytes().decode("latin-1")
            for p in sorted(root.rglob("*")) if p.is_file()}


@dataclass
class Exports:
    canary: Canary
    sent: list[dict[str, Any]]
    answers: list[dict[str, Any]]
    outputs: dict[str, str]


@pytest.fixture(scope="module")
def exports(canary_server: tuple[Any, Any, Path], tiny_model: Path,
            tmp_path_factory: pytest.TempPathFactory) -> Exports:
    """Send the canary traffic, then read back every export (once, for all checks)."""
    from transformers import AutoTokenizer

    from attnprof.tools.traffic import _WORDS

    srv, rx, files = canary_server
    base = srv.base_url
    tok = AutoTokenizer.from_pretrained(tiny_model)
    canary = Canary(CANARY_WORDS, secrets=(TINY_API_KEY,))
    for w in CANARY_WORDS:
        for text in (w, " " + w):  # mid-prompt words carry the byte-level space
            canary.id_seqs[repr(text)] = tok(text, add_special_tokens=False)["input_ids"]
    filler = " ".join(_WORDS[:30])
    prompts: list[str | list[int]] = [
        f"{filler} {CANARY_WORDS[0]} {filler} {CANARY_WORDS[1]}",
        f"{CANARY_WORDS[2]} " * 6 + filler + f" {CANARY_WORDS[0]}" * 4,
        # The same canaries sent as token ids (the client tokenized them).
        tok(f"{filler} {CANARY_WORDS[1]} {CANARY_WORDS[2]} {filler}",
            add_special_tokens=False)["input_ids"],
    ]
    sent, answers = [], []
    for i, prompt in enumerate(prompts):
        # vLLM's own answer is the positive control: the first echoes the prompt's text,
        # the others return the prompt's and the completion's token ids. Those sample (seeded):
        # the random-weight model's greedy output repeats one token, too plain to look for.
        body = {"model": "tiny", "prompt": prompt, "max_tokens": 8, "min_tokens": 8,
                "ignore_eos": True, "temperature": 0.0 if i == 0 else 1.0, "seed": 7 + i,
                "echo": i == 0, "return_token_ids": i > 0}
        status, text = _post(base + "/v1/completions", body)
        assert status == 200, text[:500]
        out = json.loads(text)
        assert out["usage"]["completion_tokens"] == 8
        sent.append(body)
        answers.append(out)
        canary.request_ids.append(out["id"])
        if i > 0:
            # The completion is secret too: its text and its token ids, when distinctive
            # enough that no export could show them by chance.
            choice = out["choices"][0]
            if len(choice["text"].strip()) >= 12 and len(set(choice["token_ids"])) >= 3:
                canary.words += (choice["text"].strip(),)
            if len(set(choice["token_ids"])) >= 3:
                canary.id_seqs[f"completion {i}"] = list(choice["token_ids"])
    n = len(prompts)

    def settled(text: str) -> bool:
        # Every family the checks below need: the worker's export thread flushes on its own
        # clock, and head statistics count their queries inside a step while the per-layer
        # calls are folded at its end, so one flush can carry the first without the second
        # (seen once in CI: queries > 0, no attnprof_attention_calls_total yet).
        return ((metric_value(text, "attnprof_request_context_tokens_count") or 0) >= n
                and (metric_value(text, "attnprof_head_stats_queries_total") or 0) > 0
                and (metric_value(text, "attnprof_attention_calls_total") or 0) > 0)

    outputs: dict[str, str] = {}
    deadline = time.monotonic() + 30
    while True:
        # The snapshot refresh folds the workers' head-statistics deltas (and flushes).
        status, snap_hs = _get(base + "/attnprof/snapshot?head_stats=1", TINY_API_KEY)
        assert status == 200, snap_hs[:500]
        status, metrics = _get(base + "/metrics")
        assert status == 200
        if settled(metrics) or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    outputs["/metrics"] = metrics
    outputs["/attnprof/snapshot?head_stats=1"] = snap_hs
    outputs["/attnprof/snapshot"] = _get(base + "/attnprof/snapshot", TINY_API_KEY)[1]
    outputs["/attnprof/snapshot (no token: 401)"] = _get(base + "/attnprof/snapshot")[1]
    status, switched = _post(base + "/attnprof/sampling", {"sample_rate": 1.0}, TINY_API_KEY)
    assert status == 200, switched
    outputs["POST /attnprof/sampling"] = switched
    # OTLP: wait for an export that carries every request (the API server's histogram).
    deadline = time.monotonic() + 20
    while True:
        flat, as_json = otlp_texts(list(rx.requests))
        if '"attnprof.request.context"' in as_json and f'"count": "{n}"' in as_json:
            break
        if time.monotonic() > deadline:
            break
        time.sleep(0.5)
    outputs["OTLP (attributes, names, units)"] = "\n".join(flat)
    outputs["OTLP (requests as JSON)"] = as_json
    from google.protobuf.json_format import MessageToJson

    rx.wait_for_spans(lambda got: len(got) > 0, timeout=20)
    outputs["OTLP spans (as JSON)"] = "\n".join(MessageToJson(r) for r in rx.trace_requests)
    # A live trace, a record window and their diff, taken while canary traffic flows.
    work = tmp_path_factory.mktemp("canary-trace")

    done = threading.Event()

    def more_traffic() -> None:  # until the trace and the record are taken (the CLI starts
        while not done.is_set():  # in a second: traffic must still flow once armed)
            for prompt in prompts[:2]:
                _post(base + "/v1/completions", {**sent[0], "prompt": prompt, "echo": False})

    mover = threading.Thread(target=more_traffic)
    mover.start()
    try:
        tr = _cli("trace", "--url", base, "--steps", "2", "--timeout", "60", "--out",
                  str(work / "trace.json"), timeout=120)
        rec = _cli("record", "--url", base, "--duration", "2s", "--out",
                   str(work / "rec.json"), timeout=120)
    finally:
        done.set()
        mover.join()
    assert tr.returncode == 0 and rec.returncode == 0, tr.stderr[-2000:] + rec.stderr[-2000:]
    dif = _cli("diff", str(work / "rec.json"), str(work / "rec.json"), "--json", timeout=120)
    assert dif.returncode == 0, dif.stderr[-2000:]
    outputs["attnprof trace (stdout, stderr)"] = tr.stdout + tr.stderr
    outputs["attnprof record / diff (stdout, stderr)"] = (rec.stdout + rec.stderr + dif.stdout
                                                           + dif.stderr)
    for name, text in _read_tree(work).items():
        outputs[f"attnprof trace/record: {name}"] = text
    # The CLI against the live server (the key from $ATTNPROF_API_KEY, never on argv).
    cli = _cli("snapshot", "--url", base, "--json", timeout=120)
    assert cli.returncode == 0, cli.stderr[-2000:]
    outputs["attnprof snapshot --json"] = cli.stdout + cli.stderr
    cli = _cli("snapshot", "--url", base, timeout=120)
    assert cli.returncode == 0, cli.stderr[-2000:]
    outputs["attnprof snapshot (table)"] = cli.stdout + cli.stderr
    # Offline profile fed with the live snapshot (traffic lengths + head statistics).
    work = tmp_path_factory.mktemp("canary-profile")
    (work / "snapshot.json").write_text(snap_hs)
    prof = _cli("profile", str(tiny_model), "--seq-lens", "32,64", "--repeats", "1",
                "--no-validate", "--memory-budget", "64MiB", "--paths", "math",
                "--out", str(work / "out"), "--lengths", str(work / "snapshot.json"),
                "--head-stats", str(work / "snapshot.json"))
    assert prof.returncode == 0, prof.stderr[-2000:]
    outputs["attnprof profile (stdout, stderr)"] = prof.stdout + prof.stderr
    for name, text in _read_tree(work / "out").items():
        outputs[f"attnprof profile: {name}"] = text
    for name, text in _read_tree(files).items():
        outputs[f"run file: {name}"] = text
    assert srv.log_path is not None
    outputs["server log"] = srv.log_path.read_text(errors="replace")
    return Exports(canary, sent, answers, outputs)


@pytest.mark.vllm
@pytest.mark.slow
def test_canaries_were_sent_and_exports_are_not_empty(exports: Exports) -> None:
    """Sanity: the canaries reached the server (vLLM's own answer shows them, text and ids, so
    the scanner finds what it looks for in real output), and every scanned export carries
    the data it exists for, so a clean scan is not a scan of nothing."""
    can, out = exports.canary, exports.outputs
    assert all(w in json.dumps(exports.sent) for w in CANARY_WORDS)
    echoed = leaks(json.dumps(exports.answers[0]), can)
    assert any(f.startswith("canary word 'quokkafjord'") for f in echoed), echoed
    assert any(f.startswith("request id") for f in echoed), echoed
    with_ids = leaks(json.dumps(exports.answers[1]), can)
    assert any(f.startswith("token ids of ' quokkafjord'") for f in with_ids), with_ids
    assert any(f.startswith("token ids of ' zebulonmarigold'") for f in with_ids), with_ids
    # The completions are looked for too (their token ids; their text when long enough).
    completions = {k: v for k, v in can.id_seqs.items() if k.startswith("completion")}
    assert completions, [a["choices"][0] for a in exports.answers[1:]]
    print(completions, can.words)
    assert len(set(can.request_ids)) == 3
    assert all(len(can.id_seqs[repr(w)]) >= 9 for w in CANARY_WORDS)

    metrics = out["/metrics"]
    assert (metric_value(metrics, "attnprof_request_context_tokens_count") or 0) >= 3, \
        [ln for ln in metrics.splitlines() if "context_tokens_count" in ln]
    assert (metric_value(metrics, "attnprof_head_stats_queries_total") or 0) > 0
    assert (metric_value(metrics, "attnprof_attention_calls_total") or 0) > 0
    snap = json.loads(out["/attnprof/snapshot?head_stats=1"])
    assert snap["requests"]["context_tokens"]["count"] >= 3
    assert snap["head_stats"] and snap["workers"][0]["layers"]
    assert json.loads(out["/attnprof/snapshot"]).get("head_stats") is None
    assert "bearer token" in out["/attnprof/snapshot (no token: 401)"]
    assert json.loads(out["POST /attnprof/sampling"])["workers"]
    assert json.loads(out["attnprof snapshot --json"])["requests"]["context_tokens"]["count"] >= 3
    assert "attnprof.request.context" in out["OTLP (attributes, names, units)"]
    assert "gen_ai.request.model" in out["OTLP (attributes, names, units)"]
    assert "attnprof.step" in out["OTLP spans (as JSON)"]
    trace = json.loads(out["attnprof trace/record: trace.json"])
    assert sum(1 for e in trace["traceEvents"] if e.get("ph") == "X") >= 2 * 3
    rec = json.loads(out["attnprof trace/record: rec.json"])
    assert rec["window"] and rec["provenance"]["model"]["config_sha256"]
    prof = json.loads(out["attnprof profile: profile.json"])
    assert prof["layers"] and prof["window_advice"], sorted(prof)
    assert json.loads(out["attnprof profile: trace.json"])["traceEvents"]
    assert {"attnprof profile: scaling.png"} <= set(out)
    assert any(k.startswith("run file: prometheus/") for k in out), sorted(out)
    assert any(k.startswith("run file: run/") for k in out), sorted(out)
    assert "Application startup complete" in out["server log"]
    empty = [name for name, text in out.items() if not text.strip()]
    assert not empty, empty


@pytest.mark.vllm
@pytest.mark.slow
def test_no_prompt_text_token_id_or_request_id_in_any_export(exports: Exports) -> None:
    """Every export, scanned for the canary words, the canaries' token-id runs and the
    request ids (see the module docstring for how each would be caught)."""
    found = {name: hits for name, text in exports.outputs.items()
             if (hits := leaks(text, exports.canary))}
    assert not found, json.dumps(found, indent=1)[:4000]
