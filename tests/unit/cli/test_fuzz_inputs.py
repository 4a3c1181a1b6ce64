"""Hypothesis over every CLI flag and every environment variable attnprof reads that takes a
value (issue 24, point 9): one line, exit 2 (or one start-up line for the environment), nothing
half-written, nothing started.

The flags are enumerated from the real argparse parser, the ``ATTNPROF_*`` variables from
:data:`attnprof.environment_variables.VARIABLES` (their kind read from the documented type)
and the ``OTEL_*`` ones from the names the OTLP exporter's source reads. A flag or variable
added later without a kind here fails ``test_every_*_has_a_kind``.

CLI properties, per flag, run in-process through :func:`attnprof.cli.main` (stdout encoded
strictly and stderr with backslashreplace, as a real process's are) with every long step
(vLLM, a model load, the network, a replay, a profile run, a probe) replaced by a marker:

* a bad value exits 2 with exactly one printable ``attnprof: error:`` line on stderr, nothing
  on stdout, the marker never reached and no file or directory created or changed;
* a good value is never refused: the command reaches its long step (or, for the commands that
  have none, finishes);
* any text (unicode, control characters, bytes that are not UTF-8) never ends in a traceback,
  and when refused, is refused the clean way above.

Environment properties, per variable, through the start-up path (``config_from_env`` as the
plugin, the stat logger and the route call it, then the plugin's ``register``): a bad value
is one ``ConfigError`` line naming the variable, a good value is read back as given, any
value is either refused that way or read as something of the documented type and range.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import io
import math
import os
import re
import subprocess
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import attnprof.cli as cli
from attnprof.cli._common import MAX_LENGTH
from attnprof.config import Config, ConfigError
from attnprof.environment_variables import VARIABLES, EnvVar
from attnprof.facts.durations import MAX_SECONDS, UNIT_SECONDS

REPO = Path(__file__).resolve().parents[3]
URL = "http://127.0.0.1:9"  # never contacted: the network is a marker here
_CONFIG = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "num_hidden_layers": 2,
           "num_attention_heads": 4, "num_key_value_heads": 2, "hidden_size": 256,
           "head_dim": 64, "intermediate_size": 512, "vocab_size": 600,
           "max_position_embeddings": 1024, "torch_dtype": "float32"}

_HC = [HealthCheck.function_scoped_fixture, HealthCheck.too_slow,
       HealthCheck.filter_too_much]
BAD = settings(max_examples=12, deadline=None, derandomize=True, suppress_health_check=_HC)
GOOD = settings(max_examples=5, deadline=None, derandomize=True, suppress_health_check=_HC)
ANY = settings(max_examples=10, deadline=None, derandomize=True, suppress_health_check=_HC)
ENV = settings(max_examples=40, deadline=None, derandomize=True, suppress_health_check=_HC)


# =============================================================================== the world

@dataclass(frozen=True)
class World:
    """Input files every command can be pointed at, an output directory and a working
    directory (the cwd, so relative defaults land in it too), all under one root."""

    root: Path

    def __getattr__(self, name: str) -> Path:  # w.ckpt, w.lengths, ... (see _make_world)
        return self.root / _FILES[name]


_FILES = {"inp": "in", "out": "out", "work": "work", "home": "home", "ckpt": "in/ckpt",
          "emptydir": "in/emptydir", "afile": "in/afile", "empty": "in/empty",
          "junk": "in/junk.bin", "lengths": "in/lengths.txt", "stats": "in/head_stats.json",
          "prompts": "in/prompts.txt", "snap": "in/snap.json", "profile": "in/profile.json",
          "existing": "out/existing.json", "multiproc": "multiproc"}


def _make_world(root: Path) -> World:
    import json

    from attnprof.aggregate.head_stats import HeadStatsAccumulator
    from attnprof.contracts.snapshot import Snapshot
    from tests.unit.contracts.test_contracts import PROFILE_1_0

    w = World(root)
    for d in ("inp", "out", "work", "home", "ckpt", "emptydir", "multiproc"):
        getattr(w, d).mkdir(parents=True)
    (w.ckpt / "config.json").write_text(json.dumps(_CONFIG))
    w.afile.write_text("x")
    w.empty.write_text("")
    w.junk.write_bytes(b"\xff\xfe\x00{[not json\x01")
    w.lengths.write_text("100\n200\n300\n")
    w.stats.write_text(json.dumps(HeadStatsAccumulator(2, 2, 2).to_dict()))
    w.prompts.write_text("The quick brown fox jumps over the lazy dog.\nA second prompt.\n")
    w.snap.write_text(json.dumps(Snapshot(time=1.0, model="m", enabled=True).to_json()))
    w.profile.write_text(json.dumps(PROFILE_1_0))
    w.existing.write_text("old\n")
    return w


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> World:
    return _make_world(tmp_path_factory.mktemp("fuzz-inputs"))


def _tree(root: Path) -> dict[str, bytes | None]:
    """Every file (with its bytes) and directory under ``root``: what 'nothing written' is
    checked against."""
    out: dict[str, bytes | None] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        base = Path(dirpath)
        for d in dirnames:
            out[str((base / d).relative_to(root))] = None
        for f in filenames:
            out[str((base / f).relative_to(root))] = (base / f).read_bytes()
    return out


# =============================================================================== running

class Reached(BaseException):
    """The command got past every check to a long step (a BaseException, so no
    ``except Exception`` in the command can take it for an error of its own)."""


@dataclass
class Outcome:
    rc: int | None
    """Exit status; None when the command reached its long step."""
    out: str
    err: str


def _stream(errors: str) -> io.TextIOWrapper:
    return io.TextIOWrapper(io.BytesIO(), encoding="utf-8", errors=errors)


def _text(stream: io.TextIOWrapper) -> str:
    stream.flush()
    raw = stream.buffer
    assert isinstance(raw, io.BytesIO)
    return raw.getvalue().decode("utf-8", "replace")


def run_cli(argv: Sequence[str]) -> Outcome:
    """``attnprof ARGV`` in this process. Any exception other than argparse's exit and the
    marker propagates: a traceback fails the test."""
    out, err = _stream("strict"), _stream("backslashreplace")
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            rc: int | None = cli.main(list(argv))
        except SystemExit as e:  # argparse's usage errors
            rc = e.code if isinstance(e.code, int) else 1
        except Reached:
            rc = None
    return Outcome(rc, _text(out), _text(err))


# Where a command's long work starts: vLLM, model download and load, the network, the
# replay and profile runs, the probe, deriving vLLM's verdicts, the recommendation itself.
LONG_WORK = (
    "attnprof.tools.http.get", "urllib.request.urlopen", "attnprof.tools.server.VllmServer",
    "attnprof.tools.models.fetch", "attnprof.tools.replay.load_model",
    "attnprof.tools.replay.collect_head_stats", "attnprof.tools.replay.replay",
    "attnprof.tools.profile_run.run_profile", "attnprof.tools.probe.probe",
    "attnprof.tools.container_start.exec_command", "os.execvp",
    "attnprof.tools.vllm_matrix.derive", "attnprof.tools.vllm_matrix.regenerate",
    "attnprof.analyze.sparsity.recommend.recommend",
    "attnprof.analyze.sparsity.recommend.evaluate", "attnprof.tools.report.build_report",
)


@pytest.fixture
def cli_env(world: World, monkeypatch: pytest.MonkeyPatch) -> World:
    """No attnprof / OTel / vLLM key in the environment, the cwd in the world, a cached parser
    (built once: argparse does not change it while parsing) and every long step a marker."""
    for name in list(os.environ):
        if name.startswith(("ATTNPROF_", "OTEL_")) or name == "VLLM_API_KEY":
            monkeypatch.delenv(name)
    monkeypatch.setenv("ATTNPROF_HOME", str(world.home))
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(world.multiproc))
    monkeypatch.chdir(world.work)
    parser = cli.build_parser()
    monkeypatch.setattr(cli, "build_parser", lambda: parser)

    def stop(*_a: Any, **_k: Any) -> Any:
        raise Reached

    for target in LONG_WORK:
        module, _, attr = target.rpartition(".")
        monkeypatch.setattr(importlib.import_module(module), attr, stop)
    from attnprof.tools import server

    real_port_error = server.port_error
    # The host is resolved and bound for real, on port 0: no test depends on a free port.
    monkeypatch.setattr(server, "port_error", lambda host, port: real_port_error(host, 0))
    import attnprof.cli.demo as demo

    real_resolve = demo.resolve_model

    def resolve_then_stop(spec: str) -> Any:  # demo's model step is its long work's start
        real_resolve(spec)
        raise Reached

    monkeypatch.setattr(demo, "resolve_model", resolve_then_stop)
    return world


_LINE_BREAKS = "\u2028\u2029\x85"


def assert_one_line(err: str) -> str:
    """Exactly one printable ``attnprof: error:`` line: no traceback, no control character
    (no second line, no carriage return or escape sequence reaching the terminal)."""
    assert err.endswith("\n") and err.count("\n") == 1, err
    line = err[:-1]
    assert line.startswith("attnprof: error: "), err
    assert not any(ord(c) < 0x20 or ord(c) == 0x7F or c in _LINE_BREAKS for c in line), err
    return line


def assert_refused(argv: Sequence[str], w: World) -> str:
    """``argv`` is refused cleanly before any long work; its error line."""
    before = _tree(w.root)
    r = run_cli(argv)
    assert r.rc is not None, f"{argv}: accepted; reached the long work"
    assert r.rc == 2, (argv, r)
    line = assert_one_line(r.err)
    assert r.out == "", (argv, r.out)
    assert _tree(w.root) == before, f"{argv}: files written or changed"
    return line


# =============================================================================== kinds

Strategy = st.SearchStrategy[str]


@dataclass(frozen=True)
class Kind:
    """What a flag's value is. ``bad``: values it must refuse (None: there are none);
    ``edges``: bad values always tried; ``good``: values it must accept; ``anything``:
    arbitrary values (paths: kept inside the world); ``data_errors``: refusals of a good
    value that are about what the file holds, not the flag (e.g. no findings in it)."""

    name: str
    good: Callable[[World], Strategy]
    bad: Callable[[World], Strategy] | None = None
    edges: Callable[[World], Sequence[str]] = lambda w: ()
    anything: Callable[[World], Strategy] | None = None
    data_errors: tuple[str, ...] = ()


_CHARS = st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00")
TEXT = st.text(_CHARS, max_size=16)
NOT_UTF8 = st.binary(min_size=1, max_size=10).filter(lambda b: b"\x00" not in b).map(
    lambda b: b.decode("utf-8", "surrogateescape"))  # argv bytes Python cannot decode
JUNK = ("", " ", "\t", "\n", "nan", "NaN", "inf", "-inf", "+Infinity", "1e999", "-1e999",
        "5x", "1e999s", "abc", "\x01", "\x1b[2J", "a\nb", "\r", "é", "💥", "0x10", "1,5",
        "--", "=", "1 2", "½", "\udcff")
ANY_TEXT = TEXT | NOT_UTF8 | st.sampled_from(JUNK)
CONTROL = "".join(map(chr, range(1, 32))) + "\x7f"
SYMBOLS = "!@#$%^&*()/\\:;<>?|{}[]\x01\x1bé"


def _parses(fn: Callable[[str], Any], s: str) -> bool:
    try:
        fn(s)
    except (ValueError, OverflowError):
        return False
    return True


def int_kind(lo: int, hi: int) -> Kind:
    not_int = [s for s in JUNK if not _parses(int, s)]
    return Kind(
        f"int {lo}..{hi}",
        good=lambda w: st.integers(lo, hi).map(str),
        bad=lambda w: st.one_of(
            st.integers(max_value=lo - 1).map(str), st.integers(min_value=hi + 1).map(str),
            st.floats().map(repr), ANY_TEXT.filter(lambda s: not _parses(int, s))),
        edges=lambda w: [*not_int, str(lo - 1), str(hi + 1), str(10**30), "9" * 5000, "1.0",
                         f"{lo}.5", "1e3"],
        anything=lambda w: ANY_TEXT | st.integers().map(str))


def float_kind(lo: float, hi: float = math.inf, *, lo_open: bool = False,
               hi_open: bool = False) -> Kind:
    """A finite number in the range (NaN and infinities are always refused)."""

    def inside(x: float) -> bool:
        return (math.isfinite(x) and (lo < x if lo_open else lo <= x)
                and (x < hi if hi_open else x <= hi))

    not_float = [s for s in JUNK if not _parses(float, s)]
    fixed = ["nan", "-nan", "inf", "-inf", "1e999", repr(lo - 1)] \
        + ([repr(lo)] if lo_open else []) + ([repr(hi)] if hi_open and math.isfinite(hi) else []) \
        + ([repr(hi * 2 + 1)] if math.isfinite(hi) else [])
    return Kind(
        f"float {'(' if lo_open else '['}{lo}, {hi}{')' if hi_open else ']'}",
        good=lambda w: st.floats(lo, hi if math.isfinite(hi) else None, exclude_min=lo_open,
                                 exclude_max=hi_open, allow_nan=False,
                                 allow_infinity=False).map(repr),
        bad=lambda w: st.floats().filter(lambda x: not inside(x)).map(repr)
        | ANY_TEXT.filter(lambda s: not _parses(float, s)),
        edges=lambda w: [*not_float, *fixed],
        anything=lambda w: ANY_TEXT | st.floats().map(repr))


PRICE = float_kind(0.0)

_UNIT_S = {**{u: UNIT_SECONDS[u] for u in ("ms", "s", "m", "min", "h")}, "": 1.0}
_NO_DIGIT = ANY_TEXT.filter(lambda s: not any("0" <= c <= "9" for c in s))


def _good_duration(w: World) -> Strategy:
    def in_unit(u: str) -> Strategy:
        top = int(MAX_SECONDS / _UNIT_S[u])
        return st.integers(1, top).map(lambda n: f"{n}{u}") | st.sampled_from(
            [f"{top}{u}", f" 1.5 {u.upper()}", f"0.5{u}"])

    return st.sampled_from(sorted(_UNIT_S)).flatmap(in_unit)


DURATION = Kind(
    "duration (0, 7 days]", good=_good_duration,
    bad=lambda w: st.one_of(
        st.integers(min_value=int(MAX_SECONDS) + 1).map(str),
        st.integers(max_value=0).map(lambda n: f"{n}s"),
        st.tuples(st.integers(1, 99), st.text("abcdefgijklnopqrtuvwxyz", min_size=1,
                                              max_size=4)).map(lambda t: f"{t[0]}{t[1]}"),
        _NO_DIGIT),
    edges=lambda w: ["", " ", "0", "0s", "0.0ms", "-5s", "-1", "5x", "5sx", "1e999s", "1e3s",
                     "nan", "inf", "infs", "1..5s", ".s", "s", "ms", "5 s s", "604801",
                     "604800001ms", "10081m", "169h", "9" * 400 + "h", "1h30m", "5 sec",
                     "\uff15s", "1,5s", "+5s", "\x01"],
    anything=lambda w: ANY_TEXT | _good_duration(w))


def _fail_on_keys() -> list[str]:
    from attnprof.analyze.diff_thresholds import DEFAULT_THRESHOLDS

    return list(DEFAULT_THRESHOLDS)


def _good_fail_on(w: World) -> Strategy:
    def value(key: str) -> Strategy:
        if key == "kernel":
            return st.sampled_from(["on", "off", "yes", "no", "1", "0", "true", "false",
                                    "never", "none"])
        return st.sampled_from(["off", "none", "never"]) | st.floats(0, 1).map(repr) \
            | st.floats(0, 100_000).map(lambda x: f"{x!r}%")

    pair = st.sampled_from(_fail_on_keys()).flatmap(
        lambda k: value(k).map(lambda v: f"{k}={v}"))
    return st.lists(pair, max_size=4).map(",".join)


FAIL_ON = Kind(
    "--fail-on thresholds", good=_good_fail_on,
    bad=lambda w: st.one_of(
        TEXT.filter(lambda s: s.strip().lower() not in _fail_on_keys() and "," not in s
                    and s.strip()).map(lambda s: f"{s}=5%"),
        st.sampled_from([k for k in _fail_on_keys() if k != "kernel"]).flatmap(
            lambda k: st.one_of(  # negative, past 1000 (100000 %), NaN; > 1 with no % sign
                st.floats(max_value=-1e-9).map(lambda x: f"{x!r}%"),
                st.floats(min_value=100_000.01).map(lambda x: f"{x!r}%"),
                st.just("nan%"), st.floats(min_value=1.001).map(repr)).map(
                lambda v: f"{k}={v}"))),
    edges=lambda w: ["x=1", "time", "time=", "time=abc", "time=-5%", "time=5", "time=nan",
                     "time=inf", "time=inf%", "kernel=maybe", "time=1e999%", "=5%",
                     "time=5%%", "fused-drop=100001%", "time=5%,bogus=1%", "time==5%",
                     "time=\x01", "\x1b=1%"])

PROM_RANGE = Kind(
    "PromQL range of at least 1 s",
    good=lambda w: st.lists(st.tuples(st.integers(1, 10**6), st.sampled_from("smhdw")),
                            min_size=1, max_size=3).map(
        lambda xs: "".join(f"{n}{u}" for n, u in xs)) | st.sampled_from(["1000ms", "1h30m"]),
    bad=lambda w: _NO_DIGIT | st.tuples(st.integers(1, 99), st.text(
        "abcefgijklnopqrtuvxz", min_size=1, max_size=3)).map(lambda t: f"{t[0]}{t[1]}"),
    edges=lambda w: ["", " ", "5", "5x", "-5m", "1e3s", "1.5h", "m", "0s", "500ms", "0h0m",
                     "999ms", "1d]) or vector(1", "1 h", "\uff11h", "5m ", "1234567890s", "5M",
                     "\x01", "5m\n"],
    anything=lambda w: ANY_TEXT | st.sampled_from(["30m", "0s", "1d"]))

_HOSTS = ["127.0.0.1", "localhost", "[::1]", "example.invalid", "10.0.0.7"]
URL_KIND = Kind(
    "http(s) URL",
    good=lambda w: st.builds(lambda s, h, p, path: f"{s}://{h}:{p}{path}",
                             st.sampled_from(["http", "https"]), st.sampled_from(_HOSTS),
                             st.integers(1, 65535), st.sampled_from(["", "/", "/v1"])),
    bad=lambda w: ANY_TEXT.filter(lambda s: not s.lower().startswith(("http://", "https://")))
    | st.builds(lambda junk: f"http://a{junk}b:8000", st.text(CONTROL + " ", min_size=1,
                                                              max_size=3))
    | st.integers(65536, 10**6).map(lambda p: f"http://127.0.0.1:{p}"),
    edges=lambda w: ["", " ", "localhost:8000", "127.0.0.1", "ftp://x", "http://",
                     "http://[::1", "http://h:99999", "http://h:0", "http://h:port",
                     "http://h x", "file:///etc/passwd", "http:// h", "http://h\n",
                     "https://\x01", "//h:1"])


def _header_safe(w: World) -> Strategy:
    return st.text(st.characters(min_codepoint=0x21, max_codepoint=0x7E), min_size=1,
                   max_size=24)


API_KEY = Kind(
    "API key (printable ASCII, no space)", good=_header_safe,
    bad=lambda w: st.builds(lambda a, c, b: a + c + b, st.text(max_size=4),
                            st.sampled_from([" ", "\t", "\x01", "\x7f", "é", "\udcff"]),
                            st.text(max_size=4)),
    edges=lambda w: ["", " ", "a b", "k\x01", "é", "k\n", "\udcff"])

HOST = Kind(
    "host to listen on", good=lambda w: st.sampled_from(["127.0.0.1", "localhost", "::1",
                                                         "0.0.0.0"]),
    bad=lambda w: st.sampled_from(["", " ", "a b", "\x01", "1.2.3.4", "\t"]),
    anything=lambda w: st.sampled_from(["", "a b", "::", "127.0.0.1", "x\x01"]))

LABEL = Kind(
    "a model label", good=lambda w: st.text(st.characters(
        blacklist_categories=("Cs", "Cc")), min_size=1, max_size=16),
    bad=lambda w: st.builds(lambda a, c: a + c, TEXT, st.sampled_from(CONTROL)),
    edges=lambda w: ["", "\x01", "a\nb", "\x7f", "m\x1b[2J"])


def _choice(choices: Sequence[str], extra_bad: Sequence[str] = ()) -> Kind:
    return Kind(
        f"one of {', '.join(choices)}", good=lambda w: st.sampled_from(list(choices)),
        bad=lambda w: st.text(SYMBOLS, min_size=1, max_size=8),
        edges=lambda w: ["", " ", "\x01", "nan", "bogus", "é", *extra_bad])


def _dtype_aliases(compute_only: bool) -> list[str]:
    from attnprof.facts.dtypes import _TABLE

    names = [k for k, (v, _) in _TABLE.items()
             if not compute_only or v in ("fp64", "fp32", "fp16", "bf16")]
    return [*names, *(n.upper() for n in names), *(f"torch.{n}" for n in names
                                                   if n in ("float32", "bfloat16"))]


def _gpu_names() -> list[str]:
    from attnprof.analyze.rules import load_matrix

    hw = load_matrix()["hardware"]
    return sorted(set(hw) | {a for s in hw.values() for a in s["aliases"]})


def _paths_kind() -> Kind:
    from attnprof.analyze.scaling import PATHS

    return Kind(
        "comma list of attention paths",
        good=lambda w: st.lists(st.sampled_from(PATHS), min_size=1, max_size=3,
                                unique=True).map(",".join),
        bad=lambda w: st.lists(st.sampled_from(PATHS), max_size=2).flatmap(
            lambda xs: st.text(SYMBOLS, min_size=1, max_size=5).map(
                lambda j: ",".join([*xs, j]))),
        edges=lambda w: ["", ",", " , ", "flash", "math,bogus", "\x01", "MATH"])


def _good_lengths(top: int, most: int, min_size: int) -> Callable[[World], Strategy]:
    return lambda w: st.lists(st.integers(1, top), min_size=min_size, max_size=most).map(
        lambda xs: ",".join(map(str, xs))) | st.sampled_from([f"{top}", f"1, {top}"])


def _bad_lengths(top: int) -> Callable[[World], Strategy]:
    wrong = st.one_of(st.integers(max_value=0).map(str), st.integers(min_value=top + 1).map(
        str), st.floats(0.5, 1e3).map(repr), _NO_DIGIT.filter(lambda s: "," not in s
                                                               and s.strip()))
    return lambda w: st.tuples(st.lists(st.integers(1, top), max_size=3), wrong).map(
        lambda t: ",".join([*map(str, t[0]), t[1]]))


SEQ_LENS = Kind("comma list of 1..64 lengths", good=_good_lengths(MAX_LENGTH, 64, 1),
                bad=_bad_lengths(MAX_LENGTH),
                edges=lambda w: ["", ",", "0", "-1", "1.5", "1e3", "a", "99999999999999",
                                 str(MAX_LENGTH + 1), "1,,2", "\uff11", "\x01",
                                 ",".join(map(str, range(1, 66)))])
# demo: documents of at most --max-model-len (4096) minus 64 tokens; none is allowed.
DOC_LENGTHS = Kind("comma list of document lengths", good=_good_lengths(4032, 20, 0),
                   bad=_bad_lengths(4032),
                   edges=lambda w: ["0", "-5", "x", "1.5", "4033", str(MAX_LENGTH + 1),
                                    "1e30", "10,x", "\x01", ",".join(["1"] * 1001)])


def _good_bytes(w: World) -> Strategy:
    from attnprof.cli.profile import _UNITS, MAX_BYTES

    return st.sampled_from(sorted(_UNITS)).flatmap(
        lambda u: st.integers(1, MAX_BYTES // _UNITS[u]).map(lambda n: f"{n}{u}"))


MEMORY = Kind(
    "a memory size", good=_good_bytes,
    bad=lambda w: _NO_DIGIT | st.tuples(st.integers(1, 99), st.text(
        "acdefhjlnopqrsuvwxyz", min_size=1, max_size=3)).map(lambda t: f"{t[0]}{t[1]}"),
    edges=lambda w: ["", "0", "0GiB", "-1GiB", "5x", "nan", "inf", "1e400", "2e18", "GiB",
                     "1 2GiB", "0.5b", "1.5e3XB", "\x01", "9" * 400])


def layers_kind(n: int) -> Kind:
    """``--layers`` of a model of ``n`` layers (validate-window: syntax only until the model
    is loaded, so ``n`` is its early bound)."""
    return Kind(
        f"layer ranges in 0..{n - 1}",
        good=lambda w: st.lists(st.tuples(st.integers(0, n - 1), st.integers(0, 3)),
                                min_size=1, max_size=3).map(lambda xs: ",".join(
                                    f"{a}-{min(a + d, n - 1)}" if d else str(a)
                                    for a, d in xs)),
        bad=lambda w: st.one_of(
            st.integers(min_value=n).map(str),
            st.tuples(st.integers(1, n - 1), st.integers(1, 5)).map(
                lambda t: f"{t[0]}-{t[0] - t[1]}"),
            _NO_DIGIT.filter(lambda s: s.replace(",", "").strip())),
        edges=lambda w: ["", ",", "a", "1-", "-1", "5-2", "0-99999999999", str(n), "1.5",
                         "\x01", "0-"])


HEADS = Kind(  # the world's model: 2 layers x 4 heads
    "LAYER.HEAD[~TWIN] list",
    good=lambda w: st.sampled_from(["0.1", "1.3~0", "0.0,1.2", " 1.1 , 0.2~3"]),
    bad=lambda w: _NO_DIGIT.filter(lambda s: s.replace(",", "").strip())
    | st.tuples(st.integers(2, 10**5), st.integers(0, 3)).map(lambda t: f"{t[0]}.{t[1]}"),
    edges=lambda w: ["", ",", "x", "1", "1.", "1.2~", "-1.0", "0.4", "2.0", "0.1~1",
                     "0.1,0.1", "\x01", "1.1~9"])


def _inside(w: World, s: str) -> str:
    """Arbitrary text as a path that stays in the world's working directory."""
    return str(w.work / ("p" + s.replace("/", "_").replace("\\", "_")))


