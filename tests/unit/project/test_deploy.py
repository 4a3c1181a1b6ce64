"""Deploy files say what attnprof needs, fit a hardened cluster, and the sidecar-style,
hash-pinned injection really works.

The manifests are checked against the real Kubernetes schemas (kubernetes_validate, strict) and
compose.yaml against the Compose specification's schema (vendored in check_jsonschema); the
hardening properties are checked by ``_check_*`` functions that take the parsed documents, and
``test_checks_reject_unhardened_variants`` shows each of them failing on a weakened copy."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tomllib
from collections.abc import Callable, Iterator
from importlib.metadata import entry_points
from pathlib import Path
from typing import Any

import check_jsonschema  # type: ignore[import-untyped]
import jsonschema
import kubernetes_validate  # type: ignore[import-untyped]
import pytest
import yaml
from kubernetes_validate.utils import all_versions  # type: ignore[import-untyped]

REPO = Path(__file__).resolve().parents[3]
K8S_DIR = REPO / "deploy/k8s"
COMPOSE = REPO / "deploy/local/compose.yaml"
PROMETHEUS_COMPOSE = REPO / "deploy/local/prometheus-compose.yml"
LOCAL_REQUIREMENTS = REPO / "deploy/local/attnprof-requirements.txt"
DEPLOY_README = REPO / "deploy/README.md"
# A Kubernetes version kubernetes_validate ships (the oldest the pyproject floor, >=1.30, has).
K8S_VERSION = "1.30.0"
# The placeholders deploy/README.md documents; everything else must be a real 64-hex pin.
DIGEST_VARS = ("VLLM_IMAGE_DIGEST", "PROMETHEUS_IMAGE_DIGEST")
WHEEL_HASH_VAR = "ATTNPROF_WHEEL_SHA256"
_HEX64 = "[0-9a-f]{64}"
_PLACEHOLDER = r"\$\{(?P<var>[A-Z0-9_]+)(?::\?[^}]*)?\}"   # ${VAR} or Compose's ${VAR:?message}
_IMAGE = re.compile(rf"^[a-z0-9][a-z0-9._/-]*(?::[\w.-]+)?@sha256:(?:{_HEX64}|{_PLACEHOLDER})$")
_REQUIREMENT = re.compile(
    rf"^attnprof==(?P<version>[^\s\\]+)\s*\\?\s*--hash=sha256:(?:{_HEX64}|{_PLACEHOLDER})\s*$",
    re.M)

Doc = dict[str, Any]


def _our_plugin_names() -> set[str]:
    return {ep.name for g in ("vllm.general_plugins", "vllm.stat_logger_plugins",
                              "vllm.endpoint_plugins")
            for ep in entry_points(group=g) if ep.value.startswith("attnprof.")}


def _k8s() -> list[Doc]:
    return [d for f in sorted(K8S_DIR.glob("*.yaml"))
            for d in yaml.safe_load_all(f.read_text()) if d]


def _compose() -> Doc:
    doc: Doc = yaml.safe_load(COMPOSE.read_text())
    return doc


def _pod_specs(docs: list[Doc]) -> Iterator[tuple[Doc, Doc]]:
    """(pod template, workload) of every workload in the manifests."""
    for d in docs:
        if d["kind"] in ("Deployment", "StatefulSet", "DaemonSet", "Job"):
            yield d["spec"]["template"], d
        elif d["kind"] == "Pod":
            yield d, d


def _containers(pod: Doc) -> list[Doc]:
    return [*pod["spec"].get("initContainers", []), *pod["spec"]["containers"]]


def _vllm(docs: list[Doc]) -> tuple[Doc, Doc]:
    (dep,) = [d for d in docs if d["kind"] == "Deployment"]
    spec = dep["spec"]["template"]["spec"]
    (vllm,) = [c for c in spec["containers"] if c["name"] == "vllm"]
    return spec, vllm


def _env(container: Doc) -> dict[str, Doc]:
    return {e["name"]: e for e in container.get("env", [])}


def _compose_env(service: Doc) -> dict[str, str]:
    env = service.get("environment", {})
    if isinstance(env, list):
        env = dict(e.split("=", 1) if "=" in e else (e, "") for e in env)
    return {k: str(v) for k, v in env.items()}


def _images(docs: list[Doc], compose: Doc) -> list[str]:
    imgs = [c["image"] for pod, _ in _pod_specs(docs) for c in _containers(pod)]
    return imgs + [s["image"] for s in compose["services"].values()]


# --- the checks (each takes parsed documents, so it can be pointed at weakened copies) --------

def _check_k8s_schemas(docs: list[Doc]) -> None:
    assert K8S_VERSION in all_versions(), f"kubernetes_validate no longer ships {K8S_VERSION}"
    assert {"Deployment", "Service", "NetworkPolicy"} <= {d["kind"] for d in docs}
    for d in docs:
        kubernetes_validate.validate(d, K8S_VERSION, strict=True)


def _check_k8s_security_context(docs: list[Doc]) -> None:
    pods = list(_pod_specs(docs))
    assert pods
    for pod, _ in pods:
        spec = pod["spec"]
        psc = spec.get("securityContext", {})
        assert spec.get("automountServiceAccountToken") is False
        assert not any(spec.get(k) for k in ("hostNetwork", "hostPID", "hostIPC"))
        for c in _containers(pod):
            sc = c.get("securityContext", {})
            eff = {**psc, **sc}
            where = c["name"]
            assert eff.get("runAsNonRoot") is True, where
            assert eff.get("runAsUser", 1) != 0, where
            assert sc.get("readOnlyRootFilesystem") is True, where
            assert sc.get("allowPrivilegeEscalation") is False, where
            assert sc.get("privileged") is not True, where
            assert "ALL" in sc.get("capabilities", {}).get("drop", []), where
            assert not sc.get("capabilities", {}).get("add"), where
            assert eff.get("seccompProfile", {}).get("type") == "RuntimeDefault", where


def _check_k8s_writable_paths(docs: list[Doc]) -> None:
    """With a read-only root, every path a container writes is an emptyDir: /tmp, and every
    cache/home directory its env points at."""
    dir_vars = {"HOME", "XDG_CACHE_HOME", "HF_HOME", "VLLM_CACHE_ROOT", "VLLM_CONFIG_ROOT",
                "TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR", "NUMBA_CACHE_DIR",
                "PROMETHEUS_MULTIPROC_DIR"}
    for pod, _ in _pod_specs(docs):
        vols = {v["name"]: v for v in pod["spec"].get("volumes", [])}
        for c in _containers(pod):
            writable = [m["mountPath"] for m in c.get("volumeMounts", [])
                        if not m.get("readOnly") and "emptyDir" in vols[m["name"]]]
            assert "/tmp" in writable, c["name"]
            for name, e in _env(c).items():
                if name in dir_vars:
                    path = e["value"]
                    assert any(path == w or path.startswith(w + "/") for w in writable), \
                        f"{c['name']}: {name}={path} is not on a writable emptyDir"
        (vllm,) = [c for c in pod["spec"]["containers"] if c["name"] == "vllm"]
        assert {"HOME", "XDG_CACHE_HOME", "HF_HOME", "VLLM_CACHE_ROOT"} <= set(_env(vllm))
        shm = [m for m in vllm["volumeMounts"] if m["mountPath"] == "/dev/shm"]
        assert shm and vols[shm[0]["name"]]["emptyDir"].get("medium") == "Memory"


def _check_k8s_resources(docs: list[Doc]) -> None:
    for pod, _ in _pod_specs(docs):
        for c in _containers(pod):
            res = c.get("resources", {})
            for kind in ("requests", "limits"):
                assert {"cpu", "memory"} <= set(res.get(kind, {})), f"{c['name']} {kind}"
        _, vllm = _vllm(docs)
        gpu_limit = vllm["resources"]["limits"].get("nvidia.com/gpu")
        assert gpu_limit is not None and int(gpu_limit) >= 1
        assert vllm["resources"]["requests"].get("nvidia.com/gpu", gpu_limit) == gpu_limit


def _check_digest_pins(docs: list[Doc], compose: Doc, readme: str) -> None:
    images = _images(docs, compose)
    assert images
    for img in images:
        m = _IMAGE.match(img)
        assert m, f"{img} is not pinned as name[:tag]@sha256:<64 hex> or a documented placeholder"
        if m["var"]:
            assert m["var"] in DIGEST_VARS, img
            assert m["var"] in readme, f"deploy/README.md does not say how to fill {m['var']}"


def _check_requirement(text: str, readme: str) -> None:
    version = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
    found = list(_REQUIREMENT.finditer(text))
    assert len(found) == 1, f"not one `attnprof==X --hash=sha256:...` requirement in:\n{text}"
    m = found[0]
    assert m["version"] == version
    if m["var"]:
        assert m["var"] == WHEEL_HASH_VAR and WHEEL_HASH_VAR in readme


def _check_k8s_attnprof_pin(docs: list[Doc], readme: str) -> None:
    spec, _ = _vllm(docs)
    (init,) = spec["initContainers"]
    cmd = init["command"]
    assert "--require-hashes" in cmd and "--no-deps" in cmd
    req = cmd[cmd.index("-r") + 1]
    (mount,) = [m for m in init["volumeMounts"] if req.startswith(m["mountPath"] + "/")]
    (vol,) = [v for v in spec["volumes"] if v["name"] == mount["name"]]
    (cm,) = [d for d in docs if d["kind"] == "ConfigMap"
             and d["metadata"]["name"] == vol["configMap"]["name"]]
    _check_requirement(cm["data"][req.rsplit("/", 1)[1]], readme)


def _check_k8s_network_policy(docs: list[Doc]) -> None:
    _, vllm = _vllm(docs)
    (dep,) = [d for d in docs if d["kind"] == "Deployment"]
    labels = dep["spec"]["template"]["metadata"]["labels"]
    ports = {p["containerPort"] for p in vllm["ports"]} | {p["name"] for p in vllm["ports"]}
    pols = [d for d in docs if d["kind"] == "NetworkPolicy"
            and d["spec"]["podSelector"].get("matchLabels")
            and d["spec"]["podSelector"]["matchLabels"].items() <= labels.items()]
    assert pols, "no NetworkPolicy selects the vLLM pod"
    for pol in pols:
        assert "Ingress" in pol["spec"]["policyTypes"]
        rules = pol["spec"].get("ingress", [])
        for rule in rules:
            # No rule open to everyone, to whole namespaces or address blocks, or to every port.
            assert rule.get("from") and rule.get("ports"), rule
            assert {p["port"] for p in rule["ports"]} <= ports, rule
            for peer in rule["from"]:
                assert "ipBlock" not in peer and peer.get("podSelector", {}).get("matchLabels"), \
                    peer
        peers = [p for r in rules for p in r["from"]]
        # Prometheus: pods in its namespace (one peer: namespace AND pod selector) ...
        assert any(p.get("namespaceSelector", {}).get("matchLabels")
                   and "prometheus" in str(p["podSelector"]["matchLabels"]) for p in peers)
        # ... and the API clients you label.
        assert any("prometheus" not in str(p["podSelector"]["matchLabels"]) for p in peers)


def _check_k8s_api_key(docs: list[Doc]) -> None:
    _, vllm = _vllm(docs)
    env = _env(vllm)
    refs = []
    for name in ("VLLM_API_KEY", "ATTNPROF_API_KEY"):
        assert "value" not in env[name], f"{name} is a literal"
        refs.append(env[name]["valueFrom"]["secretKeyRef"])
    # ATTNPROF_API_KEY alone opens /attnprof/*: it must be a monitoring key of its own, in
    # another Secret, or every tenant's inference key reads every tenant's lengths.
    assert refs[0]["name"] != refs[1]["name"], \
        "ATTNPROF_API_KEY must come from a monitoring Secret, not the inference key's"
    args = vllm.get("args", []) + vllm.get("command", [])
    assert "--api-key" not in args or args[args.index("--api-key") + 1].startswith("$(")
    # No key is committed: no Secret carries data in the manifests.
    assert not [d for d in docs if d["kind"] == "Secret" and (d.get("data") or
                                                                d.get("stringData"))]


# What every container start runs first: this, then the server in its place (exec).
_CONTAINER_START = ["python3", "-m", "attnprof.cli", "container-start", "--"]


def _check_k8s_multiproc_wiped_at_start(docs: list[Doc]) -> None:
    """The multiprocess emptyDir outlives a container restart in the pod, so the vLLM
    container's own command (it runs at every start; an init container runs once per pod)
    empties it through `attnprof container-start` before execing the server
    (tests/unit/tools/test_container_start.py restarts that command in place)."""
    spec, vllm = _vllm(docs)
    cmd = vllm.get("command", [])
    assert cmd[:len(_CONTAINER_START)] == _CONTAINER_START, \
        f"the vLLM container does not start through attnprof container-start: {cmd}"
    assert cmd[len(_CONTAINER_START):] == ["vllm", "serve"], cmd  # the image's entrypoint
    assert not any("container-start" in c.get("command", [])
                   for c in spec.get("initContainers", []))
    mp = _env(vllm)["PROMETHEUS_MULTIPROC_DIR"]["value"]
    (mount,) = [m for m in vllm["volumeMounts"] if m["mountPath"] == mp]
    assert not mount.get("readOnly")


def _check_compose_multiproc_wiped_at_start(compose: Doc) -> None:
    """compose.yaml's multiprocess dir is a tmpfs (fresh at each container start), and the
    server is exec'd through `attnprof container-start` all the same."""
    vllm = compose["services"]["vllm"]
    cmd = " ".join(vllm["command"]) if isinstance(vllm["command"], list) else vllm["command"]
    wrapper = " ".join(_CONTAINER_START)
    assert re.search(rf"&& exec {re.escape(wrapper)} python3 -m vllm\.", cmd), cmd
    assert cmd.count(" exec ") == 1
    mp = _compose_env(vllm)["PROMETHEUS_MULTIPROC_DIR"]
    tmpfs = vllm.get("tmpfs", [])
    assert mp in [t.split(":")[0] for t in ([tmpfs] if isinstance(tmpfs, str) else tmpfs)]


