"""Deploy files say what attnprof needs, and the sidecar-style injection really works."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from importlib.metadata import entry_points
from pathlib import Path
from typing import Any

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]


def _our_plugin_names() -> set[str]:
    return {ep.name for g in ("vllm.general_plugins", "vllm.stat_logger_plugins",
                              "vllm.endpoint_plugins")
            for ep in entry_points(group=g) if ep.value.startswith("attnprof.")}


def _k8s() -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all((REPO / "deploy/k8s/attnprof-vllm.yaml").read_text())
            if d]


def test_k8s_vllm_container_enables_every_plugin_and_multiproc_metrics() -> None:
    (dep,) = [d for d in _k8s() if d["kind"] == "Deployment"]
    spec = dep["spec"]["template"]["spec"]
    (vllm,) = [c for c in spec["containers"] if c["name"] == "vllm"]
    env = {e["name"]: e["value"] for e in vllm["env"]}
    assert env["ATTNPROF_ENABLED"] == "1"
    assert set(env["VLLM_PLUGINS"].split(",")) >= _our_plugin_names()
    mounts = {m["mountPath"]: m["name"] for m in vllm["volumeMounts"]}
    vols = {v["name"]: v for v in spec["volumes"]}
    # The multiprocess dir must be fresh per pod: an emptyDir mounted where the env points.
    assert "emptyDir" in vols[mounts[env["PROMETHEUS_MULTIPROC_DIR"]]]
    # The init container installs into the directory the server has on PYTHONPATH.
    (init,) = spec["initContainers"]
    target = init["command"][init["command"].index("--target") + 1]
    assert env["PYTHONPATH"] == target and target in mounts
    (svc,) = [d for d in _k8s() if d["kind"] == "Service"]
    assert svc["metadata"]["annotations"]["prometheus.io/path"] == "/metrics"


def test_compose_enables_every_plugin() -> None:
    comp = yaml.safe_load((REPO / "deploy/local/compose.yaml").read_text())
    env = comp["services"]["vllm"]["environment"]
    assert set(env["VLLM_PLUGINS"].split(",")) >= _our_plugin_names()
    assert env["ATTNPROF_ENABLED"] == "1" and env["PROMETHEUS_MULTIPROC_DIR"]


@pytest.mark.parametrize("cfg", ["deploy/local/prometheus.yml"])
def test_local_prometheus_config_is_valid(cfg: str) -> None:
    if shutil.which("promtool") is None:
        pytest.fail("promtool is not installed (make test installs it)")
    r = subprocess.run(["promtool", "check", "config", str(REPO / cfg)], capture_output=True,
                       text=True, cwd=REPO / "deploy/local")
    assert r.returncode == 0, r.stdout + r.stderr


def test_sidecar_style_install_is_discovered_through_pythonpath(tmp_path: Path) -> None:
    """What the k8s init container does: `pip install --no-deps --target DIR`, then a Python
    that only has DIR on PYTHONPATH finds vLLM's entry points and imports the plugin."""
    target = tmp_path / "attnprof"
    r = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps",
                        "--target", str(target), str(REPO)], capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert not (target / "plugin").exists() and not (target / "exporters").exists()
    probe = ("from importlib.metadata import entry_points as e; import attnprof as a;"
             "import attnprof.exporters.catalog;"
             "print(sorted(x.name for g in ('vllm.general_plugins','vllm.stat_logger_plugins',"
             "'vllm.endpoint_plugins') for x in e(group=g)), a.__file__)")
    # -S: no site-packages, so the editable install of this checkout cannot answer instead.
    env = {"PYTHONPATH": str(target), "PATH": os.environ.get("PATH", "")}
    out = subprocess.run([sys.executable, "-S", "-c", probe], capture_output=True, text=True,
                         env=env, timeout=60)
    assert out.returncode == 0, out.stderr
    names, path = out.stdout.rsplit(" ", 1)
    assert names == str(sorted(_our_plugin_names()))
    assert path.strip().startswith(str(target))