def in_file(good: str, junk: Sequence[str] = ("afile", "junk"),
            data_errors: tuple[str, ...] = ()) -> Kind:
    """A file read as input; ``good`` names the world's valid one, ``junk`` files it refuses."""
    return Kind(
        f"input file ({good})", good=lambda w: st.just(str(getattr(w, good))),
        bad=lambda w: TEXT.map(lambda s: str(w.inp / "missing" / s.replace("/", "_"))),
        edges=lambda w: ["", str(w.inp), str(w.emptydir), str(w.inp / "nope.json"),
                         str(w.afile / "below"), *(str(getattr(w, j)) for j in junk)],
        anything=lambda w: ANY_TEXT.map(lambda s: _inside(w, s)),
        data_errors=data_errors)


def _unwritable(w: World) -> list[str]:
    return [str(w.afile / "below.json"), "/proc/attnprof-fuzz/x.json", "/sys/attnprof.json"]


OUT_FILE = Kind(
    "output file", good=lambda w: st.text("abcxyz", min_size=1, max_size=6).map(
        lambda s: str(w.out / "new" / s / f"{s}.out")) | st.just(str(w.existing)),
    bad=lambda w: st.sampled_from([str(w.inp), str(w.out), str(w.emptydir), "."]),
    edges=lambda w: ["", str(w.work), *_unwritable(w)],
    anything=lambda w: ANY_TEXT.map(lambda s: _inside(w, s)))
