"""docs/SECURITY.md stays true: every test it cites exists, every route attnprof adds is named
in it, every kind of output is, and attnprof's own code binds no socket (the "opens no port"
claim)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from tests.conftest import REPO

DOC = REPO / "docs" / "SECURITY.md"
_CITE = re.compile(r"(tests/[\w/]+\.py)::(\w+)(?:\[([\w-]+)\])?")


def _tests_in(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    return {n.name for n in ast.walk(tree)
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
            and n.name.startswith("test_")}


def _missing(text: str) -> list[str]:
    missing = []
    for file, name, param in _CITE.findall(text):
        path = REPO / file
        if not path.is_file() or name not in _tests_in(path):
            missing.append(f"{file}::{name}")
        elif param and f'"{param}"' not in path.read_text():
            missing.append(f"{file}::{name}[{param}]")
    return missing


@pytest.mark.slow
def test_every_cited_test_exists() -> None:
    text = DOC.read_text()
    assert len(_CITE.findall(text)) > 60, "SECURITY.md lists the test beside each claim"
    assert _missing(text) == [], "SECURITY.md cites tests that do not exist"


@pytest.mark.slow
def test_a_citation_that_does_not_exist_is_caught() -> None:
    """The checker itself can fail: a renamed test, a missing file, a missing surface id."""
    assert _missing("[test: tests/unit/contracts/test_redact.py::test_made_up_claim]")
    assert _missing("[test: tests/unit/test_nothing_here.py::test_x]")
    assert _missing("tests/integration/test_privacy_canary.py::test_surface_leaks_nothing[nope]")
    assert not _missing("tests/integration/test_privacy_canary.py::"
                        "test_surface_leaks_nothing[metrics]")


def test_every_route_attnprof_adds_is_named() -> None:
    from fastapi import FastAPI

    from attnprof.host.vllm.endpoint import AttnProfEndpoint

    app = FastAPI()
    before = {r.path for r in app.routes}  # type: ignore[attr-defined]
    AttnProfEndpoint().attach_router(app)
    added = {r.path for r in app.routes} - before  # type: ignore[attr-defined]
    assert added >= {"/attnprof/snapshot", "/attnprof/trace", "/attnprof/sampling"}
    text = DOC.read_text()
    assert all(f"`GET {p}`" in text or f"`POST {p}`" in text for p in added), added


def test_every_kind_of_output_is_named() -> None:
    text = DOC.read_text()
    for surface in ("`/metrics`", "OTLP metrics", "OTLP spans", "TensorBoard",
                    "`attnprof record", "`attnprof report`", "`attnprof trace", "`attnprof diff`",
                    "`attnprof profile` output", "`attnprof snapshot", "The server log",
                    "PROMETHEUS_MULTIPROC_DIR", "ATTNPROF_RUN_DIR", "attnprof-hs-",
                    "attnprof-rate-", "Provenance"):
        assert surface in text, surface


_LISTENERS = {"bind", "listen", "start_http_server", "start_wsgi_server", "serve_forever",
              "make_server", "create_server", "HTTPServer", "ThreadingHTTPServer", "run_simple"}


@pytest.mark.slow
def test_attnprof_binds_no_socket() -> None:
    """attnprof's package code never listens: no bind/listen/HTTP server call anywhere in it
    (its routes live on vLLM's port; OTLP is outbound). The test tools that start vLLM or a
    loopback receiver live in tests/ and tools/server.py starts vLLM itself, not a socket."""
    roots = [REPO / "plugin" / "attnprof", REPO / "exporters" / "attnprof" / "exporters"]
    found = []
    for root in roots:
        for path in root.rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Call):
                    f = node.func
                    name = f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", "")
                    if name in _LISTENERS:
                        found.append(f"{path.relative_to(REPO)}:{node.lineno} {name}()")
    # A port check before starting vLLM binds and closes at once (serve's "port in use" line).
    allowed = {p for p in found if p.startswith("plugin/attnprof/tools/server.py")}
    assert set(found) - allowed == set(), found
