"""`attnprof container-start`: a container restarted in place (same multiprocess directory,
same pid) leaves no dead process's series on /metrics, and the wipe refuses every directory
that is not prometheus_client's alone.

The restart is real: each "container start" runs in a new pid namespace (``unshare``), so
the main process is pid 1 both times, as in a container restarted inside its pod; metrics
are written through attnprof's PrometheusSink and read by prometheus_client's
MultiProcessCollector, as vLLM's /metrics reads them. The wrapper is the one the Kubernetes
manifest runs, taken from the manifest."""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from attnprof.tools.container_start import WipeError, wipe_multiproc_dir
from tests.conftest import metric_value

REPO = Path(__file__).resolve().parents[3]
K8S_MANIFEST = REPO / "deploy/k8s/attnprof-vllm.yaml"

# The server stand-in: what attnprof's export loop writes in vLLM's API-server process, then a
# scrape of the directory the way vLLM's /metrics does it, then death without atexit (as a
# crash, an OOM kill or a liveness kill ends it). Before the crash the server ran with an old
# attention backend and an in-process engine core (a second role); after the restart it runs
# a new backend and no engine core. Both starts count the same 3 internal errors.
SERVER = r'''
import json, os, sys
from prometheus_client import CollectorRegistry, generate_latest, multiprocess
from attnprof.exporters.prometheus import PrometheusSink
from attnprof.exporters import catalog as cat
from attnprof.exporters.samples import error_samples, s

first = sys.argv[1] == "first"
roles = ["api_server", "engine_core"] if first else ["api_server"]
backend = "OLD_BACKEND" if first else "NEW_BACKEND"
PrometheusSink().export(
    error_samples("m", {"capture": 3}, {}, roles, ["capture"] if first else [], ["capture"])
    + [s(cat.LAYER_INFO, 1, model="m", layer="0", backend=backend, impl="X",
         fused="true")])
reg = CollectorRegistry()
multiprocess.MultiProcessCollector(reg)
print(json.dumps({"pid": os.getpid(), "metrics": generate_latest(reg).decode()}), flush=True)
os._exit(0)
'''


@functools.cache
def _new_pid_namespace() -> tuple[str, ...] | None:
    """An ``unshare`` prefix that runs a command as pid 1 of a new pid namespace (with its
    own /proc, as a container has), or None where this machine allows none."""
    for prefix in (("unshare", "--pid", "--fork", "--mount-proc"),
                   ("unshare", "--user", "--map-root-user", "--pid", "--fork", "--mount-proc")):
        try:
            r = subprocess.run([*prefix, sys.executable, "-c", "import os; print(os.getpid())"],
                               capture_output=True, text=True, timeout=30)
        except (OSError, subprocess.TimeoutExpired):
            continue
        if r.returncode == 0 and r.stdout.strip() == "1":
            return prefix
    return None


def _manifest_wrapper() -> list[str]:
    """The vLLM container's command in the Kubernetes manifest up to the server it execs
    (``vllm serve``, which the test replaces by SERVER), with this Python for ``python3``."""
    docs = [d for d in yaml.safe_load_all(K8S_MANIFEST.read_text()) if d]
    (dep,) = [d for d in docs if d["kind"] == "Deployment"]
    (vllm,) = [c for c in dep["spec"]["template"]["spec"]["containers"] if c["name"] == "vllm"]
    cmd = vllm.get("command", [])
    assert "container-start" in cmd and "--" in cmd, \
        f"the vLLM container does not start through `attnprof container-start`: {cmd}"
    wrapper = cmd[:cmd.index("--") + 1]
    assert cmd[len(wrapper):] == ["vllm", "serve"], cmd
    return [sys.executable if a == "python3" else a for a in wrapper]


