"""The deployment package (deploy/): the Kubernetes manifests validate against a current schema offline
(kubernetes-validate), say what the supervisor does (probe names and ports, a grace period that covers the
drain, a memory request that covers the estimate, the config the image serves); the systemd unit passes
``systemd-analyze verify`` where systemd is installed; the launchd plist parses; and a real supervisor
speaks systemd's notify protocol: READY=1 once its models serve, watchdog pings, STOPPING=1 on SIGTERM."""

from __future__ import annotations

import json
import plistlib
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import tomllib
from pathlib import Path

import grpc
import kubernetes_validate
import pytest
import yaml
from grpc_health.v1 import health_pb2, health_pb2_grpc

from common.settings import parse_duration
from supervisor.config import load
from supervisor.memory import pod_memory
from supervisor.service import LIVENESS_SERVICE
from tests.processes import REPO, SupervisorProcess, model_toml

DEPLOY = REPO / "deploy"
KUBERNETES = DEPLOY / "kubernetes"
KUBERNETES_VERSION = "1.33"  # a current release; the schemas ship with kubernetes-validate


def documents() -> dict[str, dict]:
    found = {}
    for path in sorted(KUBERNETES.glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc and doc.get("kind") != "Kustomization":
                found[doc["kind"]] = doc
    return found


def image_config(tmp_path: Path) -> Path:
    """deploy/mlxserve.toml with the image's /app paths pointed at this checkout."""
    path = tmp_path / "mlxserve.toml"
    path.write_text((DEPLOY / "mlxserve.toml").read_text().replace("/app/", f"{REPO}/"))
    return path


def mebibytes(quantity: str) -> float:
    number, unit = re.fullmatch(r"([0-9.]+)(Mi|Gi)", quantity).groups()
    return float(number) * (1024 if unit == "Gi" else 1)


def test_the_manifests_validate_against_the_kubernetes_schema():
    docs = documents()
    assert set(docs) == {"ConfigMap", "Deployment", "Service", "PodDisruptionBudget"}
    for kind, doc in docs.items():
        kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)  # raises on any error
    kustomization = yaml.safe_load((KUBERNETES / "kustomization.yaml").read_text())
    assert sorted(kustomization["resources"]) == sorted(
        p.name for p in KUBERNETES.glob("*.yaml") if p.stem != "kustomization"
    )
    broken = dict(docs["Deployment"], spec={**docs["Deployment"]["spec"], "replicas": "two"})
    with pytest.raises(kubernetes_validate.ValidationError):  # the check does check
        kubernetes_validate.validate(broken, KUBERNETES_VERSION, strict=True)


