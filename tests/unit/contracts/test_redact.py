"""Secrets out of every captured command line (issue 24, point 1): every form a secret takes on
a vLLM command line is redacted, every real setting stays readable, and every Provenance built
or read carries the redacted command (so snapshots, records, reports and diffs do)."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from attnprof.contracts.provenance import Hardware, ModelIdentity, Provenance
from attnprof.contracts.redact import (
    REDACTED,
    VLLM_OPTIONS_PATH,
    is_secret_name,
    redact_argv,
    redact_command,
    redact_value,
    vllm_option,
)
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


# ----- as vLLM's parser reads the command (issue 30, point 4) -----
def _unique_prefixes(option: str) -> list[str]:
    """Every abbreviation vLLM's parser expands to ``option`` (from the shipped table)."""
    out = [option[:n] for n in range(3, len(option))
           if (hit := vllm_option(option[:n])) is not None and hit[0] == option]
    assert out, option
    return out


def test_issue_command_loses_every_secret_under_vllm_abbreviations() -> None:
    out = redact_argv(["attnprof", "serve", "--", "--api-k", "SK1-77", "SK2-77", "--hf-tok",
                       "hf_X77"])
    assert out == ["attnprof", "serve", "--", "--api-k", R, R, "--hf-tok", R]


@pytest.mark.parametrize("option", ["--api-key", "--hf-token"])
def test_every_abbreviation_of_a_secret_option_in_every_form(option: str) -> None:
    prefixes = _unique_prefixes(option)
    assert "--api-k" in prefixes or "--hf-t" in prefixes
    for p in [*prefixes, option, option.replace("-", "_").replace("__", "--", 1)]:
        for argv in ([p, "S-77", "--port", "1"], [f"{p}=S-77", "--port", "1"],
                     [p.replace("-", "_").replace("__", "--", 1), "S-77"]):
            out = redact_argv(argv)
            assert not _leaks(out, "S-77"), (p, out)
            assert out[0].partition("=")[0] == argv[0].partition("=")[0]


def test_what_vllm_parses_as_a_setting_stays_readable() -> None:
    # A store_true switch takes no value: the model after it is the model.
    assert redact_argv(["vllm", "serve", "--allow-credentials", "Qwen/Qwen3-8B"]) == [
        "vllm", "serve", "--allow-credentials", "Qwen/Qwen3-8B"]
    for argv in (["--long-prefill-token-threshold", "2048"],
                 ["--long-prefill-token-threshold=2048"], ["--dbo-decode-token-threshold", "9"],
                 ["--max-num-batched-tokens", "8192"], ["--allow-cred", "m"]):
        assert redact_argv(argv) == argv
    # --hf-token takes one value (nargs ?): the positional model after it is not the token.
    assert redact_argv(["serve", "--hf-t", "hf_X77", "Qwen/Qwen3-8B", "--port", "1"]) == [
        "serve", "--hf-t", R, "Qwen/Qwen3-8B", "--port", "1"]
    # --api-key takes many: every word up to the next flag is a key.
    assert redact_argv(["--api-k", "a-77", "b-77", "c-77", "-tp", "2"]) == [
        "--api-k", R, R, R, "-tp", "2"]


def test_shipped_vllm_option_table_knows_the_secret_options() -> None:
    assert vllm_option("--api-key") == ("--api-key", "+", True)
    assert vllm_option("--hf-token") == ("--hf-token", "?", True)
    assert vllm_option("--allow-credentials") == ("--allow-credentials", "0", False)
    assert vllm_option("--ssl-keyfile") == ("--ssl-keyfile", "1", False)  # a path
    # vLLM hides this one from its own log (its JSON holds the watermark's secret key).
    assert vllm_option("--watermark-config") == ("--watermark-config", "1", True)
    assert redact_argv(["--watermark-c", '{"key": 77, "algorithm": "gumbel"}', "m"]) == [
        "--watermark-c", R, "m"]
    assert redact_argv(["--watermark", "0.01"]) == ["--watermark", "0.01"]  # a fraction
    assert vllm_option("--max") is None  # ambiguous: vLLM refuses it too
    assert vllm_option("--not-a-vllm-option") is None


def test_ambiguous_or_unknown_flags_fall_back_to_the_name_pattern() -> None:
    # --token is a prefix of --tokenizer, --tokens-only, ...: ambiguous, so the name decides.
    assert redact_argv(["--token", "T-77", "--port", "1"]) == ["--token", R, "--port", "1"]
    assert redact_argv(["--my-api-key", "a", "b"]) == ["--my-api-key", R, R]
    # An abbreviation vLLM expands to a setting still hides its value when the word itself
    # names a secret (fail closed: the word may be attnprof's own flag, which vLLM never
    # reads); the full option name shows it.
    assert vllm_option("--dbo-decode-token") is not None
    assert redact_argv(["--dbo-decode-token", "9"]) == ["--dbo-decode-token", R]


