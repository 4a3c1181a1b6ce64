"""attnprof exporters: one metric catalog, rendered to Prometheus (and OpenTelemetry)."""

from attnprof.exporters.catalog import CATALOG, MetricSpec, spec

__all__ = ["CATALOG", "MetricSpec", "spec"]
