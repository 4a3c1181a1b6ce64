from __future__ import annotations

import re
from pathlib import Path

import pytest

from attnprof.config import Config, ConfigError
from attnprof.environment_variables import VARIABLES, markdown_table

REPO = Path(__file__).resolve().parents[3]


def test_defaults_when_unset() -> None:
    cfg = Config.from_env({})
    assert cfg.enabled is False
    assert cfg.sample_rate == 0.05
    assert cfg.overhead_budget == 0.01
    assert cfg.seed is None
    assert cfg.home.name == "attnprof"


@pytest.mark.parametrize("raw,expected", [("1", True), ("true", True), ("ON", True),
                                          ("0", False), ("no", False), ("", False)])
def test_enabled_values(raw: str, expected: bool) -> None:
    assert Config.from_env({"ATTNPROF_ENABLED": raw}).enabled is expected


def test_good_values_parse() -> None:
    cfg = Config.from_env({"ATTNPROF_SAMPLE_RATE": "0.25", "ATTNPROF_SEED": "7",
                           "ATTNPROF_OVERHEAD_BUDGET": "0.02", "ATTNPROF_HOME": "/tmp/x",
                           "ATTNPROF_LONG_PREFILL_TOKENS": "2048"})
    assert (cfg.sample_rate, cfg.seed, cfg.overhead_budget) == (0.25, 7, 0.02)
    assert str(cfg.home) == "/tmp/x" and cfg.long_prefill_tokens == 2048


@pytest.mark.parametrize("name,raw", [
    ("ATTNPROF_SAMPLE_RATE", "abc"), ("ATTNPROF_SAMPLE_RATE", "1.5"),
    ("ATTNPROF_SAMPLE_RATE", "-0.1"), ("ATTNPROF_SAMPLE_RATE", "nan"),
    ("ATTNPROF_OVERHEAD_BUDGET", "0"), ("ATTNPROF_ENABLED", "maybe"),
    ("ATTNPROF_SEED", "x1"), ("ATTNPROF_MAX_ERRORS", "0"),
    ("ATTNPROF_LONG_PREFILL_TOKENS", "-5"), ("ATTNPROF_FAULT_INJECT", "everywhere"),
])
def test_bad_values_name_the_variable_in_one_line(name: str, raw: str) -> None:
    with pytest.raises(ConfigError) as info:
        Config.from_env({name: raw})
    msg = str(info.value)
    assert name in msg and repr(raw) in msg
    assert "\n" not in msg


def test_every_variable_read_by_config_is_documented() -> None:
    src = (REPO / "plugin/attnprof/config.py").read_text()
    used = set(re.findall(r'"(ATTNPROF_[A-Z_]+)"', src))
    documented = {v.name for v in VARIABLES}
    assert used == documented


def test_readme_table_matches_generated() -> None:
    readme = (REPO / "README.md").read_text()
    assert markdown_table() in readme, "regenerate with: attnprof env --markdown"


def test_documented_defaults_are_the_code_defaults() -> None:
    """The defaults are written once, as Config's fields; each documented default read back
    through from_env gives the same Config as no variable at all (the table cannot drift)."""
    base = Config.from_env({})
    assert base == Config()
    checked = 0
    for v in VARIABLES:
        if v.default.startswith("(") or v.default.startswith("~"):
            continue  # computed defaults ("(unset)", "(served model name)", the home dir)
        assert Config.from_env({v.name: v.default}) == base, v.name
        checked += 1
    assert checked >= 15


@pytest.mark.parametrize("name,raw", [
    ("ATTNPROF_RPC_TIMEOUT_S", "1e-300"), ("ATTNPROF_RPC_TIMEOUT_S", "0.001"),
    ("ATTNPROF_RPC_TIMEOUT_S", "601"), ("ATTNPROF_ADVICE_INTERVAL_S", "1e-9"),
    ("ATTNPROF_TRACE_MAX_RANGES", "500001"), ("ATTNPROF_TRACE_MAX_RANGES", str(10**30)),
    ("ATTNPROF_TRACE_MAX_RANGES_PER_WORKER", "200001"),
    ("ATTNPROF_SNAPSHOT_MAX_BYTES", str((512 << 20) + 1)), ("ATTNPROF_MAX_ERRORS", "1000001"),
    ("ATTNPROF_LONG_PREFILL_TOKENS", str((1 << 24) + 1)),
    ("ATTNPROF_HEAD_STATS_MIN_TOKENS", str((1 << 24) + 1)), ("ATTNPROF_SEED", "-1"),
    ("ATTNPROF_SEED", str(1 << 64)), ("ATTNPROF_FAULT_DELAY_S", "61"),
    ("ATTNPROF_RANK_SYNC", "nfs"),
])
def test_every_numeric_knob_has_a_ceiling_and_a_floor(name: str, raw: str) -> None:
    """Issue 30, point 1: no 1e-300 s timeout, no busy advice loop, no unbounded trace or
    body; each refusal is one line naming the variable and its range."""
    with pytest.raises(ConfigError) as info:
        Config.from_env({name: raw})
    msg = str(info.value)
    assert name in msg and repr(raw) in msg and "\n" not in msg
    assert "range" in msg or "one of" in msg


def test_the_ranges_edges_are_accepted() -> None:

    cfg = Config.from_env({"ATTNPROF_RPC_TIMEOUT_S": "0.1", "ATTNPROF_ADVICE_INTERVAL_S": "0",
                           "ATTNPROF_SEED": str((1 << 64) - 1), "ATTNPROF_RANK_SYNC": "rpc",
                           "ATTNPROF_TRACE_MAX_RANGES_PER_WORKER": "200000"})
    assert (cfg.rpc_timeout_s, cfg.advice_interval_s, cfg.rank_sync) == (0.1, 0.0, "rpc")
    assert cfg.seed == (1 << 64) - 1 and cfg.trace_max_ranges_per_worker == 200_000
    assert Config.from_env({"ATTNPROF_ADVICE_INTERVAL_S": "0.5"}).advice_interval_s == 0.5