def _compose_schema() -> Doc:
    path = Path(check_jsonschema.__file__).parent / "builtin_schemas/vendor/compose-spec.json"
    schema: Doc = json.loads(path.read_text())
    return schema


def _check_compose_schema(compose: Doc) -> None:
    schema = _compose_schema()
    cls = jsonschema.validators.validator_for(schema)
    cls.check_schema(schema)
    cls(schema).validate(compose)


def _check_compose_loopback_ports(compose: Doc) -> None:
    published = 0
    for name, svc in compose["services"].items():
        assert svc.get("network_mode") != "host", name
        for p in svc.get("ports", []):
            published += 1
            if isinstance(p, dict):
                assert p.get("host_ip") == "127.0.0.1", f"{name}: {p}"
            else:
                assert str(p).startswith("127.0.0.1:"), f"{name}: {p} binds every interface"
    assert published


def _check_compose_hardening(compose: Doc) -> None:
    for name, svc in compose["services"].items():
        assert svc.get("read_only") is True, name
        assert "ALL" in svc.get("cap_drop", []) and not svc.get("cap_add"), name
        assert any(o in ("no-new-privileges", "no-new-privileges:true")
                   for o in svc.get("security_opt", [])), name
        assert not svc.get("privileged"), name
        user = str(svc.get("user", "root")).split(":")[0]
        assert user not in ("", "0", "root"), f"{name} runs as root"
        tmpfs = svc.get("tmpfs", [])
        tmpfs = [tmpfs] if isinstance(tmpfs, str) else tmpfs
        assert any(t.split(":")[0] == "/tmp" for t in tmpfs), f"{name}: no tmpfs /tmp"
        assert svc.get("deploy", {}).get("resources", {}).get("limits", {}).get("memory"), name
    gpus = compose["services"]["vllm"]["deploy"]["resources"]["reservations"]["devices"]
    assert any("gpu" in d.get("capabilities", []) for d in gpus)