OUT_DIR = Kind(
    "output directory", good=lambda w: st.text("abcxyz", min_size=1, max_size=6).map(
        lambda s: str(w.out / "dirs" / s)) | st.just(str(w.emptydir)),
    bad=lambda w: st.sampled_from([str(w.afile), str(w.existing), str(w.lengths)]),
    edges=lambda w: ["", str(w.afile / "below"), "/proc/attnprof-fuzz", "/sys/attnprof"],
    anything=lambda w: ANY_TEXT.map(lambda s: _inside(w, s)))
MODEL = Kind(
    "checkpoint directory", good=lambda w: st.just(str(w.ckpt)),
    bad=lambda w: TEXT.map(lambda s: str(w.inp / "missing" / s.replace("/", "_"))),
    edges=lambda w: ["", str(w.afile), str(w.emptydir), str(w.inp), str(w.inp / "nope"),
                     "\x01"],
    anything=lambda w: ANY_TEXT.map(lambda s: _inside(w, s)))
PASSTHROUGH = Kind("vLLM's own arguments (after --), passed on unread",
                   good=lambda w: ANY_TEXT)
COMMAND = Kind(
    "an executable to become", good=lambda w: st.sampled_from(["true", "sh", sys.executable]),
    bad=lambda w: TEXT.map(lambda s: "attnprof-no-such-" + s.replace("/", "_")),
    edges=lambda w: ["", str(w.emptydir), str(w.afile), str(w.inp / "nope"), "\x01"],
    anything=lambda w: ANY_TEXT.map(lambda s: s.replace("/", "_")))

