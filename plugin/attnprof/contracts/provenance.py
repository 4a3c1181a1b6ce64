"""Where a profile or snapshot came from: versions, hardware, the model's identity, the
source revision, the command line and the time. ``attnprof diff`` reads it to say what
changed between two runs and to refuse comparing two different models.

Added in profile 1.2 and snapshot 1.5 (older files read it as null). Never holds prompt
text, token ids or request ids; secrets on the command line are redacted whenever one is
built or read (:mod:`attnprof.contracts.redact`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from attnprof.contracts.base import Record
from attnprof.contracts.redact import redact_argv

__all__ = ["GitInfo", "Hardware", "ModelIdentity", "Provenance"]


@dataclass
class Hardware(Record):
    """The machine attention ran on: CPU ISA, or the GPU's name, compute capability and
    driver."""

    type: str
    """cpu or cuda."""
    cpu: str | None = None
    cpu_isa: str | None = None
    """torch's CPU capability (e.g. AVX512, AVX2), what its CPU kernels dispatch on."""
    cpu_flags: list[str] = field(default_factory=list)
    gpu_name: str | None = None
    compute_capability: str | None = None
    driver: str | None = None
    cuda_runtime: str | None = None


@dataclass
class ModelIdentity(Record):
    """The model, by path or id and two hashes: equal hashes mean the same architecture
    (config) and the same tensor layout (weights' index or metadata; not the weight values,
    which would take minutes to read)."""

    name: str
    path: str | None = None
    config_sha256: str | None = None
    """sha256 of config.json as canonical JSON (sorted keys)."""
    weights_sha256: str | None = None
    """sha256 over the weights' index/metadata (file names, sizes, safetensors headers)."""
    weights_source: str | None = None
    """What weights_sha256 covers: safetensors-index, safetensors-headers, file-sizes."""


@dataclass
class GitInfo(Record):
    """attnprof's own git checkout, when it runs from one (never the current directory: git
    runs code a repository's config names)."""

    revision: str
    dirty: bool
    root: str | None = None


@dataclass
class Provenance(Record):
    attnprof: str | None
    python: str | None
    torch: str | None
    transformers: str | None
    vllm: str | None
    hardware: Hardware
    model: ModelIdentity
    git: GitInfo | None = None
    command: list[str] = field(default_factory=list)
    """argv of the process that measured (values of --api-key-like flags redacted)."""
    time: float = 0.0
    """Unix time the provenance was taken."""
    time_iso: str = ""

    def __post_init__(self) -> None:
        # Every Provenance built or read (a file from an older attnprof, a hand-made one)
        # carries a redacted command, so no report or diff can print a key it was handed.
        self.command = redact_argv(self.command)
