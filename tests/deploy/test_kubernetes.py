"""deploy/kubernetes/: every manifest against the Kubernetes schemas (offline, as
kubernetes-validate ships them), what each part is for, and the DaemonSet's container
run here, outside a container, as the manifests configure it."""

from __future__ import annotations

import copy
import secrets
import time
from pathlib import Path
from typing import Any

import httpx
import jsonpatch
import pytest
import yaml
from framewire.client import Client
from framewire.core.fdsocket import ping
from framewire.service import Settings
from kubernetes_validate import utils as kube

from tests.support import REPO
from tests.support.http import http_client
from tests.support.image import Dockerfile, dockerfile, entrypoint, moved, user_ids
from tests.support.media import make_clip
from tests.support.worker import free_port

KUBE = REPO / "deploy" / "kubernetes"
# The oldest Kubernetes these manifests are for, and the newest that kubernetes-validate
# (pinned in pyproject.toml) ships schemas of.
VERSIONS = ("1.30", "1.37")
EXAMPLE = "example-rank.yaml"
GPU = "nvidia.com/gpu"


def manifests() -> dict[str, list[dict[str, Any]]]:
    """Each YAML file under deploy/kubernetes (kustomize's own files apart): its objects."""
    return {
        str(path.relative_to(KUBE)): [d for d in yaml.safe_load_all(path.read_text()) if d]
        for path in sorted(KUBE.rglob("*.yaml"))
        if path.name != "kustomization.yaml"
    }


def kustomization(directory: Path = KUBE) -> dict[str, Any]:
    return yaml.safe_load((directory / "kustomization.yaml").read_text())


def the(kind: str, file: str | None = None) -> dict[str, Any]:
    """The one object of ``kind`` (in ``file``, else in any manifest)."""
    found = [
        doc
        for name, docs in manifests().items()
        if file is None or name == file
        for doc in docs
        if doc["kind"] == kind
    ]
    assert len(found) == 1, f"{len(found)} objects of kind {kind}"
    return found[0]


def with_component(daemonset: dict[str, Any], component: str) -> dict[str, Any]:
    """``daemonset`` as kustomize renders it with ``component``'s JSON patches."""
    spec = kustomization(KUBE / component)
    assert spec["kind"] == "Component"
    patched = copy.deepcopy(daemonset)
    for entry in spec["patches"]:
        target = entry["target"]
        assert (target["kind"], target["name"]) == ("DaemonSet", daemonset["metadata"]["name"])
        patched = jsonpatch.apply_patch(patched, yaml.safe_load(entry["patch"]))
    return patched


def pod(workload: dict[str, Any]) -> dict[str, Any]:
    spec: dict[str, Any] = workload["spec"]
    return spec["template"]["spec"] if "template" in spec else spec


def container(workload: dict[str, Any], name: str) -> dict[str, Any]:
    [found] = [c for c in pod(workload)["containers"] if c["name"] == name]
    return found


def argv(c: dict[str, Any], image: Dockerfile) -> list[str]:
    """What the container runs: Kubernetes's command/args over the image's ENTRYPOINT/CMD."""
    if "command" in c:
        return [*c["command"], *c.get("args", [])]
    assert image.entrypoint is not None
    return [*image.entrypoint, *c.get("args", image.cmd or [])]


def environment(
    c: dict[str, Any], image: Dockerfile, secret_values: dict[tuple[str, str], str]
) -> dict[str, str]:
    """The container's environment: the image's, its ConfigMaps', then its own entries."""
    env = dict(image.env)
    for source in c.get("envFrom", []):
        if "secretRef" in source:
            # The object store's credentials: an optional Secret, absent here as in a
            # cluster without one; the worker must start without it.
            assert source["secretRef"]["optional"] is True
            continue
        configmap = the("ConfigMap")
        assert source["configMapRef"]["name"] == configmap["metadata"]["name"]
        env |= configmap["data"]
    for entry in c.get("env", []):
        if "value" in entry:
            env[entry["name"]] = entry["value"]
        else:
            ref = entry["valueFrom"]["secretKeyRef"]
            env[entry["name"]] = secret_values[ref["name"], ref["key"]]
    return env


