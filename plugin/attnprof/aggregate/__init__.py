"""aggregate: pure Python state fed by capture. The step sampler, per-layer/phase attention
aggregates, request statistics, quantile estimation and the head-statistics accumulator.

Imports neither vLLM nor torch at module level, so every counting rule is unit-tested with
hand-built records in milliseconds.
"""
