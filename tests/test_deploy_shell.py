"""What an operator installs besides the code: the pod specs in deploy/k8s meet the
"restricted" Pod Security level (hostPath volumes, where unavoidable, the only
exception, in a namespace labelled with the level that allows them), hold their
shared memory within their memory limits, and run the image `make image` builds;
the Dockerfile and the systemd unit set no setting that would override the config
file; the unit runs as the user its sysusers.d file creates."""

from __future__ import annotations

import dataclasses
import re
import shutil
import subprocess
import tomllib
from pathlib import Path
from typing import Any

import pytest
import yaml

from ckptd.core.wire import DEFAULT_SOCKET
from ckptd.daemon.app import config

REPO = Path(__file__).resolve().parent.parent
K8S = REPO / "deploy" / "k8s"
SYSTEMD = REPO / "deploy" / "systemd"
VERSION = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
HEADROOM = 1 << 30
"""The least memory a daemon container's limit leaves it beyond its shared memory."""


def _objects() -> list[tuple[str, dict[str, Any]]]:
    """Every object in every manifest under deploy/k8s, with its file's name."""
    return [
        (p.name, d)
        for p in sorted(K8S.glob("*.yaml"))
        if p.name != "kustomization.yaml"
        for d in yaml.safe_load_all(p.read_text())
        if d
    ]


def _pod_specs() -> list[tuple[str, dict[str, Any]]]:
    """(``file:kind/name``, pod spec) for every workload in the manifests."""
    out = []
    for file, obj in _objects():
        spec = obj.get("spec", {})
        spec = spec.get("jobTemplate", {}).get("spec", spec)  # a CronJob's
        pod = obj["spec"] if obj["kind"] == "Pod" else spec.get("template", {}).get("spec")
        if pod is not None:
            out.append((f"{file}:{obj['kind']}/{obj['metadata']['name']}", pod))
    assert out
    return out


def _containers(spec: dict[str, Any]) -> list[dict[str, Any]]:
    return [*spec.get("initContainers", []), *spec["containers"]]


_RESTRICTED_VOLUMES = {
    "configMap",
    "csi",
    "downwardAPI",
    "emptyDir",
    "ephemeral",
    "persistentVolumeClaim",
    "projected",
    "secret",
}


def restricted_violations(spec: dict[str, Any]) -> list[str]:
    """Where a pod spec breaks the "restricted" Pod Security Standard (which includes
    "baseline"): the rules of kubernetes.io/docs/concepts/security/pod-security-standards,
    as the admission controller checks them."""
    out: list[str] = []
    pod = spec.get("securityContext", {})
    for key in ("hostNetwork", "hostPID", "hostIPC"):
        if spec.get(key):
            out.append(f"{key} is set")
    for v in spec.get("volumes", []):
        kinds = set(v) - {"name"}
        if not kinds <= _RESTRICTED_VOLUMES:
            out.append(f"volume {v['name']} is a {'/'.join(sorted(kinds))} volume")
    if pod.get("runAsUser") == 0:
        out.append("the pod runs as uid 0")
    if pod.get("sysctls"):
        out.append("the pod sets sysctls")
    for c in _containers(spec):
        ctx, name = c.get("securityContext", {}), c["name"]
        if ctx.get("privileged"):
            out.append(f"{name} is privileged")
        if ctx.get("allowPrivilegeEscalation") is not False:
            out.append(f"{name} does not set allowPrivilegeEscalation: false")
        if ctx.get("runAsNonRoot", pod.get("runAsNonRoot")) is not True:
            out.append(f"{name} does not set runAsNonRoot: true (nor does the pod)")
        if ctx.get("runAsUser") == 0:
            out.append(f"{name} runs as uid 0")
        seccomp = ctx.get("seccompProfile", pod.get("seccompProfile", {})).get("type")
        if seccomp not in ("RuntimeDefault", "Localhost"):
            out.append(f"{name} has seccompProfile {seccomp}, not RuntimeDefault/Localhost")
        caps = ctx.get("capabilities", {})
        if "ALL" not in caps.get("drop", []):
            out.append(f"{name} does not drop ALL capabilities")
        if set(caps.get("add", [])) - {"NET_BIND_SERVICE"}:
            out.append(f"{name} adds capabilities {caps['add']}")
        if any(p.get("hostPort") for p in c.get("ports", [])):
            out.append(f"{name} uses a hostPort")
        if ctx.get("procMount", "Default") != "Default":
            out.append(f"{name} sets procMount")
        if ctx.get("windowsOptions", {}).get("hostProcess"):
            out.append(f"{name} is a hostProcess container")
    return out