def _vllm_flags(empty_ok: bool) -> Kind:
    """vLLM flags as shell words (``--variant``, ``--baseline-args``): every word group starts
    with ``--`` and the quotes balance; what they mean is vLLM's to refuse, at start-up."""
    good = ["--kv-cache-dtype fp8", "--max-model-len 2048",
            "--hf-overrides '{\"sliding_window\":8}'", "--enforce-eager"]
    return Kind(
        "vLLM flags (shell words)", good=lambda w: st.sampled_from(good + [""] * empty_ok),
        bad=lambda w: st.sampled_from(["fp8", "kv-cache-dtype fp8", "--a '", '--b "x',
                                       "-x 1"] + [""] * (not empty_ok)),
        edges=lambda w: ["--a '", "fp8"] + [" "] * (not empty_ok))


_MEASURE: dict[str, Kind] = {
    "--checkpoint": MODEL,
    "--only": _choice(["window", "fp8_kv", "max_model_len"], ["fp8", "head_split", "all"]),
    "--variant": _vllm_flags(False), "--baseline-args": _vllm_flags(True),
    "--rounds": int_kind(1, 50), "--duration": DURATION, "--concurrency": int_kind(1, 256),
    "--seed": int_kind(0, 2**32 - 1), "--keep-logs": OUT_DIR,
    "--mde": float_kind(0, 1, lo_open=True, hi_open=True), "--max-rounds": int_kind(2, 50),
    "--instances": int_kind(1, 8),
    "--device-plan": _choice(["auto", "side_by_side", "turns"], ["gpu", "split"]),
}

