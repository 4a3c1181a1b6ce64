"""``attnprof diff`` only compares files (issue 30, point 7): it runs no git and no subprocess,
even when an input file names a repository whose config runs code; provenance runs git only
in attnprof's own checkout; and every string from an input file reaches the terminal or the
Markdown with its control characters escaped."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from attnprof._text import inert
from attnprof.cli import main
from attnprof.contracts.provenance import GitInfo
from attnprof.exporters.diff_report import render_markdown, render_text
from attnprof.tools import provenance
from tests.unit.analyze.test_diff import _diff, _snap

_SPAWN_EVENTS = ("subprocess.Popen", "os.system", "os.posix_spawn", "os.exec", "os.spawn",
                 "os.fork", "os.forkpty")
_seen: list[str] = []
_watching: list[bool] = [False]


def _audit(event: str, _args: tuple[Any, ...]) -> None:
    if _watching[0] and event in _SPAWN_EVENTS:
        _seen.append(event)


sys.addaudithook(_audit)  # audit hooks cannot be removed: this one only counts while watched


@pytest.fixture
def spawned() -> Iterator[list[str]]:
    """Every process start (Python's audit events) while the test body runs."""
    _seen.clear()
    _watching[0] = True
    try:
        yield _seen
    finally:
        _watching[0] = False


def _git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args],
                          cwd=repo, check=True, capture_output=True, text=True).stdout.strip()


def _evil_repo(root: Path) -> tuple[Path, str, str, Path]:
    """A repository whose own config runs a script: gpg.program (called by ``git log`` on a
    signed commit when log.showSignature is set) and core.fsmonitor (``git status``). Returns
    the repo, two revisions (the second signed) and the marker file the script creates."""
    repo, marker = root / "evil", root / "MARKER"
    repo.mkdir()
    _git(repo, "init", "-q")
    _git(repo, "commit", "-q", "--allow-empty", "-m", "base")
    base, tree = _git(repo, "rev-parse", "HEAD"), _git(repo, "rev-parse", "HEAD^{tree}")
    signed = (f"tree {tree}\nparent {base}\nauthor t <t@t> 1 +0000\ncommitter t <t@t> 1 +0000\n"
              "gpgsig -----BEGIN PGP SIGNATURE-----\n \n x\n -----END PGP SIGNATURE-----\n\n"
              "signed\n")
    new = subprocess.run(["git", "hash-object", "-t", "commit", "-w", "--stdin"], cwd=repo,
                         input=signed, check=True, capture_output=True, text=True).stdout.strip()
    _git(repo, "update-ref", "HEAD", new)
    script = repo / ".git" / "evil.sh"
    script.write_text(f"#!/bin/sh\ntouch {marker}\n")
    script.chmod(0o755)
    for key, value in (("gpg.program", str(script)), ("log.showSignature", "true"),
                       ("core.fsmonitor", str(script))):
        _git(repo, "config", key, value)
    return repo, base, new, marker


def _write_snap(path: Path, revision: str, root: Path, **kw: Any) -> Path:
    snap = _snap(**kw)
    assert snap.provenance is not None
    snap.provenance.git = GitInfo(revision=revision, dirty=False, root=str(root))
    path.write_text(json.dumps(snap.to_json()))
    return path


def test_the_evil_repository_does_run_code_under_git(tmp_path: Path) -> None:
    """The control: the repository below really runs its script when git log reads it."""
    repo, base, new, marker = _evil_repo(tmp_path)
    subprocess.run(["git", "log", "--oneline", f"{base}..{new}"], cwd=repo, check=True,
                   capture_output=True)
    assert marker.exists()


def test_a_diff_of_files_naming_an_evil_repository_runs_nothing(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
        spawned: list[str]) -> None:
    _watching[0] = False  # building the repository starts git, of course
    repo, base, new, marker = _evil_repo(tmp_path)
    a = _write_snap(tmp_path / "a.json", base, repo)
    b = _write_snap(tmp_path / "b.json", new, repo, seed=1)
    monkeypatch.chdir(repo)  # the old diff also tried the current directory
    _watching[0] = True
    for fmt in ([], ["--markdown"], ["--json"]):
        rc = main(["diff", str(a), str(b), *fmt])
        assert rc in (0, 1)
    out = capsys.readouterr().out
    assert spawned == [] and not marker.exists()
    # The revisions still show (they were recorded when each file was made), with the
    # command that lists the commits, for the reader to run where they trust the checkout.
    assert base[:10] in out and new[:10] in out
    assert f"git log --oneline {base[:12]}..{new[:12]}" in out


def test_only_hex_revisions_reach_the_suggested_git_command() -> None:
    base, new = _snap(), _snap(seed=1)
    for s, rev in ((base, "a" * 40), (new, "$(touch x); b")):
        assert s.provenance is not None
        s.provenance.git = GitInfo(revision=rev, dirty=False)
    assert not any("git log" in n for n in _diff(base, new).notes)


