"""The worker's image, built and run for real: docker/Dockerfile under Debian's podman, from a
base image made of Debian packages, then compose.yaml under podman-compose and the
DaemonSet's pod under ``podman kube play``.

Run by scripts/test-image (and so by .ci/run), never by scripts/test: one build takes
minutes. The files are used as shipped but for what this machine cannot have: the GPU
reservation (an override file here), the node selection and the GPU runtime class, and the
Secret objects (their values are given inline).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.support import REPO
from tests.support.image import LOCK, lockfile
from tests.support.podman import BASE, IMAGE, Podman, build_base, build_image, install
from tests.support.real import needs_root

REBUILT = "localhost/framewire-test:rebuilt"
TAGS = (BASE, IMAGE, REBUILT)
PROJECT = "framewire"  # compose.yaml's name: containers framewire_worker_1, volumes framewire_*
WORKER, DEMO = f"{PROJECT}_worker_1", f"{PROJECT}_demo_1"
GRACE_S = 45  # compose's stop_grace_period
TOKEN = "image-test-token-0123456789"
CONTEXT = ("pyproject.toml", "README.md", "requirements.lock", "docker", "core", "client",
           "service", "integrations")  # fmt: skip

pytestmark = needs_root  # rootful podman

timings: dict[str, float] = {}


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def podman(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Podman]:
    install()
    engine = Podman(tmp_path_factory.mktemp("podman"))
    yield engine
    engine.reset()


@pytest.fixture(scope="module")
def image(podman: Podman, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The image, built from this checkout on a fresh storage (no layer cached), then once
    more after a source change (every layer but framewire's own cached)."""
    work = tmp_path_factory.mktemp("build")
    t0 = time.monotonic()
    build_base(podman, work)
    timings["base image (mmdebstrap + import)"] = time.monotonic() - t0

    def build(context: Path, tag: str) -> float:
        t = time.monotonic()
        build_image(podman, work, context, tag)
        return time.monotonic() - t

    timings["build, nothing cached"] = build(REPO, IMAGE)
    changed = work / "context"
    changed.mkdir()
    for name in CONTEXT:
        if (REPO / name).is_dir():
            shutil.copytree(REPO / name, changed / name, ignore=shutil.ignore_patterns("*.pyc"))
        else:
            shutil.copy2(REPO / name, changed / name)
    with (changed / "service" / "__init__.py").open("a") as f:
        f.write("# a source change\n")
    timings["build after a source change"] = build(changed, REBUILT)
    podman("rmi", REBUILT)
    size = int(podman("image", "inspect", IMAGE, "--format", "{{.Size}}").stdout)
    timings["image size (MB)"] = size / 1e6
    yield IMAGE
    print("\n" + "\n".join(f"  {k}: {v:,.1f}" for k, v in timings.items()))


def test_the_image_runs_the_locked_versions_and_the_same_ffmpeg(podman, image):
    """What the image installed is the lock's image part, version for version, and so is the
    environment the tests run in: the same ffmpeg binary, to the byte."""
    lf = lockfile()
    wanted = lf.needed_by(lf.pins(LOCK.read_text()), "image.in")
    script = (
        "import importlib.metadata as m, json, imageio_ffmpeg as f, hashlib;"
        "print(json.dumps({'dists': {d.metadata['Name']: d.version for d in m.distributions()},"
        "'ffmpeg': hashlib.sha256(open(f.get_ffmpeg_exe(), 'rb').read()).hexdigest()}))"
    )
    run = podman("run", "--rm", "--entrypoint", "python", image, "-c", script)
    found = json.loads(run.stdout)
    versions = {lf.canonical(k): v for k, v in found["dists"].items()}
    assert {n: versions.get(n) for n in wanted} == {n: p.version for n, p in wanted.items()}
    assert not {"pytest", "mypy", "ruff", "moto", "uv"} & set(versions)  # no dev tools
    import imageio_ffmpeg

    assert found["ffmpeg"] == sha256(Path(imageio_ffmpeg.get_ffmpeg_exe()))


