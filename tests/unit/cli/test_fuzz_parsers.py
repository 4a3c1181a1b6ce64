"""Property-based fuzzing of every parser of files, URL answers and flags the CLI has.

The one property: a parser returns a valid result or raises its one typed error (the CLI
prints it as one line and exits 2): :class:`CliError` at the CLI, :class:`ContractError`
for the contracts, :class:`InputError` for the length sources, :class:`HttpError` for
URLs. Any other exception (KeyError, OverflowError, AttributeError...) fails the test.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
import typing
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from attnprof.analyze.sparsity.inputs import InputError
from attnprof.cli._common import CliError
from attnprof.contracts.base import ContractError, Document, Record
from tests.unit.cli.test_cli_errors import RawServer

MAX_LENGTH = 2**31 - 1  # attnprof.cli._common.MAX_LENGTH (checked in test_doc_lengths)

FAST = settings(max_examples=150, deadline=None, derandomize=True,
                suppress_health_check=[HealthCheck.function_scoped_fixture,
                                       HealthCheck.too_slow])


def _one_line(err: BaseException) -> None:
    msg = str(err)
    assert msg and "\n" not in msg and len(msg) < 2000, msg


def _expect(fn: Callable[[], Any], *errors: type[BaseException]) -> Any:
    """``fn()``, or one of ``errors`` with a one-line message (then None)."""
    try:
        return fn()
    except errors as err:
        _one_line(err)
        return None


# ----- JSON values -----
_scalars = (st.none() | st.booleans() | st.integers(min_value=-(10**40), max_value=10**40)
            | st.floats(allow_nan=True, allow_infinity=True) | st.text(max_size=12)
            | st.sampled_from([0, 1, -1, 10**400, 1e30, 1e400, "1e30", "+Inf", "NaN", "",
                               "\n"]))
json_values = st.recursive(
    _scalars,
    lambda kids: st.lists(kids, max_size=4) | st.dictionaries(st.text(max_size=8), kids,
                                                              max_size=4),
    max_leaves=20)


def _contract_types() -> list[type[Record]]:
    import attnprof.contracts.advice as advice
    import attnprof.contracts.profile as profile
    import attnprof.contracts.snapshot as snapshot

    out: list[type[Record]] = []
    for mod in (snapshot, profile, advice):
        for name in mod.__all__:
            cls = getattr(mod, name)
            if isinstance(cls, type) and issubclass(cls, Record):
                out.append(cls)
    return out


CONTRACTS = _contract_types()


def _shaped(tp: Any, depth: int = 0) -> st.SearchStrategy[Any]:
    """JSON that mostly has the shape of ``tp`` (right keys, nested records), with any
    field dropped or replaced by any JSON value: where the decoder's edges are."""
    while typing.get_origin(tp) is typing.Annotated:
        tp = typing.get_args(tp)[0]
    anything = json_values
    if depth > 3:
        return anything
    origin = typing.get_origin(tp)
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        hints = typing.get_type_hints(tp, include_extras=True)
        fields = {f.name: st.one_of(_shaped(hints[f.name], depth + 1), anything)
                  for f in dataclasses.fields(tp) if not f.name.startswith("_")}
        if issubclass(tp, Document):
            fields["schema_version"] = st.sampled_from(
                [tp.version_tag(), f"{tp.KIND}/1", f"{tp.KIND}/2.0", "x/1.0", 1, None])
        return st.fixed_dictionaries({}, optional=fields)
    if origin in (list, tuple):
        args = typing.get_args(tp)
        return st.lists(_shaped(args[0], depth + 1) if args else anything, max_size=3)
    if origin is dict:
        args = typing.get_args(tp)
        return st.dictionaries(st.sampled_from(["0", "1", "x", "prefill", "-3"]),
                               _shaped(args[1], depth + 1) if args else anything, max_size=3)
    if origin in (typing.Union, __import__("types").UnionType):
        return st.one_of([_shaped(a, depth + 1) for a in typing.get_args(tp)])
    if tp in (int, float):  # numbers past a float, past int64, not numbers at all
        return st.sampled_from([10**400, -(10**400), 2**64, 1e308, 0.5, True, "1"]) | anything
    return anything


DOCUMENTS = [c for c in CONTRACTS if issubclass(c, Document)]


def _check_contract(cls: type[Record], data: Any) -> None:
    out = _expect(lambda: cls.from_json(data), ContractError)
    if out is not None:
        json.dumps(out.to_json())  # what was read can be written back


