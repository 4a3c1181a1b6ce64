"""Sliding-window and sparse-attention advice from traffic and sampled attention statistics.

Pure analysis (numpy, no torch): the statistics it reads are folded by
:mod:`attnprof.capture.head_rows` (the torch side), replays run in :mod:`attnprof.tools.replay`.
Results are typed (:mod:`.results`) and become JSON only at ``to_json()`` / ``export_summary``.
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