FLAGS: dict[str, Kind] = {
    "container-start command": COMMAND,
    "serve --model": MODEL, "serve --port": int_kind(1, 65535), "serve --host": HOST,
    "serve vllm_args": PASSTHROUGH,
    "demo --model": MODEL, "demo --port": int_kind(1, 65535), "demo --out": OUT_FILE,
    "demo --seed": int_kind(0, 2**32 - 1), "demo --chats": int_kind(0, 100_000),
    "demo --doc-lengths": DOC_LENGTHS, "demo --concurrency": int_kind(1, 1024),
    "demo --sample-rate": float_kind(0, 1),
    # the world's document (100 tokens) + 64 must fit
    "demo --max-model-len": int_kind(164, MAX_LENGTH), "demo --gpu-hour-price": PRICE,
    "snapshot --url": URL_KIND, "snapshot --api-key": API_KEY, "snapshot --png": OUT_FILE,
    "snapshot --roofline": OUT_FILE,
    "trace --url": URL_KIND, "trace --api-key": API_KEY, "trace --steps": int_kind(1, 1000),
    "trace --timeout": float_kind(0, 300, lo_open=True), "trace --out": OUT_FILE,
    "profile model": MODEL, "profile --show": in_file("profile"), "profile --seq-lens": SEQ_LENS,
    "profile --batch-size": int_kind(1, 1 << 20), "profile --memory-budget": MEMORY,
    "profile --out": OUT_DIR,
    "profile --attn-implementation": _choice(["sdpa", "eager", "flex_attention"],
                                             ["flash_attention_2", "SDPA "]),
    "profile --attention-dropout": float_kind(0, 1, hi_open=True),
    "profile --repeats": int_kind(1, 1000), "profile --paths": _paths_kind(),
    "profile --lengths": in_file("lengths"), "profile --head-stats": in_file("stats"),
    "profile --validate-max-seconds": float_kind(0), "profile --tensorboard": OUT_DIR,
    "compat --head-dim": int_kind(1, 4096),
    "compat --dtype": _choice(_dtype_aliases(False), ["bf17", "float33", "torch.", "int4"]),
    "compat --gpu": _choice(_gpu_names(), ["sm99", "h1000", "9.9"]),
    "compat --out": OUT_FILE,
    "suggest-window --lengths": in_file("lengths"), "suggest-window --url": URL_KIND,
    "suggest-window --api-key": API_KEY, "suggest-window --prometheus": URL_KIND,
    "suggest-window --prometheus-model": LABEL, "suggest-window --prometheus-range": PROM_RANGE,
    "suggest-window --model": MODEL, "suggest-window --window": int_kind(1, MAX_LENGTH),
    "suggest-window --sinks": int_kind(0, MAX_LENGTH), "suggest-window --layers": layers_kind(2),
    "suggest-window --head-stats": in_file("stats"),
    "suggest-window --prompts": in_file("prompts", ("empty", "junk")),
    "suggest-window --stats-out": OUT_FILE,
    "suggest-window --tau": float_kind(0, 1, lo_open=True),
    "suggest-window --quantile": float_kind(0, 1, hi_open=True),
    "suggest-window --min-exact": float_kind(0, 1),
    "validate-window --window": int_kind(1, MAX_LENGTH),
    "validate-window --sinks": int_kind(0, MAX_LENGTH), "validate-window --model": MODEL,
    "validate-window --prompts": in_file("prompts", ("empty", "junk")),
    "validate-window --layers": layers_kind(100_000),
    "validate-window --max-tokens": int_kind(2, MAX_LENGTH),
    "validate-window --generate": int_kind(0, 1 << 20),
    "validate-window --target-agreement": float_kind(0, 1),
    "validate-window --max-kl": float_kind(0),
    "validate-window --min-positions": int_kind(0, MAX_LENGTH), "validate-window --out": OUT_FILE,
    "validate-heads --model": MODEL,
    "validate-heads --prompts": in_file("prompts", ("empty", "junk")),
    "validate-heads --heads": HEADS,
    # statistics without underused heads: read, understood, nothing to replay
    "validate-heads --head-stats": in_file("stats", data_errors=("nothing to validate",)),
    "validate-heads --max-heads": int_kind(1, 100_000),
    "validate-heads --max-tokens": int_kind(2, MAX_LENGTH),
    "validate-heads --target-agreement": float_kind(0, 1),
    "validate-heads --max-kl": float_kind(0),
    "validate-heads --min-positions": int_kind(0, MAX_LENGTH), "validate-heads --out": OUT_FILE,
    "tensorboard --url": URL_KIND, "tensorboard --api-key": API_KEY,
    "tensorboard --logdir": OUT_DIR, "tensorboard --interval": DURATION,
    "tensorboard --count": int_kind(1, 10**9), "tensorboard --duration": DURATION,
    "record --url": URL_KIND, "record --api-key": API_KEY, "record --duration": DURATION,
    "record --out": OUT_FILE,
    "diff base": in_file("snap"), "diff new": in_file("snap"), "diff --fail-on": FAIL_ON,
    "diff --write-markdown": OUT_FILE, "diff --write-json": OUT_FILE,
    "probe --device": _choice(["auto", "cpu", "cuda"], ["CPU", "gpu"]),
    "probe --dtype": _choice(_dtype_aliases(True), ["fp8", "int8", "bf17"]),
    "probe --repeats": int_kind(1, 100), "probe --array-mib": int_kind(1, 1 << 16),
    "report files": in_file("snap"), "report --url": URL_KIND, "report --api-key": API_KEY,
    "report --prometheus": URL_KIND, "report --model": LABEL, "report --range": PROM_RANGE,
    "report --gpu-hour-price": PRICE, "report --replicas": int_kind(1, 100_000),
    "report --gpus-per-replica": float_kind(0, 4096, lo_open=True), "report --out": OUT_DIR,
    "report --timeout": float_kind(0, 3600, lo_open=True),
    **{f"report {k}": v for k, v in _MEASURE.items()},
    **{f"{c} {f}": float_kind(0, lo_open=True) for c in ("report", "whatif")
       for f in ("--mean-replicas", "--replica-max-tokens-per-s")},
    "whatif files": in_file("snap"), "whatif --url": URL_KIND, "whatif --api-key": API_KEY,
    "whatif --gpu-hour-price": PRICE, "whatif --out": OUT_DIR,
    "whatif --timeout": float_kind(0, 3600, lo_open=True),
    **{f"whatif {k}": v for k, v in _MEASURE.items()},
}


def _base(w: World) -> dict[str, dict[str, str | None]]:
    """Each command's arguments that make it valid and lead it to its long step (positional
    arguments by their dest; None: a switch)."""
    return {
        "container-start": {},
        "serve": {"--model": str(w.ckpt)},
        "demo": {"--model": str(w.ckpt), "--out": str(w.out / "demo.json"),
                 "--doc-lengths": "100"},
        "snapshot": {"--url": URL},
        "trace": {"--url": URL, "--out": str(w.out / "trace.json")},
        "profile": {"model": str(w.ckpt), "--out": str(w.out / "profile")},
        "compat": {},
        "suggest-window": {"--lengths": str(w.lengths), "--model": str(w.ckpt)},
        "validate-window": {"--window": "8", "--sinks": "1", "--model": str(w.ckpt)},
        "validate-heads": {"--model": str(w.ckpt), "--heads": "0.1"},
        "tensorboard": {"--url": URL, "--logdir": str(w.out / "tb")},
        "record": {"--url": URL, "--out": str(w.existing)},  # exists: must stay as it is
        "diff": {"base": str(w.snap), "new": str(w.snap)},
        "probe": {},
        "report": {"--url": URL, "--out": str(w.out / "report")},
        "whatif": {"--url": URL, "--checkpoint": str(w.ckpt), "--out": str(w.out / "whatif")},
    }


# Flags that mean something only beside others: (arguments dropped, arguments added).
CONTEXT: dict[str, tuple[tuple[str, ...], Callable[[World], dict[str, str | None]]]] = {
    "profile --show": (("model", "--out"), lambda w: {}),
    "profile --head-stats": ((), lambda w: {"--lengths": str(w.lengths)}),
    "suggest-window --url": (("--lengths",), lambda w: {}),
    "suggest-window --api-key": (("--lengths",), lambda w: {"--url": URL}),
    "suggest-window --prometheus": (("--lengths",), lambda w: {}),
    "suggest-window --prometheus-model": (("--lengths",), lambda w: {"--prometheus": URL}),
    "suggest-window --prometheus-range": (("--lengths",), lambda w: {"--prometheus": URL}),
    "suggest-window --prompts": ((), lambda w: {"--collect-stats": None}),
    "validate-heads --head-stats": (("--heads",), lambda w: {}),
    "report files": (("--url",), lambda w: {}),
    "report --prometheus": (("--url",), lambda w: {}),
    "report --model": (("--url",), lambda w: {"--prometheus": URL}),
    "report --range": (("--url",), lambda w: {"--prometheus": URL}),
    **{f"report {k}": ((), lambda w: {"--validate": None}) for k in _MEASURE},
    "whatif files": (("--url",), lambda w: {}),
}


def value_flags() -> dict[str, argparse.Action]:
    """Every argument of every subcommand that takes a value, from the real parser:
    ``"COMMAND --flag"`` (positionals by their dest)."""
    out: dict[str, argparse.Action] = {}

    def walk(parser: argparse.ArgumentParser, path: list[str]) -> None:
        for a in parser._actions:
            if isinstance(a, argparse._SubParsersAction):
                for name, sub in a.choices.items():
                    walk(sub, [*path, name])
            elif a.nargs != 0 and not isinstance(a, (argparse._HelpAction,
                                                    argparse._VersionAction)):
                name = max(a.option_strings, key=len) if a.option_strings else a.dest
                out[" ".join([*path, name])] = a

    walk(cli.build_parser(), [])
    return out


def argv_for(key: str, value: str, w: World) -> list[str]:
    """The command line that gives ``value`` to the flag ``key``, everything else valid:
    options as ``--flag=value`` (so a value may start with '-'), positionals after ``--``."""
    cmd, _, flag = key.rpartition(" ")
    args = dict(_base(w)[cmd])
    drop, add = CONTEXT.get(key, ((), lambda _w: {}))
    for d in drop:
        args.pop(d)
    args.update(add(w))
    args[flag] = value
    opts = [k if v is None else f"{k}={v}" for k, v in args.items() if k.startswith("-")]
    pos = [v for k, v in args.items() if not k.startswith("-") and v is not None]
    return [cmd, *opts, *(["--", *pos] if pos else [])]


def _flag_params() -> list[str]:
    return sorted(FLAGS)


# =============================================================================== CLI tests

def test_every_value_flag_has_a_kind() -> None:
    """A flag added to any subcommand without a kind here (or a kind for a flag that is gone)
    fails: each must be fuzzed."""
    found = value_flags()
    assert sorted(set(found) - set(FLAGS)) == [], "value flags without a kind in FLAGS"
    assert sorted(set(FLAGS) - set(found)) == [], "kinds in FLAGS for flags that are gone"
    assert set(CONTEXT) <= set(FLAGS)


def test_the_harness_sees_refusals_and_long_work(cli_env: World) -> None:
    """The properties below can fail: a good command line reaches its marker, a bad one is
    refused, and the tree check sees a file written."""
    w = cli_env
    assert run_cli(argv_for("trace --steps", "5", w)).rc is None
    r = run_cli(argv_for("trace --steps", "0", w))
    assert r.rc == 2 and "--steps" in assert_one_line(r.err)
    before = _tree(w.root)
    (w.out / "probe.txt").write_text("x")
    try:
        assert _tree(w.root) != before
    finally:
        (w.out / "probe.txt").unlink()


