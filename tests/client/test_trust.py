"""A client talks to its worker's user only: another local user who takes the worker's port
or sockets while it is down gets no token, no frames and no request, and the client says
``worker_not_trusted``."""

from __future__ import annotations

import asyncio
import os
import shutil
import socket
import tempfile
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from framewire.client import AsyncClient, Client, FramewireError, decode_reference

from tests.support.identity import NOBODY, Impostor, fd_answer, http_answer
from tests.support.media import make_clip, reference_mp4, sha256
from tests.support.worker import free_port

TOKEN = "s3cret-token-of-the-worker"
WORKER_ARGS = ("--token", TOKEN)


@pytest.fixture
def base() -> Iterator[Path]:
    """A directory other users can reach (tmp_path is root's alone)."""
    made = Path(tempfile.mkdtemp(prefix="framewire-trust-"))
    made.chmod(0o755)
    yield made
    shutil.rmtree(made)


def shared_dir(path: Path) -> Path:
    """A directory every user may add names to, like /tmp (root's, sticky)."""
    path.mkdir()
    path.chmod(0o1777)
    return path


def nobodys_dir(path: Path) -> Path:
    """A directory another user (65534) made first."""
    path.mkdir()
    os.chown(path, NOBODY, NOBODY)
    path.chmod(0o777)
    return path


def outcome(call) -> str:
    """``answered``, or the code the call raised."""
    try:
        call()
    except FramewireError as exc:
        return exc.code
    return "answered"


def info_outcome(twin: type, url: str, **kw) -> str:
    """What asking ``url`` for /v1/info does, with either twin (``answered``, or the code)."""
    if twin is Client:
        with Client(url, local_fallback=False, **kw) as c:
            return outcome(c.info)

    async def ask() -> str:
        async with AsyncClient(url, local_fallback=False, **kw) as c:
            try:
                await c.info()
            except FramewireError as exc:
                return exc.code
        return "answered"

    return asyncio.run(ask())


def fake_info(fd_socket: Path) -> dict:
    return {"instance": "impostor", "sockets": {"fd_socket": str(fd_socket)}}


@pytest.mark.parametrize("twin", [Client, AsyncClient])
def test_a_port_taken_by_another_user_gets_no_token(tmp_path, twin):
    port = free_port()
    with Impostor(("127.0.0.1", port), http_answer(fake_info(tmp_path / "fd.sock"))) as spy:
        seen = info_outcome(twin, f"http://127.0.0.1:{port}", token=TOKEN)
    assert (seen, spy.received) == ("worker_not_trusted", []), f"{seen}: {spy.received}"


def test_a_port_of_the_worker_uid_named_by_the_caller_is_trusted(tmp_path, monkeypatch):
    port = free_port()
    answer = http_answer(fake_info(tmp_path / "fd.sock"))
    with (
        Impostor(("127.0.0.1", port), answer) as spy,
        Client(f"http://127.0.0.1:{port}", token=TOKEN, worker_uid=NOBODY) as c,
    ):
        assert c.info()["instance"] == "impostor"
    monkeypatch.setenv("FRAMEWIRE_WORKER_UID", str(NOBODY))
    with (
        Impostor(("127.0.0.1", port), answer) as spy2,
        Client(f"http://127.0.0.1:{port}", token=TOKEN) as c,
    ):
        assert c.info()["instance"] == "impostor"
    assert [TOKEN.encode() in data for data, _ in spy.received + spy2.received] == [True, True]


@pytest.mark.parametrize("twin", [Client, AsyncClient])
def test_a_unix_socket_served_by_another_user_gets_nothing(base, twin):
    uds = shared_dir(base / "run") / "api.sock"
    with Impostor(str(uds), http_answer(fake_info(uds.parent / "fd.sock"))) as spy:
        seen = info_outcome(twin, f"unix://{uds}", token=TOKEN)
    assert (seen, spy.received) == ("worker_not_trusted", []), f"{seen}: {spy.received}"


