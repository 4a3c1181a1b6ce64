"""``attnprof whatif`` and ``report --validate`` refuse what they cannot measure in one line,
before any server starts (the flags' values are fuzzed in test_fuzz_inputs.py)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
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


def test_mde_must_be_a_share_and_instances_a_small_count(tmp_path: Path, capsys: Any,
                                                         no_servers: None) -> None:
    assert main(["whatif", str(DEMO), "--mde", "5", "--out", str(tmp_path / "o")]) == 2
    assert "--mde must be a share in (0, 1) (0.05 for 5%), got 5.0" in _err(capsys)
    assert main(["whatif", str(DEMO), "--mde", "nan", "--out", str(tmp_path / "o")]) == 2
    assert "--mde must be a share" in _err(capsys)
    with pytest.raises(SystemExit):
        main(["whatif", str(DEMO), "--instances", "0", "--out", str(tmp_path / "o")])
    assert "--instances: 0 is not in 1..8" in capsys.readouterr().err


def test_the_baseline_is_the_recorded_flags_then_baseline_args() -> None:
    from attnprof.cli._measure import baseline_args
    from attnprof.contracts.provenance import Hardware, ModelIdentity, Provenance

    prov = Provenance(attnprof=None, python=None, torch=None, transformers=None, vllm=None,
                      hardware=Hardware(type="cpu"), model=ModelIdentity(name="m"),
                      command=["/x/vllm/entrypoints/openai/api_server.py", "--model", "/m",
                               "--max-model-len", "4096", "--enforce-eager"])
    args, basis = baseline_args(SimpleNamespace(provenance=prov), 999,
                                ["--max-model-len", "2048"])
    # --baseline-args come last: vLLM's parser keeps the last value, so they override.
    assert args == ["--max-model-len", "4096", "--enforce-eager", "--max-model-len", "2048"]
    assert basis.startswith("the record's vLLM command line") and "--baseline-args" in basis
    golden = Provenance(attnprof=None, python=None, torch=None, transformers=None, vllm=None,
                        hardware=Hardware(type="cpu"), model=ModelIdentity(name="m"),
                        command=["attnprof", "golden"])
    args, basis = baseline_args(SimpleNamespace(provenance=golden), 1024, [])
    assert args == ["--max-model-len", "1024"] and "vLLM's defaults" in basis


def test_the_runs_own_command_line_keeps_no_secret_given_inside_vllm_flags() -> None:
    from attnprof.contracts.provenance import Hardware, ModelIdentity, Provenance

    argv = ["attnprof", "whatif", "rec.json", "--baseline-args",
            "--api-key sk-live-123 --max-model-len 2048",
            "--variant=--hf-token hf_abc --kv-cache-dtype fp8", "--api-key", "k-777"]
    prov = Provenance(attnprof=None, python=None, torch=None, transformers=None, vllm=None,
                      hardware=Hardware(type="cpu"), model=ModelIdentity(name="m"),
                      command=argv)
    text = " ".join(prov.command)
    assert not any(s in text for s in ("sk-live-123", "hf_abc", "k-777")), text
    assert "--max-model-len 2048" in text and "--kv-cache-dtype fp8" in text


def test_an_abbreviated_flag_keeps_no_secret_in_the_runs_command_line() -> None:
    # argparse takes a unique prefix: `--baseline '--api-key X'` is --baseline-args, and
    # `--varia=...` is --variant; their values were kept verbatim (the review found it).
    from attnprof.contracts.provenance import Hardware, ModelIdentity, Provenance

    argv = ["attnprof", "whatif", "rec.json", "--baseline", "--api-key sk-live-123",
            "--varia=--hf-token hf_abc --kv-cache-dtype fp8"]
    from attnprof.cli import build_parser

    ns = build_parser().parse_args(argv[1:])  # the abbreviations are the options they stand for
    assert "sk-live-123" in ns.baseline_args and ns.variant
    prov = Provenance(attnprof=None, python=None, torch=None, transformers=None, vllm=None,
                      hardware=Hardware(type="cpu"), model=ModelIdentity(name="m"),
                      command=argv)
    text = " ".join(prov.command)
    assert not any(s in text for s in ("sk-live-123", "hf_abc")), text
    assert "--kv-cache-dtype fp8" in text