def _env(mp_dir: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ATTNPROF_", "PROMETHEUS_"))}
    env["PROMETHEUS_MULTIPROC_DIR"] = str(mp_dir)
    # container-start also sweeps attnprof's leftovers from the temporary directory: the
    # test's own, never the machine's (tests/unit/tools/test_private_files.py covers it).
    tmp = mp_dir.parent / "tmpdir"
    tmp.mkdir(exist_ok=True)
    env["TMPDIR"] = str(tmp)
    return env


def _start_container(mp_dir: Path, phase: str, wrapper: list[str]) -> dict[str, Any]:
    ns = _new_pid_namespace()
    if ns is None:
        pytest.skip("no pid namespace available here (unshare --pid refused, also with "
                    "--user --map-root-user): cannot reuse a pid")
    r = subprocess.run([*ns, *wrapper, sys.executable, "-c", SERVER, phase], env=_env(mp_dir),
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr[-3000:]
    out: dict[str, Any] = json.loads(r.stdout.strip().splitlines()[-1])
    out["stderr"] = r.stderr
    return out


def _restart_in_place(tmp_path: Path, wrapper: list[str]) -> tuple[dict[str, Any],
                                                                     dict[str, Any]]:
    mp_dir = tmp_path / "prometheus-multiproc"   # the emptyDir: survives the restart
    mp_dir.mkdir()
    first = _start_container(mp_dir, "first", wrapper)
    second = _start_container(mp_dir, "second", wrapper)
    # The premise: the restarted main process got the dead one's pid, so it reopens its files.
    assert first["pid"] == second["pid"] == 1
    return first, second


@pytest.mark.slow
def test_without_the_wipe_a_restart_in_place_keeps_dead_series_and_doubles_counters(
        tmp_path: Path) -> None:
    """The flaw the entrypoint exists for (the manifest's old command: the server directly)."""
    _, second = _restart_in_place(tmp_path, [])
    m = second["metrics"]
    assert 'backend="OLD_BACKEND"' in m
    assert metric_value(m, "attnprof_plugin_processes", role="engine_core") == 1
    assert metric_value(m, "attnprof_internal_errors_total", model="m", place="capture") == 6


@pytest.mark.slow
def test_restart_in_place_through_the_manifest_entrypoint_leaves_no_stale_series(
        tmp_path: Path) -> None:
    first, second = _restart_in_place(tmp_path, _manifest_wrapper())
    assert 'backend="OLD_BACKEND"' in first["metrics"]   # the first start did write them
    m = second["metrics"]
    # The dead process's gauges are gone: its backend, its role, its tripped breaker.
    assert "OLD_BACKEND" not in m and 'backend="NEW_BACKEND"' in m
    assert metric_value(m, "attnprof_plugin_processes", role="engine_core") is None
    assert metric_value(m, "attnprof_plugin_processes", role="api_server") == 1
    assert metric_value(m, "attnprof_capture_disabled", model="m", place="capture") == 0
    # Counters start again from this process's own count, not the dead one's total plus it.
    assert metric_value(m, "attnprof_internal_errors_total", model="m", place="capture") == 3
    assert "removed" in second["stderr"] and "removed" not in first["stderr"]


# --- the wipe itself ---------------------------------------------------------------------------

_WRITE_EVERY_KIND = r'''
from prometheus_client import Counter, Gauge, Histogram, Summary
Counter("c", "c").inc()
Histogram("h", "h").observe(1)
Summary("s", "s").observe(1)
for mode in Gauge._MULTIPROC_MODES:
    Gauge("g_" + mode, "g", multiprocess_mode=mode).set(1)
'''


def test_wipe_removes_every_file_prometheus_client_writes_and_keeps_the_directory(
        tmp_path: Path) -> None:
    mp_dir = tmp_path / "mp"
    mp_dir.mkdir()
    r = subprocess.run([sys.executable, "-c", _WRITE_EVERY_KIND], env=_env(mp_dir),
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    written = sorted(p.name for p in mp_dir.iterdir())
    assert len(written) >= 4 and any(n.startswith("gauge_livesum_") for n in written)
    assert wipe_multiproc_dir(str(mp_dir)) == written
    assert mp_dir.is_dir() and not list(mp_dir.iterdir())   # a mount point: kept, emptied
    assert wipe_multiproc_dir(str(mp_dir)) == []             # an empty one is fine


def _dir_with(tmp_path: Path, *extra: str) -> Path:
    d = tmp_path / "mp"
    d.mkdir()
    (d / "counter_7.db").write_bytes(b"x")
    (d / "gauge_livesum_1.db").write_bytes(b"x")
    outside = tmp_path / "precious.txt"
    outside.write_text("keep")
    for name in extra:
        if name == "notes.txt" or name == ".keep":
            (d / name).write_text("not a metric")
        elif name == "dir:gauge_livemax_3.db":
            (d / "gauge_livemax_3.db").mkdir()
        elif name == "link:counter_9.db":
            (d / "counter_9.db").symlink_to(outside)
    return d


def _snapshot(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): ("dir" if p.is_dir() and not p.is_symlink()
                                       else os.readlink(p) if p.is_symlink()
                                       else p.read_text(errors="replace"))
            for p in sorted(root.rglob("*"))}


@pytest.mark.parametrize(("case", "message"), [
    ("root", "root directory"),
    ("link-to-root", "root directory"),
    ("unset", "not set"),
    ("missing", "does not exist"),
    ("file", "not a directory"),
    ("notes.txt", "'notes.txt'"),
    (".keep", "'.keep'"),
    ("dir:gauge_livemax_3.db", "'gauge_livemax_3.db'"),
    ("link:counter_9.db", "'counter_9.db'"),
])
def test_wipe_refuses_what_is_not_a_multiprocess_directory_and_removes_nothing(
        tmp_path: Path, case: str, message: str) -> None:
    d = _dir_with(tmp_path, case)
    path = {"root": "/", "unset": "", "missing": str(tmp_path / "nowhere"),
            "file": str(d / "counter_7.db")}.get(case, str(d))
    if case == "link-to-root":
        (tmp_path / "to-root").symlink_to("/")
        path = str(tmp_path / "to-root")
    before = _snapshot(tmp_path)
    with pytest.raises(WipeError, match=message) as err:
        wipe_multiproc_dir(path)
    assert "\n" not in str(err.value)
    assert _snapshot(tmp_path) == before


# --- the command line --------------------------------------------------------------------------

def _cli(env: dict[str, str], *argv: str) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-m", "attnprof.cli", "container-start", *argv],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


@pytest.mark.slow
def test_cli_execs_the_command_in_its_own_place_after_emptying(tmp_path: Path) -> None:
    d = _dir_with(tmp_path)
    show = ("import os, sys; print(os.getpid(), sorted(os.listdir("
            "os.environ['PROMETHEUS_MULTIPROC_DIR']))); sys.exit(3)")
    p = _cli(_env(d), "--", sys.executable, "-c", show)
    out, err = p.communicate(timeout=60)
    # exec, not a child: same pid (signals reach the server directly), its exit status.
    assert out.split() == [str(p.pid), "[]"] and p.returncode == 3, err
    assert err.count("\n") == 1 and "removed 2 multiprocess metric file(s)" in err


@pytest.mark.slow
@pytest.mark.parametrize("case", ["root", "unset", "stranger", "no-command", "bad-command"])
def test_cli_refusals_are_one_line_exit_2_and_run_and_remove_nothing(tmp_path: Path,
                                                                      case: str) -> None:
    d = _dir_with(tmp_path, "notes.txt" if case == "stranger" else "")
    marker = tmp_path / "ran"
    env = _env(d)
    if case == "root":
        env["PROMETHEUS_MULTIPROC_DIR"] = "/"
    elif case == "unset":
        del env["PROMETHEUS_MULTIPROC_DIR"]
    command = [sys.executable, "-c", f"open({str(marker)!r}, 'w')"]
    if case == "no-command":
        command = []
    elif case == "bad-command":
        command = [str(tmp_path / "no-such-server"), "--model", "m"]
    before = _snapshot(tmp_path)
    p = _cli(env, "--", *command)
    out, err = p.communicate(timeout=60)
    assert p.returncode == 2 and out == "", (out, err)
    assert err.startswith("attnprof: error: ") and err.count("\n") == 1, err
    assert not marker.exists() and _snapshot(tmp_path) == before
