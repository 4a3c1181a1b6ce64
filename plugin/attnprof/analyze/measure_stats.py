"""Statistics that fit each metric a measured what-if (``attnprof whatif``) compares, and the
three-state verdict a prediction gets against them.

- Throughput: paired per-round log-ratios ``log(variant / baseline)``, their mean and a 95%
  Student-t interval on the log scale, reported as ``exp(.) - 1``. A round compares two server
  instances, and a fresh instance differs from another by a fixed offset the rounds cannot
  average away: :func:`instance_variance` estimates that component from the A/A arm and
  from arms replicated over several instance pairs (pooled across arms under one
  equal-variance assumption, so its degrees of freedom are usable), and
  :func:`log_ratio_interval` adds it (Satterthwaite's degrees of freedom).
- Latency quantiles (TTFT, ITL p50/p99): pooled per-request values over all rounds, the
  relative change of the quantile with a paired percentile bootstrap (a pair is the same
  request, (round, index), in both arms, resampled within its round). Never a quantile of a
  handful of values: below :func:`min_requests` paired requests there is no interval.
- Greedy agreement: prompts diverged, the median first-divergence position, and per-token
  agreement with a Wilson interval on the effective sample size (the design effect of tokens
  clustered in prompts); :func:`prompts_for_band` sizes the prompts.
- :func:`mde` and :func:`rounds_for_mde`: the smallest throughput change a run detects
  (alpha 0.05 two-sided, power 0.8) and the rounds a target needs.

Pure Python (no numpy or scipy), like :mod:`attnprof.analyze.twosample`.
"""

from __future__ import annotations

import math
import random
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

from attnprof.aggregate.quantiles import nearest_rank
from attnprof.contracts.whatif import CheckVerdict, Interval

__all__ = ["AgreementStats", "PairedArm", "agreement_interval", "design_effect",
           "instance_variance", "log_ratio_interval", "log_ratios", "mde", "min_requests",
           "paired_bootstrap_quantile", "prompts_for_band", "quantile", "rounds_for_mde",
           "t_quantile", "verdict", "wilson"]

Z95 = 1.959963984540054
"""The two-sided 95% normal quantile."""
MIN_REQUESTS = 20
"""Fewest paired requests any quantile is estimated from."""


# --- Student t -----------------------------------------------------------------------------

def _betacf(a: float, b: float, x: float) -> float:
    # Continued fraction of the regularized incomplete beta (modified Lentz).
    tiny = 1e-300
    qab, qap, qam = a + b, a + 1.0, a - 1.0
    c, d = 1.0, 1.0 - qab * x / qap
    d = 1.0 / (d if abs(d) > tiny else tiny)
    h = d
    for m in range(1, 300):
        m2 = 2 * m
        aa = m * (b - m) * x / ((qam + m2) * (a + m2))
        d = 1.0 + aa * d
        d = 1.0 / (d if abs(d) > tiny else tiny)
        c = 1.0 + aa / c
        c = c if abs(c) > tiny else tiny
        h *= d * c
        aa = -(a + m) * (qab + m) * x / ((a + m2) * (qap + m2))
        d = 1.0 + aa * d
        d = 1.0 / (d if abs(d) > tiny else tiny)
        c = 1.0 + aa / c
        c = c if abs(c) > tiny else tiny
        delta = d * c
        h *= delta
        if abs(delta - 1.0) < 1e-14:
            break
    return h


def _betai(a: float, b: float, x: float) -> float:
    """The regularized incomplete beta I_x(a, b)."""
    if x <= 0.0:
        return 0.0
    if x >= 1.0:
        return 1.0
    lbt = (math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x)
           + b * math.log1p(-x))
    if x < (a + 1.0) / (a + b + 2.0):
        return math.exp(lbt) * _betacf(a, b, x) / a
    return 1.0 - math.exp(lbt) * _betacf(b, a, 1.0 - x) / b


def _t_cdf(t: float, df: float) -> float:
    tail = 0.5 * _betai(df / 2.0, 0.5, df / (df + t * t))
    return 1.0 - tail if t >= 0 else tail


