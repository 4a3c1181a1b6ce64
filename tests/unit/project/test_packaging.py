"""``import attnprof`` is the public face, from an editable install and from a built wheel in
a clean venv; every subpackage ships; no module loads twice under two names."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from tests.conftest import REPO, run_py

_PUBLIC = ("import attnprof, sys; "
           "assert callable(attnprof.profile) and callable(attnprof.instrument); "
           "assert attnprof.__version__ and attnprof.__version__ != '0.0.0+unknown'; "
           "import attnprof.exporters.catalog, attnprof.capture.vllm, attnprof.host.vllm; "
           "import attnprof.cli; "
           "assert 'torch' not in sys.modules, 'import attnprof must not import torch'; "
           "print(attnprof.__file__)")


def _packages_in_tree() -> set[str]:
    out = set()
    for root, prefix in ((REPO / "plugin" / "attnprof", "attnprof"),
                         (REPO / "exporters" / "attnprof" / "exporters", "attnprof.exporters")):
        for init in root.rglob("__init__.py"):
            rel = init.parent.relative_to(root).parts
            out.add(".".join((prefix, *rel)))
    return out


def test_every_subpackage_is_listed_for_the_wheel() -> None:
    cfg = tomllib.loads((REPO / "pyproject.toml").read_text())
    listed = set(cfg["tool"]["setuptools"]["packages"])
    assert listed == _packages_in_tree()


def test_face_signatures_are_the_capture_ones() -> None:
    """attnprof.instrument/profile spell out capture.transformers' arguments (so that
    ``import attnprof`` loads no capture code): names, kinds and defaults must agree."""
    import inspect

    import attnprof
    from attnprof.capture import transformers as tr

    for name in ("instrument", "profile"):
        face = inspect.signature(getattr(attnprof, name)).parameters
        impl = inspect.signature(getattr(tr, name)).parameters
        assert [(p.name, p.kind, p.default) for p in face.values()] == \
            [(p.name, p.kind, p.default) for p in impl.values()], name


def test_no_alias_package() -> None:
    r = run_py("import attnprof.plugin")
    assert r.returncode != 0 and "No module named 'attnprof.plugin'" in r.stderr


@pytest.mark.slow
def test_public_api_from_editable_install() -> None:
    r = run_py(_PUBLIC)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip().startswith(str(REPO / "plugin" / "attnprof"))


@pytest.mark.slow
def test_no_module_is_imported_twice_under_two_names(tmp_path: Path) -> None:
    code = ("import sys, attnprof, attnprof.exporters.hub, "
            "attnprof.capture.vllm.hooks, attnprof.cli; import importlib.util as u; "
            "files = {}; "
            "[files.setdefault(getattr(m, '__file__', None), []).append(n) "
            " for n, m in list(sys.modules.items()) if n.split('.')[0] in "
            " ('attnprof', 'plugin', 'exporters')]; "
            "dup = {f: ns for f, ns in files.items() if f and len(ns) > 1}; "
            "assert not dup, dup; "
            "assert not any(n.split('.')[0] in ('plugin', 'exporters') for n in sys.modules)")
    r = run_py(code)
    assert r.returncode == 0, r.stderr
    for top in ("plugin", "exporters"):  # nothing installs these names (cwd: not the repo)
        r = subprocess.run([sys.executable, "-c", f"import {top}"], cwd=tmp_path,
                           capture_output=True, text=True, timeout=60)
        assert r.returncode != 0, f"an installed top-level module {top!r} is importable"


@pytest.mark.slow
def test_public_api_from_wheel_in_clean_venv(tmp_path: Path) -> None:
    dist = tmp_path / "dist"
    # No build isolation: nothing downloads; the venv's setuptools (>= 77) builds it.
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps",
                        "--no-build-isolation", "-q", "-w", str(dist), str(REPO)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    (wheel,) = dist.glob("attnprof-*.whl")
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True,
                   timeout=120)
    py = venv / "bin" / "python"
    r = subprocess.run([sys.executable, "-m", "pip", "--python", str(py), "install", "-q",
                        "--no-deps", "--no-index", str(wheel)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    r = subprocess.run([str(py), "-c", _PUBLIC], capture_output=True, text=True, timeout=120,
                       cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert str(venv) in r.stdout
    r = subprocess.run([str(py), "-c", "import importlib.resources as r; "
                        "print(r.files('attnprof.analyze').joinpath('data/compat_matrix.json')"
                        ".is_file(), r.files('attnprof').joinpath('py.typed').is_file(), "
                        "r.files('attnprof.contracts').joinpath('data/vllm_serve_options.json')"
                        ".is_file())"],
                       capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert r.stdout.split() == ["True", "True", "True"], r.stderr