def test_an_encoder_in_the_image_may_yield(podman, image):
    """Under the container's default seccomp profile and without capabilities, the worker
    can give a child its encoders' default priority (niceness 19, SCHED_BATCH), and the
    idle policy: what the worker does to every big encode's ffmpeg."""
    script = (
        "import subprocess; from framewire.core.media.priority import Priority, lower_priority\n"
        "for policy in ('batch', 'idle'):\n"
        "    child = subprocess.Popen(['sleep', '30'])\n"
        "    lower_priority(child.pid, Priority(19, policy))\n"
        "    f = open(f'/proc/{child.pid}/stat').read().rsplit(')', 1)[1].split()\n"
        "    print(policy, f[16], f[38]); child.kill()\n"
    )
    run = podman("run", "--rm", "--cap-drop", "ALL", "--entrypoint", "python", image, "-c", script)
    assert run.stdout.split() == ["batch", "19", "3", "idle", "19", "5"], run.stdout + run.stderr


def test_pyav_writers_fork_from_their_template_in_the_image(podman, image):
    """Under the container's default seccomp profile, without capabilities, as the image's
    user: pidfds can be made and signalled through, and the installed template (which
    finds the writer beside it) forks a writer that writes its output, says it is done,
    and whose status the template reports."""
    script = (
        "import os, socket\n"
        "from framewire.service._encode.forks import Template, pidfds_work\n"
        "from framewire.service._encode.profiles import PYAV_TEMPLATE\n"
        "template = Template(PYAV_TEMPLATE)\n"
        "mine, theirs = socket.socketpair(); err = os.memfd_create('err')\n"
        "job = ['--size', '64x48', '--rate', '24/1', '--crf', '18', '--threads', '1',\n"
        "       '/tmp/one.mp4']\n"
        "writer = template.fork(job, [], theirs.fileno(), err); theirs.close()\n"
        "writer.stdin.write(bytes(64 * 48 * 3 * 2)); writer.stdin.close()\n"
        "mine.settimeout(60); said = mine.recv(16)\n"
        "print(pidfds_work(), said == b'done\\n', writer.wait(60),\n"
        "      os.path.getsize('/tmp/one.mp4') > 0, os.pread(err, 4096, 0))\n"
        "template.discard()\n"
    )
    run = podman("run", "--rm", "--cap-drop", "ALL", "--entrypoint", "python", image, "-c", script)
    assert run.stdout.split()[:4] == ["True", "True", "0", "True"], run.stdout + run.stderr