def t_quantile(p: float, df: float) -> float:
    """The ``p`` quantile of Student's t with ``df`` (> 0, may be fractional: Satterthwaite)
    degrees of freedom; the normal quantile for an infinite ``df``."""
    if not 0.0 < p < 1.0:
        raise ValueError(f"p must be in (0, 1), got {p}")
    if math.isinf(df):
        return statistics.NormalDist().inv_cdf(p)
    if p < 0.5:
        return -t_quantile(1.0 - p, df)
    lo, hi = 0.0, 1.0
    while _t_cdf(hi, df) < p:
        hi *= 2.0
    for _ in range(200):
        mid = (lo + hi) / 2.0
        if _t_cdf(mid, df) < p:
            lo = mid
        else:
            hi = mid
        if hi - lo < 1e-12 * max(1.0, hi):
            break
    return (lo + hi) / 2.0


# --- Throughput: paired log-ratios ---------------------------------------------------------

def _change(x: float) -> float:
    """``exp(x) - 1`` of a log-ratio, saturating where exp would overflow."""
    return math.expm1(min(x, 700.0))


def log_ratios(base: Sequence[float | None], var: Sequence[float | None]) -> list[float]:
    """``log(var_r / base_r)`` of each round with both sides positive and finite."""
    return [x for _, x in _log_ratios(base, var)]


def _log_ratios(base: Sequence[float | None], var: Sequence[float | None]
                ) -> list[tuple[int, float]]:
    return [(r, math.log(v / b)) for r, (b, v) in enumerate(zip(base, var, strict=False))
            if b is not None and v is not None and math.isfinite(b) and math.isfinite(v)
            and b > 0 and v > 0]


def log_ratio_interval(base: Sequence[float | None], var: Sequence[float | None], *,
                       instance_var: float = 0.0, instance_df: int | None = None,
                       instances: int = 1) -> Interval | None:
    """The change ``var / base - 1`` over paired rounds: the mean of ``log(var_r / base_r)``
    and its 95% Student-t interval, reported as ``exp(.) - 1``. ``instance_var`` (log scale)
    is the variance of one instance pair's offset (:func:`instance_variance`), divided by the
    ``instances`` pairs the rounds ran on and added to the rounds' own variance of the mean;
    the degrees of freedom are Satterthwaite's (``instance_df`` None: the component taken as
    known), and the interval is never narrower than the rounds' own. A round missing either
    side or non-positive is left out; None without any round; one round: low = high = mean
    (no interval: its verdict is inconclusive)."""
    d = log_ratios(base, var)
    if not d:
        return None
    m = statistics.fmean(d)
    n = len(d)
    if n < 2:
        c = _change(m)
        return Interval(c, c, c, 1)
    within = statistics.variance(d) / n
    inst = max(0.0, instance_var) / max(1, instances)
    total = within + inst
    if total <= 0.0:
        c = _change(m)
        return Interval(c, c, c, n)
    den = within * within / (n - 1)
    if inst > 0.0 and instance_df:
        den += inst * inst / instance_df
    df = total * total / den if den > 0 else math.inf
    half = t_quantile(0.975, df) * math.sqrt(total)
    if within > 0.0:
        # Satterthwaite's df exceeds the rounds' when a well-known floor meets few rounds:
        # adding a variance must never narrow the rounds' own interval.
        half = max(half, t_quantile(0.975, n - 1) * math.sqrt(within))
    return Interval(_change(m), _change(m - half), _change(m + half), n)


@dataclass(frozen=True)
class PairedArm:
    """One arm's paired per-round throughputs and the instance pair each round ran on;
    ``control``: an A/A arm, whose true change is 0."""

    base: Sequence[float | None]
    var: Sequence[float | None]
    instances: Sequence[int]
    control: bool = False


