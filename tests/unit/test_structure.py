"""The rooms' rules, checked on the source: capture -> aggregate -> analyze -> export."""

from __future__ import annotations

import ast
from pathlib import Path

from tests.conftest import REPO

_ROOTS = {REPO / "plugin" / "attnprof": "attnprof",
          REPO / "exporters" / "attnprof" / "exporters": "attnprof.exporters"}


def _modules() -> dict[str, Path]:
    out = {}
    for root, prefix in _ROOTS.items():
        for p in root.rglob("*.py"):
            parts = list(p.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join([prefix, *parts])] = p
    return out


def _imports(path: Path, top_level_only: bool = False) -> set[str]:
    tree = ast.parse(path.read_text())
    nodes = tree.body if top_level_only else list(ast.walk(tree))
    found: set[str] = set()
    for node in nodes:
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
            found |= {f"{node.module}.{a.name}" for a in node.names}
    return found


def _internal(mod_imports: set[str], mods: dict[str, Path]) -> set[str]:
    return {m for m in mod_imports if m in mods}


def test_no_import_cycles() -> None:
    mods = _modules()
    graph = {m: _internal(_imports(p), mods) - {m} for m, p in mods.items()}
    # A package importing its own submodules is not a cycle of rooms.
    graph = {m: {d for d in deps if not d.startswith(m + ".")} for m, deps in graph.items()}
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m: str) -> None:
        state[m] = 1
        stack.append(m)
        for d in graph[m]:
            if state.get(d) == 1:
                raise AssertionError("import cycle: " + " -> ".join([*stack[stack.index(d):], d]))
            if d not in state:
                visit(d)
        stack.pop()
        state[m] = 2

    for m in graph:
        if m not in state:
            visit(m)


def test_only_exporters_import_export_libraries() -> None:
    for mod, path in _modules().items():
        if mod.startswith("attnprof.exporters"):
            continue
        bad = {m for m in _imports(path) if m.split(".")[0] in (
            "prometheus_client", "opentelemetry", "tensorboard", "matplotlib")}
        assert not bad, f"{mod} imports {sorted(bad)}: that belongs in exporters/"


def test_aggregate_imports_neither_torch_nor_vllm() -> None:
    for mod, path in _modules().items():
        if mod.startswith("attnprof.aggregate"):
            bad = {m for m in _imports(path, top_level_only=True)
                   if m.split(".")[0] in ("torch", "vllm", "transformers")}
            assert not bad, f"{mod} imports {sorted(bad)} at module level"


def test_analyze_and_aggregate_never_import_capture_or_tools() -> None:
    for mod, path in _modules().items():
        if mod.startswith(("attnprof.analyze", "attnprof.aggregate", "attnprof.contracts",
                           "attnprof.facts", "attnprof.exporters")):
            bad = {m for m in _imports(path) if m.startswith(("attnprof.capture",
                                                               "attnprof.tools",
                                                               "attnprof.cli"))}
            assert not bad, f"{mod} imports {sorted(bad)}"
