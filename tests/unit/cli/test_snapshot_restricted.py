"""``attnprof snapshot`` against a server with no key: the table of what it did answer, and
one line saying what is withheld and how to open it (the server's ``restricted`` field,
control characters escaped)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from attnprof.exporters.snapshot_public import public_snapshot
from tests.bearer_server import BearerJsonServer
from tests.golden import SNAPSHOT


@pytest.mark.slow
def test_a_restricted_answer_is_shown_with_what_opens_the_rest() -> None:
    hint = "no API key is configured; set ATTNPROF_API_KEY \x1b[31mon the server"
    doc = public_snapshot(json.loads(SNAPSHOT.read_text()), hint)
    srv = BearerJsonServer("k", lambda _n: doc)
    try:
        r = subprocess.run([sys.executable, "-m", "attnprof.cli", "snapshot", "--url", srv.url,
                            "--api-key", "k"], capture_output=True, text=True, timeout=120)
    finally:
        srv.stop()
    assert r.returncode == 0, r.stderr
    assert "Attention layers in worker" in r.stdout
    (line,) = [x for x in r.stderr.splitlines() if "ATTNPROF_API_KEY" in x]
    assert line.startswith(f"attnprof: {srv.url}: no API key") and "\x1b" not in r.stderr


@pytest.mark.parametrize("env,args,says", [
    ({"ATTNPROF_API_KEY": "m"}, ["--api-key", "k"], "$ATTNPROF_API_KEY"),
    ({}, ["--api-k", "k1", "k2"], "every inference key opens it"),  # as vLLM's parser reads
    ({}, ["--api_key=k"], "every inference key opens it"),
    ({"VLLM_API_KEY": "k"}, [], "every inference key opens it"),
    ({}, ["--allow-credentials", "--port", "1"], "only what /metrics shows"),
])
def test_serve_says_which_key_opens_the_snapshot(monkeypatch: pytest.MonkeyPatch,
                                                 env: dict[str, str], args: list[str],
                                                 says: str) -> None:
    """The line ``attnprof serve`` prints matches what the server will do: vLLM's key (any
    spelling its parser takes) opens the routes when ATTNPROF_API_KEY is unset."""
    from attnprof.cli.serve import _key_note

    for name in ("ATTNPROF_API_KEY", "VLLM_API_KEY"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert says in _key_note(args)
