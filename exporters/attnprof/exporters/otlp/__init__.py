"""OpenTelemetry (OTLP) rendering of the export boundary's samples.

The same catalog and the same :class:`~attnprof.exporters.samples.Sample` /
:class:`~attnprof.exporters.samples.HistogramSample` lists as Prometheus, sent as OTLP
metrics (and, with ``ATTNPROF_OTLP_SPANS=1``, sampled steps as spans) over http/protobuf or
gRPC by the OpenTelemetry SDK. One module per reason to change:

* :mod:`.config`: the ``OTEL_*`` variables and attnprof's start-up checks on them;
* :mod:`.resource`: OTel attribute names and the per-process Resource;
* :mod:`.histograms`: explicit to base-2 exponential histogram conversion;
* :mod:`.metrics`: :class:`OtlpSink`, the MeterProvider and its exporter;
* :mod:`.spans`: :class:`OtlpSpanSink`.

Nothing outside ``attnprof.exporters`` imports OpenTelemetry; these modules import it lazily
so :func:`otlp_config_from_env` can say clearly when it is missing.
"""

from attnprof.exporters.otlp.config import PROTOCOLS, OtlpConfig, otlp_config_from_env
from attnprof.exporters.otlp.histograms import ExponentialBuckets, exponential_buckets
from attnprof.exporters.otlp.metrics import OtlpExportError, OtlpSink
from attnprof.exporters.otlp.resource import ROLES, attributes, build_resource
from attnprof.exporters.otlp.spans import OtlpSpanSink

__all__ = [
    "PROTOCOLS",
    "ROLES",
    "ExponentialBuckets",
    "OtlpConfig",
    "OtlpExportError",
    "OtlpSink",
    "OtlpSpanSink",
    "attributes",
    "build_resource",
    "exponential_buckets",
    "otlp_config_from_env",
]
