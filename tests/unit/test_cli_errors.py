"""Every user-caused CLI error is one line on stderr and exit code 2."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import free_port


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