@pytest.mark.slow
@pytest.mark.parametrize("key", _flag_params())
def test_bad_flag_values_are_one_line_exit_2_before_any_work(key: str, cli_env: World
                                                             ) -> None:
    kind = FLAGS[key]
    if kind.bad is None:
        pytest.skip(f"{key}: {kind.name}")
    w = cli_env
    for value in kind.edges(w):
        assert_refused(argv_for(key, value, w), w)

    @BAD
    @given(value=kind.bad(w))
    def prop(value: str) -> None:
        assert_refused(argv_for(key, value, w), w)

    prop()


@pytest.mark.parametrize("key", _flag_params())
def test_good_flag_values_are_accepted(key: str, cli_env: World) -> None:
    kind = FLAGS[key]
    w = cli_env

    @GOOD
    @given(value=kind.good(w))
    def prop(value: str) -> None:
        argv = argv_for(key, value, w)
        r = run_cli(argv)
        if r.rc == 2 and kind.data_errors:
            line = assert_one_line(r.err)
            assert any(e in line for e in kind.data_errors), (argv, r)
            return
        assert r.rc in (None, 0), (argv, r)  # reached its long step, or finished

    prop()


@pytest.mark.parametrize("key", _flag_params())
def test_any_flag_value_is_never_a_traceback(key: str, cli_env: World) -> None:
    kind = FLAGS[key]
    w = cli_env
    strategy = kind.anything(w) if kind.anything is not None else ANY_TEXT

    @ANY
    @given(value=strategy)
    def prop(value: str) -> None:
        argv = argv_for(key, value, w)
        before = _tree(w.root)
        r = run_cli(argv)  # an exception other than the marker fails here
        if r.rc in (None, 0):
            return
        assert r.rc == 2, (argv, r)
        assert_one_line(r.err)
        assert r.out == "" and _tree(w.root) == before, argv

    prop()


# =============================================================================== environment

def _env_field(name: str) -> str | None:
    f = name.removeprefix("ATTNPROF_").lower()
    return f if f in Config.__dataclass_fields__ else None


@dataclass(frozen=True)
class EnvKind:
    """A variable's documented type as strategies: ``bad`` values (None: none exist),
    ``good`` ones, and ``ok(value, raw)``: a value read from ``raw`` is of the type."""

    bad: Strategy | None
    good: Strategy
    ok: Callable[[Any, str], bool]
    edges: tuple[str, ...] = ()


_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


def _env_bool() -> EnvKind:
    words = [*_TRUE, *_FALSE]
    good = st.tuples(st.sampled_from(words), st.booleans(), st.sampled_from(["", " "])).map(
        lambda t: f"{t[2]}{t[0].upper() if t[1] else t[0]}{t[2]}")
    return EnvKind(
        bad=ANY_TEXT.filter(lambda s: s.strip().lower() not in (*words, "")),
        good=good, ok=lambda v, raw: isinstance(v, bool),
        edges=("maybe", "2", "-1", "y", "n", "truee", "nan", "\x01", "1\n0", "é"))


def _env_float(lo: float, hi: float, lo_open: bool, zero_off: bool = False) -> EnvKind:
    def inside(x: float) -> bool:
        in_range = (lo < x if lo_open else lo <= x) and x <= hi
        return math.isfinite(x) and (in_range or (zero_off and x == 0.0))

    good = st.floats(lo, hi, exclude_min=lo_open, allow_nan=False).map(repr)
    # The next float past each documented edge (and past 0 for a knob whose 0 is "off"):
    # the range the table prints is the one enforced, to the last bit.
    past = [x for x in (math.nextafter(lo, -math.inf), math.nextafter(hi, math.inf),
                        math.nextafter(0.0, math.inf)) if not inside(x)]
    return EnvKind(
        bad=st.floats().filter(lambda x: not inside(x)).map(repr)
        | ANY_TEXT.filter(lambda s: s.strip() != "" and not _parses(float, s)),
        good=good | st.just("0") if zero_off else good,
        ok=lambda v, raw: isinstance(v, float) and inside(v),
        # 1e-300 where it is out of range: a positive value under the floor (a busy loop,
        # an instant timeout)
        edges=("abc", "nan", "-nan", "inf", "-inf", "1e999", repr(lo - 1), repr(hi + 1),
               *([repr(lo)] if lo_open else []), *(() if inside(1e-300) else ("1e-300",)),
               *map(repr, past), "0.5.5", "5%", "\x01", "1,5"))


def _env_int(lo: int | None, hi: int | None = None) -> EnvKind:
    low = lo if lo is not None else -(10**30)
    high = hi if hi is not None else 10**30
    return EnvKind(
        bad=(st.integers(max_value=lo - 1).map(str) if lo is not None else st.nothing())
        | (st.integers(min_value=hi + 1).map(str) if hi is not None else st.nothing())
        | st.floats().map(repr)
        | ANY_TEXT.filter(lambda s: s.strip() != "" and not _parses(int, s)),
        good=st.integers(low, high).map(str),
        ok=lambda v, raw: isinstance(v, int) and low <= v <= high,
        edges=("x1", "1.5", "1e3", "nan", "inf", "0x10", "\x01", "9" * 5000,
               *([str(lo - 1)] if lo is not None else []),
               *([str(hi + 1), str(10**30)] if hi is not None else [])))


def _env_choice(choices: Sequence[str]) -> EnvKind:
    return EnvKind(
        bad=ANY_TEXT.filter(lambda s: s.strip() != "" and s not in choices),
        good=st.sampled_from(list(choices)), ok=lambda v, raw: v in choices,
        edges=("native", "EXPLICIT", "\x01", "explicit,exponential"))


def _env_list(choices: Sequence[str]) -> EnvKind:
    return EnvKind(
        bad=st.lists(st.sampled_from(list(choices)), max_size=2).flatmap(
            lambda xs: st.text(SYMBOLS, min_size=1, max_size=5).map(
                lambda j: ",".join([*xs, j]))),
        good=st.lists(st.sampled_from(list(choices)), min_size=1, max_size=3).map(",".join),
        ok=lambda v, raw: isinstance(v, tuple) and all(x in choices for x in v),
        edges=("everywhere", ",", " , ", "capture,bogus", "\x01"))


FREE = EnvKind(bad=None, good=ANY_TEXT, ok=lambda v, raw: True)
# A path: anything, but ~user of an unknown user is refused (test_home_of_an_unknown_user).
PATH = EnvKind(bad=None, good=ANY_TEXT.filter(lambda s: not s.startswith("~")),
               ok=lambda v, raw: True)


def env_kind(var: EnvVar) -> EnvKind | None:
    """The variable's documented type (``float in [0, 1]``, ``int >= 1``, ``bool``, ``A or
    B``, ``comma list of ...``, ``path``, ``str``) as an :class:`EnvKind`; None for a type
    this test does not know (a new one: give it a kind)."""
    t = var.type
    if t == "bool":
        return _env_bool()
    if m := re.fullmatch(r"(0 or )?float in ([\[(])([-0-9.e]+), ([-0-9.e]+)\]", t):
        return _env_float(float(m[3]), float(m[4]), m[2] == "(", zero_off=bool(m[1]))
    if m := re.fullmatch(r"int in \[(-?[0-9]+), (-?[0-9]+)\]", t):
        return _env_int(int(m[1]), int(m[2]))
    if m := re.fullmatch(r"int >= (-?[0-9]+)", t):
        return _env_int(int(m[1]))
    if m := re.fullmatch(r"one of ([a-z_]+(?:, [a-z_]+)+)", t):
        return _env_choice(m[1].split(", "))
    if t == "int":
        return _env_int(None)
    if m := re.fullmatch(r"comma list of ([a-z_]+(?:, [a-z_]+)*)", t):
        return _env_list(m[1].split(", "))
    if m := re.fullmatch(r"([a-z_]+) or ([a-z_]+)", t):
        return _env_choice([m[1], m[2]])
    if t == "path":
        return PATH
    if t == "str":
        return FREE
    return None


# Values a variable is read beside (the spans need an endpoint to go to).
_ENDPOINT = "http://127.0.0.1:4318"
ENV_CONTEXT: dict[str, dict[str, str]] = {
    "ATTNPROF_OTLP_SPANS": {"OTEL_EXPORTER_OTLP_ENDPOINT": _ENDPOINT},
}


