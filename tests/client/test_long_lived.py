"""A client that lives as ranks do: idle past every timeout, workers restarted under it.

Real workers with short timeouts (idle 1 s), real restarts on the same sockets
(SIGTERM, SIGKILL), and one client kept across all of it: every save succeeds,
a stream whose worker went away fails with ``stream_lost`` and leaves nothing,
and with no worker at all the client writes the worker's bytes itself.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import signal
import time
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
from framewire.client import AsyncClient, Client, Unavailable, VideoWriter
from framewire.core.errors import FramewireError
from framewire.service._outputs import remove_stale_temps

from tests.support.engines import diffusers_save, sglang_save
from tests.support.media import make_clip, reference_mp4, sha256
from tests.support.processes import framewire_temps, wait_gone
from tests.support.requests import wait_for_ffmpeg
from tests.support.worker import Worker

IDLE_S = 1.0
GAP_S = 2.5  # past the worker's idle timeout and the client's keep-alive expiry
ARGS = ("--idle-timeout-s", str(IDLE_S))


def restart(workers, old: Worker, how: signal.Signals) -> Worker:
    """Stop ``old`` with ``how`` and start a new worker on the same sockets and roots."""
    old.proc.send_signal(how)
    old.proc.wait(timeout=30)
    return workers.start(*ARGS, root=old.uds.parent)


def fd_regions(worker: Worker) -> list[str]:
    with worker.http() as h:
        status = h.get("/v2/systemsharedmemory/status").json()
    return [r["key"] for r in status if r["key"].startswith("fd:")]


@pytest.mark.parametrize("url", ["uds", "tcp"])
def test_saves_after_idle_gaps_past_every_timeout_succeed(workers, tmp_path, url):
    w = workers.start(*ARGS)
    clip = make_clip(frames=6)
    want = reference_mp4(clip, tmp_path / "ref.mp4")
    with Client(w.uds_url if url == "uds" else w.tcp_url, fd_socket=w.fd_socket) as fw:
        for i in range(3):
            result = fw.save_video(clip, f"idle/{i}.mp4", fps=24)
            assert (result.route, result.sha256) == ("stream", want)
            assert fw.host_route == "fd"
            time.sleep(GAP_S)
    assert sha256(w.outputs / "idle/2.mp4") == want


def test_a_slow_stream_keeps_its_regions_between_chunks(workers, tmp_path):
    w = workers.start(*ARGS)
    clip = make_clip(frames=12)
    want = reference_mp4(clip, tmp_path / "ref.mp4")
    with Client(w.uds_url, fd_socket=w.fd_socket) as fw, fw.open_video("slow.mp4", fps=24) as out:
        for chunk in torch.split(clip, 4, dim=1):
            out.write(chunk)
            time.sleep(GAP_S)  # a slow VAE: longer than every idle timeout
        assert fw.host_route == "fd"
    assert (out.result.route, out.result.sha256) == ("stream", want)
    assert fd_regions(w) == []


@pytest.mark.parametrize("how", [signal.SIGTERM, signal.SIGKILL])
def test_one_client_lives_through_worker_restarts(workers, tmp_path, how):
    w = workers.start(*ARGS)
    clip = make_clip(frames=6)
    want = reference_mp4(clip, tmp_path / "ref.mp4")
    with Client(w.uds_url, local_fallback=False) as fw:  # the fd socket found by /v1/info
        assert fw.save_video(clip, "a.mp4", fps=24).sha256 == want
        first = fw.instance
        for i in range(2):
            w = restart(workers, w, how)
            result = fw.save_video(clip, f"r{i}.mp4", fps=24)
            assert (result.route, result.sha256) == ("stream", want)
            assert fw.instance != first and fw.host_route == "fd"
            first = fw.instance
    assert fd_regions(w) == []


def half_written(fw: Client, clip: torch.Tensor, path: str) -> VideoWriter:
    """A stream of ``clip`` opened on ``path`` with its first half written."""
    writer = fw.open_video(path, fps=24)
    writer.write(clip[:, : clip.shape[1] // 2])
    return writer


def rest_is_lost(writer: VideoWriter, clip: torch.Tensor) -> float:
    """The second half of ``clip`` and the close fail as ``stream_lost``; the seconds that
    took. The writer is aborted after (which must not raise)."""
    started = time.monotonic()
    with pytest.raises(Unavailable) as lost:
        writer.write(clip[:, clip.shape[1] // 2 :])
        writer.close()
    took = time.monotonic() - started
    assert lost.value.code == "stream_lost"
    writer.abort()
    return took


def test_a_stream_whose_worker_restarted_is_lost_and_leaves_nothing(workers):
    w = workers.start(*ARGS)
    clip = make_clip(frames=8)
    with Client(w.uds_url, fd_socket=w.fd_socket) as fw:
        writer = half_written(fw, clip, "lost/s.mp4")
        w = restart(workers, w, signal.SIGKILL)
        rest_is_lost(writer, clip)
        # The client still works with the new worker.
        assert fw.save_video(clip, "after.mp4", fps=24).route == "stream"
    # The killed worker's ffmpeg flushes what it had and exits: its private directory is
    # removed at the new worker's start, or as soon as that ffmpeg lets go of it.
    assert_gone(w.outputs / "lost", timeout=10)
    assert framewire_temps(w.outputs) == []


def assert_gone(directory: Path, timeout: float) -> None:
    """``directory`` is empty (or gone) within ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while directory.exists() and list(directory.iterdir()):
        assert time.monotonic() < deadline, list(directory.iterdir())
        time.sleep(0.05)