def _secret_path(compose: Doc, service: str, path: str) -> str:
    """The top-level secret mounted at `path` in `service`; its file must be a required
    (${VAR:?...}) variable, so Compose refuses to start without it."""
    m = re.fullmatch(r"/run/secrets/([\w.-]+)", path)
    assert m, f"{path} is not a Compose secret"
    mounted = [s if isinstance(s, str) else s["source"]
               for s in compose["services"][service].get("secrets", [])]
    assert m[1] in mounted, f"{service} does not mount secret {m[1]}"
    src = compose["secrets"][m[1]]["file"]
    assert re.fullmatch(r"\$\{[A-Z0-9_]+:\?[^}]*\}", src), f"secret {m[1]} has a default: {src}"
    return m[1]


def _check_compose_credentials(compose: Doc) -> None:
    env = _compose_env(compose["services"]["grafana"])
    assert "GF_SECURITY_ADMIN_PASSWORD" not in env, "a literal (default) Grafana password"
    _secret_path(compose, "grafana", env["GF_SECURITY_ADMIN_PASSWORD__FILE"])
    assert env.get("GF_AUTH_ANONYMOUS_ENABLED") == "false"
    # vLLM (and attnprof) take the API key from the secret that Prometheus scrapes with.
    vllm = compose["services"]["vllm"]
    cmd = " ".join(vllm["command"]) if isinstance(vllm["command"], list) else vllm["command"]
    assert not {"VLLM_API_KEY", "ATTNPROF_API_KEY"} & set(_compose_env(vllm))
    key = re.search(r'VLLM_API_KEY="\$\$\(cat (/run/secrets/[\w.-]+)\)"', cmd)
    mon = re.search(r'ATTNPROF_API_KEY="\$\$\(cat (/run/secrets/[\w.-]+)\)"', cmd)
    assert key and mon, "both keys come from secret files"
    inference = _secret_path(compose, "vllm", key[1])
    secret = _secret_path(compose, "vllm", mon[1])
    # The monitoring key is another secret, from another file, and the server refuses to
    # start when both hold the same key.
    assert secret != inference, "ATTNPROF_API_KEY must not be the inference key's secret"
    files = [re.match(r"\$\{(\w+)", compose["secrets"][n]["file"]) for n in (secret, inference)]
    assert files[0] and files[1] and files[0][1] != files[1][1], "one file for both keys"
    assert '[ "$$ATTNPROF_API_KEY" != "$$VLLM_API_KEY" ]' in cmd
    assert cmd.index("!= \"$$VLLM_API_KEY\"") < cmd.index("exec ")
    prom = yaml.safe_load(PROMETHEUS_COMPOSE.read_text())
    (job,) = [j for j in prom["scrape_configs"] if j["job_name"] == "vllm"]
    auth = job.get("authorization", {})
    assert auth.get("type", "Bearer") == "Bearer" and auth.get("credentials_file")
    # Prometheus scrapes with the monitoring key, and never holds a tenant's inference key.
    assert _secret_path(compose, "prometheus", auth["credentials_file"]) == secret
    assert inference not in compose["services"]["prometheus"].get("secrets", [])