@pytest.fixture(scope="module")
def compose(podman: Podman, image: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """compose.yaml brought up as shipped, less the GPU reservation and with its encodes not
    yielding (the suite runs beside it on the same cores: a niced x264 behind it would make
    the drain's bound a race); down (volumes too) after."""
    override = tmp_path_factory.mktemp("compose") / "no-gpu.yaml"
    override.write_text(
        "services:\n  worker:\n    deploy: !reset {}\n    environment:\n"
        "      FRAMEWIRE_ENCODE_NICE: '0'\n      FRAMEWIRE_ENCODE_SCHED: normal\n"
    )
    argv = [sys.executable, "-m", "podman_compose", "-f", str(REPO / "compose.yaml"),
            "-f", str(override)]  # fmt: skip

    def run(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
        done = podman.command([*argv, *args], timeout=timeout)
        assert done.returncode == 0, done.stdout + done.stderr
        return done

    t0 = time.monotonic()
    run("up", "-d")
    yield run, t0
    run("down", "--volumes", "--timeout", str(GRACE_S))


def volume(podman: Podman, name: str) -> Path:
    return Path(podman.inspect(f"{PROJECT}_{name}", ".Mountpoint"))


def test_compose_demo_is_byte_exact_with_the_host(podman, compose, workers):
    """The demo starts beside the worker (podman-compose does not wait for it to be healthy),
    waits for it itself, and saves through the sockets volume: the bytes the host makes."""
    _, t0 = compose
    assert podman.wait_exit(DEMO, timeout=300) == 0, podman("logs", DEMO).stderr
    timings["compose up to the demo's exit 0 (s)"] = time.monotonic() - t0
    assert "answered at unix:///run/framewire/api.sock" in podman("logs", DEMO).stdout
    made = sorted((volume(podman, "outputs") / "framewire-demo").glob("*.mp4"))
    assert len(made) == 3, made
    host = workers.start()
    demo = [sys.executable, "-m", "framewire.service", "demo", "--url", host.uds_url]
    subprocess.run(demo, check=True, capture_output=True, timeout=300)
    mine = sorted((host.outputs / "framewire-demo").glob("*.mp4"))
    ends = ("-a.mp4", "-b.mp4", "-a-streamed.mp4")
    for end in ends:
        [theirs] = [p for p in made if p.name.endswith(end)]
        [ours] = [p for p in mine if p.name.endswith(end)]
        assert sha256(theirs) == sha256(ours), end
    [whole] = [p for p in made if p.name.endswith("-a.mp4")]
    print(f"\n  demo output {whole.name}: sha256 {sha256(whole)} (the host's too)")


def _healthy(podman: Podman) -> bool:
    return podman("healthcheck", "run", WORKER, check=False).returncode == 0


def test_the_healthcheck_answers(podman, compose):
    """Healthy within the image's start period (60 s) of the worker's start: right after
    ``up`` (this test alone, or first) it may still be starting."""
    podman.wait_until("the worker's healthcheck passed", lambda: _healthy(podman), 60)
    assert podman.inspect(WORKER, ".Config.Healthcheck.Test")  # the image's, as built


def test_the_healthcheck_answers_while_another_container_takes_every_core(podman, compose):
    """The check runs in the worker's container, whose CPU weight is the least (its encodes
    yield): a busy loop per core in a container of the default weight must not make it miss
    its timeout (5 s), or an orchestrator would take a worker under load for a dead one."""
    podman.wait_until("the worker's healthcheck passed", lambda: _healthy(podman), 60)
    hog = f"{PROJECT}-hog"
    loops = "for i in $(seq $(nproc)); do (while :; do :; done) & done; wait"
    podman("run", "-d", "--rm", "--name", hog, IMAGE, "sh", "-c", loops)
    try:
        for _ in range(3):
            t0 = time.monotonic()
            assert _healthy(podman)
            took = time.monotonic() - t0
            assert took < 5, took
            timings["healthcheck, every core busy elsewhere (s)"] = took
    finally:
        podman("rm", "-f", "-t", "0", hog, check=False)


def test_the_compose_worker_has_the_least_cpu_weight(podman, compose):
    """compose.yaml's cpu_shares, as the kernel applies it to the worker's container: its
    cgroup's CPU weight against the ranks' containers (cgroup v1 shares, or v2 weight)."""
    shares = yaml.safe_load((REPO / "compose.yaml").read_text())["services"]["worker"]["cpu_shares"]
    assert podman.inspect(WORKER, ".HostConfig.CpuShares") == str(shares) == "2"
    read = "cat /sys/fs/cgroup/cpu.weight 2>/dev/null || cat /sys/fs/cgroup/cpu/cpu.shares"
    applied = podman("exec", WORKER, "sh", "-c", read).stdout.strip()
    assert applied in ("1", "2"), applied  # v2: shares 2 map to weight 1


def test_a_killed_worker_is_restarted_and_the_demo_saves_again(podman, compose):
    """restart: unless-stopped. The worker dies as if the OOM killer took it; podman starts it
    again, and the demo's next run saves through the same volume."""
    init = int(podman.inspect(WORKER, ".State.Pid"))  # compose's init: the worker's parent
    [worker] = Path(f"/proc/{init}/task/{init}/children").read_text().split()
    before = int(podman.inspect(WORKER, ".RestartCount"))
    os.kill(int(worker), signal.SIGKILL)
    podman.wait_until(
        "the worker restarted",
        lambda: (
            int(podman.inspect(WORKER, ".RestartCount")) > before
            and podman.inspect(WORKER, ".State.Status") == "running"
        ),
        timeout=60,
    )
    assert podman("start", "--attach", DEMO, check=False, timeout=300).returncode == 0


def test_sigterm_during_an_encode_drains_and_exits_0(podman, compose):
    """A client container saves a clip; once the worker's gauge shows its encode running, the
    worker is told to stop: the save completes, and the worker exits 0 within compose's grace
    period."""
    client = "framewire-test-client"
    # The compose demo saves through the same worker: its encodes must not be taken for ours.
    assert podman.wait_exit(DEMO, timeout=300) == 0, podman("logs", DEMO).stderr
    script = (
        "import numpy as np; from framewire.client import Client\n"
        "clip = np.random.default_rng(0).random((3, 96, 480, 640), dtype=np.float32)\n"
        "with Client('unix:///run/framewire/api.sock', local_fallback=False) as c:\n"
        "    r = c.save_video(clip, 'drain.mp4', fps=24, preset='slow')\n"
        "print('saved', r.frames, r.route, r.sha256, flush=True)\n"
    )
    podman(
        "run", "-d", "--name", client, "-v", f"{PROJECT}_sockets:/run/framewire",
        "--entrypoint", "python", IMAGE, "-c", script,
    )  # fmt: skip
    try:
        _wait_in_flight(podman, client, timeout=120)
        t0 = time.monotonic()
        podman("stop", "--time", str(GRACE_S), WORKER, timeout=GRACE_S + 30)
        stopped = time.monotonic() - t0
        assert podman.wait_exit(client, timeout=60) == 0, podman("logs", client).stderr
        out = podman("logs", client).stdout
        assert "saved 96 " in out and " local " not in out, out  # by the worker
        assert int(podman.inspect(WORKER, ".State.ExitCode")) == 0
        assert stopped < GRACE_S
        timings["SIGTERM to exit 0, an encode in flight (s)"] = stopped
        saved = volume(podman, "outputs") / "drain.mp4"
        assert sha256(saved) == out.split()[-1]  # complete: the bytes the client was told
    finally:
        podman("rm", "--force", client, check=False)


def _wait_in_flight(podman: Podman, client: str, timeout: float) -> None:
    """Until the compose worker's framewire_encodes_in_flight is above 0 (no token there):
    watched from inside its container, every 20 ms, so that a short encode is not missed.
    A save over 64 MiB goes as stream sessions: their encoders count as well."""
    script = (
        "import time, urllib.request as u\n"
        f"deadline = time.monotonic() + {timeout}\n"
        "while time.monotonic() < deadline:\n"
        "    try:\n"
        "        text = u.urlopen('http://127.0.0.1:7700/metrics', timeout=5).read().decode()\n"
        "    except OSError:  # not listening yet\n"
        "        text = ''\n"
        "    if any(line.startswith('framewire_encodes_in_flight ') and float(line.split()[1])\n"
        "           for line in text.splitlines()):\n"
        "        raise SystemExit(0)\n"
        "    time.sleep(0.02)\n"
        "raise SystemExit('no encode in flight')\n"
    )
    watched = podman("exec", WORKER, "python", "-c", script, timeout=timeout + 30, check=False)
    assert watched.returncode == 0, (
        f"{watched.stderr}\nclient: {podman('logs', client, check=False).stderr[-2000:]}"
        f"\nworker: {podman('logs', WORKER, check=False).stderr[-2000:]}"
    )


def _kube(doc: dict[str, Any], host: Path) -> dict[str, Any]:
    """A pod as ``podman kube play`` runs it here: the GPU node's selection, runtime class
    and limits dropped, hostPath volumes moved under ``host``, Secrets' values inline."""
    spec = doc["spec"]
    for key in ("nodeSelector", "tolerations", "runtimeClassName"):
        spec.pop(key, None)
    for vol in spec["volumes"]:
        if "hostPath" in vol:
            vol["hostPath"]["path"] = f"{host}{vol['hostPath']['path']}"
    for c in spec.get("initContainers", []) + spec["containers"]:
        for env in c.get("env", []):
            if "secretKeyRef" in env.get("valueFrom", {}):
                env.pop("valueFrom")
                env["value"] = TOKEN
        c["envFrom"] = [e for e in c.get("envFrom", []) if "secretRef" not in e]
        c.get("resources", {}).pop("limits", None)
        c.get("resources", {}).pop("requests", None)
    return doc


def _get(
    podman: Podman, container: str, path: str, token: str | None = None, check: bool = True
) -> int | None:
    """The status of GET ``path`` on the worker's port, asked on the pod's own loopback
    (None, unless ``check``, when nothing answers there yet)."""
    header = f", headers={{'authorization': 'Bearer {token}'}}" if token else ""
    script = (
        "import urllib.request as u, urllib.error as e\n"
        f"req = u.Request('http://127.0.0.1:7700{path}'{header})\n"
        "try: print(u.urlopen(req, timeout=10).status)\n"
        "except e.HTTPError as x: print(x.code)\n"
    )
    run = podman("exec", container, "python", "-c", script, check=check)
    return int(run.stdout) if run.returncode == 0 else None


def test_the_daemonset_pod_and_the_example_rank(podman, image, tmp_path):
    """The DaemonSet's pod template under ``podman kube play``: its init container owns the
    hostPath volumes, the worker runs on a read-only root with its emptyDir /tmp, answers
    /healthz and /readyz, keeps /metrics for the token, and example-rank.yaml's demo exits 0
    through the hostPath sockets."""
    kube, host = REPO / "deploy" / "kubernetes", tmp_path / "host"
    daemonset = yaml.safe_load((kube / "daemonset.yaml").read_text())
    template = daemonset["spec"]["template"]
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "framewire"}, **template}
    pod["metadata"] = {"name": "framewire", "labels": template["metadata"]["labels"]}
    # podman 4.3 restarts an init container that exited 0 under restartPolicy Always (a
    # DaemonSet's); OnFailure still restarts a worker that dies.
    pod["spec"]["restartPolicy"] = "OnFailure"
    worker_yaml, rank_yaml = tmp_path / "worker.yaml", tmp_path / "rank.yaml"
    worker_yaml.write_text(yaml.safe_dump(_kube(pod, host)))
    rank = yaml.safe_load((kube / "example-rank.yaml").read_text())
    rank_yaml.write_text(yaml.safe_dump(_kube(rank, host)))
    podman("kube", "play", "--configmap", str(kube / "configmap.yaml"), str(worker_yaml))
    try:
        worker = "framewire-worker"
        podman.wait_until(
            "the pod's worker answering /healthz",
            lambda: _get(podman, worker, "/healthz", check=False) == 200,
            timeout=120,
        )
        assert _get(podman, worker, "/healthz") == 200
        assert _get(podman, worker, "/readyz") == 200
        assert _get(podman, worker, "/metrics") == 401
        assert _get(podman, worker, "/metrics", TOKEN) == 200
        assert podman.inspect(worker, ".HostConfig.ReadonlyRootfs") == "true"
        assert podman("exec", worker, "touch", "/etc/x", check=False).returncode != 0
        assert podman("exec", worker, "touch", "/tmp/x", check=False).returncode == 0
        sockets = host / "run" / "framewire"
        assert (sockets.stat().st_uid, oct(sockets.stat().st_mode)[-4:]) == (10001, "2770")
        podman("kube", "play", str(rank_yaml))
        try:
            rank_ctr = "framewire-example-rank-rank"
            assert podman.wait_exit(rank_ctr, timeout=300) == 0, podman("logs", rank_ctr).stderr
            assert "every process got the same bytes" in podman("logs", rank_ctr).stdout
        finally:
            podman("kube", "down", str(rank_yaml), check=False)
        saved = list((host / "var" / "lib" / "framewire" / "outputs" / "framewire-demo").iterdir())
        assert len(saved) == 3
    finally:
        podman("kube", "down", str(worker_yaml), check=False)
        # kube play's network, made on the first play; kube down leaves it.
        podman("network", "rm", "--force", "podman-default-kube-network", check=False)


def test_nothing_is_left_behind(podman, image, compose):
    """Last: compose down, kube down and the client's removal leave no container, pod, volume
    or network; the test's own image tags go too."""
    run, _ = compose
    run("down", "--volumes", "--timeout", str(GRACE_S))
    for tag in TAGS:
        podman("rmi", "--force", tag, check=False)
    assert podman.leftovers() == {"containers": [], "pods": [], "volumes": [], "networks": []}
    listed = podman("images", "--format", "{{.Repository}}:{{.Tag}}").stdout.split()
    assert not set(TAGS) & set(listed)
