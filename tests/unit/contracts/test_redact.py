"""Secrets out of every captured command line (issue 24, point 1): every form a secret takes on
a vLLM command line is redacted, every real setting stays readable, and every Provenance built
or read carries the redacted command (so snapshots, records, reports and diffs do)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from attnprof.contracts.provenance import Hardware, ModelIdentity, Provenance
from attnprof.contracts.redact import REDACTED, is_secret_name, redact_argv, redact_value
from attnprof.tools import provenance

R = REDACTED


def _leaks(out: list[str], *secrets: str) -> list[str]:
    joined = "\0".join(out)
    return [s for s in secrets if s in joined]


# ----- flags -----
def test_api_key_loses_every_value_in_both_forms() -> None:
    # vLLM 0.32 takes several keys: the old redaction left the second one readable.
    out = redact_argv(["vllm", "serve", "m", "--api-key", "k1-aaaa", "k2-bbbb", "k3-cccc",
                       "--port", "8000"])
    assert out == ["vllm", "serve", "m", "--api-key", R, R, R, "--port", "8000"]
    # After the = form a stray word is a key by intent (argparse would not take it).
    assert redact_argv(["--api-key=k1-aaaa", "k2-bbbb", "--port", "8000"]) == [
        "--api-key=" + R, R, "--port", "8000"]
    assert redact_argv(["--api-key", "k1", "--", "k2"]) == ["--api-key", R, "--", "k2"]


@pytest.mark.parametrize("flag", [
    "--hf-token", "--token", "--api_key", "--apikey", "--client-secret", "--db-password",
    "--smtp-passwd", "--credential", "--aws-credentials", "--auth", "--proxy-auth",
    "--authorization", "--private-key", "--hf-overrides.auth_token", "--signature",
    "--session-cookie", "--HFToken", "--apiKey", "--bearer",
])
def test_every_secret_segment_flag_is_redacted(flag: str) -> None:
    assert is_secret_name(flag)
    assert redact_argv([flag, "S3CR3T", "--port", "1"]) == [flag, R, "--port", "1"]
    assert redact_argv([f"{flag}=S3CR3T", "--port", "1"]) == [f"{flag}={R}", "--port", "1"]


@pytest.mark.parametrize("flag,value", [
    # Plurals are counts ("tokens" is not the segment "token"): real settings a diff shows.
    ("--max-num-batched-tokens", "8192"), ("--max-tokens", "16"),
    ("--enable-prompt-tokens-details", "x"),
    # The tokenizer is a path or a model id, not a credential.
    ("--tokenizer", "Qwen/Qwen3-8B"), ("--tokenizer-mode", "slow"),
    ("--skip-tokenizer-init", "Qwen/Qwen3-8B"),
    # A path to a key file names where the key is, not the key ("keyfile" is one segment).
    ("--ssl-keyfile", "/etc/tls/server.pem"),
    ("--kv-cache-dtype", "fp8"), ("--enable-auto-tool-choice", "m"), ("--port", "8000"),
])
def test_real_settings_stay_readable(flag: str, value: str) -> None:
    assert not is_secret_name(flag)
    assert redact_argv([flag, value]) == [flag, value]
    assert redact_argv([f"{flag}={value}"]) == [f"{flag}={value}"]


def test_environment_style_words_with_a_secret_name() -> None:
    out = redact_argv(["env", "OPENAI_API_KEY=sk-9", "HF_TOKEN=hf_x", "AWS_SECRET_ACCESS_KEY=a",
                       "TOKENIZERS_PARALLELISM=false", "VLLM_PORT=8000", "vllm", "serve"])
    assert out == ["env", f"OPENAI_API_KEY={R}", f"HF_TOKEN={R}", f"AWS_SECRET_ACCESS_KEY={R}",
                   "TOKENIZERS_PARALLELISM=false", "VLLM_PORT=8000", "vllm", "serve"]


# ----- URLs and headers -----
@pytest.mark.parametrize("word,secrets,kept", [
    ("http://user:pw-77@host:9090/x", ["user", "pw-77"], ["http://", "host:9090/x"]),
    ("redis://:pw-77@cache:6379/0", ["pw-77"], ["cache:6379/0"]),
    ("https://ghp_tok77@github.com/o/r.git", ["ghp_tok77"], ["github.com/o/r.git"]),
    ("http://h/v1?api_key=Q1&b=2&max_tokens=5", ["Q1"], ["b=2", "max_tokens=5", "api_key="]),
    ("https://h/cb#access_token=Z9&state=s", ["Z9"], ["state=s"]),
    ("https://b.s3/o?X-Amz-Credential=AK&X-Amz-Signature=SG&X-Amz-Expires=60",
     ["AK", "SG"], ["X-Amz-Expires=60"]),
    ("Authorization: Bearer zz-77", ["zz-77"], ["Authorization: "]),
    ("X-Api-Key: abc-77", ["abc-77"], ["X-Api-Key: "]),
    ("Bearer zz-77", ["zz-77"], ["Bearer "]),
])
def test_url_credentials_and_headers_in_any_value(word: str, secrets: list[str],
                                                  kept: list[str]) -> None:
    for argv in (["--endpoint", word], [f"--endpoint={word}"], [word]):
        out = redact_argv(argv)
        assert not _leaks(out, *secrets), out
        assert all(k in "".join(out) for k in kept), out


# ----- JSON values -----
def test_json_valued_flags_keep_keys_and_redact_secret_values_at_any_depth() -> None:
    doc: dict[str, Any] = {"rope_scaling": {"type": "yarn", "factor": 4.0}, "hf_token": "T-77",
           "nested": {"apiKey": "A-77", "clientSecret": 1234567,
                      "endpoint": "https://u:p-77@h/x?access_token=Z-77&b=2"},
           "auth": {"user": "U-77", "scopes": ["S-77"], "enabled": True, "ttl": None},
           "max_tokens": 16, "tokenizer": "tok/x"}
    for flag in ("--hf-overrides", "--override-generation-config", "-cc",
                 "--compilation-config", "--kv-transfer-config", "--anything-json"):
        for argv in ([flag, json.dumps(doc)], [f"{flag}={json.dumps(doc)}"]):
            out = redact_argv(argv)
            assert not _leaks(out, "T-77", "A-77", "1234567", "p-77", "Z-77", "U-77", "S-77")
            got = json.loads(out[-1].partition("=")[2] if "=" in argv[0] else out[-1])
            # Every key stays; non-secret values are exactly what was run.
            assert set(got) == set(doc) and set(got["nested"]) == set(doc["nested"])
            assert got["rope_scaling"] == doc["rope_scaling"]
            assert got["max_tokens"] == 16 and got["tokenizer"] == "tok/x"
            assert got["hf_token"] == R and got["nested"]["clientSecret"] == R
            assert got["auth"] == {"user": R, "scopes": [R], "enabled": True, "ttl": None}
            assert got["nested"]["endpoint"] == f"https://{R}@h/x?access_token={R}&b=2"


def test_json_without_secrets_is_left_byte_for_byte() -> None:
    word = '{"level": 3,  "cudagraph_capture_sizes": [1, 2, 4]}'
    assert redact_argv(["-cc", word]) == ["-cc", word]
    assert redact_argv(["--hf-overrides", "[1, 2]"]) == ["--hf-overrides", "[1, 2]"]


def test_json_arrays_and_json_looking_words_that_do_not_parse() -> None:
    out = redact_argv(["--x", '[{"token": "T-77"}, "http://a:b-77@h"]'])
    assert not _leaks(out, "T-77", "b-77") and json.loads(out[1])[0] == {"token": R}
    # Python-literal style (not JSON): quoted secret pairs are still found.
    out = redact_argv(["--x", "{'api_key': 'K-77', 'n': 'v'}"])
    assert not _leaks(out, "K-77") and "'n': 'v'" in out[1]
    assert redact_value("{") == "{" and redact_value("[" * 100_000) == "[" * 100_000


# ----- properties -----
def test_redaction_is_idempotent_on_every_form() -> None:
    argv = ["vllm", "serve", "m", "--api-key", "k1", "k2", "--hf-token=t", "OPENAI_API_KEY=x",
            "--u", "http://a:b@h/?token=q&b=2", "-cc", '{"auth": {"k": "v"}}', "--x",
            "Authorization: Bearer z", "--y", "Bearer z"]
    once = redact_argv(argv)
    assert redact_argv(once) == once and len(once) == len(argv)


@pytest.mark.slow
@settings(max_examples=300, deadline=None, derandomize=True)
@given(st.lists(st.text(max_size=40), max_size=12))
def test_never_raises_keeps_length_and_every_flag(argv: list[str]) -> None:
    out = redact_argv(argv)
    assert len(out) == len(argv) and redact_argv(out) == out
    for a, b in zip(argv, out, strict=True):
        if a.startswith("--") and "=" not in a:
            assert a == b  # flags are what make the command readable


@pytest.mark.slow
@settings(max_examples=200, deadline=None, derandomize=True)
@given(st.lists(st.from_regex(r"[A-Za-z0-9_\-]{6,20}", fullmatch=True), min_size=1,
                max_size=4))
def test_no_api_key_value_survives(keys: list[str]) -> None:
    marked = [f"K{k}Z" for k in keys]
    for argv in (["serve", "--api-key", *marked, "--port", "1"],
                 ["serve", f"--api-key={marked[0]}", *marked[1:]],
                 ["serve", "--hf-overrides", json.dumps({"x": {"api_key": marked}})]):
        assert not _leaks(redact_argv(argv), *marked)


# ----- every Provenance is redacted -----
def _prov(command: list[str]) -> Provenance:
    return Provenance(attnprof="0", python="3", torch=None, transformers=None, vllm=None,
                      hardware=Hardware(type="cpu"), model=ModelIdentity(name="m"),
                      command=command)


def test_provenance_built_read_or_collected_carries_a_redacted_command() -> None:
    argv = ["api_server.py", "--model", "m", "--api-key", "k1-77", "k2-77", "--port", "1"]
    want = ["api_server.py", "--model", "m", "--api-key", R, R, "--port", "1"]
    assert _prov(argv).command == want
    # A file written by an older attnprof (which left the second key) is redacted on read.
    raw = _prov([]).to_json() | {"command": argv}
    assert Provenance.from_json(raw).command == want
    assert provenance.collect("m", None, argv=argv).command == want


def test_a_diff_of_an_old_file_shows_no_key() -> None:
    """The diff reads Provenance, so a snapshot from an older server (its second key in
    clear) reaches no diff output (library path; the canary checks the real server's CLI)."""
    from attnprof.contracts.snapshot import Snapshot
    from attnprof.exporters.diff_report import render_markdown, render_text
    from tests.unit.analyze.test_diff import _diff, _snap

    doc = _snap().to_json()
    doc["provenance"]["command"] = ["serve", "--api-key", "k1-77", "k2-77"]
    base = Snapshot.from_json(doc)
    assert base.provenance is not None
    assert base.provenance.command == ["serve", "--api-key", R, R]
    rep = _diff(base, _snap(seed=1))
    text = render_text(rep) + render_markdown(rep) + json.dumps(rep.to_json())
    assert "--api-key" in text and not _leaks([text], "k1-77", "k2-77")


@pytest.mark.slow
def test_attnprof_env_never_prints_a_secret_value() -> None:
    env = {**os.environ, "ATTNPROF_API_KEY": "k-77", "ATTNPROF_HOME": "/srv/attnprof"}
    out = subprocess.run([sys.executable, "-m", "attnprof.cli", "env"], env=env,
                         capture_output=True, text=True, timeout=60).stdout
    assert "k-77" not in out and "(set, not shown)" in out and "/srv/attnprof" in out