def startup(env: dict[str, str]) -> tuple[Config | None, Any, str | None]:
    """(config, OTLP config, None) when attnprof starts with ``env`` as the whole
    environment, else (None, None, the one line its start-up prints). Read as the plugin,
    the stat logger and the route read it (``config_from_env``, OTLP included as when
    enabled); a refusal is then checked through the plugin's own ``register``."""
    from attnprof.host.vllm import register
    from attnprof.host.vllm.runtime import config_from_env

    with mock.patch.dict(os.environ, env, clear=True):
        try:
            cfg, otlp = config_from_env(check_otlp=True)
        except ConfigError:
            pass
        else:
            return cfg, otlp, None
        # Refused: what vLLM's process prints as it stops (enabled, so OTEL_* are read).
        os.environ.setdefault("ATTNPROF_ENABLED", "1")
        with pytest.raises(SystemExit) as stop:
            register()
    line = str(stop.value.code)
    return None, None, line


def assert_startup_line(line: str | None, name: str, raw: str = "") -> None:
    assert line is not None, f"{name}={raw!r}: accepted"
    assert line.startswith("attnprof: invalid configuration: "), line
    assert name in line, line
    assert not any(ord(c) < 0x20 or ord(c) == 0x7F or c in _LINE_BREAKS for c in line), line


def _env_params() -> list[str]:
    return [v.name for v in VARIABLES]


def test_every_attnprof_variable_has_a_kind() -> None:
    """Derived from the registry: a variable whose documented type has no strategy fails."""
    missing = [f"{v.name} ({v.type})" for v in VARIABLES if env_kind(v) is None]
    assert missing == []
    assert {"ATTNPROF_TRACE_OPEN", "ATTNPROF_TRACE_MAX_RANGES",
            "ATTNPROF_TRACE_MAX_RANGES_PER_WORKER"} <= set(_env_params())


@pytest.mark.parametrize("name", _env_params())
def test_bad_attnprof_variables_are_one_startup_line(name: str) -> None:
    var = next(v for v in VARIABLES if v.name == name)
    kind = env_kind(var)
    assert kind is not None
    if kind.bad is None:
        pytest.skip(f"{name} ({var.type}): every value is one")
    ctx = ENV_CONTEXT.get(name, {})
    _every_bad_value_is_one_startup_line(name, kind, ctx)


@pytest.mark.slow
@pytest.mark.parametrize("name", _env_params())
def test_good_and_any_attnprof_values(name: str) -> None:
    """Good values start and are read as given; any value either starts with something of
    the documented type or is refused with one line naming the variable."""
    var = next(v for v in VARIABLES if v.name == name)
    kind = env_kind(var)
    assert kind is not None
    ctx = ENV_CONTEXT.get(name, {})
    fld = _env_field(name)

    @ENV
    @given(raw=kind.good)
    def good(raw: str) -> None:
        cfg, _, line = startup({**ctx, name: raw})
        assert line is None and cfg is not None, line
        if fld is not None and kind.bad is not None:
            assert kind.ok(getattr(cfg, fld), raw), (raw, getattr(cfg, fld))

    @ENV
    @given(raw=ANY_TEXT.map(lambda s: s.encode("utf-8", "surrogateescape").decode(
        "utf-8", "replace")))
    def anything(raw: str) -> None:
        cfg, _, line = startup({**ctx, name: raw})
        if cfg is None:
            assert_startup_line(line, name)
        elif fld is not None and raw.strip():
            assert kind.ok(getattr(cfg, fld), raw), (raw, getattr(cfg, fld))

    good()
    anything()


# ----- OTEL_*: the standard variables the OTLP exporter reads

def _otel_read() -> set[str]:
    src = (REPO / "exporters/attnprof/exporters/otlp/config.py").read_text()
    return set(re.findall(r'"(OTEL_[A-Z_]+)"', src))


def _good_url(path: str) -> Strategy:
    return st.builds(lambda s, h, p: f"{s}://{h}:{p}{path}", st.sampled_from(["http", "https"]),
                     st.sampled_from(_HOSTS), st.integers(1, 65535))


def _otel_url(path: str) -> EnvKind:
    return EnvKind(
        bad=ANY_TEXT.filter(lambda s: s.strip() != "" and not s.strip().lower().startswith(
            ("http://", "https://")))
        | st.builds(lambda junk: f"http://a{junk}b:4318", st.text(CONTROL + " ", min_size=1,
                                                                  max_size=3).filter(
            lambda s: s.strip()))
        | st.integers(65536, 10**6).map(lambda p: f"http://127.0.0.1:{p}"),
        good=_good_url(path),
        ok=lambda v, raw: True,
        edges=("collector:4318", "localhost", "http://host:port", "http://h:99999",
               "http://h:0", "http://[::1", "ftp://h:1", "http://", "http://a b:4318",
               "http://h\x01:1", "file:///x", "//h:4318"))


def _otel_ms(lo: float, hi: float) -> EnvKind:
    return EnvKind(
        bad=st.floats().filter(lambda x: not (math.isfinite(x) and lo <= x <= hi)).map(repr)
        | ANY_TEXT.filter(lambda s: s.strip() != "" and not _parses(float, s)),
        good=st.floats(lo, hi).map(repr) | st.integers(int(lo) + 1, int(hi)).map(str),
        ok=lambda v, raw: True,
        edges=("1s", "0", "-5", "nan", "inf", "1e300", "1e-300", repr(hi * 2), "5ms", "\x01"))


_TOKEN = st.text("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-_.", min_size=1,
                 max_size=10)


def _good_pairs(key: Strategy) -> Strategy:
    import urllib.parse

    value = st.text(st.characters(min_codepoint=0x20, max_codepoint=0x7E), max_size=12).map(
        lambda v: urllib.parse.quote(v, safe=""))
    return st.lists(st.tuples(key, value), min_size=1, max_size=3).map(
        lambda xs: ",".join(f"{k}={v}" for k, v in xs))


def _otel_headers() -> EnvKind:
    return EnvKind(
        bad=st.sampled_from(["novalue", "=x", "bad key=1", "a=1,broken", "k=%0Av", "k=v%0D%0A",
                             "k=%00", "k=%1B[2J", "é=1", "k=\x01"])
        | _good_pairs(_TOKEN).map(lambda s: s + ",broken"),
        good=_good_pairs(_TOKEN), ok=lambda v, raw: True,
        edges=("novalue", "=x", "k=%0Av"))


def _otel_protocol() -> EnvKind:
    from attnprof.exporters.otlp import PROTOCOLS

    return EnvKind(
        bad=ANY_TEXT.filter(lambda s: s.strip() != "" and s.strip() not in PROTOCOLS),
        good=st.sampled_from(PROTOCOLS), ok=lambda v, raw: True,
        edges=("http/json", "udp", "GRPC", "\x01"))


def _otel_kinds() -> dict[str, EnvKind]:
    return {
        "OTEL_EXPORTER_OTLP_ENDPOINT": _otel_url(""),
        "OTEL_EXPORTER_OTLP_METRICS_ENDPOINT": _otel_url("/v1/metrics"),
        "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": _otel_url("/v1/traces"),
        "OTEL_EXPORTER_OTLP_PROTOCOL": _otel_protocol(),
        "OTEL_EXPORTER_OTLP_METRICS_PROTOCOL": _otel_protocol(),
        "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": _otel_protocol(),
        "OTEL_EXPORTER_OTLP_HEADERS": _otel_headers(),
        "OTEL_EXPORTER_OTLP_METRICS_HEADERS": _otel_headers(),
        "OTEL_EXPORTER_OTLP_TRACES_HEADERS": _otel_headers(),
        "OTEL_METRIC_EXPORT_INTERVAL": _otel_ms(100, 86_400_000),
        "OTEL_METRIC_EXPORT_TIMEOUT": _otel_ms(1, 3_600_000),
        "OTEL_RESOURCE_ATTRIBUTES": EnvKind(
            bad=st.sampled_from(["broken", "=x", "a=1,b", " =1"]),
            good=_good_pairs(_TOKEN), ok=lambda v, raw: True),
    }


OTEL_KINDS = _otel_kinds()
# What every OTEL_* variable is read beside: an endpoint (else none is read), and for the
# traces' own variables the spans switched on.
OTEL_CONTEXT: dict[str, dict[str, str]] = {
    name: {"OTEL_EXPORTER_OTLP_ENDPOINT": _ENDPOINT,
           **({"ATTNPROF_OTLP_SPANS": "1"} if "TRACES" in name else {})}
    for name in OTEL_KINDS}