def instance_variance(arms: Sequence[PairedArm]) -> tuple[float, int]:
    """``(variance, df)``: the variance of an instance pair's offset in ``log(var / base)``
    beyond the rounds' own noise, pooled over arms. Each arm's per-instance means scatter by
    that variance plus the rounds' noise over their count: around 0 for an A/A arm (k
    instance pairs: k degrees of freedom), around the arm's mean otherwise (k - 1). The
    rounds' noise is the pooled within-instance variance; the pooled estimate assumes one
    instance variance for every arm (the flags change the model's speed, not how two fresh
    servers differ). ``(0.0, 0)``: nothing to estimate it from (one instance pair per arm and
    no A/A arm)."""
    ss_between = 0.0
    noise_weight = 0.0
    df_between = 0
    ss_within = 0.0
    df_within = 0
    for arm in arms:
        groups: dict[int, list[float]] = {}
        for r, x in _log_ratios(arm.base, arm.var):
            inst = arm.instances[r] if r < len(arm.instances) else 0
            groups.setdefault(inst, []).append(x)
        if not groups:
            continue
        means = [statistics.fmean(g) for g in groups.values()]
        inv_n = sum(1.0 / len(g) for g in groups.values())
        for g, mu in zip(groups.values(), means, strict=True):
            ss_within += sum((x - mu) ** 2 for x in g)
            df_within += len(g) - 1
        k = len(means)
        if arm.control:
            ss_between += sum(mu * mu for mu in means)
            noise_weight += inv_n
            df_between += k
        elif k >= 2:
            grand = statistics.fmean(means)
            ss_between += sum((mu - grand) ** 2 for mu in means)
            noise_weight += (k - 1) / k * inv_n
            df_between += k - 1
    if df_between == 0:
        return 0.0, 0
    noise = ss_within / df_within if df_within else 0.0
    return max(0.0, (ss_between - noise * noise_weight) / df_between), df_between


def _power_quantiles(df: float) -> float:
    return t_quantile(0.975, df) + t_quantile(0.8, df)


def mde(sd_log: float, rounds: int, *, instance_var: float = 0.0, instances: int = 1
        ) -> float:
    """The smallest throughput change (a share: 0.02 is 2%) a paired run of ``rounds`` rounds
    detects with alpha 0.05 (two-sided) and power 0.8: ``(t_0.975 + t_0.8) x se`` on the log
    scale, ``se^2 = sd_log^2 / rounds + instance_var / instances``, df ``rounds - 1``. Infinite
    under two rounds."""
    if rounds < 2:
        return math.inf
    se = math.sqrt(sd_log * sd_log / rounds + max(0.0, instance_var) / max(1, instances))
    return _change(_power_quantiles(rounds - 1) * se)


def rounds_for_mde(target: float, sd_log: float, *, instance_var: float = 0.0,
                   instances: int = 1, max_rounds: int = 50) -> int:
    """The fewest rounds (at least 2) whose :func:`mde` is ``target`` or smaller; ``max_rounds``
    when none up to it is (the instance term alone may exceed the target: then only more
    instance pairs help; check ``mde(..., max_rounds)``)."""
    for n in range(2, max_rounds + 1):
        if mde(sd_log, n, instance_var=instance_var, instances=instances) <= target:
            return n
    return max_rounds


# --- Latency quantiles: pooled per-request values, paired bootstrap ------------------------

def min_requests(q: float) -> int:
    """Fewest paired requests the ``q`` quantile is estimated from: at least
    :data:`MIN_REQUESTS`, and enough that its nearest rank is not the largest value (p99:
    100, whose nearest rank is the 99th)."""
    return max(MIN_REQUESTS, math.ceil(round(1.0 / (1.0 - q), 9)))


def quantile(xs: Sequence[float], q: float) -> float:
    """The nearest-rank ``q`` quantile of ``xs`` (non-empty), as every attnprof quantile
    (:func:`attnprof.aggregate.quantiles.nearest_rank`)."""
    return nearest_rank(sorted(xs), range(1, len(xs) + 1), q)


def _round_pairs(b: Sequence[float | None], v: Sequence[float | None]
                 ) -> list[tuple[float, float]]:
    """One round's requests measured (finite) in both arms, as (baseline, variant)."""
    return [(x, y) for x, y in zip(b, v, strict=False)
            if x is not None and y is not None and math.isfinite(x) and math.isfinite(y)]