def mounts(workload: dict[str, Any], c: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """mount path -> (the volume, whether read-only) of ``c``."""
    volumes = {v["name"]: v for v in pod(workload)["volumes"]}
    return {
        m["mountPath"]: volumes[m["name"]] | {"readOnly": m.get("readOnly", False)}
        for m in c["volumeMounts"]
    }


WORKER = the("DaemonSet")
TOKEN = ("framewire-token", "token")


# --- schemas and kustomize ---------------------------------------------------------------------


@pytest.mark.parametrize("version", VERSIONS)
def test_every_manifest_is_valid_against_the_kubernetes_schemas(version):
    objects = [doc for docs in manifests().values() for doc in docs]
    objects.append(with_component(WORKER, "expandable-segments"))
    kinds = set()
    for doc in objects:
        kube.validate(doc, version, strict=True)
        kinds.add(doc["kind"])
    assert kinds == {"Namespace", "ConfigMap", "DaemonSet", "Service", "NetworkPolicy", "Pod"}
    # Strict: a misspelled field is an error, so passing means something.
    broken = copy.deepcopy(WORKER)
    pod(broken)["hostPid"] = True
    with pytest.raises(kube.ValidationError):
        kube.validate(broken, version, strict=True)


def test_the_kustomization_lists_every_manifest_but_the_example():
    spec = kustomization()
    assert spec["kind"] == "Kustomization" and spec["namespace"] == "framewire"
    top_level = {name for name in manifests() if "/" not in name}
    assert sorted(spec["resources"]) == sorted(top_level - {EXAMPLE})
    assert the("Namespace")["metadata"]["name"] == spec["namespace"]
    # The component is offered (commented out); its directory is a kustomize Component.
    assert "#   - expandable-segments" in (KUBE / "kustomization.yaml").read_text()
    assert kustomization(KUBE / "expandable-segments")["kind"] == "Component"


# --- the DaemonSet and the image ---------------------------------------------------------------


def test_the_worker_runs_the_image_entrypoint_with_real_settings():
    image, c = dockerfile(), container(WORKER, "worker")
    assert "command" not in c and "args" not in c  # `framewire serve` as the image has it
    assert argv(c, image) == image.argv
    env = environment(c, image, {TOKEN: "x"})
    known = {f"FRAMEWIRE_{name.upper()}" for name in Settings.model_fields}
    assert {k for k in env if k.startswith("FRAMEWIRE_")} <= known
    for var in ("FRAMEWIRE_UDS", "FRAMEWIRE_FD_SOCKET", "FRAMEWIRE_OUTPUT_ROOTS",
                "FRAMEWIRE_INPUT_ROOTS"):  # fmt: skip
        assert env[var] == image.env[var], var  # the image's paths
    # The image's user, and the directories it needs handed to that user and group.
    uid, gid = user_ids(image)
    security = pod(WORKER)["securityContext"]
    assert (security["runAsUser"], security["runAsGroup"], security["runAsNonRoot"]) == (
        uid, gid, True
    )  # fmt: skip
    assert str(gid) in env["FRAMEWIRE_ALLOWED_GIDS"].split(",")
    [init] = pod(WORKER)["initContainers"]
    assert f"chown {uid}:{gid}" in " ".join(init["command"])
    assert {m["mountPath"] for m in init["volumeMounts"]} == {
        m["mountPath"] for m in c["volumeMounts"] if m["name"] != "tmp"
    }
    assert c["securityContext"]["capabilities"] == {"drop": ["ALL"]}
    grace = float(env["FRAMEWIRE_SHUTDOWN_GRACE"])
    assert pod(WORKER)["terminationGracePeriodSeconds"] > grace


def test_the_worker_sees_every_gpu_and_takes_none_from_the_device_plugin():
    spec, c = pod(WORKER), container(WORKER, "worker")
    env = environment(c, dockerfile(), {TOKEN: "x"})
    assert GPU not in str(c["resources"])  # an exclusive grant of some GPUs
    assert spec["runtimeClassName"] == "nvidia" and env["NVIDIA_VISIBLE_DEVICES"] == "all"
    assert "compute" in env["NVIDIA_DRIVER_CAPABILITIES"].split(",")
    assert spec["nodeSelector"] == {f"{GPU}.present": "true"}
    assert {"key": GPU, "operator": "Exists", "effect": "NoSchedule"} in spec["tolerations"]


def test_sockets_outputs_and_inputs_are_the_nodes_and_the_example_rank_shares_them():
    image, worker = dockerfile(), container(WORKER, "worker")
    rank_pod = the("Pod", EXAMPLE)
    rank = container(rank_pod, "rank")
    env = environment(worker, image, {TOKEN: "x"})
    theirs, mine = mounts(WORKER, worker), mounts(rank_pod, rank)
    sockets = str(Path(env["FRAMEWIRE_UDS"]).parent)
    assert str(Path(env["FRAMEWIRE_FD_SOCKET"]).parent) == sockets
    assert theirs[sockets]["hostPath"]["path"] == mine[sockets]["hostPath"]["path"]
    for root, worker_reads_only in (("FRAMEWIRE_OUTPUT_ROOTS", False),
                                    ("FRAMEWIRE_INPUT_ROOTS", True)):  # fmt: skip
        assert theirs[env[root]]["readOnly"] is worker_reads_only
        assert theirs[env[root]]["hostPath"]["path"] == mine[env[root]]["hostPath"]["path"]
    # The rank talks to this worker as the demo does, with the worker's token, waiting for it
    # (bounded) rather than starting one of its own when it comes up first.
    url = f"unix://{env['FRAMEWIRE_UDS']}"
    assert argv(rank, image) == ["framewire", "demo", "--url", url, "--wait", "120"]
    [token] = [e for e in rank["env"] if e["name"] == "FRAMEWIRE_TOKEN"]
    ref = token["valueFrom"]["secretKeyRef"]
    assert (ref["name"], ref["key"]) == TOKEN
    # Its group lets it use the sockets (mode 0660) and the fd socket.
    gid = pod(rank_pod)["securityContext"]["runAsGroup"]
    assert str(gid) in env["FRAMEWIRE_ALLOWED_GIDS"].split(",")
    assert rank["resources"]["limits"][GPU] == 1  # its own GPU; the worker sees all


def test_each_route_has_the_namespaces_it_needs():
    worker_pod, rank_pod = pod(WORKER), pod(the("Pod", EXAMPLE))
    # CUDA IPC: producer and worker in one PID namespace; named segments: one IPC
    # namespace. Across pods, that is the node's.
    for spec in (worker_pod, rank_pod):
        assert spec["hostPID"] is True and spec["hostIPC"] is True
        assert spec.get("hostNetwork", False) is False  # HTTP on the pod's network
    # Expandable segments: pidfd_getfd needs CAP_SYS_PTRACE in effect, which a non-root
    # container never has in Kubernetes, and a seccomp profile that allows it.
    ptrace = with_component(WORKER, "expandable-segments")
    c = container(ptrace, "worker")
    assert c["securityContext"]["capabilities"] == {"drop": ["ALL"], "add": ["SYS_PTRACE"]}
    assert pod(ptrace)["securityContext"]["runAsUser"] == 0
    assert c["securityContext"]["seccompProfile"] == {"type": "Unconfined"}
    assert pod(ptrace)["hostPID"] is True
    assert "SYS_PTRACE" not in str(WORKER)  # only with the component


def test_probes_and_metrics_reach_the_port_the_worker_listens_on():
    c = container(WORKER, "worker")
    env = environment(c, dockerfile(), {TOKEN: "x"})
    [port] = c["ports"]
    assert (
        port["containerPort"] == int(env["FRAMEWIRE_PORT"]) and env["FRAMEWIRE_HOST"] == "0.0.0.0"
    )
    probes = {kind: c[f"{kind}Probe"]["httpGet"] for kind in ("startup", "liveness", "readiness")}
    assert {kind: (p["path"], p["port"]) for kind, p in probes.items()} == {
        "startup": ("/healthz", port["name"]),
        "liveness": ("/healthz", port["name"]),
        "readiness": ("/readyz", port["name"]),
    }
    annotations = WORKER["spec"]["template"]["metadata"]["annotations"]
    assert annotations == {"prometheus.io/scrape": "true",
                           "prometheus.io/port": str(port["containerPort"]),
                           "prometheus.io/path": "/metrics"}  # fmt: skip
    labels = WORKER["spec"]["template"]["metadata"]["labels"]
    service, policy = the("Service"), the("NetworkPolicy")
    assert service["spec"]["selector"] == labels == WORKER["spec"]["selector"]["matchLabels"]
    assert service["spec"]["ports"][0]["targetPort"] == port["name"]
    assert policy["spec"]["podSelector"]["matchLabels"] == labels
    assert policy["spec"]["ingress"][0]["ports"] == [{"port": port["name"], "protocol": "TCP"}]


# --- the container's command, run here ---------------------------------------------------------


def status(http: httpx.Client, path: str) -> int | None:
    try:
        return http.get(path).status_code
    except httpx.TransportError:  # not listening yet
        return None


def test_the_daemonset_command_serves_outside_a_container(tmp_path):
    image, c = dockerfile(), container(WORKER, "worker")
    token = secrets.token_hex(16)
    env = environment(c, image, {TOKEN: token})
    env = moved(env, {m["mountPath"]: tmp_path / m["name"] for m in c["volumeMounts"]})
    env.pop("FRAMEWIRE_ENCODERS")  # the engines' ffmpeg binaries are the image's own files
    # The pod has a network namespace of its own; here the machine's loopback stands in
    # for it, on a port that is free.
    env |= {"FRAMEWIRE_HOST": "127.0.0.1", "FRAMEWIRE_PORT": str(free_port())}
    base = f"http://127.0.0.1:{env['FRAMEWIRE_PORT']}"
    with entrypoint(argv(c, image), env, tmp_path / "worker.log") as proc, \
            http_client(base, timeout=15) as http:  # fmt: skip
        startup = c["startupProbe"]
        deadline = time.monotonic() + startup["failureThreshold"] * startup["periodSeconds"]
        while status(http, startup["httpGet"]["path"]) != 200:
            assert proc.poll() is None, (tmp_path / "worker.log").read_text()
            assert time.monotonic() < deadline, "the startup probe never passed"
            time.sleep(0.1)
        for kind in ("liveness", "readiness"):  # as the kubelet asks: no token
            assert http.get(c[f"{kind}Probe"]["httpGet"]["path"]).status_code == 200, kind
        # Prometheus must send the token.
        assert http.get("/metrics").status_code == 401
        metrics = http.get("/metrics", headers={"authorization": f"Bearer {token}"})
        assert metrics.status_code == 200 and "framewire_requests_total" in metrics.text
        # A rank on the node: the sockets, with the token.
        with Client(f"unix://{env['FRAMEWIRE_UDS']}", token=token) as client:
            result = client.save_video(make_clip(frames=2), "rank/a.mp4", fps=24)
        assert Path(result.path) == tmp_path / "outputs" / "rank" / "a.mp4"
        assert ping(env["FRAMEWIRE_FD_SOCKET"]).ok


def test_the_ranks_keep_their_cores_and_the_worker_runs_beside_them():
    """Encodes yield across pods by where they run: a Guaranteed rank pod (every container's
    CPU and memory requests equal to its limits, whole CPUs) gets cores of its own under
    the kubelet's static CPU manager; the worker, Burstable (a CPU request, no CPU limit),
    runs on the shared pool, weighed there by its request."""
    rank = pod(the("Pod", EXAMPLE))
    for c in rank["containers"]:
        requests, limits = c["resources"]["requests"], c["resources"]["limits"]
        for kind in ("cpu", "memory"):
            assert requests[kind] == limits[kind], (c["name"], kind)
        assert float(requests["cpu"]).is_integer() and int(requests["cpu"]) >= 1
    worker = container(WORKER, "worker")["resources"]
    assert "cpu" in worker["requests"] and "cpu" not in worker.get("limits", {})
    guide = (REPO / "docs" / "deployment.md").read_text()
    assert "--cpu-manager-policy=static" in guide and "Guaranteed" in guide