@pytest.mark.slow
@pytest.mark.parametrize("cls", DOCUMENTS, ids=lambda c: c.__name__)
def test_document_from_json(cls: type[Record]) -> None:
    @FAST
    @given(data=_shaped(cls) | json_values)
    def run(data: Any) -> None:
        _check_contract(cls, data)

    run()


@pytest.mark.slow
@settings(max_examples=300, deadline=None, derandomize=True)
@given(pair=st.sampled_from([c for c in CONTRACTS if c not in DOCUMENTS]).flatmap(
    lambda cls: st.tuples(st.just(cls), _shaped(cls) | json_values)))
def test_record_from_json(pair: tuple[type[Record], Any]) -> None:
    _check_contract(*pair)


# ----- files -----
_texts = st.one_of(
    st.text(max_size=200),
    json_values.map(json.dumps),
    st.lists(st.integers(min_value=-5, max_value=10**35) | st.floats(), max_size=6).map(
        lambda xs: "\n".join(map(str, xs))),
    st.lists(st.tuples(st.floats() | st.integers(max_value=10**35),
                       st.floats() | st.integers()), max_size=5).map(
        lambda rows: json.dumps({"buckets": [{"le": a, "count": b} for a, b in rows]})),
    st.lists(st.tuples(st.integers(max_value=10**35), st.floats()), max_size=5).map(
        lambda rows: "le,count\n" + "\n".join(f"{a},{b}" for a, b in rows)),
    st.sampled_from(["[" * 5000, "1e30", "0\n", "length,count\n5,inf\n", "{\"lengths\": 3}"]),
)


@pytest.fixture
def scratch(tmp_path: Path) -> Iterator[Path]:
    yield tmp_path / "input"


@pytest.mark.slow
@FAST
@given(text=_texts)
def test_lengths_file(scratch: Path, text: str) -> None:
    from attnprof.cli.suggest import read_lengths

    scratch.write_text(text)
    dist = _expect(lambda: read_lengths(scratch), CliError)
    if dist is not None:
        assert all(0 < n <= MAX_LENGTH for n in dist.lengths)
        assert all(math.isfinite(w) and w > 0 for w in dist.weights)


@pytest.mark.slow
@FAST
@given(data=_shaped(CONTRACTS[CONTRACTS.index(__import__(
    "attnprof.contracts.profile", fromlist=["ProfileReport"]).ProfileReport)]) | json_values,
    raw=st.booleans(), junk=st.binary(max_size=40))
def test_profile_show(scratch: Path, data: Any, raw: bool, junk: bytes) -> None:
    from attnprof.cli.profile import show_profile

    scratch.write_bytes(junk if raw else json.dumps(data).encode())
    _expect(lambda: show_profile(scratch), CliError)


@pytest.mark.slow
@FAST
@given(data=_shaped(__import__("attnprof.contracts.snapshot",
                               fromlist=["Snapshot"]).Snapshot) | json_values)
def test_snapshot_document(data: Any) -> None:
    from attnprof.cli.snapshot import parse_snapshot

    _expect(lambda: parse_snapshot(data, "x"), CliError)
    _expect(lambda: parse_snapshot(data, "x", complete=True), CliError)


def _real_head_stats() -> dict[str, Any]:
    from attnprof.aggregate.head_stats import HeadStatsAccumulator

    d: dict[str, Any] = HeadStatsAccumulator(2, 1, 2, [0, 4], [8, 16]).to_dict()
    return d


_odd_numbers = st.sampled_from([0, -1, 10**15, 10**400, 2.5, "3", None, [], {}])


@st.composite
def _head_stats(draw: st.DrawFn) -> dict[str, Any]:
    """A real accumulator's state with some keys, array specs or indexes replaced."""
    d = _real_head_stats()
    for key in draw(st.lists(st.sampled_from(sorted(d)), max_size=3)):
        d[key] = draw(_odd_numbers | json_values)
    arrays = d.get("arrays")
    if isinstance(arrays, dict) and arrays and draw(st.booleans()):
        name = draw(st.sampled_from(sorted(arrays)))
        spec = dict(arrays[name]) if isinstance(arrays[name], dict) else {}
        spec[draw(st.sampled_from(["shape", "index", "value"]))] = draw(
            st.lists(st.integers(-10, 10**6) | _odd_numbers, max_size=4) | json_values)
        arrays[name] = spec
    if draw(st.booleans()):  # inside a snapshot instead of on its own
        return {"schema_version": "attnprof.snapshot/1.3",
                "workers": [{"pid": 1, "head_stats": d}]}
    return d