def _check_compose_attnprof_pin(compose: Doc, readme: str) -> None:
    vllm = compose["services"]["vllm"]
    cmd = " ".join(vllm["command"]) if isinstance(vllm["command"], list) else vllm["command"]
    assert "--require-hashes" in cmd and "--no-deps" in cmd
    req = re.search(r"-r (\S+)", cmd)
    assert req
    (mount,) = [v for v in vllm["volumes"] if v.split(":")[1] == req[1]]
    assert (COMPOSE.parent / mount.split(":")[0]).resolve() == LOCAL_REQUIREMENTS
    _check_requirement(LOCAL_REQUIREMENTS.read_text(), readme)
    assert re.fullmatch(rf"\$\{{{WHEEL_HASH_VAR}:\?[^}}]*\}}",
                        _compose_env(vllm).get(WHEEL_HASH_VAR, "")), "hash var must be required"


# --- the tests ---------------------------------------------------------------------------------

def test_k8s_vllm_container_enables_every_plugin_and_multiproc_metrics() -> None:
    spec, vllm = _vllm(_k8s())
    env: dict[str, Any] = {n: e.get("value") for n, e in _env(vllm).items()}
    assert env["ATTNPROF_ENABLED"] == "1"
    assert set(env["VLLM_PLUGINS"].split(",")) >= _our_plugin_names()
    mounts = {m["mountPath"]: m["name"] for m in vllm["volumeMounts"]}
    vols = {v["name"]: v for v in spec["volumes"]}
    # The multiprocess dir: an emptyDir mounted where the env points (fresh per pod; the
    # container's command empties it at every container start, checked below).
    assert "emptyDir" in vols[mounts[env["PROMETHEUS_MULTIPROC_DIR"]]]
    # The init container installs into the directory the server has on PYTHONPATH.
    (init,) = spec["initContainers"]
    target = init["command"][init["command"].index("--target") + 1]
    assert env["PYTHONPATH"] == target and target in mounts
    (svc,) = [d for d in _k8s() if d["kind"] == "Service"]
    assert svc["metadata"]["annotations"]["prometheus.io/path"] == "/metrics"