def assert_logged(worker: Worker, line: str, timeout: float) -> None:
    """``line`` is in ``worker``'s log within ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while line not in worker.log.read_text():
        assert time.monotonic() < deadline, worker.log.read_text()
        time.sleep(0.05)


def test_a_private_directory_held_by_the_killed_workers_ffmpeg_goes_when_it_exits(workers):
    """The killed worker's ffmpeg, stopped, still holds the output's private directory (its
    lock) when the new worker starts: the new worker keeps it, then removes it once
    that ffmpeg has flushed and exited."""
    w = workers.start(*ARGS)
    clip = make_clip(frames=8)
    with Client(w.uds_url, fd_socket=w.fd_socket) as fw:
        writer = half_written(fw, clip, "held/s.mp4")
        [ffmpeg] = wait_for_ffmpeg(w)
        os.kill(ffmpeg, signal.SIGSTOP)
        try:
            w = restart(workers, w, signal.SIGKILL)
            [private] = framewire_temps(w.outputs)
            time.sleep(0.5)
            assert private.is_dir(), "removed while a process still held it"
        finally:
            os.kill(ffmpeg, signal.SIGCONT)  # reads the end of its input: flushes, exits
        rest_is_lost(writer, clip)
    assert_gone(w.outputs / "held", timeout=10)
    # The watch warns just after it removes the directory: the line may trail the removal.
    assert_logged(w, f"removed {private}, left by a worker that was killed", timeout=5)
    wait_gone({ffmpeg})  # the killed worker's ffmpeg exited, every thread of it


def test_a_stream_whose_worker_is_down_is_lost(workers):
    w = workers.start(*ARGS)
    clip = make_clip(frames=8)
    with Client(w.uds_url, fd_socket=w.fd_socket) as fw:
        writer = half_written(fw, clip, "down.mp4")
        w.proc.send_signal(signal.SIGKILL)
        w.proc.wait(timeout=30)
        assert rest_is_lost(writer, clip) < 10
    # What the killed worker was writing, if its encode had begun, is the next worker's
    # to sweep as it starts (none starts here: swept as it would, once the encoder it
    # left behind, which holds the directory's lock, has ended).
    deadline = time.monotonic() + 30
    while True:
        held: list[Path] = []
        remove_stale_temps([str(w.outputs)], held=held)
        if not held:
            break
        assert time.monotonic() < deadline, f"still held: {held}"
        time.sleep(0.05)


# --- no worker: the local fallback --------------------------------------------------------


def nobody(tmp_path) -> str:
    return f"unix://{tmp_path / 'nobody.sock'}"


def test_no_worker_saves_locally_with_the_worker_s_bytes(workers, tmp_path, caplog):
    w = workers.start(*ARGS)
    clip = make_clip(frames=7, height=40, width=56)  # not multiples of 16: padded
    with Client(w.uds_url) as fw:
        worker_sha = fw.save_video(clip, "w.mp4", fps=24).sha256
    caplog.set_level(logging.WARNING, logger="framewire.client")
    with Client(nobody(tmp_path), fd_socket=tmp_path / "nofd.sock", output_root=tmp_path) as fw:
        results = [fw.save_video(clip, f"local/{i}.mp4", fps=24) for i in range(3)]
    assert {(r.route, r.sha256) for r in results} == {("local", worker_sha)}
    assert sha256(tmp_path / "local/2.mp4") == worker_sha
    assert worker_sha == reference_mp4(clip, tmp_path / "ref.mp4")
    warnings = [r for r in caplog.records if "encoding in this process" in r.getMessage()]
    assert len(warnings) == 1  # once per outage, not per call


def held_descriptors() -> Counter[str]:
    """What this process's descriptors name, each with how many name it (the same binary
    held twice counts twice)."""
    named: Counter[str] = Counter()
    for fd in os.listdir("/proc/self/fd"):
        try:
            named[os.readlink(f"/proc/self/fd/{fd}")] += 1
        except OSError:
            pass
    return named


@pytest.mark.parametrize("kind", ["sync", "async"])
def test_a_client_that_encoded_locally_lets_go_of_the_encoders_binaries_as_it_closes(
    tmp_path, kind
):
    """The local encoder holds each ffmpeg binary open (run from that descriptor) and may
    start a PyAV writer ahead: all of it goes when the client closes, not at exit.

    Counted against what this process held before, as what was added and is left: the
    process has run other tests, whose garbage the collector may close meanwhile (a whole
    list compared once failed so, 21 descriptors before and 19 during)."""
    clip = make_clip(frames=3, height=32, width=48)
    gc.collect()
    before = held_descriptors()
    url = nobody(tmp_path)
    if kind == "sync":
        with Client(url, fd_socket=tmp_path / "nofd.sock", output_root=tmp_path) as fw:
            assert fw.save_video(clip, "a.mp4", fps=24).route == "local"
            during = held_descriptors()
    else:

        async def go() -> list[str]:
            async with AsyncClient(url, fd_socket=tmp_path / "nofd.sock",
                                   output_root=tmp_path) as fw:  # fmt: skip
                assert (await fw.save_video(clip, "a.mp4", fps=24)).route == "local"
                return held_descriptors()

        during = asyncio.run(go())
    added = during - before
    assert any("ffmpeg" in os.path.basename(name) for name in added), added  # its binary
    assert not held_descriptors() - before  # nothing of it left once the client closed


def test_local_saves_keep_each_profile_s_bytes(tmp_path):
    clip = make_clip(frames=5, height=64, width=96)
    with Client(nobody(tmp_path), fd_socket=tmp_path / "nofd.sock", output_root=tmp_path) as fw:
        sglang = fw.save_video(clip, "s.mp4", fps=23.976, quality=5.5, profile="sglang")
        frames = clip.permute(1, 2, 3, 0).numpy()
        diffusers = fw.save_video(frames, "d.mp4", fps=8, profile="diffusers")
        imageio_u8 = fw.save_video((frames * 255).astype(np.uint8), "u.mp4", fps=24, quality=7)
    assert sglang.sha256 == sglang_save(
        clip, tmp_path / "sref.mp4", fps=23.976, output_compression=55
    )
    assert diffusers.sha256 == diffusers_save(frames, tmp_path / "dref.mp4", fps=8)
    u8 = torch.from_numpy((frames * 255).astype(np.uint8)).permute(3, 0, 1, 2)
    assert imageio_u8.sha256 == reference_mp4(u8, tmp_path / "uref.mp4", quality=7)


def test_a_stream_with_no_worker_is_written_locally(tmp_path):
    clip = make_clip(frames=10)
    want = reference_mp4(clip, tmp_path / "ref.mp4")
    with Client(nobody(tmp_path), fd_socket=tmp_path / "nofd.sock", output_root=tmp_path) as fw:
        with fw.open_video("s/local.mp4", fps=24) as out:
            for chunk in torch.split(clip, 3, dim=1):
                out.write(chunk)
        assert out.frames_received == 10
    assert (out.result.route, out.result.sha256) == ("local", want)
    assert sha256(tmp_path / "s/local.mp4") == want


def test_an_aborted_local_stream_leaves_nothing(tmp_path):
    clip = make_clip(frames=6)
    fw = Client(nobody(tmp_path), output_root=tmp_path)
    with fw, pytest.raises(RuntimeError), fw.open_video("gone/x.mp4", fps=24) as out:
        out.write(clip[:, :3])
        raise RuntimeError("the producer failed")
    assert not (tmp_path / "gone/x.mp4").exists()
    assert framewire_temps(tmp_path) == []


def test_without_the_fallback_no_worker_is_unavailable_within_seconds(tmp_path):
    clip = make_clip(frames=4)
    started = time.monotonic()
    with Client(nobody(tmp_path), local_fallback=False) as fw, pytest.raises(Unavailable):
        fw.save_video(clip, "x.mp4", fps=24)
    assert time.monotonic() - started < 5
    assert not (tmp_path / "x.mp4").exists()


def test_a_relative_path_needs_a_local_root(tmp_path, monkeypatch):
    from framewire.client import BadRequest

    monkeypatch.delenv("FRAMEWIRE_OUTPUT_ROOTS", raising=False)
    with Client(nobody(tmp_path)) as fw, pytest.raises(BadRequest) as refused:
        fw.save_video(make_clip(frames=3), "rel.mp4", fps=24)
    assert refused.value.code == "no_output_root"
    monkeypatch.setenv("FRAMEWIRE_OUTPUT_ROOTS", f"{tmp_path / 'env'},/elsewhere")
    with Client(nobody(tmp_path)) as fw:
        assert fw.save_video(make_clip(frames=3), "rel.mp4", fps=24).route == "local"
        absolute = fw.save_video(make_clip(frames=3), tmp_path / "abs/a.mp4", fps=24)
    assert (tmp_path / "env/rel.mp4").exists() and absolute.path == str(tmp_path / "abs/a.mp4")


# What the worker refuses to write, the local fallback refuses with the same class and code.
REFUSED_PATHS = [
    ("../escape.mp4", "path_traversal"),
    ("out/escape.mp4", "path_outside_roots"),  # out: a link to a directory outside the root
    ("sub/.framewire-tmp-1-0123456789abcdef/x.mp4", "reserved_name"),
    ("sub/img%03d.png", "unsupported_output_format"),
]


def _refusal(call) -> tuple[type[FramewireError], str]:
    with pytest.raises(FramewireError) as refused:
        call()
    return type(refused.value), refused.value.code


@pytest.mark.parametrize(("path", "code"), REFUSED_PATHS)
def test_the_local_fallback_refuses_the_paths_the_worker_refuses(workers, tmp_path, path, code):
    w = workers.start(*ARGS)
    outside, root = tmp_path / "outside", tmp_path / "root"
    outside.mkdir()
    root.mkdir()
    for where in (w.outputs, root):
        (where / "out").symlink_to(outside, target_is_directory=True)
    clip = make_clip(frames=3)
    with Client(w.uds_url) as fw:
        by_worker = _refusal(lambda: fw.save_video(clip, path, fps=24))
    assert by_worker[1] == code
    with Client(nobody(tmp_path), fd_socket=tmp_path / "nofd.sock", output_root=root) as fw:
        assert _refusal(lambda: fw.save_video(clip, path, fps=24)) == by_worker

        def stream() -> None:
            with fw.open_video(path, fps=24) as out:
                out.write(clip)

        assert _refusal(stream) == by_worker
    # Nothing was written, made or left anywhere.
    assert list(outside.iterdir()) == [] and not (tmp_path / "escape.mp4").exists()
    assert sorted(p.name for p in root.iterdir()) == ["out"]
    assert framewire_temps(tmp_path) == []


def test_the_async_client_lives_through_idle_gaps_and_outages(workers, tmp_path):
    w = workers.start(*ARGS)
    clip = make_clip(frames=6)
    want = reference_mp4(clip, tmp_path / "ref.mp4")

    async def run() -> list[tuple[str | None, str | None]]:
        got = []
        async with AsyncClient(w.uds_url, output_root=tmp_path) as fw:
            got.append(((r := await fw.save_video(clip, "a0.mp4", fps=24)).route, r.sha256))
            await asyncio.sleep(GAP_S)
            got.append(((r := await fw.save_video(clip, "a1.mp4", fps=24)).route, r.sha256))
            w.proc.send_signal(signal.SIGKILL)
            w.proc.wait(timeout=30)
            got.append(((r := await fw.save_video(clip, "a2.mp4", fps=24)).route, r.sha256))
            async with fw.open_video("a3.mp4", fps=24) as out:
                await out.write(clip)
            got.append((out.result.route, out.result.sha256))
        return got

    assert asyncio.run(run()) == [("stream", want)] * 2 + [("local", want)] * 2