@pytest.mark.slow
@FAST
@given(data=_head_stats() | json_values)
def test_head_stats_file(scratch: Path, data: Any) -> None:
    from attnprof.cli.suggest import load_head_stats

    scratch.write_text(json.dumps(data))
    _expect(lambda: load_head_stats(scratch), CliError)


@pytest.mark.slow
@FAST
@given(manifest=st.fixed_dictionaries({}, optional={"files": json_values,
                                                    "sha256": json_values,
                                                    "format": json_values}) | json_values)
def test_model_manifest(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, manifest: Any
                        ) -> None:
    from attnprof.cli._common import resolve_model
    from attnprof.tools.models import DIR_NAME, MANIFEST

    monkeypatch.setenv("ATTNPROF_HOME", str(tmp_path / "home"))
    d = tmp_path / "home" / "models" / DIR_NAME
    d.mkdir(parents=True, exist_ok=True)
    (d / MANIFEST).write_text(json.dumps(manifest))
    _expect(lambda: resolve_model("smollm2"), CliError)


# ----- URL answers (the real client against a raw socket) -----
def _http_answers() -> st.SearchStrategy[bytes]:
    status = st.sampled_from([200, 200, 200, 204, 301, 401, 403, 404, 500])
    body = st.one_of(st.binary(max_size=60), json_values.map(lambda v: json.dumps(v).encode()),
                     _shaped(__import__("attnprof.contracts.snapshot",
                                        fromlist=["Snapshot"]).Snapshot).map(
                         lambda v: json.dumps(v).encode()))

    def frame(s: int, b: bytes, mode: int, cut: int) -> bytes:
        if mode == 0:  # well-formed
            return f"HTTP/1.1 {s} X\r\nContent-Length: {len(b)}\r\n\r\n".encode() + b
        if mode == 1:  # the length promises more than comes
            return f"HTTP/1.1 {s} X\r\nContent-Length: {len(b) + 10}\r\n\r\n".encode() + b
        if mode == 2:  # chunked, cut anywhere
            full = (f"HTTP/1.1 {s} X\r\nTransfer-Encoding: chunked\r\n\r\n{len(b):x}\r\n"
                    .encode() + b + b"\r\n0\r\n\r\n")
            return full[:cut % (len(full) + 1)]
        if mode == 3:  # no length: body until close
            return f"HTTP/1.1 {s} X\r\n\r\n".encode() + b
        whole = f"HTTP/1.1 {s} X\r\nContent-Length: {len(b)}\r\n\r\n".encode() + b
        return whole[:cut % (len(whole) + 1)]  # cut anywhere, headers included

    return st.one_of(st.builds(frame, status, body, st.integers(0, 4), st.integers(0, 400)),
                     st.binary(max_size=80))


@pytest.fixture(scope="module")
def raw() -> Iterator[RawServer]:
    srv = RawServer()
    yield srv
    srv.close()