def test_the_deployment_matches_the_supervisor_it_runs(tmp_path):
    docs = documents()
    served = docs["ConfigMap"]["data"]["mlxserve.toml"]
    assert served == (DEPLOY / "mlxserve.toml").read_text()  # the image's config and the ConfigMap's are one
    config = load(image_config(tmp_path))
    toml = tomllib.loads(served)
    pod = docs["Deployment"]["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports["grpc"] == int(config.listen.rsplit(":", 1)[1])
    assert ports["http"] == int(config.http_listen.rsplit(":", 1)[1])
    assert ports["metrics"] == config.probe_port and config.probe_host == "0.0.0.0"
    assert container["livenessProbe"]["grpc"] == {"port": ports["grpc"], "service": LIVENESS_SERVICE}
    for probe in ("startupProbe", "readinessProbe"):  # "" is SERVING once every model loaded at start serves
        assert container[probe]["grpc"] == {"port": ports["grpc"], "service": ""}
    annotations = docs["Deployment"]["spec"]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/port"] == str(config.probe_port)
    # SIGTERM comes after preStop; the drain and the runners' exit must fit in what is left.
    pre_stop = container["lifecycle"]["preStop"]["sleep"]["seconds"]
    drain = parse_duration("drain_grace", toml["drain_grace"]) + parse_duration("kill_timeout", toml["kill_timeout"])
    assert pod["terminationGracePeriodSeconds"] >= pre_stop + drain + 5
    # The memory request covers what the supervisor estimates for these models.
    total, rows = pod_memory(config)
    assert [name for name, _, _ in rows] == ["default"]
    assert mebibytes(container["resources"]["requests"]["memory"]) * 2**20 >= total
    assert mebibytes(container["resources"]["limits"]["memory"]) >= mebibytes(
        container["resources"]["requests"]["memory"]
    )


def test_the_estimate_command_prints_the_memory_request(tmp_path):
    done = subprocess.run(
        [sys.executable, "-m", "supervisor", "estimate", "--config", str(image_config(tmp_path))],
        capture_output=True,
        text=True,
        cwd=REPO,
        check=True,
    )
    total, _ = pod_memory(load(image_config(tmp_path)))
    assert done.stdout.splitlines()[-1] == f"memory request: {-(-total // 2**20)}Mi"
    bad = subprocess.run(
        [sys.executable, "-m", "supervisor", "estimate", "--config", str(tmp_path / "missing.toml")],
        capture_output=True,
        text=True,
        cwd=REPO,
    )
    assert bad.returncode == 2 and bad.stderr.startswith("supervisor: ")


def test_the_leaderworkerset_runs_one_group_across_its_pods(tmp_path):
    """deploy/kubernetes/leaderworkerset: the ConfigMap and Service validate against the schema, and so do the
    leader's and the worker's pod templates (the LeaderWorkerSet's own fields are its CRD's, which the schema
    package does not carry: checked here by name). Every pod writes the same hostfile from the set's
    environment, which the config's model accepts (ranks = the set's size); the leader serves, the worker
    runs a rank of that model, on the port the hostfile names."""
    from supervisor.worker import lws_hostfile, worker_rank

    folder = KUBERNETES / "leaderworkerset"
    docs = {d["kind"]: d for p in sorted(folder.glob("*.yaml")) for d in yaml.safe_load_all(p.read_text())}
    assert set(docs) == {"ConfigMap", "Service", "LeaderWorkerSet", "Kustomization"}
    assert sorted(docs["Kustomization"]["resources"]) == sorted(
        p.name for p in folder.glob("*.yaml") if p.stem != "kustomization"
    )
    for kind in ("ConfigMap", "Service"):
        kubernetes_validate.validate(docs[kind], KUBERNETES_VERSION, strict=True)
    lws = docs["LeaderWorkerSet"]
    assert lws["apiVersion"] == "leaderworkerset.x-k8s.io/v1"
    group = lws["spec"]["leaderWorkerTemplate"]
    assert set(group) == {"size", "restartPolicy", "leaderTemplate", "workerTemplate"}
    assert group["restartPolicy"] in ("RecreateGroupOnPodRestart", "None")
    for role in ("leaderTemplate", "workerTemplate"):
        template = {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": role}, "template": group[role]}
        kubernetes_validate.validate(template, KUBERNETES_VERSION, strict=True)
    (leader,) = group["leaderTemplate"]["spec"]["containers"]
    (worker,) = group["workerTemplate"]["spec"]["containers"]
    # The config, with the hostfile the pods write (here from a group of `size` pods' environment).
    served = docs["ConfigMap"]["data"]["mlxserve.toml"]
    hostfile_path = tomllib.loads(served)["models"]["default"]["hostfile"]
    for container in (leader, worker):
        command = container["args"][0].split()
        assert command[:5] == ["python", "-m", "supervisor", "lws-hostfile", hostfile_path]
        port = int(command[command.index("--port") + 1])
        assert {"name": "ring", "containerPort": port} in container["ports"]
    env = {"LWS_LEADER_ADDRESS": "mlxserve-group-0.mlxserve-group.default", "LWS_GROUP_SIZE": str(group["size"])}
    hostfile = tmp_path / "hostfile.json"
    hostfile.write_text(json.dumps(lws_hostfile(env, port)))
    config_path = tmp_path / "mlxserve.toml"
    config_path.write_text(served.replace("/app/", f"{REPO}/").replace(hostfile_path, str(hostfile)))
    config = load(config_path)
    assert "exec python -m supervisor serve --config /etc/mlxserve/mlxserve.toml" in leader["args"][0]
    model = worker["args"][0].split("--model ")[1].split()[0]
    assert worker_rank(config.models[model], None, {**env, "LWS_WORKER_INDEX": "1"}) == 1
    assert leader["startupProbe"]["grpc"] == {"port": 50051, "service": ""}
    assert docs["Service"]["spec"]["selector"]["leaderworkerset.sigs.k8s.io/worker-index"] == "0"


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd is not installed here")
def test_the_systemd_unit_verifies(tmp_path):
    unit = (DEPLOY / "systemd" / "mlxserve.service").read_text()
    assert re.search(r"^Type=notify$", unit, re.M) and re.search(r"^KillMode=mixed$", unit, re.M)
    stop = int(re.search(r"^TimeoutStopSec=(\d+)$", unit, re.M).group(1))
    toml = tomllib.loads((DEPLOY / "mlxserve.toml").read_text())
    assert stop >= parse_duration("", toml["drain_grace"]) + parse_duration("", toml["kill_timeout"]) + 5
    # Installed as docs/deploy.md says, with this checkout standing in for /opt/mlxserve.
    installed = tmp_path / "mlxserve.service"
    fitted = unit.replace("/opt/mlxserve", str(REPO))
    installed.write_text(fitted)
    done = subprocess.run(["systemd-analyze", "verify", str(installed)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    installed.write_text(fitted.replace(f"{REPO}/.venv/bin/python", "/nonexistent/python"))  # the check does check
    assert subprocess.run(["systemd-analyze", "verify", str(installed)], capture_output=True).returncode != 0


def test_the_launchd_plist_parses_and_waits_for_the_drain():
    plist = plistlib.loads((DEPLOY / "launchd" / "org.mlxserve.supervisor.plist").read_bytes())
    assert plist["ProgramArguments"][1:4] == ["-m", "supervisor", "serve"]
    assert plist["KeepAlive"] == {"SuccessfulExit": False}  # restarted after a crash, not after a clean stop
    toml = tomllib.loads((DEPLOY / "mlxserve.toml").read_text())
    assert plist["ExitTimeOut"] >= parse_duration("", toml["drain_grace"]) + parse_duration("", toml["kill_timeout"])


def test_a_supervisor_tells_systemd_it_is_ready_alive_and_stopping(tmp_path):
    address = tmp_path / "notify.sock"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    listener.bind(str(address))
    listener.settimeout(1.0)
    sup = SupervisorProcess(
        tmp_path / "sup",
        model_toml("default"),
        env={"NOTIFY_SOCKET": str(address), "WATCHDOG_USEC": "400000"},
    )
    messages: list[tuple[float, str]] = []

    def receive_until(field: str, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                data = listener.recv(4096).decode()
            except TimeoutError:
                continue
            messages.extend((time.monotonic(), line) for line in data.splitlines())
            if field in data.splitlines():
                return
        raise AssertionError(f"no {field} within {timeout} s; got {[m for _, m in messages]}\n{sup.stderr[-2000:]}")

    try:
        receive_until("READY=1", 120)
        # READY=1 means what the readiness probe means: the model serves, and the health service says so.
        with grpc.insecure_channel(f"127.0.0.1:{sup.port}") as channel:
            check = health_pb2_grpc.HealthStub(channel).Check
            for service in ("", LIVENESS_SERVICE):
                assert check(health_pb2.HealthCheckRequest(service=service), timeout=5).status == 1  # SERVING
        assert any(m.startswith("STATUS=ready") for _, m in messages)
        receive_until("WATCHDOG=1", 2)
        receive_until("WATCHDOG=1", 2)  # every 0.2 s (half of WATCHDOG_USEC)
        sup.process.send_signal(signal.SIGTERM)
        receive_until("STOPPING=1", 10)
        assert sup.process.wait(60) == 0
        assert [m for _, m in messages].count("READY=1") == 1  # sent once, when ready
    finally:
        if sup.process.poll() is None:
            sup.stop()
        listener.close()