@pytest.mark.slow
def test_k8s_manifests_validate_against_kubernetes_schemas() -> None:
    _check_k8s_schemas(_k8s())


def test_k8s_containers_run_non_root_read_only_without_capabilities() -> None:
    _check_k8s_security_context(_k8s())


def test_k8s_writable_paths_are_emptydirs() -> None:
    _check_k8s_writable_paths(_k8s())


def test_k8s_containers_have_requests_limits_and_a_gpu() -> None:
    _check_k8s_resources(_k8s())


def test_every_image_is_pinned_by_digest() -> None:
    _check_digest_pins(_k8s(), _compose(), DEPLOY_README.read_text())


def test_k8s_attnprof_is_pinned_by_version_and_hash() -> None:
    _check_k8s_attnprof_pin(_k8s(), DEPLOY_README.read_text())


def test_k8s_network_policy_admits_only_prometheus_and_labelled_clients() -> None:
    _check_k8s_network_policy(_k8s())


def test_k8s_api_key_comes_from_a_secret() -> None:
    _check_k8s_api_key(_k8s())


def test_k8s_render_fills_every_pin_and_rejects_bad_ones() -> None:
    digest, wheel = "a" * 64, "b" * 64
    render = str(K8S_DIR / "render.sh")
    env = {"PATH": os.environ.get("PATH", ""), "VLLM_IMAGE_DIGEST": f"sha256:{digest}",
           "ATTNPROF_WHEEL_SHA256": wheel}
    r = subprocess.run(["bash", render], capture_output=True, text=True, env=env, timeout=30)
    assert r.returncode == 0, r.stderr
    assert "${" not in r.stdout
    docs = [d for d in yaml.safe_load_all(r.stdout) if d]
    assert len(docs) == len(_k8s())
    _check_k8s_schemas(docs)
    for pod, _ in _pod_specs(docs):
        for c in _containers(pod):
            assert c["image"] == f"vllm/vllm-openai:v0.32.0@sha256:{digest}"
    (cm,) = [d for d in docs if d["kind"] == "ConfigMap"]
    assert f"--hash=sha256:{wheel}" in cm["data"]["requirements.txt"]
    for bad in ({"VLLM_IMAGE_DIGEST": "latest"}, {"ATTNPROF_WHEEL_SHA256": "b" * 63},
                {"VLLM_IMAGE_DIGEST": ""}):
        r = subprocess.run(["bash", render], capture_output=True, text=True,
                           env={**env, **bad}, timeout=30)
        assert r.returncode != 0 and not r.stdout.strip("-\n"), bad