def test_provenance_runs_git_only_in_attnprofs_own_checkout(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    repo, _, _, marker = _evil_repo(tmp_path)
    monkeypatch.chdir(repo)  # a server started from inside someone else's repository
    prov = provenance.collect("m", None, argv=["x"])
    assert not marker.exists()
    own = subprocess.run(["git", "rev-parse", "HEAD"], cwd=Path(provenance.__file__).parent,
                         capture_output=True, text=True)
    want = own.stdout.strip() if own.returncode == 0 else None
    assert (prov.git.revision if prov.git is not None else None) == want
    if prov.git is not None:  # the checkout's top level, as git itself names it
        top = subprocess.run(["git", "rev-parse", "--show-toplevel"], check=True,
                             cwd=Path(provenance.__file__).parent, capture_output=True,
                             text=True)
        assert prov.git.root == top.stdout.strip()


def test_a_git_dir_in_the_environment_points_git_nowhere_else(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """GIT_DIR (or GIT_WORK_TREE, GIT_CONFIG_*) in the server's environment would make git
    read that repository, record its revision and run its hooks, from any directory."""
    repo, _, _, marker = _evil_repo(tmp_path)
    own = subprocess.run(["git", "rev-parse", "HEAD"], cwd=Path(provenance.__file__).parent,
                         capture_output=True, text=True)
    want = own.stdout.strip() if own.returncode == 0 else None
    monkeypatch.setenv("GIT_DIR", str(repo / ".git"))
    monkeypatch.setenv("GIT_WORK_TREE", str(repo))
    git = provenance.git_info()
    assert not marker.exists()
    assert (git.revision if git is not None else None) == want


def test_installed_inside_someone_elses_repository_git_never_runs_there(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """attnprof in a virtual environment inside another project's checkout: an upward
    search from its own folder would find that project's repository and run its hooks."""
    repo, _, _, marker = _evil_repo(tmp_path)
    tools = repo / ".venv" / "lib" / "python3.11" / "site-packages" / "attnprof" / "tools"
    tools.mkdir(parents=True)
    monkeypatch.setattr(provenance, "_OWN_SOURCE", tools)
    assert provenance.git_info() is None
    assert provenance.collect("m", None, argv=["x"]).git is None
    assert not marker.exists()


_HOSTILE = "tiny\x1b[2J\x1b]0;pwned\x07\rREGRESSION: none\u202e"


def test_control_characters_from_input_files_are_printed_escaped(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    base, new = _snap(), _snap(seed=1, kernel="k2[amx]")
    for s in (base, new):
        assert s.provenance is not None
        s.provenance.command = ["vllm", "serve", _HOSTILE, "--label", "a\rb\nc"]
        s.provenance.model.name = _HOSTILE
    new.provenance.hardware.cpu = "cpu\x1b[31m"  # type: ignore[union-attr]
    rep = _diff(base, new, allow_model_change=True)
    rep.notes.append("note from a file \x1b[2J\r")
    for out in (render_text(rep), render_markdown(rep)):
        assert not any(c in out for c in "\x1b\r\x07\u202e"), repr(out)
        assert "\\x1b[2J" in out and "\\r" in out
    # A PR comment: a name from a file makes no image, link, mention or autolink.
    for s in (base, new):
        s.model = ("![x](https://evil.example/p.png) [docs](http://evil.example) @octocat "
                   "www.evil.example")
        assert s.provenance is not None  # the side line's time and revision too
        s.provenance.time_iso = "![t](https://evil.example/t.png) @octocat"
        s.provenance.git = GitInfo(revision="@octocat12", dirty=False)
    md = render_markdown(_diff(base, new, allow_model_change=True))
    assert "evil" in md and not any(x in md for x in ("](", "@octocat", "://", "www.evil"))
    # The same through the CLI, on files: nothing a file holds drives the terminal.
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    a.write_text(json.dumps(base.to_json()))
    b.write_text(json.dumps(new.to_json()))
    for fmt in ([], ["--markdown"], ["--json"]):
        main(["diff", str(a), str(b), "--allow-model-change", *fmt])
        out = capsys.readouterr()
        assert not any(c in out.out + out.err for c in "\x1b\r\x07\u202e"), repr(out)


def test_inert_escapes_every_control_and_keeps_text() -> None:
    assert inert("Qwen/Qwen3-8B -> é ✓") == "Qwen/Qwen3-8B -> é ✓"
    assert inert("\x1b[2J\r\n\t\x00\x7f\x9b\u2028\u202e") == (
        "\\x1b[2J\\r\\n\\t\\x00\\x7f\\x9b\\u2028\\u202e")


def test_a_broken_own_checkout_never_searches_above_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """attnprof's folder holds a ``.git`` git cannot use (an empty directory, a checkout
    copied without its repository): git's upward search would go on to the repository
    above and run its hooks; GIT_CEILING_DIRECTORIES stops it at attnprof's folder."""
    repo, _, _, marker = _evil_repo(tmp_path)
    own = repo / "attnprof-copy"
    (own / ".git").mkdir(parents=True)
    tools = own / "plugin" / "attnprof" / "tools"
    tools.mkdir(parents=True)
    monkeypatch.setattr(provenance, "_OWN_SOURCE", tools)
    assert provenance.git_info() is None
    assert not marker.exists()


def test_the_terminal_view_prints_names_as_they_are() -> None:
    """Markdown's escapes are the PR comment's; the terminal shows a name as it is."""
    base, new = _snap(), _snap(seed=1)
    for s in (base, new):
        s.model = "org/m@v2 <fp8> | see https://x.example"
    text = render_text(_diff(base, new))
    assert "(org/m@v2 <fp8> | see https://x.example" in text, text
    assert not any(x in text for x in ("&#", "&lt;", "\\|"))
    assert "org/m&#64;v2 &lt;fp8> \\| see https&#58;//x.example" in render_markdown(
        _diff(base, new))
