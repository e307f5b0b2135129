"""What every integration shares: the switch, one client per process (another after a
fork), the paths the worker may write, the bound on a worker's answers, the check of
what it wrote, and the engine's log kept to plain lines."""

from __future__ import annotations

import hashlib
import itertools
import logging
import os
import time

import httpx
import numpy as np
import pytest
from framewire.client import OutputResult
from framewire.integrations import _worker
from framewire.integrations._route import guarded, route
from framewire.integrations._switch import ENV, Declined, clean, clean_code, enabled
from framewire.integrations._worker import Mismatch, Silent, Worker, checked, timed_out


@pytest.mark.parametrize(("value", "name", "on"), [
    ("", "sglang", False), ("sglang", "sglang", True), ("vllm-omni, SGLang", "sglang", True),
    ("sglang", "vllm-omni", False), ("all", "diffusers", True), ("sglangx", "sglang", False),
])  # fmt: skip
def test_only_what_framewire_integrations_names_is_on(monkeypatch, value, name, on):
    monkeypatch.setenv(ENV, value)
    assert enabled(name) is on


def test_one_client_per_process_and_another_in_a_forked_child(monkeypatch, tmp_path):
    monkeypatch.setenv("FRAMEWIRE_URL", f"unix://{tmp_path / 'api.sock'}")
    worker = Worker()
    parent = worker.client()
    assert worker.client() is parent  # made once, lazily
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: its own client, never its parent's connections
        os.write(write, b"1" if worker.client() is not parent else b"0")
        os._exit(0)
    os.close(write)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0 and os.read(read, 1) == b"1"
    os.close(read)
    monkeypatch.setenv("FRAMEWIRE_URL", f"unix://{tmp_path / 'other.sock'}")
    assert worker.client() is not parent  # another worker named: another client
    parent.close()


def test_a_path_outside_the_worker_roots_is_declined(worker, tmp_path, monkeypatch):
    monkeypatch.setenv("FRAMEWIRE_URL", worker.uds_url)
    routes = Worker()
    inside = worker.outputs / "sub" / "a.mp4"
    assert routes.target(inside) == str(inside)
    monkeypatch.chdir(worker.outputs)
    assert routes.target("b.mp4") == str(worker.outputs / "b.mp4")  # as the engine opens it
    for outside in (tmp_path / "a.mp4", worker.outputs / ".." / "escape.mp4"):
        with pytest.raises(Declined):
            routes.target(outside)
    (worker.outputs / "link").symlink_to(tmp_path)
    with pytest.raises(Declined):
        routes.target(worker.outputs / "link" / "a.mp4")  # a link out of the roots
    routes.client().close()


@pytest.mark.parametrize(("value", "bound"), [(None, 90.0), ("2.5", 2.5), ("0", 90.0),
                                              ("soon", 90.0)])  # fmt: skip
def test_the_client_waits_on_the_worker_for_the_bound_at_most(monkeypatch, tmp_path, value, bound):
    """Not the client's hour: FRAMEWIRE_INTEGRATION_TIMEOUT_S, 90 s by default (past the
    worker's own 60 s bound on an ffmpeg that makes no progress)."""
    monkeypatch.setenv("FRAMEWIRE_URL", f"unix://{tmp_path / 'api.sock'}")
    if value is None:
        monkeypatch.delenv(_worker.TIMEOUT_ENV, raising=False)
    else:
        monkeypatch.setenv(_worker.TIMEOUT_ENV, value)
    client = Worker().client()
    assert client.fd_timeout == bound
    client.close()


def test_a_worker_that_timed_out_is_left_alone_for_the_bound(monkeypatch, tmp_path):
    monkeypatch.setenv(_worker.TIMEOUT_ENV, "0.3")
    monkeypatch.setenv("FRAMEWIRE_URL", f"unix://{tmp_path / 'a.sock'}")
    worker = Worker()
    worker.went_silent()
    with pytest.raises(Silent):
        worker.client()
    monkeypatch.setenv("FRAMEWIRE_URL", f"unix://{tmp_path / 'b.sock'}")
    worker.client().close()  # another worker: asked
    monkeypatch.setenv("FRAMEWIRE_URL", f"unix://{tmp_path / 'a.sock'}")
    time.sleep(0.35)
    worker.client().close()  # asked again after the bound


def test_a_timeout_is_told_from_other_failures_through_the_cause_chain():
    def chained(*chain: BaseException) -> BaseException:
        for inner, outer in itertools.pairwise(chain):
            outer.__cause__ = inner
        return chain[-1]

    assert timed_out(chained(httpx.ReadTimeout("read"), OSError("lost"), RuntimeError("x")))
    assert timed_out(TimeoutError("the fd socket"))
    assert not timed_out(chained(httpx.ConnectError("refused"), RuntimeError("x")))