def test_k8s_vllm_container_empties_the_multiproc_dir_at_every_start() -> None:
    _check_k8s_multiproc_wiped_at_start(_k8s())


def test_compose_vllm_container_empties_the_multiproc_dir_at_every_start() -> None:
    _check_compose_multiproc_wiped_at_start(_compose())


def test_compose_enables_every_plugin() -> None:
    env = _compose_env(_compose()["services"]["vllm"])
    assert set(env["VLLM_PLUGINS"].split(",")) >= _our_plugin_names()
    assert env["ATTNPROF_ENABLED"] == "1" and env["PROMETHEUS_MULTIPROC_DIR"]
    assert env["PYTHONPATH"] == "/attnprof"


@pytest.mark.slow
def test_compose_validates_against_compose_spec() -> None:
    _check_compose_schema(_compose())


def test_compose_publishes_ports_on_loopback_only() -> None:
    _check_compose_loopback_ports(_compose())


def test_compose_services_are_hardened() -> None:
    _check_compose_hardening(_compose())


def test_compose_has_no_default_credentials_and_scrapes_with_the_key() -> None:
    _check_compose_credentials(_compose())


def test_compose_attnprof_is_pinned_by_version_and_hash() -> None:
    _check_compose_attnprof_pin(_compose(), DEPLOY_README.read_text())


def _weaken(*path: str | int, value: Any = None, delete: bool = False) -> Callable[[Any], None]:
    """A mutation: set (or delete) the item at `path` (keys and list indices)."""
    def apply(doc: Any) -> None:
        *parents, last = path
        for p in parents:
            doc = doc[p]
        if delete:
            del doc[last]
        else:
            doc[last] = value
    return apply


_DEP = (1, "spec", "template", "spec")   # the Deployment in the parsed k8s documents
_VLLM = (*_DEP, "containers", 0)
_INIT = (*_DEP, "initContainers", 0)
_NP = 3                                   # the NetworkPolicy
_K8S_KINDS = ["ConfigMap", "Deployment", "Service", "NetworkPolicy"]


