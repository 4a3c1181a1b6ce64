"""The rooms' rules, checked on the source: capture -> aggregate -> analyze -> export.

Every import counts, wherever it is written: at module level, inside a function or a class,
under ``if TYPE_CHECKING``, and ``importlib.import_module("...")`` / ``__import__("...")``
with a literal name. docs/architecture.md lists these rules with the test of each.
"""

from __future__ import annotations

import ast
import functools
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.conftest import REPO

_ROOTS = {REPO / "plugin" / "attnprof": "attnprof",
          REPO / "exporters" / "attnprof" / "exporters": "attnprof.exporters"}

_EXPORT_LIBS = ("prometheus_client", "opentelemetry", "tensorboard", "matplotlib")
_MODEL_LIBS = ("torch", "vllm", "transformers")
_IMPORTERS = ("import_module", "__import__")


def _modules() -> dict[str, Path]:
    out = {}
    for root, prefix in _ROOTS.items():
        for p in root.rglob("*.py"):
            parts = list(p.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join([prefix, *parts])] = p
    return out


def imports_in(source: str) -> set[str]:
    """Every module name ``source`` imports, anywhere in it (``from a import b`` gives both
    ``a`` and ``a.b``: b may be a submodule)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
            found |= {f"{node.module}.{a.name}" for a in node.names}
        elif isinstance(node, ast.Call) and node.args:
            fn = node.func
            name = fn.attr if isinstance(fn, ast.Attribute) else getattr(fn, "id", None)
            arg = node.args[0]
            if name in _IMPORTERS and isinstance(arg, ast.Constant) \
                    and isinstance(arg.value, str):
                found.add(arg.value)
    return found


def _dotted(node: ast.AST) -> str | None:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        return ".".join([node.id, *reversed(parts)])
    return None


def uses_in(source: str) -> set[str]:
    """Every dotted name ``source`` reads (``sys.stderr.write`` gives ``sys``,
    ``sys.stderr`` and ``sys.stderr.write``), plus the names it imports."""
    found = set(imports_in(source))
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and (d := _dotted(node)):
            parts = d.split(".")
            found |= {".".join(parts[:i]) for i in range(2, len(parts) + 1)}
    return found


@functools.cache
def _all_imports() -> dict[str, frozenset[str]]:
    return {m: frozenset(imports_in(p.read_text())) for m, p in _modules().items()}


def _matches(name: str, banned: tuple[str, ...]) -> str | None:
    """The entry of ``banned`` that ``name`` is or lies under."""
    return next((b for b in banned if name == b or name.startswith(b + ".")), None)


def _violations(rooms: tuple[str, ...], banned: tuple[str, ...], *, uses: bool = False,
                exempt: Callable[[str], bool] = lambda m: False) -> set[tuple[str, str]]:
    """(module, banned name) for each module in ``rooms`` that imports (or, with ``uses``,
    reads) something under ``banned``."""
    out = set()
    for mod, path in _modules().items():
        if not mod.startswith(rooms) or exempt(mod):
            continue
        names = uses_in(path.read_text()) if uses else _all_imports()[mod]
        out |= {(mod, b) for n in names if (b := _matches(n, banned))}
    return out


# Each rule: (rooms it binds, what they must not import or read, read attributes too,
# modules exempt). Module names are prefixes: "attnprof.analyze" covers its subpackages.
RULES: dict[str, tuple[tuple[str, ...], tuple[str, ...], bool, Callable[[str], bool]]] = {
    "aggregate imports neither torch, vLLM nor transformers": (
        ("attnprof.aggregate",), _MODEL_LIBS, False, lambda m: False),
    "analyze imports neither torch, vLLM, transformers, capture, tools nor cli": (
        ("attnprof.analyze",),
        (*_MODEL_LIBS, "attnprof.capture", "attnprof.tools", "attnprof.cli"), False,
        lambda m: False),
    "analyze never touches sys.stderr or torch.profiler": (
        ("attnprof.analyze",), ("sys.stderr", "torch.profiler"), True, lambda m: False),
    "only capture, host and tools import vLLM": (
        ("attnprof",), ("vllm",), False,
        lambda m: m.startswith(("attnprof.capture", "attnprof.host", "attnprof.tools"))),
    "only exporters import export libraries (cli included)": (
        ("attnprof",), _EXPORT_LIBS, False, lambda m: m.startswith("attnprof.exporters")),
    "aggregate, analyze, contracts, facts and exporters never import capture, host, tools or "
    "cli": (
        ("attnprof.aggregate", "attnprof.analyze", "attnprof.contracts", "attnprof.facts",
         "attnprof.exporters"),
        ("attnprof.capture", "attnprof.host", "attnprof.tools", "attnprof.cli"), False,
        lambda m: False),
    # Capture measures inside the step and hands typed records on; what is made of them
    # (findings, exports, routes, RPC answers) is downstream or the host's.
    "capture imports neither analyze, exporters, the host, tools nor cli": (
        ("attnprof.capture",),
        ("attnprof.analyze", "attnprof.exporters", "attnprof.host", "attnprof.tools",
         "attnprof.cli"), False, lambda m: False),
    "aggregate imports no analyze": (
        ("attnprof.aggregate",), ("attnprof.analyze",), False, lambda m: False),
    # The plugin host wires the rooms inside a server; only its own entry points (vLLM's
    # plugin groups name them), the package's public face and the command line reach it.
    "only the host, the package's public face and cli import the host": (
        ("attnprof",), ("attnprof.host",), False,
        lambda m: m == "attnprof" or m.startswith(("attnprof.host", "attnprof.cli"))),
    "the host never imports cli": (
        ("attnprof.host",), ("attnprof.cli",), False, lambda m: False),
}


def _check(rule: str) -> None:
    rooms, banned, uses, exempt = RULES[rule]
    bad = sorted(_violations(rooms, banned, uses=uses, exempt=exempt))
    assert not bad, f"{rule}: " + "; ".join(f"{m} uses {n}" for m, n in bad)


def test_aggregate_imports_neither_torch_nor_vllm() -> None:
    _check("aggregate imports neither torch, vLLM nor transformers")


def test_analyze_imports_neither_torch_vllm_capture_nor_tools() -> None:
    _check("analyze imports neither torch, vLLM, transformers, capture, tools nor cli")


def test_analyze_never_touches_stderr_or_the_profiler() -> None:
    _check("analyze never touches sys.stderr or torch.profiler")


def test_only_capture_host_and_tools_import_vllm() -> None:
    _check("only capture, host and tools import vLLM")


def test_only_exporters_import_export_libraries() -> None:
    _check("only exporters import export libraries (cli included)")


def test_inner_rooms_never_import_capture_host_tools_or_cli() -> None:
    _check("aggregate, analyze, contracts, facts and exporters never import capture, host, "
           "tools or cli")


def test_capture_imports_neither_analyze_exporters_nor_the_host() -> None:
    _check("capture imports neither analyze, exporters, the host, tools nor cli")


def test_aggregate_imports_no_analyze() -> None:
    _check("aggregate imports no analyze")


def test_only_the_host_public_face_and_cli_import_the_host() -> None:
    _check("only the host, the package's public face and cli import the host")


def test_the_host_never_imports_cli() -> None:
    _check("the host never imports cli")


def test_no_import_cycles() -> None:
    mods = _modules()
    graph = {m: {d for d in _all_imports()[m] if d in mods} - {m} for m in mods}
    # A package importing its own submodules is not a cycle of rooms.
    graph = {m: {d for d in deps if not d.startswith(m + ".")} for m, deps in graph.items()}
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m: str) -> None:
        state[m] = 1
        stack.append(m)
        for d in sorted(graph[m]):
            if state.get(d) == 1:
                raise AssertionError("import cycle: " + " -> ".join([*stack[stack.index(d):], d]))
            if d not in state:
                visit(d)
        stack.pop()
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m)


@pytest.mark.parametrize("source", [
    "def f():\n    import torch\n",
    "class C:\n    def f(self):\n        from torch import nn\n",
    "import importlib\ndef f():\n    return importlib.import_module('torch.nn')\n",
    "from importlib import import_module\nx = import_module('torch')\n",
    "def f():\n    return __import__('torch')\n",
    "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import torch\n",
])
def test_imports_anywhere_are_collected(source: str) -> None:
    assert "torch" in {_matches(n, ("torch",)) for n in imports_in(source)}


def test_stderr_and_profiler_reads_are_collected() -> None:
    src = ("import sys\ndef f(torch):\n    print('x', file=sys.stderr)\n"
           "    with torch.profiler.profile():\n        pass\n")
    assert {"sys.stderr", "torch.profiler"} <= uses_in(src)


def test_the_module_map_is_the_tree() -> None:
    """docs/architecture.md draws every module of the tree (``make module-map``): a module
    added, moved or re-described without regenerating it fails here."""
    from tests import module_map

    assert module_map.current() == module_map.render(), "stale: run make module-map"
