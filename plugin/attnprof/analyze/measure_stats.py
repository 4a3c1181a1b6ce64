"""Statistics that fit each measured metric (stubs: final signatures, filled next)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from attnprof.contracts.whatif import CheckVerdict, Interval

__all__ = ["AgreementStats", "agreement_interval", "log_ratio_interval", "mde",
           "paired_bootstrap_quantile", "rounds_for_mde", "verdict"]


@dataclass(frozen=True)
class AgreementStats:
    prompts: int
    diverged: int
    median_first_divergence: float | None
    per_token: float | None
    low: float | None
    high: float | None
    effective_n: float
    design_effect: float


def log_ratio_interval(base: Sequence[float | None], var: Sequence[float | None], *,
                       instance_var: float = 0.0, instance_df: int | None = None,
                       instances: int = 1) -> Interval | None:
    raise NotImplementedError


def paired_bootstrap_quantile(base_rounds: Sequence[Sequence[float | None]],
                              var_rounds: Sequence[Sequence[float | None]], q: float, *,
                              seed: int = 0, n_boot: int = 2000) -> Interval | None:
    raise NotImplementedError


def agreement_interval(diverged_at: Sequence[int | None], compared_tokens: int
                       ) -> AgreementStats:
    raise NotImplementedError


def mde(sd_log: float, rounds: int, *, instance_var: float = 0.0, instances: int = 1
        ) -> float:
    raise NotImplementedError


def rounds_for_mde(target: float, sd_log: float, *, instance_var: float = 0.0,
                   instances: int = 1, max_rounds: int = 50) -> int:
    raise NotImplementedError


def verdict(predicted: float, band: float, low: float | None, high: float | None,
            rounds: int) -> CheckVerdict:
    raise NotImplementedError
