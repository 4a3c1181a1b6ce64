"""Every user-caused CLI error is one line on stderr and exit code 2."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.bearer_server import BearerJsonServer
from tests.conftest import free_port

# Every test here starts processes or runs for seconds: `make test` runs them,
# `make unit` skips them.
pytestmark = pytest.mark.slow


def _cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    import os

    full = {**os.environ, **(env or {})}
    return subprocess.run([sys.executable, "-m", "attnprof.cli", *args],
                          capture_output=True, text=True, timeout=120, env=full)


def _one_line_error(r: subprocess.CompletedProcess[str], *needles: str) -> None:
    assert r.returncode == 2, (r.returncode, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("attnprof: error: "), r.stderr
    for n in needles:
        assert n in lines[0]


def test_snapshot_unreachable_url() -> None:
    _one_line_error(_cli("snapshot", "--url", f"http://127.0.0.1:{free_port()}"),
                    "cannot reach")


def test_serve_missing_model_path(tmp_path: Path) -> None:
    _one_line_error(_cli("serve", "--model", str(tmp_path / "nope")), "does not exist")


def test_serve_not_a_checkpoint(tmp_path: Path) -> None:
    _one_line_error(_cli("serve", "--model", str(tmp_path)), "no config.json")


def test_serve_bad_setting_fails_before_starting_vllm(tmp_path: Path) -> None:
    _one_line_error(_cli("serve", "--model", str(tmp_path),
                         env={"ATTNPROF_SAMPLE_RATE": "abc"}), "ATTNPROF_SAMPLE_RATE")


@pytest.mark.parametrize("args,needle", [
    (["--doc-lengths", "10,x"], "--doc-lengths"),
    (["--doc-lengths", "-5"], "positive"),
    (["--sample-rate", "2"], "--sample-rate"),
])
def test_demo_bad_flags(args: list[str], needle: str) -> None:
    _one_line_error(_cli("demo", *args), needle)


def test_demo_unwritable_out() -> None:
    _one_line_error(_cli("demo", "--out", "/proc/attnprof/demo.json"), "output directory")


def test_written_files_get_the_umask_mode_not_mkstemps_0600(tmp_path: Path) -> None:
    """CLI outputs are written atomically through a temp file; they must still be readable
    like any file the user creates (a served dashboard, the regenerated matrix)."""
    import os

    from attnprof.cli._common import write_atomic

    old = os.umask(0o022)
    try:
        write_atomic(tmp_path / "out.json", "{}\n")
    finally:
        os.umask(old)
    assert (tmp_path / "out.json").stat().st_mode & 0o777 == 0o644
    assert (tmp_path / "out.json").read_text() == "{}\n"


# ----- issue 10: every bad input is one line and exit 2, with nothing half-written -----


_SNAP = {"schema_version": "attnprof.snapshot/1.3", "time": 1.0, "model": "m", "enabled": True}
_CONFIG = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "num_hidden_layers": 2,
           "num_attention_heads": 4, "num_key_value_heads": 2, "hidden_size": 256,
           "head_dim": 64, "intermediate_size": 512, "vocab_size": 600,
           "max_position_embeddings": 1024, "torch_dtype": "float32"}


class RawServer:
    """Answers every connection with the same raw bytes (truncated, not HTTP, anything),
    then closes it: what a broken proxy or the wrong port sends."""

    def __init__(self, answer: bytes = b"") -> None:
        self.answer = answer
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            with conn:
                conn.settimeout(2)
                try:
                    conn.recv(65536)
                    conn.sendall(self.answer)
                except OSError:
                    pass

    def close(self) -> None:
        self.sock.close()


def _http(status: int, body: bytes, headers: str = "") -> bytes:
    return (f"HTTP/1.1 {status} X\r\nContent-Length: {len(body)}\r\n{headers}\r\n").encode() \
        + body


def _assert_clean(r: subprocess.CompletedProcess[str], *needles: str) -> None:
    _one_line_error(r, *needles)
    assert "Traceback" not in r.stderr and r.stdout == ""


BAD_ANSWERS = {
    "not_http": b"hello, this is not HTTP\n",
    "empty": b"",
    "truncated_body": b"HTTP/1.1 200 OK\r\nContent-Length: 500\r\n\r\n{\"schema_version\"",
    "truncated_chunked": b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n40\r\n{\"sch",
    "truncated_headers": b"HTTP/1.1 200 OK\r\nContent-Len",
    "not_json": _http(200, b"<html>hello</html>"),
    "json_not_snapshot": _http(200, b"[1, 2, 3]"),
    "binary": _http(200, bytes(range(256))),
}


@pytest.fixture
def raw_server() -> Iterator[RawServer]:
    srv = RawServer()
    yield srv
    srv.close()


@pytest.mark.parametrize("answer", sorted(BAD_ANSWERS))
@pytest.mark.parametrize("command", ["snapshot", "suggest-prometheus"])
def test_bad_http_answers_are_one_line(raw_server: RawServer, answer: str, command: str,
                                       tmp_path: Path) -> None:
    raw_server.answer = BAD_ANSWERS[answer]
    if command == "snapshot":
        r = _cli("snapshot", "--url", raw_server.url)
    else:
        r = _cli("suggest-window", "--prometheus", raw_server.url, "--model",
                 str(_checkpoint(tmp_path)))
    _assert_clean(r)


def _checkpoint(tmp_path: Path) -> Path:
    d = tmp_path / "ckpt"
    d.mkdir(exist_ok=True)
    (d / "config.json").write_text(json.dumps(_CONFIG))
    return d


def test_snapshot_with_missing_keys(raw_server: RawServer) -> None:
    """A layer without its backend (a server of another build, a proxy's rewrite) used to
    end in a KeyError from the table renderer."""
    snap = {**_SNAP, "workers": [{"pid": 1, "layers": [{"name": "l0", "index": 0}]}]}
    raw_server.answer = _http(200, json.dumps(snap).encode())
    _assert_clean(_cli("snapshot", "--url", raw_server.url), "not", "snapshot",
                  "missing field")


@pytest.mark.parametrize("content", ["1e30\n", "100\n99999999999999999999999\n",
                                     '{"buckets": [{"le": 1e30, "count": 3}]}',
                                     '{"buckets": [{"le": 100, "count": 1e400}]}',
                                     "[" * 100000 + "]" * 100000])
def test_absurd_lengths_file(tmp_path: Path, content: str) -> None:
    f = tmp_path / "lengths.txt"
    f.write_text(content)
    _assert_clean(_cli("suggest-window", "--lengths", str(f), "--model",
                       str(_checkpoint(tmp_path))), str(f))


def _limited(cmd: list[str], timeout: float = 60) -> subprocess.CompletedProcess[str]:
    """The old parser built a set of 10**10 ints: cap the child's memory so a regression
    fails fast instead of swapping the machine."""
    import resource

    def cap() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (6 << 30, 6 << 30))

    return subprocess.run([sys.executable, "-m", "attnprof.cli", *cmd], capture_output=True,
                          text=True, timeout=timeout, preexec_fn=cap)


@pytest.mark.parametrize("spec", ["0-10000000000", "0-1,5-2", "-1", "1-", "a-b", ","])
def test_layers_out_of_range_fail_fast(tmp_path: Path, spec: str) -> None:
    f = tmp_path / "lengths.txt"
    f.write_text("100\n200\n")
    _assert_clean(_limited(["suggest-window", "--lengths", str(f), "--model",
                            str(_checkpoint(tmp_path)), f"--layers={spec}"], timeout=30),
                  "--layers")


def test_validate_window_out_directory_fails_before_the_replay(tmp_path: Path) -> None:
    out = tmp_path / "outdir"
    out.mkdir()
    # No model at all: the --out check must come first (the replay takes minutes).
    r = _cli("validate-window", "--window", "64", "--sinks", "4", "--model",
             str(tmp_path / "no-model"), "--out", str(out))
    _assert_clean(r, "--out", "is a directory")
    assert list(out.iterdir()) == []


def test_suggest_stats_out_directory_fails_first(tmp_path: Path) -> None:
    out = tmp_path / "outdir"
    out.mkdir()
    r = _cli("suggest-window", "--lengths", "/nonexistent", "--model", str(tmp_path / "none"),
             "--stats-out", str(out))
    _assert_clean(r, "--stats-out", "is a directory")


def test_demo_out_directory_fails_first(tmp_path: Path) -> None:
    r = _cli("demo", "--out", str(tmp_path), "--model", str(tmp_path / "none"))
    _assert_clean(r, "--out", "is a directory")


def test_profile_without_matplotlib_fails_before_profiling(tmp_path: Path) -> None:
    """matplotlib draws scaling.png at the very end: check it is there first."""
    code = ("import sys; sys.modules['matplotlib'] = None\n"
            "from attnprof.cli import main\n"
            f"sys.exit(main(['profile', {str(_checkpoint(tmp_path))!r}, '--seq-lens', '8',"
            f" '--out', {str(tmp_path / 'out')!r}]))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=120)
    _assert_clean(r, "matplotlib", "attnprof[report]")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("manifest", ['{"files": []}', '{"files": null}', '[]',
                                      '{"files": {"a": "x"}}', '{"files": "abc"}'])
def test_damaged_model_manifest(tmp_path: Path, manifest: str) -> None:
    from attnprof.tools.models import DIR_NAME, MANIFEST

    d = tmp_path / "home" / "models" / DIR_NAME
    d.mkdir(parents=True)
    (d / MANIFEST).write_text(manifest)
    f = tmp_path / "lengths.txt"
    f.write_text("100\n")
    r = _cli("suggest-window", "--lengths", str(f), "--model", "smollm2",
             env={"ATTNPROF_HOME": str(tmp_path / "home")})
    _assert_clean(r, "attnprof model fetch")


@pytest.mark.parametrize("args,needle", [
    (["profile", "x", "--memory-budget", "1e400"], "--memory-budget"),
    (["profile", "x", "--memory-budget", "nan"], "--memory-budget"),
    (["profile", "x", "--seq-lens", "1e30"], "--seq-lens"),
    (["profile", "x", "--seq-lens", "99999999999999999999"], "--seq-lens"),
    (["profile", "x", "--batch-size", "100000000000000000000"], "--batch-size"),
    (["profile", "x", "--validate-max-seconds", "nan"], "--validate-max-seconds"),
    (["validate-window", "--window", "64", "--sinks", "4", "--max-kl", "nan"], "--max-kl"),
    (["validate-window", "--window", "100000000000000000000", "--sinks", "4"], "--window"),
    (["validate-window", "--window", "64", "--sinks", "4", "--layers", "0-99999999999"],
     "--layers"),
    (["suggest-window", "--lengths", "x", "--tau", "nan"], "--tau"),
    (["suggest-window", "--lengths", "x", "--window", "10000000000000000000000"], "--window"),
    (["suggest-window", "--prometheus", "http://127.0.0.1:1", "--prometheus-range",
      "1d]) or vector(1"], "--prometheus-range"),
    (["suggest-window", "--prometheus", "ftp://x"], "--prometheus"),
    (["snapshot", "--url", "127.0.0.1:8000"], "--url"),
    (["snapshot", "--url", "http://[::1"], "--url"),
    (["demo", "--concurrency", "0"], "--concurrency"),
    (["demo", "--port", "70000"], "--port"),
    (["demo", "--doc-lengths", "1e30"], "--doc-lengths"),
])
def test_absurd_flags_fail_fast(args: list[str], needle: str) -> None:
    # A model that is not there: the flag must be refused first (before the model is read,
    # vLLM started or a replay run), and a regression fails on the model, not after minutes.
    if args[0] in ("validate-window", "demo", "suggest-window"):
        args = [*args, "--model", "/nonexistent-attnprof-model"]
    _assert_clean(_cli(*args), needle)


def test_profile_show_missing_keys(tmp_path: Path) -> None:
    f = tmp_path / "profile.json"
    f.write_text(json.dumps({"schema_version": "attnprof.profile/1.1", "model": {}}))
    _assert_clean(_cli("profile", "--show", str(f)), "missing field")


# ----- the API key on /attnprof/* -----

@pytest.fixture
def auth_server() -> Iterator[BearerJsonServer]:
    """A snapshot behind a bearer token, like vLLM with --api-key."""
    srv = BearerJsonServer("s3cret-key", lambda _n: _SNAP)
    yield srv
    srv.stop()


_NO_KEYS = {"ATTNPROF_API_KEY": "", "VLLM_API_KEY": ""}


def test_snapshot_needs_the_api_key(auth_server: BearerJsonServer) -> None:
    r = _cli("snapshot", "--url", auth_server.url, "--json", env=_NO_KEYS)
    _assert_clean(r, "401", "requires an API key", "--api-key", "ATTNPROF_API_KEY")
    assert auth_server.seen == [None]


@pytest.mark.parametrize("args", [
    ("snapshot", "--url", "http://user:s3cret-pw@127.0.0.1:1"),
    ("snapshot", "--url", "http://user:s3cret-pw@127.0.0.1:99999"),
    ("trace", "--url", "https://:s3cret-pw@example.invalid/x"),
    ("report", "--prometheus", "http://user:s3cret-pw@127.0.0.1:9090"),
])
def test_a_url_with_credentials_is_one_line_that_never_shows_them(args: tuple[str, ...]
                                                                  ) -> None:
    # urllib takes user:password@host for a host name; the error used to print the password.
    r = _cli(*args, env=_NO_KEYS)
    _assert_clean(r, args[1])
    assert "s3cret-pw" not in r.stderr


def test_a_route_off_on_the_server_says_what_to_set_there() -> None:
    # attnprof's 403 (the server has no key configured): passing a key cannot help, so the
    # one line is the server's own reason, not "pass --api-key".
    reason = ("attnprof: the live trace is off until the server has an API key (vLLM's "
              "--api-key or ATTNPROF_API_KEY), or ATTNPROF_TRACE_OPEN=1 opens it to anyone")
    srv = BearerJsonServer("never-sent", lambda _n: _SNAP, refusal=(403, {"error": reason}))
    try:
        for key in ([], ["--api-key", "some-key"]):
            r = _cli("trace", "--url", srv.url, "--steps", "1", *key, env=_NO_KEYS)
            _assert_clean(r, "403", reason)
            assert "refused the API key" not in r.stderr and "pass --api-key" not in r.stderr
    finally:
        srv.stop()


@pytest.mark.parametrize("flag,env", [
    ("s3cret-key", {}),
    (None, {"ATTNPROF_API_KEY": "s3cret-key"}),
    (None, {"VLLM_API_KEY": "s3cret-key"}),
    ("s3cret-key", {"ATTNPROF_API_KEY": "wrong", "VLLM_API_KEY": "wrong"}),  # the flag wins
    (None, {"ATTNPROF_API_KEY": "s3cret-key", "VLLM_API_KEY": "wrong"}),
])
def test_snapshot_sends_the_api_key(auth_server: BearerJsonServer, flag: str | None,
                                    env: dict[str, str]) -> None:
    args = ["snapshot", "--url", auth_server.url, "--json"]
    r = _cli(*args, *(["--api-key", flag] if flag else []), env={**_NO_KEYS, **env})
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["model"] == "m"
    assert auth_server.seen == ["Bearer s3cret-key"]


def test_wrong_api_key_is_one_line_and_never_printed(auth_server: BearerJsonServer) -> None:
    for r in (_cli("snapshot", "--url", auth_server.url, "--api-key", "wrong-key-123",
                   env=_NO_KEYS),
              _cli("-v", "snapshot", "--url", auth_server.url,
                   env={**_NO_KEYS, "ATTNPROF_API_KEY": "wrong-key-123"}),
              _cli("snapshot", "--url", auth_server.url,
                   "--api-key", "bad\nkey-123", env=_NO_KEYS)):
        _assert_clean(r, "API key")
        assert "key-123" not in r.stderr + r.stdout


def test_suggest_url_sends_the_api_key(auth_server: BearerJsonServer, tmp_path: Path) -> None:
    r = _cli("suggest-window", "--url", auth_server.url, "--model", str(_checkpoint(tmp_path)),
             env={**_NO_KEYS, "ATTNPROF_API_KEY": "s3cret-key"})
    # Authorized: the snapshot has no finished requests yet, which is the (one-line) answer.
    _assert_clean(r, "no finished requests")
    assert auth_server.seen == ["Bearer s3cret-key"]


@pytest.mark.parametrize("args", [["demo", "--port", "abc"], ["snapshot", "--nope"],
                                  ["nosuchcommand"], [], ["profile", "--seq-lens"]])
def test_usage_errors_are_one_line(args: list[str]) -> None:
    """argparse's own errors too: one line (no usage block), exit 2."""
    _assert_clean(_cli(*args))


def test_env_does_not_print_the_api_key() -> None:
    r = _cli("env", env={"ATTNPROF_API_KEY": "s3cret-key"})
    assert "s3cret-key" not in r.stdout + r.stderr


def test_demo_with_its_port_taken_is_one_line_before_any_work(tmp_path: Path) -> None:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        r = _cli("demo", "--port", str(port), "--out", str(tmp_path / "demo.json"))
    _one_line_error(r, f"port {port}", "already in use")
    assert not (tmp_path / "demo.json").exists()


@pytest.mark.parametrize("args,needle", [
    (["--gpu-hour-price", "-1"], "--gpu-hour-price"),
    (["--gpu-hour-price", "abc"], "not a number"),
    (["--gpu-hour-price", "nan"], "finite"),
    (["--replicas", "0"], "--replicas"),
    ([], "give one source"),
    (["--url", "http://127.0.0.1:1", "--prometheus", "http://127.0.0.1:2"], "give one source"),
    (["--range", "1h", "x.json"], "--range go with --prometheus"),
])
def test_report_bad_flags(args: list[str], needle: str, tmp_path: Path) -> None:
    out = tmp_path / "out"
    _one_line_error(_cli("report", *args, "--out", str(out)), needle)
    assert not out.exists()


def test_report_unreachable_sources_and_bad_files(tmp_path: Path) -> None:
    out = tmp_path / "out"
    port = free_port()
    _one_line_error(_cli("report", "--url", f"http://127.0.0.1:{port}", "--out", str(out)),
                    "cannot reach")
    _one_line_error(_cli("report", "--prometheus", f"http://127.0.0.1:{port}", "--out",
                         str(out)), "cannot reach")
    bad = tmp_path / "bad.json"
    bad.write_text('{"schema_version": "attnprof.diff/1.0"}')
    _one_line_error(_cli("report", str(bad), "--out", str(out)), "not an attnprof snapshot")
    bad.write_text("{not json")
    _one_line_error(_cli("report", str(bad), "--out", str(out)), "not JSON")
    _one_line_error(_cli("report", str(tmp_path / "missing.json"), "--out", str(out)),
                    "cannot read")
    assert not out.exists()
    afile = tmp_path / "a-file"
    afile.write_text("x")
    _one_line_error(_cli("report", str(bad), "--out", str(afile)), "is a file")
