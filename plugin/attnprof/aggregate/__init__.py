"""aggregate: pure Python state fed by capture. The step sampler, per-layer/phase attention
aggregates, request statistics, quantile estimation and the head-statistics accumulator.

Imports neither vLLM nor torch, anywhere (capture hands over numbers and numpy arrays), so every
counting rule is unit-tested with hand-built records in milliseconds.
"""
