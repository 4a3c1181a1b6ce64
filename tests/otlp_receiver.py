"""A loopback OTLP receiver for tests: metrics and traces, http/protobuf (``/v1/metrics``,
``/v1/traces``) and gRPC (MetricsService, TraceService), decoded with the official protobuf
messages. Modes: ``normal``, ``refusing`` (HTTP 503 / gRPC UNAVAILABLE), ``slow`` (sleep
``delay`` seconds, then answer normally)."""

from __future__ import annotations

import threading
import time
from concurrent import futures
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import grpc
from opentelemetry.proto.collector.metrics.v1 import metrics_service_pb2 as pb
from opentelemetry.proto.collector.metrics.v1 import metrics_service_pb2_grpc as pbg
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2 as tpb
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2_grpc as tpbg

from tests.conftest import free_port as free_port  # re-exported: the OTLP tests and benchmarks


class OtlpReceiver:
    def __init__(self, protocol: str = "http/protobuf", mode: str = "normal",
                 delay: float = 2.0) -> None:
        assert protocol in ("http/protobuf", "grpc") and mode in ("normal", "refusing", "slow")
        self.protocol, self.mode, self.delay = protocol, mode, delay
        self.requests: list[pb.ExportMetricsServiceRequest] = []
        self.trace_requests: list[tpb.ExportTraceServiceRequest] = []
        self.headers: list[dict[str, str]] = []
        self.hits = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._http: ThreadingHTTPServer | None = None
        self._grpc: Any = None
        self.port = 0

    # -- shared ---------------------------------------------------------------------------
    def _handle(self, body: bytes | pb.ExportMetricsServiceRequest,
                headers: dict[str, str]) -> bool:
        """Store the request; False when refusing."""
        with self._lock:
            self.hits += 1
        if self.mode == "refusing":
            return False
        if self.mode == "slow":
            self._stop.wait(self.delay)
        req = body if isinstance(body, pb.ExportMetricsServiceRequest) else \
            pb.ExportMetricsServiceRequest.FromString(body)
        with self._lock:
            self.requests.append(req)
            self.headers.append(headers)
        return True

    def _handle_traces(self, body: bytes | tpb.ExportTraceServiceRequest) -> bool:
        """Store a trace export; False when refusing."""
        if self.mode == "refusing":
            return False
        req = body if isinstance(body, tpb.ExportTraceServiceRequest) else \
            tpb.ExportTraceServiceRequest.FromString(body)
        with self._lock:
            self.trace_requests.append(req)
        return True

    def spans(self) -> list[tuple[dict[str, Any], Any]]:
        """Every span received so far, with its resource's attributes."""
        out = []
        with self._lock:
            reqs = list(self.trace_requests)
        for req in reqs:
            for rs in req.resource_spans:
                res = {a.key: getattr(a.value, a.value.WhichOneof("value") or "string_value")
                       for a in rs.resource.attributes}
                for ss in rs.scope_spans:
                    out.extend((res, sp) for sp in ss.spans)
        return out

    def wait_for_spans(self, check: Any, timeout: float = 10.0) -> list[tuple[dict[str, Any],
                                                                              Any]]:
        """The spans once ``check(spans)`` holds (AssertionError after ``timeout``)."""
        deadline = time.monotonic() + timeout
        while True:
            got = self.spans()
            if check(got):
                return got
            if time.monotonic() > deadline:
                raise AssertionError(f"{len(got)} spans received; the check still fails")
            time.sleep(0.05)

    @property
    def endpoint(self) -> str:
        """What OTEL_EXPORTER_OTLP_METRICS_ENDPOINT should say."""
        if self.protocol == "grpc":
            return f"http://127.0.0.1:{self.port}"
        return f"http://127.0.0.1:{self.port}/v1/metrics"

    def start(self) -> OtlpReceiver:
        if self.protocol == "grpc":
            self._start_grpc()
        else:
            self._start_http()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._http is not None:
            self._http.shutdown()
            self._http.server_close()
        if self._grpc is not None:
            self._grpc.stop(grace=None).wait(2)

    def __enter__(self) -> OtlpReceiver:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def wait_for(self, n: int = 1, timeout: float = 5.0) -> list[pb.ExportMetricsServiceRequest]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self._lock:
                if len(self.requests) >= n:
                    return list(self.requests)
            time.sleep(0.01)
        raise AssertionError(f"{len(self.requests)} OTLP requests, expected {n}")

    # -- transports -----------------------------------------------------------------------
    def _start_http(self) -> None:
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                if self.path == "/v1/traces":
                    ok = receiver._handle_traces(body)
                    out = tpb.ExportTraceServiceResponse().SerializeToString()
                elif self.path == "/v1/metrics":
                    ok = receiver._handle(body, {k.lower(): v for k, v in self.headers.items()})
                    out = pb.ExportMetricsServiceResponse().SerializeToString()
                else:
                    self.send_response(404)
                    self.end_headers()
                    return
                if not ok:
                    self.send_response(503)
                    self.end_headers()
                    return
                try:
                    self.send_response(200)
                    self.send_header("Content-Type", "application/x-protobuf")
                    self.send_header("Content-Length", str(len(out)))
                    self.end_headers()
                    self.wfile.write(out)
                except (BrokenPipeError, ConnectionResetError):
                    pass  # slow mode: the exporter gave up at its timeout, as it should

            def log_message(self, *args: Any) -> None:
                pass

        class Server(ThreadingHTTPServer):
            def process_request(self, request: Any, client_address: Any) -> None:
                # Named like the receiver's other threads, so leak checks can tell
                # the exporter's threads from the receiver's per-request ones.
                threading.Thread(target=self.process_request_thread, daemon=True,
                                 args=(request, client_address),
                                 name="otlp-receiver-request").start()

        self._http = Server(("127.0.0.1", 0), Handler)
        self._http.daemon_threads = True
        self.port = self._http.server_address[1]
        threading.Thread(target=self._http.serve_forever, daemon=True,
                         name="otlp-receiver-http").start()

    def _start_grpc(self) -> None:
        receiver = self

        class Servicer(pbg.MetricsServiceServicer):  # type: ignore[misc]
            def Export(self, request: Any, context: Any) -> Any:
                meta = {k: v for k, v in context.invocation_metadata()}
                if not receiver._handle(request, meta):
                    context.abort(grpc.StatusCode.UNAVAILABLE, "refusing")
                return pb.ExportMetricsServiceResponse()

        class TraceServicer(tpbg.TraceServiceServicer):  # type: ignore[misc]
            def Export(self, request: Any, context: Any) -> Any:
                if not receiver._handle_traces(request):
                    context.abort(grpc.StatusCode.UNAVAILABLE, "refusing")
                return tpb.ExportTraceServiceResponse()

        self._grpc = grpc.server(futures.ThreadPoolExecutor(
            max_workers=4, thread_name_prefix="otlp-receiver-grpc"))
        pbg.add_MetricsServiceServicer_to_server(Servicer(), self._grpc)
        tpbg.add_TraceServiceServicer_to_server(TraceServicer(), self._grpc)
        self.port = self._grpc.add_insecure_port("127.0.0.1:0")
        self._grpc.start()


def exporter_threads() -> int:
    """Live threads, not counting the in-process receiver's: its pools grow lazily
    (gRPC up to 4 workers, HTTP one per request), which is not the exporter leaking."""
    return sum(1 for t in threading.enumerate() if not t.name.startswith("otlp-receiver"))