@pytest.mark.slow
@pytest.mark.parametrize(("check", "where", "mutation"), [
    ("k8s_schemas", "k8s", _weaken(*_VLLM, "securityContext", "readOnlyRootFilesytem",
                                   value=True)),
    ("k8s_schemas", "k8s", _weaken(*_VLLM, "resources", "limits", value="8Gi")),
    ("k8s_security_context", "k8s", _weaken(*_VLLM, "securityContext",
                                            value={"readOnlyRootFilesystem": True})),
    ("k8s_security_context", "k8s", _weaken(*_INIT, "securityContext", "runAsUser", value=0)),
    ("k8s_security_context", "k8s", _weaken(*_DEP, "automountServiceAccountToken",
                                            delete=True)),
    ("k8s_writable_paths", "k8s", _weaken(*_VLLM, "volumeMounts", 3, delete=True)),
    ("k8s_writable_paths", "k8s", _weaken(*_INIT, "volumeMounts", 2, delete=True)),
    ("k8s_resources", "k8s", _weaken(*_VLLM, "resources", "limits", "nvidia.com/gpu",
                                     delete=True)),
    ("k8s_resources", "k8s", _weaken(*_INIT, "resources", "limits", value={"cpu": "1"})),
    ("digest_pins", "k8s", _weaken(*_VLLM, "image", value="vllm/vllm-openai:latest")),
    ("digest_pins", "k8s", _weaken(*_INIT, "image", value="vllm/vllm-openai@sha256:${DIGEST}")),
    ("digest_pins", "compose", _weaken("services", "grafana", "image",
                                       value="grafana/grafana:11.6.0")),
    ("k8s_attnprof_pin", "k8s", _weaken(0, "data", "requirements.txt", value="attnprof\n")),
    ("k8s_attnprof_pin", "k8s", _weaken(*_INIT, "command", 4, value="--no-color")),
    ("k8s_network_policy", "k8s", _weaken(_NP, "spec", "ingress", 0, "from",
                                          value=[{"podSelector": {}}])),
    ("k8s_network_policy", "k8s", _weaken(_NP, "spec", "podSelector", "matchLabels",
                                          value={"app": "other"})),
    ("k8s_api_key", "k8s", _weaken(*_VLLM, "env", 0, value={"name": "VLLM_API_KEY",
                                                          "value": "sk-123"})),
    ("k8s_api_key", "k8s", _weaken(*_VLLM, "env", 1, "valueFrom", "secretKeyRef", "name",
                                   value="vllm-api-key")),
    ("k8s_multiproc_wiped_at_start", "k8s", _weaken(*_VLLM, "command", delete=True)),
    ("k8s_multiproc_wiped_at_start", "k8s", _weaken(*_VLLM, "command",
                                                    value=["vllm", "serve"])),
    ("k8s_multiproc_wiped_at_start", "k8s", _weaken(*_VLLM, "volumeMounts", 1, "readOnly",
                                                    value=True)),
    ("compose_schema", "compose", _weaken("services", "vllm", "read-only", value=True)),
    ("compose_loopback_ports", "compose", _weaken("services", "grafana", "ports",
                                                  value=["3000:3000"])),
    ("compose_hardening", "compose", _weaken("services", "prometheus", "read_only",
                                             delete=True)),
    ("compose_hardening", "compose", _weaken("services", "vllm", "cap_drop", value=["NET_RAW"])),
    ("compose_hardening", "compose", _weaken("services", "grafana", "user", value="0")),
    ("compose_credentials", "compose", _weaken("services", "grafana", "environment",
                                               value={"GF_SECURITY_ADMIN_PASSWORD": "admin",
                                                      "GF_AUTH_ANONYMOUS_ENABLED": "false"})),
    ("compose_credentials", "compose", _weaken("secrets", "grafana_admin_password", "file",
                                               value="${GRAFANA_ADMIN_PASSWORD_FILE:-./pw}")),
    ("compose_credentials", "compose", _weaken("secrets", "attnprof_api_key", "file",
                                               value="${VLLM_API_KEY_FILE:?same file}")),
    ("compose_credentials", "compose", _weaken("services", "prometheus", "secrets",
                                               value=["vllm_api_key", "attnprof_api_key"])),
    ("compose_multiproc_wiped_at_start", "compose", _weaken(
        "services", "vllm", "command", 0,
        value="python3 -m pip install -r /r.txt && exec python3 -m vllm.entrypoints.openai"
              ".api_server --model /models/my-model")),
    ("compose_multiproc_wiped_at_start", "compose", _weaken(
        "services", "vllm", "tmpfs", value=["/tmp:exec,mode=1777"])),
    ("compose_attnprof_pin", "compose", _weaken("services", "vllm", "environment",
                                                WHEEL_HASH_VAR,
                                                value="${ATTNPROF_WHEEL_SHA256:-}")),
])
def test_checks_reject_unhardened_variants(check: str, where: str,
                                           mutation: Callable[[Any], None]) -> None:
    """Every check can fail: the real files pass it, a copy weakened in one place does not."""
    readme = DEPLOY_README.read_text()
    fn = globals()[f"_check_{check}"]

    def run(k8s: list[Doc], compose: Doc) -> None:
        if check == "digest_pins":
            fn(k8s, compose, readme)
        elif check.endswith("attnprof_pin"):
            fn(k8s if where == "k8s" else compose, readme)
        else:
            fn(k8s if check.startswith("k8s") else compose)

    k8s, compose = _k8s(), _compose()
    assert [d["kind"] for d in k8s] == _K8S_KINDS, "the mutations' indices need updating"
    run(k8s, compose)
    mutation(k8s if where == "k8s" else compose)
    with pytest.raises((AssertionError, jsonschema.ValidationError)):
        run(k8s, compose)


@pytest.mark.parametrize("cfg", ["deploy/local/prometheus.yml"])
def test_local_prometheus_config_is_valid(cfg: str) -> None:
    if shutil.which("promtool") is None:
        pytest.fail("promtool is not installed (make test installs it)")
    r = subprocess.run(["promtool", "check", "config", str(REPO / cfg)], capture_output=True,
                       text=True, cwd=REPO / "deploy/local")
    assert r.returncode == 0, r.stdout + r.stderr