def test_the_checker_finds_what_the_level_refuses() -> None:
    """The rules above are not vacuous: a root init container breaks several."""
    spec = {
        "initContainers": [{"name": "prep", "securityContext": {"runAsUser": 0}}],
        "containers": [],
        "volumes": [{"name": "v", "hostPath": {"path": "/x"}}],
    }
    found = restricted_violations(spec)
    assert "prep runs as uid 0" in found and "volume v is a hostPath volume" in found
    assert len(found) == 6, found


def test_every_container_meets_the_restricted_pod_security_level() -> None:
    """Every container of every workload (init and sidecar ones included) passes
    "restricted". The only exception allowed is a hostPath volume (the DaemonSet's
    node NVMe, socket directory and /dev/shm), and a namespace holding a pod that has
    one is labelled with the level that admits it, so apply does not fail on it."""
    labels = {
        obj["metadata"]["name"]: obj["metadata"].get("labels", {})
        for _, obj in _objects()
        if obj["kind"] == "Namespace"
    }
    workloads = {f"{f}:{o['kind']}/{o['metadata']['name']}": o for f, o in _objects()}
    for where, spec in _pod_specs():
        found = restricted_violations(spec)
        hostpaths = {v["name"] for v in spec.get("volumes", []) if "hostPath" in v}
        allowed = {f"volume {name} is a hostPath volume" for name in hostpaths}
        assert set(found) <= allowed, f"{where}: {sorted(set(found) - allowed)}"
        if hostpaths:
            namespace = workloads[where]["metadata"]["namespace"]
            level = labels[namespace].get("pod-security.kubernetes.io/enforce")
            assert level == "privileged", f"{where} has hostPath volumes, {namespace} {level}"


def _memory(text: str) -> int:
    units = {"Ki": 1 << 10, "Mi": 1 << 20, "Gi": 1 << 30, "Ti": 1 << 40}
    number, unit = re.fullmatch(r"(\d+)([KMGT]i)?", str(text)).groups()  # type: ignore[union-attr]
    return int(number) * units.get(unit, 1)


def test_the_daemon_memory_limit_holds_its_shared_memory(tmp_path: Path) -> None:
    """A daemon's leases live in /dev/shm and are charged to its container (it
    fallocates them): its memory limit is at least their bound (a memory emptyDir's
    sizeLimit, or on the host's /dev/shm the ConfigMap's staging budget) plus room
    for the daemon itself, and the request equals it so the node reserves it."""
    (cm,) = (o for _, o in _objects() if o["kind"] == "ConfigMap")
    toml = tmp_path / "ckptd.toml"
    toml.write_text(cm["data"]["ckptd.toml"])
    budget = config.load(toml, env={}).staging_budget_bytes
    checked = 0
    for where, spec in _pod_specs():
        volumes = {v["name"]: v for v in spec.get("volumes", [])}
        for c in _containers(spec):
            if c.get("args", [])[:1] != ["serve"]:
                continue  # not a daemon
            shm = next(m["name"] for m in c["volumeMounts"] if m["mountPath"] == "/dev/shm")
            empty = volumes[shm].get("emptyDir")
            if empty is not None:
                assert empty["medium"] == "Memory", where
                bound = _memory(empty["sizeLimit"])
                assert budget <= bound, f"{where}: the staging budget exceeds /dev/shm"
            else:
                bound = budget
            resources = c["resources"]
            assert "memory" in resources.get("limits", {}), f"{where}: no memory limit"
            limit = _memory(resources["limits"]["memory"])
            assert limit >= bound + HEADROOM, f"{where}: {limit} < {bound} + {HEADROOM}"
            assert _memory(resources["requests"]["memory"]) == limit, where
            checked += 1
    assert checked == 2


