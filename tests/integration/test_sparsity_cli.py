"""suggest-window / validate-window: the JSON contract, bad inputs as one error line."""

from __future__ import annotations

import http.server
import json
import subprocess
import sys
import urllib.parse
from pathlib import Path

import pytest

from attnprof.analyze.sparsity.recommend import evaluate
from attnprof.analyze.sparsity.savings import LengthDistribution
from attnprof.capture import head_rows
from attnprof.cli import main
from attnprof.facts.shape import AttentionShape
from tests.conftest import REPO, free_port


def run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    rc = main(argv)
    out, err = capsys.readouterr()
    return rc, out, err


@pytest.fixture()
def lengths(tmp_path: Path) -> Path:
    f = tmp_path / "lengths.txt"
    f.write_text("\n".join(str(x) for x in [40, 60, 80, 100, 120, 300, 500, 700]) + "\n")
    return f


def test_suggest_json_contract(tiny_model: Path, lengths: Path,
                               capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, _ = run(["suggest-window", "--lengths", str(lengths), "--model", str(tiny_model),
                      "--json"], capsys)
    assert rc == 0
    d = json.loads(out)
    for key in ("sinks", "window", "attention_flop_saving", "kv_memory_saving",
                "exact_request_fraction"):
        assert key in d
    for key in ("attention_flop_saving", "kv_memory_saving", "exact_request_fraction"):
        assert 0.0 <= d[key] <= 1.0
    assert d["exact_request_fraction"] >= 0.9 and d["pareto"]
    rc, out, _ = run(["suggest-window", "--lengths", str(lengths), "--model", str(tiny_model),
                      "--window", "64", "--sinks", "4", "--json"], capsys)
    ev = json.loads(out)
    arch = AttentionShape.from_model_dir(tiny_model)
    want = evaluate(LengthDistribution.from_lengths([40, 60, 80, 100, 120, 300, 500, 700]),
                    arch, 64, 4)
    assert (ev["window"], ev["sinks"]) == (64, 4)
    assert ev["attention_flop_saving"] == want.attention_flop_saving > 0
    assert ev["exact_request_fraction"] == pytest.approx(2 / 8)  # 40 and 60 <= 4 + 64
    rc, out, _ = run(["suggest-window", "--lengths", str(lengths), "--model", str(tiny_model),
                      "--window", "64", "--sinks", "4", "--layers", "1"], capsys)
    assert rc == 0 and "on layers 1 (1 of 2)" in out


def test_suggest_with_collected_head_stats(tiny_model: Path, lengths: Path, tmp_path: Path,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    stats = tmp_path / "stats.json"
    prompts = tmp_path / "prompts.txt"
    prompts.write_text(" ".join(["the model reads a long document about rivers"] * 30) + "\n")
    rc, out, err = run(["suggest-window", "--lengths", str(lengths), "--model",
                        str(tiny_model), "--collect-stats", "--prompts", str(prompts),
                        "--stats-out", str(stats), "--json"], capsys)
    assert rc == 0, err
    d = json.loads(out)
    assert d["head_stats"] is True and d["classification"]["layers"]
    assert d["heads_at_risk_count"] is not None
    # the saved statistics reproduce the same advice without the model run
    rc, out2, _ = run(["suggest-window", "--lengths", str(lengths), "--model", str(tiny_model),
                       "--head-stats", str(stats), "--json"], capsys)
    d2 = json.loads(out2)
    assert (d2["window"], d2["layers"], d2["attention_flop_saving"]) == \
        (d["window"], d["layers"], d["attention_flop_saving"])


@pytest.mark.parametrize(("content", "message"), [
    ("", "empty"),
    ("12\nabc\n", "line 2: 'abc' is not an integer length"),
    ("[1, 2", "malformed JSON"),
    ("le,count\n10,5\n20,3\n", "not cumulative"),
])
def test_suggest_bad_files_one_line(tmp_path: Path, tiny_model: Path, content: str,
                                    message: str, capsys: pytest.CaptureFixture[str]) -> None:
    f = tmp_path / "bad.txt"
    f.write_text(content)
    rc, out, err = run(["suggest-window", "--lengths", str(f), "--model", str(tiny_model)],
                       capsys)
    assert rc == 2 and out == ""
    assert err.count("\n") == 1 and err.startswith("attnprof: error: ") and message in err


def test_suggest_unreachable_sources(tiny_model: Path, capsys: pytest.CaptureFixture[str]
                                     ) -> None:
    port = free_port()  # nothing listens there
    for flag in ("--url", "--prometheus"):
        rc, out, err = run(["suggest-window", flag, f"http://127.0.0.1:{port}", "--model",
                            str(tiny_model)], capsys)
        assert rc == 2 and out == "" and err.count("\n") == 1
        assert err.startswith("attnprof: error: cannot reach")
    rc, _, err = run(["suggest-window", "--lengths", "/nonexistent/x", "--model",
                      str(tiny_model)], capsys)
    assert rc == 2 and "cannot read" in err
    rc, _, err = run(["suggest-window", "--lengths", "/dev/null", "--model", "/nonexistent"],
                     capsys)
    assert rc == 2 and "does not exist" in err


def test_validate_window_cli(tiny_model: Path, tmp_path: Path,
                             capsys: pytest.CaptureFixture[str]) -> None:
    prompts = tmp_path / "prompts.txt"
    prompts.write_text(" ".join(["a garden letter in the morning light"] * 12) + "\n")
    out_file = tmp_path / "replay.json"
    rc, out, _ = run(["validate-window", "--window", "8", "--sinks", "2", "--model",
                      str(tiny_model), "--prompts", str(prompts), "--out", str(out_file),
                      "--json"], capsys)
    assert rc == 0
    d = json.loads(out)
    assert d == json.loads(out_file.read_text())
    assert d["positions"] > 0 and 0 <= d["agreement"] <= 1 and d["mean_kl"] >= 0
    assert d["safe"] == (d["agreement"] >= 0.95 and d["mean_kl"] <= 0.05
                         and d["positions"] >= 64)
    rc, out, _ = run(["validate-window", "--window", "8", "--sinks", "2", "--model",
                      str(tiny_model), "--prompts", str(prompts)], capsys)
    assert ("NOT safe" in out) != d["safe"]
    rc, _, err = run(["validate-window", "--window", "0", "--sinks", "2"], capsys)
    assert rc == 2 and err.startswith("attnprof: error: --window")
    prompts.write_text("[1, 2]")
    rc, out, err = run(["validate-window", "--window", "8", "--sinks", "2", "--model",
                        str(tiny_model), "--prompts", str(prompts)], capsys)
    assert rc == 2 and out == "" and err.count("\n") == 1
    assert "expected a JSON list of strings" in err


def test_entry_point_exit_code(tmp_path: Path) -> None:
    f = tmp_path / "empty.txt"
    f.write_text("")
    proc = subprocess.run([sys.executable, "-m", "attnprof.cli", "suggest-window",
                           "--lengths", str(f)], capture_output=True, text=True, cwd=REPO,
                          timeout=120)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.strip().splitlines() == [
        f"attnprof: error: {f}: the file is empty (no lengths)"]


class _Endpoints(http.server.BaseHTTPRequestHandler):
    """Loopback stand-ins for an attnprof server and a Prometheus API (real HTTP, real JSON)."""

    snapshot: dict[str, object] = {}
    queries: list[str] = []

    def do_GET(self) -> None:
        url = urllib.parse.urlparse(self.path)
        if url.path == "/attnprof/snapshot":
            body = dict(self.snapshot)
            if "head_stats=1" not in url.query:  # as the real route: only when asked for
                body["head_stats"] = None
        elif url.path == "/api/v1/query":
            self.queries.append(urllib.parse.parse_qs(url.query)["query"][0])
            body = {"status": "success", "data": {"resultType": "vector", "result": [
                {"metric": {"le": le}, "value": [1733140000.0, c]}
                for le, c in (("100", "30"), ("1000", "90"), ("+Inf", "100"))]}}
        else:
            self.send_error(404)
            return
        data = json.dumps(body).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args: object) -> None:
        pass


def test_suggest_from_live_snapshot_and_prometheus(tiny_model: Path,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    import threading

    import torch

    from attnprof.aggregate.head_stats import HeadStatsAccumulator
    from attnprof.aggregate.quantiles import QuantileSketch

    sk = QuantileSketch()
    for x in [50] * 10 + [400] * 10:
        sk.add(x)
    acc = HeadStatsAccumulator(2, 2, 2, window_grid=(128, 256))
    torch.manual_seed(0)
    for layer in range(2):
        head_rows.update(acc, layer, torch.randn(300, 4, 64), torch.randn(300, 2, 64), 0.125)
    _Endpoints.snapshot = {"schema_version": "attnprof.snapshot/1",
                           "requests": {"context_tokens": {"sketch": sk.to_dict()}},
                           "head_stats": acc.to_dict(),  # merged by the API server (1.4)
                           "workers": [{"head_stats": None}]}
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Endpoints)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    base = f"http://127.0.0.1:{srv.server_address[1]}"
    try:
        rc, out, err = run(["suggest-window", "--url", base, "--model", str(tiny_model),
                            "--json"], capsys)
        assert rc == 0, err
        d = json.loads(out)
        assert d["head_stats"] is True and d["traffic"]["requests"] == 20
        assert abs(d["traffic"]["p90"] - 400) <= 5
        rc, out, err = run(["suggest-window", "--prometheus", base, "--prometheus-model",
                            "tiny", "--prometheus-range", "1d", "--model", str(tiny_model),
                            "--window", "128", "--sinks", "4", "--json"], capsys)
        assert rc == 0, err
        d = json.loads(out)
        assert d["traffic"]["requests"] == 100
        assert d["exact_request_fraction"] == pytest.approx(0.3)  # 30 requests <= 100 tokens
        assert _Endpoints.queries[-1] == (
            'sum by (le) (increase(attnprof_request_context_tokens_bucket{model="tiny"}[1d]))')
    finally:
        srv.shutdown()
        srv.server_close()


def test_suggest_url_refuses_a_snapshot_whose_head_statistics_were_left_out(
        tiny_model: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import threading

    from attnprof.aggregate.quantiles import QuantileSketch

    sk = QuantileSketch()
    for x in (50, 400):
        sk.add(x)
    _Endpoints.snapshot = {"schema_version": "attnprof.snapshot/1.4",
                           "requests": {"context_tokens": {"sketch": sk.to_dict()}},
                           "head_stats": None, "workers": [],
                           "truncated": "head_stats left out: the body would be 70000000 "
                                        "bytes, over ATTNPROF_SNAPSHOT_MAX_BYTES=67108864"}
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Endpoints)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        rc, out, err = run(["suggest-window", "--url", f"http://127.0.0.1:"
                            f"{srv.server_address[1]}", "--model", str(tiny_model)], capsys)
    finally:
        srv.shutdown()
        srv.server_close()
    assert rc == 2 and out == ""
    assert "ATTNPROF_SNAPSHOT_MAX_BYTES" in err and len(err.strip().splitlines()) == 1