@pytest.mark.vllm
def test_shipped_vllm_option_table_equals_the_installed_vllm_parser() -> None:
    from attnprof.capture.vllm.option_table import TABLE_PATH, build, dumps

    assert TABLE_PATH.read_text() == dumps(build()), (
        "vLLM's options changed: run python -m attnprof.capture.vllm.option_table")


@pytest.mark.parametrize("key", ["pwd", "pass", "passphrase", "creds", "jwt", "apitoken",
                                 "hftoken", "secretkey", "api_tokens", "HFTOKEN", "apiToken",
                                 "db_pass", "accessTokens", "API_KEY_2", "token_b64"])
def test_secret_json_keys_missed_before(key: str) -> None:
    assert is_secret_name(key)
    out = redact_argv(["--hf-overrides", json.dumps({"a": {key: "S-77"}, "n": 1})])
    assert not _leaks(out, "S-77") and json.loads(out[1]) == {"a": {key: R}, "n": 1}


@pytest.mark.parametrize("key", ["max_tokens", "num_tokens", "pass_config", "token_threshold",
                                 "long_prefill_token_threshold", "keys", "special_tokens",
                                 "eos_token_id", "passes", "tokenizer", "ssl_keyfile"])
def test_setting_names_that_only_look_secret(key: str) -> None:
    assert not is_secret_name(key)


def test_env_assignments_inside_values_and_json_strings() -> None:
    assert redact_argv(["--x=HF_TOKEN=hf_77"]) == [f"--x=HF_TOKEN={R}"]
    assert redact_argv(["--env", "HF_TOKEN=hf_77"]) == ["--env", f"HF_TOKEN={R}"]
    out = redact_argv(["--additional-config",
                       json.dumps({"env": ["HF_TOKEN=hf_77", "A=1"], "cmd": "x API_KEY=k77 y"})])
    assert not _leaks(out, "hf_77", "k77")
    assert json.loads(out[1]) == {"env": [f"HF_TOKEN={R}", "A=1"], "cmd": f"x API_KEY={R} y"}


@pytest.mark.parametrize("word,secrets,kept", [
    ("http://h/v1?api%5Fkey=Q77&b=2", ["Q77"], ["api%5Fkey=", "b=2"]),
    ("http://h/v1?api%5fkey=Q77", ["Q77"], ["api%5fkey="]),
    ("https://h/cb?jwt=J77&pwd=P77&x=1", ["J77", "P77"], ["x=1"]),
    ("postgres://user:p@ss-77@db:5432/x", ["p@ss-77", "ss-77", "user"], ["db:5432/x"]),
    ("https://a:b@c@d-77@h/x", ["d-77"], ["h/x"]),
    ("ApiKey ak-77", ["ak-77"], ["ApiKey "]),
    ("Authorization: ApiKey ak-77", ["ak-77"], ["Authorization: "]),
])
def test_query_names_urls_and_schemes_missed_before(word: str, secrets: list[str],
                                                    kept: list[str]) -> None:
    for argv in (["--endpoint", word], [f"--endpoint={word}"], [word],
                 ["--hf-overrides", json.dumps({"u": word})]):
        out = redact_argv(argv)
        assert not _leaks(out, *secrets), out
        assert all(k in "".join(out) for k in kept), out
        assert redact_argv(out) == out


# ----- properties -----
@pytest.mark.parametrize("argv", [
    ["attnprof", "whatif", "r.json", "--baseline-args", "--api-key sk-live-1 --max-model-len 2048"],
    ["attnprof", "whatif", "r.json", "--baseline", "--api-k sk-live-1 sk-live-2"],
    ["attnprof", "whatif", "r.json", "--baseline-args=--hf-tok sk-live-1 --max-model-len 2048"],
    ["attnprof", "whatif", "r.json", "--varia", "--max-model-len 2048 --api-key=sk-live-1"],
])
def test_a_value_that_is_itself_vllms_command_line_loses_its_secrets(argv: list[str]) -> None:
    # A flag of ours whose value is vLLM's words (attnprof whatif --baseline-args), under any
    # abbreviation argparse takes: the words inside are redacted as vLLM's parser reads them.
    out = redact_argv(argv)
    text = " ".join(out)
    assert "sk-live" not in text and REDACTED in text, out
    assert out[:3] == argv[:3] and len(out) == len(argv)
    if "--max-model-len 2048" in " ".join(argv):
        assert "--max-model-len 2048" in text
    assert redact_argv(out) == out