def test_an_fd_socket_served_by_another_user_gets_no_frames(worker, base, tmp_path):
    """The worker answers HTTP; its fd socket's path is another user's socket now, which
    answers as that worker: the frames' memfd must not go there."""
    fd_socket = shared_dir(base / "run") / "fd.sock"
    clip = make_clip(frames=4, height=16, width=16)
    with worker.http(TOKEN) as h:
        instance = h.get("/v1/info").json()["instance"]
    with (
        Impostor(str(fd_socket), fd_answer(instance)) as spy,
        Client(worker.uds_url, token=TOKEN, fd_socket=fd_socket, local_fallback=False) as c,
    ):
        seen = outcome(lambda: c.save_video(clip, "fd.mp4", fps=24))
    assert (seen, spy.received) == ("worker_not_trusted", []), f"{seen}: {spy.received}"
    assert not (worker.outputs / "fd.mp4").exists()
    # The worker itself is trusted as before.
    with Client(worker.uds_url, token=TOKEN) as c:
        result = c.save_video(clip, "fd.mp4", fps=24)
        assert c.host_route == "fd"
    assert result.sha256 == reference_mp4(clip, tmp_path / "ref.mp4")
    assert sha256(worker.outputs / "fd.mp4") == result.sha256
    (worker.outputs / "fd.mp4").unlink()


def test_a_reference_decode_is_not_asked_of_another_user(worker, base):
    """No request reaches the impostor, and no local decode hides it."""
    fd_socket = shared_dir(base / "run") / "fd.sock"
    clip = worker.inputs / "ref.mp4"
    reference_mp4(make_clip(frames=4, height=16, width=16), clip)
    with Impostor(str(fd_socket), fd_answer("impostor")) as spy:
        seen = outcome(
            lambda: decode_reference(clip, fps=24, width=16, height=16, fd_socket=fd_socket)
        )
    assert (seen, spy.received) == ("worker_not_trusted", []), f"{seen}: {spy.received}"
    with decode_reference(clip, fps=24, width=16, height=16, fd_socket=worker.fd_socket) as got:
        assert got.source == "worker" and np.asarray(got.frames).shape == (4, 16, 16, 3)
    clip.unlink()


def test_sockets_in_another_users_directory_are_not_used(worker, base, monkeypatch):
    """The default runtime directory, made first by another user, holding its own fd
    socket: a client does not connect there at all."""
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(base))
    monkeypatch.delenv("FRAMEWIRE_FD_SOCKET", raising=False)
    runtime = nobodys_dir(base / "framewire")
    clip = worker.inputs / "ref.mp4"
    reference_mp4(make_clip(frames=4, height=16, width=16), clip)
    with Impostor(str(runtime / "fd.sock"), fd_answer("impostor")) as spy:
        seen = outcome(lambda: decode_reference(clip, fps=24, width=16, height=16))
    assert (seen, spy.received) == ("worker_not_trusted", []), f"{seen}: {spy.received}"
    clip.unlink()


def host_address() -> str:
    """This host's address on its network (not loopback), or skip."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("10.254.254.254", 9))  # nothing is sent: the route picks the address
        except OSError:
            pytest.skip("no network address")
        address = s.getsockname()[0]
    if address.startswith("127."):
        pytest.skip("no network address")
    return address


@pytest.mark.parametrize("twin", [Client, AsyncClient])
def test_a_worker_on_another_host_gets_the_token_only_when_trusted(tmp_path, twin):
    """Who answers on a non-loopback address cannot be checked: the token goes there over
    plain HTTP only when the caller says so (a request without a token may go)."""
    address, port = host_address(), free_port()
    url = f"http://{address}:{port}"
    with Impostor((address, port), http_answer(fake_info(tmp_path / "fd.sock")), uid=0) as spy:
        refused = info_outcome(twin, url, token=TOKEN)
        tokenless = info_outcome(twin, url)
        trusted = info_outcome(twin, url, token=TOKEN, trust_remote=True)
    assert (refused, tokenless, trusted) == ("worker_not_trusted", "answered", "answered")
    sent = [data for data, _ in spy.received]
    assert [TOKEN.encode() in data for data in sent] == [False, True]