def result_of(data: bytes, **changed: object) -> OutputResult:
    fields = {"path": "memory://v.mp4", "ok": True, "bytes": len(data),
              "sha256": hashlib.sha256(data).hexdigest(), **changed}  # fmt: skip
    return OutputResult.model_validate(fields)


def test_an_output_is_checked_against_what_the_worker_reported(tmp_path):
    data = b"an mp4's bytes"
    path = tmp_path / "a.mp4"
    path.write_bytes(data)
    assert checked(str(path), result_of(data)).sha256 == hashlib.sha256(data).hexdigest()
    for bad in (result_of(data, sha256="0" * 64), result_of(data, bytes=len(data) + 1)):
        with pytest.raises(Mismatch, match="not the one the worker reported"):
            checked(str(path), bad)
    with pytest.raises(Mismatch, match="not at the path"):
        checked(str(tmp_path / "gone.mp4"), result_of(data))
    memory = result_of(data)
    memory.data = data
    assert checked("memory://v.mp4", memory) is memory
    memory.data = b"other bytes"
    with pytest.raises(Mismatch):
        checked("memory://v.mp4", memory)


def test_a_workers_words_are_one_plain_line_without_the_token(monkeypatch):
    monkeypatch.setenv("FRAMEWIRE_TOKEN", "t0ken")
    said = clean("no\nframewire: FORGED\r\x1b[31m\u2028 t0ken " + "x" * 500)
    assert "\n" not in said and "\r" not in said and "\x1b" not in said and "\u2028" not in said
    assert said.startswith("no\\nframewire: FORGED\\r\\x1b[31m\\u2028 [token] ")
    assert len(said) == 240 and said.endswith("...")
    assert clean_code("encoder_unavailable") == "encoder_unavailable"
    for hostile in ("bad\ncode", "A" * 80, "", None, 7, "ünïcode"):
        assert clean_code(hostile) == "an unknown code"


def test_the_engines_own_error_goes_to_the_caller_unchanged():
    def routed() -> str:
        raise RuntimeError("framewire's own bug")

    def original(x: int) -> str:
        raise ValueError(f"the engine's own error {x}")

    with pytest.raises(ValueError, match="the engine's own error 3"):
        route("test", routed, original, (3,), {})
    assert route("test", routed, lambda x: f"engine {x}", (4,), {}) == "engine 4"


def test_a_guarded_step_never_raises_and_says_so_once(caplog):
    def boom() -> None:
        raise KeyError("x\ny")

    with caplog.at_level(logging.WARNING, logger="framewire.integrations"):
        guarded("a test step", boom)
        guarded("a test step", boom)
    [said] = [r.getMessage() for r in caplog.records if "a test step" in r.getMessage()]
    assert said == "framewire: a test step failed (KeyError: 'x\\ny'): the engine's own code runs"


class Recorder:
    """A stream writer that keeps what each ``write`` was given (copied, as the client's
    copies it) and where its buffer was."""

    def __init__(self) -> None:
        self.chunks: list[bytes] = []
        self.buffers: set[int] = set()
        self.result: OutputResult | None = None

    def write(self, chunk: np.ndarray) -> None:
        self.chunks.append(chunk.tobytes())
        self.buffers.add(chunk.__array_interface__["data"][0])

    def __enter__(self) -> Recorder:
        return self

    def __exit__(self, *exc: object) -> None:
        data = b"".join(self.chunks)
        digest = hashlib.sha256(data).hexdigest()
        self.result = OutputResult(
            ok=True, path="memory://v.mp4", bytes=len(data), sha256=digest, data=data
        )


def test_a_list_of_frames_goes_in_bounded_chunks_through_one_buffer(monkeypatch):
    """20 float frames, quantized as vLLM-omni does: three chunks (8, 8, 4 frames), all
    written from one chunk buffer (nothing allocated per frame or per chunk), bytes equal
    to the stack's; a frame of another shape is refused as np.stack refuses it."""
    from framewire.integrations._vllm_omni_hooks import _quantizer

    recorder = Recorder()

    class Client:
        def open_video(self, target: str, **options: object) -> Recorder:
            return recorder

    monkeypatch.setattr(_worker.WORKER, "client", lambda: Client())
    rng = np.random.default_rng(3)
    frames = [rng.random((6, 10, 3), dtype=np.float32) * 1.4 - 0.2 for _ in range(20)]
    result = _worker.write_frames("memory://v.mp4", frames, _quantizer())
    quantized = [np.rint(np.clip(f, 0, 1) * np.float32(255)).astype(np.uint8) for f in frames]
    stacked = np.stack(quantized)
    assert [len(c) for c in recorder.chunks] == [8 * 180, 8 * 180, 4 * 180]
    assert len(recorder.buffers) == 1
    assert result.data == stacked.tobytes()
    with pytest.raises(ValueError, match="one shape"):
        _worker.write_frames("memory://v.mp4", [*frames[:9], frames[9][:5]], _quantizer())