def test_the_manifests_run_the_image_make_image_builds(tmp_path: Path) -> None:
    """ckptd:<version> (what `make image` tags), pulled only if the node lacks it, in
    every manifest; kustomization.yaml's `images:` entry is where a registry's name
    goes, and kustomize renders it into every container."""
    for where, spec in _pod_specs():
        for c in _containers(spec):
            if c["image"].split(":")[0] == "ckptd":
                assert c["image"] == f"ckptd:{VERSION}", where
                assert c.get("imagePullPolicy") == "IfNotPresent", f"{where}: {c['name']}"
    kustomization = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    (entry,) = kustomization["images"]
    assert entry == {"name": "ckptd", "newName": "ckptd", "newTag": VERSION}
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        return  # the rendering below needs kustomize (kubectl's); the file is checked
    renamed = dict(kustomization, images=[dict(entry, newName="registry.example/team/ckptd")])
    overlay = tmp_path / "k8s"  # a copy: the repository's stays untouched
    shutil.copytree(K8S, overlay)
    (overlay / "kustomization.yaml").write_text(yaml.safe_dump(renamed))
    out = subprocess.run(
        [kubectl, "kustomize", str(overlay)], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    rendered = [d for d in yaml.safe_load_all(out.stdout) if d]
    images = [
        c["image"]
        for d in rendered
        if d["kind"] == "DaemonSet"
        for c in _containers(d["spec"]["template"]["spec"])
    ]
    assert images == [f"registry.example/team/ckptd:{VERSION}"], images


def _config_keys() -> set[str]:
    return {f.name for f in dataclasses.fields(config.Config)}


def test_the_image_and_the_unit_leave_settings_to_the_config_file() -> None:
    """Neither the Dockerfile nor the unit sets a CKPTD_<key> (an environment setting
    beats the operator's config file); the directories they prepare are the daemon's
    built-in root and socket directory, so nothing needs setting."""
    keys = _config_keys()
    dockerfile = (REPO / "Dockerfile").read_text()
    unit = (SYSTEMD / "ckptd.service").read_text()
    env_lines = re.findall(r"^ENV\s+(.*)$", dockerfile, re.MULTILINE)
    env_lines += re.findall(r"^Environment=(.*)$", unit, re.MULTILINE)
    set_names = {n for line in env_lines for n in re.findall(r"\b(CKPTD_\w+)[= ]", line)}
    overriding = sorted(n for n in set_names if n[len("CKPTD_") :].lower() in keys)
    assert not overriding, f"settings that override the config file: {overriding}"
    (volume,) = re.findall(r"^VOLUME\s+(.*)$", dockerfile, re.MULTILINE)
    socket_dir = str(Path(DEFAULT_SOCKET).parent)
    assert set(yaml.safe_load(volume)) == {config.DEFAULT_ROOT, socket_dir}
    (state,) = re.findall(r"^StateDirectory=(\S+)$", unit, re.MULTILINE)
    (runtime,) = re.findall(r"^RuntimeDirectory=(\S+)$", unit, re.MULTILINE)
    assert (f"/var/lib/{state}", f"/run/{runtime}") == (config.DEFAULT_ROOT, socket_dir)
    # The flags ExecStart passes: only where the config file is.
    (exec_start,) = re.findall(r"^ExecStart=(.*)$", unit, re.MULTILINE)
    flags = [a for a in exec_start.split() if a.startswith("--")]
    assert flags == ["--config"], exec_start


def test_the_unit_runs_as_the_user_its_sysusers_file_creates(tmp_path: Path) -> None:
    tool = shutil.which("systemd-sysusers")
    if tool is None:
        pytest.skip("systemd-sysusers is not installed")
    unit = (SYSTEMD / "ckptd.service").read_text()
    (tmp_path / "etc").mkdir()
    out = subprocess.run(
        [tool, f"--root={tmp_path}", str(SYSTEMD / "ckptd.sysusers")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    users = {ln.split(":")[0]: ln.split(":") for ln in (tmp_path / "etc/passwd").open()}
    groups = {ln.split(":")[0] for ln in (tmp_path / "etc/group").open()}
    (user,) = re.findall(r"^User=(\S+)$", unit, re.MULTILINE)
    (group,) = re.findall(r"^Group=(\S+)$", unit, re.MULTILINE)
    assert user in users and group in groups, (users, groups)
    (state,) = re.findall(r"^StateDirectory=(\S+)$", unit, re.MULTILINE)
    assert users[user][5] == f"/var/lib/{state}"  # its home is the daemon's root
    # The install the unit's comment describes puts ckptd where ExecStart looks.
    venv = re.search(r"python3 -m venv (\S+)", unit)
    assert venv is not None, "the unit says how to install ckptd"
    assert re.search(rf"^ExecStart={re.escape(venv[1])}/bin/ckptd ", unit, re.MULTILINE)


def test_node_tmpfiles_prepares_the_daemonset_directories(tmp_path: Path) -> None:
    tool = shutil.which("systemd-tmpfiles")
    if tool is None:
        pytest.skip("systemd-tmpfiles is not installed")
    out = subprocess.run(
        [tool, f"--root={tmp_path}", "--create", str(K8S / "node.tmpfiles")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    (daemonset,) = (o for _, o in _objects() if o["kind"] == "DaemonSet")
    spec = daemonset["spec"]["template"]["spec"]
    (daemon,) = (c for c in spec["containers"] if c["name"] == "ckptd")
    uid, gid = daemon["securityContext"]["runAsUser"], daemon["securityContext"]["runAsGroup"]
    for v in spec["volumes"]:
        path = v.get("hostPath", {}).get("path")
        if path is None or path == "/dev/shm":
            continue
        st = (tmp_path / path.lstrip("/")).stat()
        assert (st.st_uid, st.st_gid, st.st_mode & 0o7777) == (uid, gid, 0o750), path