def test_a_command_line_value_without_secrets_stays_byte_for_byte() -> None:
    argv = ["attnprof", "whatif", "r.json", "--baseline-args", "--max-model-len 2048 -O3",
            "--variant=--kv-cache-dtype fp8 --kv-cache-dtype-skip-layers sliding_window"]
    assert redact_argv(argv) == argv
    assert redact_command("--max-model-len 2048 --api-key 'k 1'") == \
        "--max-model-len 2048 --api-key '<redacted>'"
    nested = "sk-live-1"
    for _ in range(4):  # a command line quoted inside a command line, four times over
        nested = shlex.join(["--baseline-args", nested if "--" in nested
                             else f"--api-key {nested}", "-O3"])
    out = redact_command(nested)
    assert "sk-live" not in out and out.count("-O3") == 4, out


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


# ----- against vLLM's real parser, not the table alone -----
# Each command: what vLLM's own FlexibleArgumentParser makes of it decides what is secret
# (its preprocessing of `_`, dotted `--opt.key value` and `-O3`, then argparse's
# abbreviations and nargs), and no value it reads into a secret field, or under a secret
# key of a JSON option, may survive redaction. The model (the positional) stays readable.
_PARSED_FORMS = [
    ["m", "--api-key", "S77a", "S77b", "-tp", "1"],
    ["m", "--api_key", "S77a", "--port", "8123"],
    ["m", "--api-k", "S77a", "S77b", "--hf-tok", "S77c"],
    ["m", "--api_k=S77a", "--hf_t=S77c"],
    ["m", "--api-key=-S77a"],
    ["m", "--api-key", "S77a", "-5"],
    ["m", "--api-key", "S77a", "-O3"],
    ["m", "--hf-token", "S77c", "--port", "8123"],
    ["m", "--hf-token", "-1"],
    ["m", "--api-k.x", "S77a"],
    ["m", "--watermark-config", '{"key": 77701, "algorithm": "gumbel"}'],
    ["m", "--watermark-config.key", "77701"],
    ["m", "--watermark_c.key=77701"],
    ["m", "--additional-config", '{"a": {"api_key": "S77d", "n": 1}, "t": "Bearer S77e"}'],
    ["m", "--additional-config.nested.api_key", "S77d"],
    ["m", "--additional_config.hf.token=S77d"],
    ["m", "--additional-config.api_key+", "S77d,S77e"],
    ["m", "--hf-overrides.password", "S77d", "--port", "8123"],
    ["m", "-O", "3", "--api-key", "S77a"],
    ["m", "--hf-overrides.hf_token", "-S77d"],  # the next word, even one starting with -
    ["m", "--additional-config.api_key", "-S77d", "--port", "8123"],
    ["m", "--api-key", "S77a", "-S77 b"],  # argparse reads a '-' word with a space as a value
]
_SECRET_FIELDS = {"api_key", "hf_token", "watermark_config"}


@pytest.fixture(scope="module")
def vllm_parser() -> Any:
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    return make_arg_parser(FlexibleArgumentParser())


def _parsed_secrets(value: Any, secret: bool) -> list[str]:
    if isinstance(value, dict):
        return [s for k, v in value.items()
                for s in _parsed_secrets(v, secret or is_secret_name(str(k)))]
    if isinstance(value, list):
        return [s for v in value for s in _parsed_secrets(v, secret)]
    if secret and value is not None and not isinstance(value, bool):
        return [str(value)]
    return []


@pytest.mark.vllm
def test_secret_fields_are_the_tables() -> None:
    doc = json.loads(VLLM_OPTIONS_PATH.read_text())["options"]
    secret = {o[2:].replace("-", "_") for o, (_, s) in doc.items() if s}
    assert secret == _SECRET_FIELDS


@pytest.mark.vllm
@pytest.mark.parametrize("argv", _PARSED_FORMS)
def test_no_value_vllms_parser_reads_as_secret_survives(vllm_parser: Any,
                                                        argv: list[str]) -> None:
    ns = vllm_parser.parse_args(list(argv))
    secrets = [s for dest, v in vars(ns).items()
               for s in _parsed_secrets(v, dest in _SECRET_FIELDS)]
    assert secrets, f"{argv}: the case must carry a secret vLLM reads"
    out = redact_argv(argv)
    assert not _leaks(out, *secrets), (argv, out, secrets)
    assert ns.model_tag == "m" and out[0] == "m"