def paired_bootstrap_quantile(base_rounds: Sequence[Sequence[float | None]],
                              var_rounds: Sequence[Sequence[float | None]], q: float, *,
                              seed: int = 0, n_boot: int = 2000,
                              clusters: Sequence[int] | None = None) -> Interval | None:
    """The relative change of the ``q`` quantile of per-request values pooled over rounds,
    ``Q(var) / Q(base) - 1``, with a 95% percentile bootstrap over pairs (the same request,
    (round, index), in both arms). None below :func:`min_requests` pairs or with a zero
    baseline quantile (``rounds`` of the interval: the rounds that held a pair).

    The resample follows how the data was made (a hierarchical bootstrap): ``clusters`` (one
    id per round, e.g. the server instance pair that served it) are drawn with replacement,
    then rounds within each drawn cluster, then requests within each drawn round. A round's
    requests share its moment on the machine (contention slows all of them at once) and an
    instance's rounds share the instance: resampling requests alone treats both as fixed and
    gave an A/A interval that excluded 0 (the overhead toggle's TTFT, H4). Without
    ``clusters`` each round is its own cluster; with one round, requests alone."""
    # The rounds that held a pair, grouped by cluster in the rounds' order.
    ids = list(clusters) if clusters is not None else []
    groups: dict[int, list[list[tuple[float, float]]]] = {}
    for i, (base, var) in enumerate(zip(base_rounds, var_rounds, strict=False)):
        held = _round_pairs(base, var)
        if held:
            groups.setdefault(ids[i] if i < len(ids) else i, []).append(held)
    tops = list(groups.values())
    paired = [r for rounds in tops for r in rounds]
    n = sum(len(r) for r in paired)
    if n < min_requests(q):
        return None
    qb = quantile([x for r in paired for x, _ in r], q)
    if qb <= 0:
        return None
    point = quantile([y for r in paired for _, y in r], q) / qb - 1.0
    rng = random.Random(seed)
    many = len(paired) > 1  # one round: its requests alone (the same draws as ever)
    stats = []
    for _ in range(n_boot):
        bs: list[float] = []
        vs: list[float] = []
        for _c in range(len(tops)):
            rounds = tops[rng.randrange(len(tops))] if many else tops[0]
            for _r in range(len(rounds)):
                r = rounds[rng.randrange(len(rounds))] if many else rounds[0]
                for _ in range(len(r)):
                    x, y = r[rng.randrange(len(r))]
                    bs.append(x)
                    vs.append(y)
        b = quantile(bs, q)
        if b > 0:
            stats.append(quantile(vs, q) / b - 1.0)
    if len(stats) < n_boot // 2:
        return None
    stats.sort()
    lo = stats[int(0.025 * (len(stats) - 1))]
    hi = stats[math.ceil(0.975 * (len(stats) - 1))]
    return Interval(point, min(lo, point), max(hi, point), len(paired))


# --- Greedy agreement: prompts, Wilson on the effective n ----------------------------------

def wilson(successes: float, n: float, z: float = Z95) -> tuple[float, float]:
    """The Wilson score interval of ``successes`` in ``n`` (both may be fractional: an
    effective sample size); ``(0, 1)`` for ``n`` 0."""
    if n <= 0:
        return 0.0, 1.0
    p = min(1.0, max(0.0, successes / n))
    z2 = z * z
    centre = (p + z2 / (2 * n)) / (1 + z2 / n)
    half = z * math.sqrt(p * (1 - p) / n + z2 / (4 * n * n)) / (1 + z2 / n)
    return max(0.0, centre - half), min(1.0, centre + half)


def design_effect(successes: Sequence[int], sizes: Sequence[int]) -> float:
    """Kish's design effect ``1 + (m0 - 1) x ICC`` of binary outcomes clustered in groups
    (``successes[i]`` of ``sizes[i]``), the ICC by one-way ANOVA (clamped to [0, 1]; 1 when
    it is undefined, every outcome alike: the conservative reading). 1 with one cluster."""
    k = len(sizes)
    total = sum(sizes)
    if k < 2 or total <= k:
        return float(max(1, total)) if k == 1 else 1.0
    p = sum(successes) / total
    ssb = sum((s - m * p) ** 2 / m for s, m in zip(successes, sizes, strict=True) if m)
    ssw = sum(s - s * s / m for s, m in zip(successes, sizes, strict=True) if m)
    msb = ssb / (k - 1)
    msw = ssw / (total - k)
    m0 = (total - sum(m * m for m in sizes) / total) / (k - 1)
    den = msb + (m0 - 1) * msw
    icc = 1.0 if den <= 0 else min(1.0, max(0.0, (msb - msw) / den))
    return 1.0 + (m0 - 1) * icc