@pytest.mark.slow
@settings(max_examples=120, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(answer=_http_answers())
def test_snapshot_url_answers(raw: RawServer, answer: bytes) -> None:
    from attnprof.cli.snapshot import fetch_snapshot

    raw.answer = answer
    _expect(lambda: fetch_snapshot(raw.url, timeout=5), CliError)


@pytest.mark.slow
@settings(max_examples=120, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(answer=_http_answers())
def test_prometheus_url_answers(raw: RawServer, answer: bytes) -> None:
    from attnprof.tools.prometheus_query import query_prometheus

    raw.answer = answer
    _expect(lambda: query_prometheus(raw.url, timeout=5), InputError)


@settings(max_examples=40, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(answer=_http_answers())
def test_post_json_answers(raw: RawServer, answer: bytes) -> None:
    """The traffic the demo and the benchmarks send: whatever comes back is the JSON it
    holds or one HttpError (an error status keeps its code), never a urllib exception."""
    from attnprof.tools.http import HttpError, post_json

    raw.answer = answer
    try:
        post_json(raw.url + "/v1/completions", {"prompt": "x"}, timeout=5)
    except HttpError as err:
        assert "\n" not in str(err) and str(err)
        m = re.match(rb"HTTP/1.1 (\d{3}) ", answer)
        if err.status is not None:
            assert m is not None and int(m.group(1)) == err.status >= 300


_prom_result = st.lists(st.fixed_dictionaries({}, optional={
    "metric": st.fixed_dictionaries({}, optional={"le": st.sampled_from(
        ["+Inf", "1e30", "NaN", "-5", "100", "x"]) | json_values}),
    "value": st.tuples(st.floats(), st.sampled_from(["3", "1e400", "NaN", "-1", "x"])
                       | json_values).map(list) | json_values}), max_size=5)


@pytest.mark.slow
@FAST
@given(result=_prom_result | json_values, status=st.sampled_from(["success", "error", 1]))
def test_prometheus_answer_body(result: Any, status: Any) -> None:
    from attnprof.tools.prometheus_query import parse_prometheus_answer

    body = json.dumps({"status": status, "data": {"resultType": "vector", "result": result}})
    _expect(lambda: parse_prometheus_answer(body.encode(), "http://p"), InputError)


# ----- flags -----
_flag_text = st.one_of(
    st.text(max_size=30),
    st.text(alphabet="0123456789-,. eE+kKmMgGiBbtT", max_size=30),
    st.sampled_from(["1e30", "1e400", "nan", "inf", "-0", "0-10000000000", "99999999999999999",
                     "5-2", "-", "", "24GiB", "1.5e3MB"]))


@FAST
@given(text=_flag_text)
def test_memory_budget(text: str) -> None:
    from attnprof.cli.profile import MAX_BYTES, parse_bytes

    v = _expect(lambda: parse_bytes(text), CliError)
    assert v is None or 0 < v <= MAX_BYTES


@FAST
@given(text=_flag_text)
def test_seq_lens(text: str) -> None:
    from attnprof.cli.profile import parse_seq_lens

    v = _expect(lambda: parse_seq_lens(text), CliError)
    assert v is None or (v and all(0 < n <= MAX_LENGTH for n in v))


@FAST
@given(text=_flag_text, n=st.integers(1, 200))
def test_layers(text: str, n: int) -> None:
    from attnprof.cli.suggest import parse_layers

    v = _expect(lambda: parse_layers(text, n), CliError)
    assert v is None or (v and all(0 <= x < n for x in v))


@FAST
@given(text=_flag_text)
def test_doc_lengths(text: str) -> None:
    from attnprof.cli import _common
    from attnprof.cli.demo import _lengths

    assert _common.MAX_LENGTH == MAX_LENGTH

    v = _expect(lambda: _lengths(text), CliError)
    assert v is None or all(0 < n <= MAX_LENGTH for n in v)


@FAST
@given(text=_flag_text | st.sampled_from(["1h30m", "5m", "1d]) or vector(1", "30s"]),
       model=st.none() | st.text(max_size=10))
def test_prometheus_range_and_model(text: str, model: str | None) -> None:
    from attnprof.tools.prometheus_query import query_url

    url = _expect(lambda: query_url("http://p:9090", model, text), InputError)
    if url is not None:  # what was accepted cannot close the selector or the range early
        import urllib.parse

        q = urllib.parse.parse_qs(urllib.parse.urlsplit(url).query)["query"][0]
        assert q.count("[") == 1 and q.endswith(f"[{text}]))")


@FAST
@given(url=st.text(max_size=40) | st.sampled_from(
    ["http://", "http://[::1", "http://h:99999", "ftp://h", "localhost:8000", "http://h/x y",
     "https://h:1/", "file:///etc/passwd"]))
def test_urls(url: str) -> None:
    from attnprof.tools.http import HttpError, check_url

    _expect(lambda: check_url(url), HttpError)


@FAST
@given(flag=st.none() | st.text(max_size=20), env_key=st.none() | st.text(max_size=20))
def test_api_key(flag: str | None, env_key: str | None) -> None:
    from attnprof.tools.http import HttpError, resolve_api_key

    env = {} if env_key is None else {"ATTNPROF_API_KEY": env_key}
    try:
        key = resolve_api_key(flag, env)
    except HttpError as err:
        _one_line(err)
        for k in (flag, env_key):  # never repeated in the message
            assert not k or len(k) < 3 or k not in str(err)
        return
    assert key == (flag or env_key or None)


@FAST
@given(tau=st.floats(), quantile=st.floats(), min_exact=st.floats())
def test_thresholds(tau: float, quantile: float, min_exact: float) -> None:
    from attnprof.cli.suggest import check_thresholds

    if _expect(lambda: check_thresholds(tau, quantile, min_exact) or True, CliError):
        assert 0 < tau <= 1 and 0 <= quantile < 1 and 0 <= min_exact <= 1
