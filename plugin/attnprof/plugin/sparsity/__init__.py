"""Sliding-window and sparse-attention advice from traffic and sampled attention statistics.

Pure analysis (numpy); torch and transformers are imported lazily by the parts that need
them (:mod:`.stats` updates, :mod:`.replay`).
"""

from __future__ import annotations

from attnprof.plugin.sparsity.classify import Thresholds, classify
from attnprof.plugin.sparsity.inputs import (
    InputError,
    from_prometheus_response,
    from_snapshot,
    query_prometheus,
    read_lengths_file,
)
from attnprof.plugin.sparsity.recommend import (
    evaluate,
    export_summary,
    format_summary,
    recommend,
)
from attnprof.plugin.sparsity.savings import Arch, LengthDistribution
from attnprof.plugin.sparsity.stats import HeadStatsAccumulator

__all__ = [
    "Arch",
    "HeadStatsAccumulator",
    "InputError",
    "LengthDistribution",
    "Thresholds",
    "classify",
    "evaluate",
    "export_summary",
    "format_summary",
    "from_prometheus_response",
    "from_snapshot",
    "query_prometheus",
    "read_lengths_file",
    "recommend",
]