@dataclass(frozen=True)
class AgreementStats:
    """Greedy agreement of a variant against the baseline over held-out prompts."""

    prompts: int
    diverged: int
    """Prompts whose greedy continuations differed within the compared tokens."""
    median_first_divergence: float | None
    """Median index of the first differing token among the prompts that diverged."""
    per_token: float | None
    """Tokens that agreed over tokens compared (each prompt up to and including its first
    disagreement: after it the prefixes differ)."""
    low: float | None
    high: float | None
    """Wilson 95% interval of ``per_token`` on the effective n (tokens / design effect)."""
    effective_n: float
    design_effect: float


def agreement_interval(diverged_at: Sequence[int | None], compared_tokens: int
                       ) -> AgreementStats:
    """Agreement from each prompt's first divergence (None: none within
    ``compared_tokens``): a prompt that diverged at index d contributes d agreeing tokens and
    one that differs, one that did not contributes ``compared_tokens`` agreeing ones."""
    agree: list[int] = []
    sizes: list[int] = []
    for d in diverged_at:
        if d is None:
            agree.append(compared_tokens)
            sizes.append(compared_tokens)
        else:
            agree.append(d)
            sizes.append(d + 1)
    pos = [d for d in diverged_at if d is not None]
    total = sum(sizes)
    if total <= 0:
        return AgreementStats(len(diverged_at), len(pos), None, None, None, None, 0.0, 1.0)
    deff = design_effect(agree, sizes)
    n_eff = total / deff
    p = sum(agree) / total
    lo, hi = wilson(p * n_eff, n_eff)
    return AgreementStats(prompts=len(diverged_at), diverged=len(pos),
                          median_first_divergence=statistics.median(pos) if pos else None,
                          per_token=p, low=lo, high=hi, effective_n=n_eff,
                          design_effect=deff)


def prompts_for_band(band: float, *, agreement: float, tokens_per_prompt: float,
                     design: float | None = None, max_prompts: int = 1000) -> int:
    """The fewest prompts whose per-token agreement interval (Wilson, effective n = prompts x
    tokens per prompt / design effect) is no wider than ``band`` at the expected
    ``agreement``: narrower intervals than the band are what can confirm a prediction.
    ``design`` None: tokens per prompt (every prompt all-or-nothing, the worst case).
    ``max_prompts`` when none up to it is."""
    m = max(1.0, tokens_per_prompt)
    deff = m if design is None else max(1.0, design)
    for k in range(2, max_prompts + 1):
        n_eff = k * m / deff
        lo, hi = wilson(agreement * n_eff, n_eff)
        if hi - lo <= band:
            return k
    return max_prompts


# --- The verdict ---------------------------------------------------------------------------

def verdict(predicted: float, band: float, low: float | None, high: float | None,
            rounds: int | None) -> CheckVerdict:
    """``confirmed`` when the 95% interval [low, high] lies inside ``predicted +/- band``;
    ``off`` when it lies wholly outside; else ``inconclusive`` (it straddles an edge), and
    always without an interval or from one round. ``rounds`` None: an exact figure (vLLM's
    capacity line, a count), not a sample."""
    if low is None or high is None or (rounds is not None and rounds < 2):
        return "inconclusive"
    if not (math.isfinite(low) and math.isfinite(high) and math.isfinite(predicted)):
        return "inconclusive"
    lo_edge, hi_edge = predicted - band, predicted + band
    if low >= lo_edge and high <= hi_edge:
        return "confirmed"
    if low > hi_edge or high < lo_edge:
        return "off"
    return "inconclusive"
