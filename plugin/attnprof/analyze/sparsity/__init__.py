"""Sliding-window and sparse-attention advice from traffic and sampled attention statistics.

Pure analysis (numpy); torch and transformers are imported lazily by the parts that need
them (:mod:`.stats` updates, :mod:`.replay`).
"""

from __future__ import annotations

from attnprof.aggregate.head_stats import HeadStatsAccumulator
from attnprof.analyze.sparsity.classify import Thresholds, classify
from attnprof.analyze.sparsity.inputs import (
    InputError,
    from_prometheus_response,
    from_snapshot,
    read_lengths_file,
)
from attnprof.analyze.sparsity.recommend import (
    evaluate,
    export_summary,
    format_summary,
    recommend,
)
from attnprof.analyze.sparsity.results import Evaluation, Recommendation
from attnprof.analyze.sparsity.savings import LengthDistribution

__all__ = [
    "Evaluation",
    "HeadStatsAccumulator",
    "InputError",
    "LengthDistribution",
    "Recommendation",
    "Thresholds",
    "classify",
    "evaluate",
    "export_summary",
    "format_summary",
    "from_prometheus_response",
    "from_snapshot",
    "read_lengths_file",
    "recommend",
]
