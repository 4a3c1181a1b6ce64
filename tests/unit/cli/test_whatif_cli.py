"""``attnprof whatif`` and ``report --validate`` refuse what they cannot measure in one line,
before any server starts (the flags' values are fuzzed in test_fuzz_inputs.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from attnprof.cli import main
from tests.golden import DEMO


@pytest.fixture
def no_servers(monkeypatch: pytest.MonkeyPatch) -> None:
    from attnprof.tools import server

    def refuse(*_a: Any, **_k: Any) -> Any:
        raise AssertionError("a vLLM server was started")

    monkeypatch.setattr(server, "VllmServer", refuse)


def _err(capsys: Any) -> str:
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("attnprof: error: "), err
    return err


def test_a_record_without_a_local_checkpoint_asks_for_one(tmp_path: Path, capsys: Any,
                                                          no_servers: None) -> None:
    assert main(["whatif", str(DEMO), "--out", str(tmp_path / "o")]) == 2
    assert "give --checkpoint DIR" in _err(capsys)
    assert not (tmp_path / "o").exists()


@pytest.mark.slow  # builds the tiny checkpoint
def test_only_a_what_if_the_report_has(tmp_path: Path, capsys: Any, no_servers: None,
                                       tiny_model: Path) -> None:
    # The tiny demo's traffic is too short for window advice: no "window" what-if.
    assert main(["whatif", str(DEMO), "--checkpoint", str(tiny_model), "--only", "window",
                 "--out", str(tmp_path / "o")]) == 2
    err = _err(capsys)
    assert "--only window" in err and "fp8_kv" in err and "max_model_len" in err


def test_report_takes_measurement_flags_only_with_validate(tmp_path: Path,
                                                           capsys: Any) -> None:
    assert main(["report", str(DEMO), "--rounds", "2", "--out", str(tmp_path / "o")]) == 2
    assert "--rounds go with --validate" in _err(capsys)


def test_a_variant_that_is_no_vllm_flag_is_refused_first(tmp_path: Path, capsys: Any,
                                                         no_servers: None) -> None:
    assert main(["whatif", str(DEMO), "--variant", "kv-cache-dtype fp8",
                 "--out", str(tmp_path / "o")]) == 2
    assert "--variant: flag 'kv-cache-dtype fp8' is not a vLLM --flag" in _err(capsys)