@pytest.mark.slow
def test_sidecar_style_install_is_discovered_through_pythonpath(tmp_path: Path) -> None:
    """What the k8s init container does, with its own command and requirements: a wheel built
    from this checkout, pinned by `pip hash`, installed with `--require-hashes --no-deps
    --target DIR`; a Python that only has DIR on PYTHONPATH finds vLLM's entry points and
    imports the plugin. A wrong hash installs nothing. Then the same for compose.yaml."""
    wheels = tmp_path / "wheels"
    # No build isolation: the environment's setuptools (a dependency of torch and vLLM)
    # builds the wheel, so the test does not fetch setuptools from the index each run.
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps",
                        "--no-build-isolation", "-w", str(wheels), str(REPO)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    (wheel,) = wheels.glob("attnprof-*.whl")
    h = subprocess.run([sys.executable, "-m", "pip", "hash", str(wheel)], capture_output=True,
                       text=True, timeout=60)
    sha = re.search(rf"--hash=sha256:({_HEX64})", h.stdout)
    assert sha, h.stdout + h.stderr

    docs = _k8s()
    spec, _ = _vllm(docs)
    (init,) = spec["initContainers"]
    (cm,) = [d for d in docs if d["kind"] == "ConfigMap"]
    template = cm["data"]["requirements.txt"]
    target = tmp_path / "attnprof"

    def install(digest: str) -> subprocess.CompletedProcess[str]:
        req = tmp_path / "requirements.txt"
        req.write_text(template.replace("${" + WHEEL_HASH_VAR + "}", digest))
        cmd = [{"python3": sys.executable, "/attnprof": str(target),
                "/requirements/requirements.txt": str(req)}.get(a, a) for a in init["command"]]
        # The index in the ConfigMap is yours; here the wheel comes from a folder instead.
        return subprocess.run([*cmd, "--no-index", "--find-links", str(wheels)],
                              capture_output=True, text=True, timeout=300)

    bad = install("0" * 64)
    assert bad.returncode != 0 and "DO NOT MATCH THE HASHES" in bad.stderr, bad.stderr[-2000:]
    assert not list(target.glob("attnprof*"))
    r = install(sha[1])
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
    # The vLLM container's command runs from that install too: it empties the multiprocess
    # dir and execs the server (here a Python saying where its attnprof came from).
    _, vllm = _vllm(docs)
    wrapper = [sys.executable if a == "python3" else a
               for a in vllm["command"][:vllm["command"].index("--") + 1]]
    mp = tmp_path / "prometheus-multiproc"
    mp.mkdir()
    (mp / "counter_1.db").write_bytes(b"stale")
    out = subprocess.run(
        [*wrapper, sys.executable, "-c", "import attnprof.cli.container_start as m; "
                                         "print(m.__file__)"],
        capture_output=True, text=True, timeout=60,
        env={**env, "PROMETHEUS_MULTIPROC_DIR": str(mp)})
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().startswith(str(target)) and not list(mp.iterdir())

    # compose.yaml's vLLM container: the same pin in deploy/local, filled by pip itself from
    # the environment (compose passes ATTNPROF_WHEEL_SHA256 through), installed --no-index.
    cmd = " ".join(_compose()["services"]["vllm"]["command"])
    pip = cmd[:cmd.index(" && ")].split()
    local = tmp_path / "compose-attnprof"
    pip = [{"python3": sys.executable, "/attnprof": str(local), "/wheels": str(wheels),
            "/etc/attnprof/requirements.txt": str(LOCAL_REQUIREMENTS)}.get(a, a) for a in pip]
    for digest, ok in (("0" * 64, False), (sha[1], True)):
        r = subprocess.run(pip, capture_output=True, text=True, timeout=300,
                           env={**os.environ, WHEEL_HASH_VAR: digest})
        assert (r.returncode == 0) == ok, r.stderr[-2000:]
    assert (local / "attnprof" / "__init__.py").is_file()


def test_compose_refuses_to_start_with_the_inference_key_as_monitoring_key(
        tmp_path: Path) -> None:
    """The vLLM service's own shell steps (from compose.yaml, `$$` unescaped, the secrets in
    files here): the same key in both files, or an empty monitoring key, stops before the
    server starts; two different keys go on."""
    vllm = _compose()["services"]["vllm"]
    cmd = " ".join(vllm["command"]) if isinstance(vllm["command"], list) else vllm["command"]
    steps = cmd[cmd.index("export VLLM_API_KEY="):cmd.index("&& exec ")].replace("$$", "$")

    def start(inference: str, monitoring: str) -> subprocess.CompletedProcess[str]:
        script = steps
        for name, value in (("vllm_api_key", inference), ("attnprof_api_key", monitoring)):
            (tmp_path / name).write_text(value + "\n")
            script = script.replace(f"/run/secrets/{name}", str(tmp_path / name))
        return subprocess.run(["sh", "-c", script + " && echo started"], capture_output=True,
                              text=True, timeout=30)

    ok = start("inference-k", "monitoring-k")
    assert ok.returncode == 0 and ok.stdout.strip() == "started", ok.stderr
    for inference, monitoring in (("same-k", "same-k"), ("inference-k", "")):
        r = start(inference, monitoring)
        assert r.returncode == 1 and "started" not in r.stdout
        assert "monitoring key other than the vLLM API key" in r.stderr
        assert "same-k" not in r.stderr