OTEL_CONTEXT["OTEL_EXPORTER_OTLP_ENDPOINT"] = {}
OTEL_CONTEXT["OTEL_EXPORTER_OTLP_METRICS_ENDPOINT"] = {}


def test_every_otel_variable_read_has_a_kind() -> None:
    assert sorted(_otel_read() ^ set(OTEL_KINDS)) == []


def _every_bad_value_is_one_startup_line(name: str, kind: Any, ctx: dict[str, str]) -> None:
    """The kind's edge cases, then hypothesis over its bad values: one start-up line each."""
    for raw in kind.edges:
        assert_startup_line(startup({**ctx, name: raw})[2], name, raw)

    @ENV
    @given(raw=kind.bad)
    def prop(raw: str) -> None:
        assert_startup_line(startup({**ctx, name: raw})[2], name, raw)

    prop()


@pytest.mark.parametrize("name", sorted(OTEL_KINDS))
def test_bad_otel_variables_are_one_startup_line(name: str) -> None:
    kind = OTEL_KINDS[name]
    if kind.bad is None:
        pytest.skip(f"{name}: every value is one")
    ctx = OTEL_CONTEXT[name]
    _every_bad_value_is_one_startup_line(name, kind, ctx)


def _otel_sane(cfg: Any) -> bool:
    """What an accepted OTLP configuration must be: URLs an exporter can use, header values
    a header can carry, an interval and a timeout a timer can wait."""
    from urllib.parse import urlparse

    def url_ok(u: str) -> bool:
        p = urlparse(u)
        return (p.scheme in ("http", "https") and bool(p.hostname) and (p.port or 1) > 0
                and not any(ord(c) <= 0x20 or ord(c) == 0x7F for c in u))

    return (url_ok(cfg.endpoint) and (not cfg.spans or url_ok(cfg.traces_endpoint))
            and all(all(0x20 <= ord(c) < 0x7F for c in v) for _, v in cfg.headers)
            and 0.1 <= cfg.interval_s <= 86_400 and 0.001 <= cfg.timeout_s <= 3600)


@pytest.mark.parametrize("name", sorted(OTEL_KINDS))
def test_good_and_any_otel_values(name: str) -> None:
    kind = OTEL_KINDS[name]
    ctx = OTEL_CONTEXT[name]

    @ENV
    @given(raw=kind.good)
    def good(raw: str) -> None:
        _, otlp, line = startup({**ctx, name: raw})
        assert line is None and otlp is not None, line
        assert _otel_sane(otlp), otlp

    @ENV
    @given(raw=ANY_TEXT.map(lambda s: s.encode("utf-8", "surrogateescape").decode(
        "utf-8", "replace")))
    def anything(raw: str) -> None:
        _, otlp, line = startup({**ctx, name: raw})
        if line is not None:
            assert_startup_line(line, name)
        elif otlp is not None:
            assert _otel_sane(otlp), (raw, otlp)

    good()
    anything()


# ----- the start-up line as the processes print it, and what it must not print

def test_home_of_an_unknown_user_is_one_line(cli_env: World,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """``ATTNPROF_HOME=~nobody-here`` was a RuntimeError from pathlib at start-up (and a
    traceback from ``attnprof model path``): now one line naming the variable."""
    raw = "~attnprof-no-such-user/cache"
    assert_startup_line(startup({"ATTNPROF_HOME": raw})[2], "ATTNPROF_HOME", raw)
    monkeypatch.setenv("ATTNPROF_HOME", raw)
    for argv in (["model", "path"], ["serve", "--model", "smollm2"]):
        r = run_cli(argv)
        assert r.rc == 2 and "ATTNPROF_HOME" in assert_one_line(r.err), (argv, r)


@pytest.mark.parametrize("name", [*_env_params(), *sorted(OTEL_KINDS)])
def test_attnprof_serve_refuses_a_bad_variable_before_vllm(name: str, cli_env: World,
                                                           monkeypatch: pytest.MonkeyPatch
                                                           ) -> None:
    """The CLI's start-up path (``attnprof serve`` checks the server's environment before
    it starts vLLM): one line naming the variable, vLLM never started."""
    var = next((v for v in VARIABLES if v.name == name), None)
    kind = OTEL_KINDS.get(name) or env_kind(var)  # type: ignore[arg-type]
    assert kind is not None
    if kind.bad is None:
        pytest.skip(f"{name}: every value is one")
    ctx = OTEL_CONTEXT.get(name) or ENV_CONTEXT.get(name, {})
    for raw in kind.edges[:3]:
        for k, v in {**ctx, name: raw}.items():
            monkeypatch.setenv(k, v)
        line = assert_refused(argv_for("serve --model", str(cli_env.ckpt), cli_env), cli_env)
        assert "invalid configuration" in line and name in line, line


_SECRET = st.text("abcdefghijklmnopqrstuvwxyz0123456789", min_size=8, max_size=16)


@ENV
@given(secret=_SECRET, form=st.integers(0, 4))
def test_header_and_endpoint_errors_never_show_a_credential(secret: str, form: int) -> None:
    """OTEL_EXPORTER_OTLP_HEADERS holds credentials and the start-up line lands in the
    server's log: a malformed value is named by position, never repeated; an endpoint's
    user:password is not shown either."""
    name, raw = [
        ("OTEL_EXPORTER_OTLP_HEADERS", f"authorization=Bearer%20{secret},broken"),
        ("OTEL_EXPORTER_OTLP_HEADERS", f"Authorization: Bearer {secret}"),
        ("OTEL_EXPORTER_OTLP_METRICS_HEADERS", f"x-key={secret}%0A"),
        ("OTEL_EXPORTER_OTLP_ENDPOINT", f"http://user:{secret}@collector:port"),
        ("OTEL_EXPORTER_OTLP_METRICS_ENDPOINT", f"https://u:{secret}@h x:4318/v1/metrics"),
    ][form]
    ctx = OTEL_CONTEXT[name]
    line = startup({**ctx, name: raw})[2]
    assert_startup_line(line, name, raw)
    assert secret not in str(line), line


_PLUGIN_START = "from attnprof.host.vllm import register; register()"


@pytest.mark.slow
@pytest.mark.parametrize("env", [
    {"ATTNPROF_TRACE_MAX_RANGES_PER_WORKER": "0"},
    {"ATTNPROF_ENABLED": "1", "OTEL_EXPORTER_OTLP_ENDPOINT": _ENDPOINT,
     "OTEL_METRIC_EXPORT_INTERVAL": "1e300"},
    {"ATTNPROF_ENABLED": "1", "ATTNPROF_SAMPLE_RATE": "0.\u20285"},
], ids=["trace-cap", "otel-interval", "line-separator"])
def test_the_plugin_prints_one_startup_line(env: dict[str, str]) -> None:
    """What a vLLM process shows when the plugin refuses its environment: exit 1 and one
    line on stderr (a real interpreter, as vLLM loads the plugin)."""
    base = {k: v for k, v in os.environ.items()
            if not k.startswith(("ATTNPROF_", "OTEL_", "VLLM_"))}
    r = subprocess.run([sys.executable, "-c", _PLUGIN_START], capture_output=True, text=True,
                       timeout=60, env={**base, **env})
    assert r.returncode == 1 and r.stdout == "", r
    assert r.stderr.count("\n") == 1 and r.stderr.startswith("attnprof: invalid configuration"), r
    assert list(env)[-1] in r.stderr and "Traceback" not in r.stderr


# ----- writes that cannot happen, found before the work (root is told yes by os.access)

def test_compat_regenerate_refuses_an_unwritable_out_before_deriving(cli_env: World) -> None:
    """--regenerate runs vLLM's selection code in a child process before it writes: an --out
    root cannot write (/sys) is refused first."""
    for out in _unwritable(cli_env):
        line = assert_refused(["compat", "--regenerate", f"--out={out}"], cli_env)
        assert "--out" in line, line


@pytest.mark.skipif(not Path("/sys").is_dir(), reason="needs Linux's /sys")
def test_a_write_that_fails_is_one_line() -> None:
    """write_atomic's OSError (a directory that refuses files even to root, a full disk) is a
    CliError, not a traceback after the work, and leaves nothing behind."""
    from attnprof.cli._common import CliError, write_atomic

    target = Path("/sys/attnprof-fuzz.json")
    with pytest.raises(CliError) as err:
        write_atomic(target, "{}\n")
    assert "\n" not in str(err.value) and str(target) in str(err.value)
    assert not target.exists()
