"""A PyAV writer forked from its template says on its job's socket that its output is complete and
closed; the worker's wait ends at that word, not at the child's exit (its teardown runs
beside the output's checks), and the child is reaped afterwards all the same."""

from __future__ import annotations

import ast
import os
import socket
import sys
import textwrap
import time
from pathlib import Path

import av
import numpy as np
from framewire.core.media import process
from framewire.core.media.process import FfmpegProcess
from framewire.service._encode.forks import Template
from framewire.service._encode.profiles import PYAV_TEMPLATE

TEMPLATE = Path(PYAV_TEMPLATE[-1])  # read, not imported: it imports PyAV


def _writers_done() -> bytes:
    """The word as the template's writers (which import nothing of framewire) spell it."""
    for node in ast.parse(TEMPLATE.read_text()).body:
        if isinstance(node, ast.Assign) and [ast.unparse(t) for t in node.targets] == ["DONE"]:
            return ast.literal_eval(node.value)
    raise AssertionError("the template has no DONE")


def _child(tail: str) -> tuple[FfmpegProcess, socket.socket]:
    """A child reading its stdin to the end, then running ``tail`` (its socket is
    ``word``), its wait told to hear the word on the other end."""
    mine, theirs = socket.socketpair()
    code = textwrap.dedent(f"""
        import os, socket, sys, time
        word = socket.socket(fileno={theirs.fileno()})
        sys.stdin.buffer.read()
        {tail}
    """)
    ff = FfmpegProcess([sys.executable, "-c", code], pass_fds=[theirs.fileno()])
    theirs.close()
    ff.hears_done_on(mine)
    return ff, mine


def test_the_word_spelled_alike_on_both_sides():
    assert _writers_done() == process.DONE


def test_a_wait_ends_at_the_childs_word_and_close_reaps_it():
    ff, word = _child("word.sendall(b'done\\n'); time.sleep(30); os._exit(0)")
    try:
        t0 = time.monotonic()
        assert ff.wait() == 0
        assert time.monotonic() - t0 < 10 and ff.proc.poll() is None  # still there
    finally:
        ff.close()
    assert ff.proc.returncode is not None and word.fileno() == -1  # reaped, socket closed


def test_without_the_word_the_wait_ends_at_the_exit_with_its_status():
    for tail, status in (
        ("word.close(); time.sleep(0.3); os._exit(3)", 3),  # failed: closed, no word
        ("word.sendall(b'dome\\n'); time.sleep(0.3); os._exit(0)", 0),  # not the word
        ("os._exit(4)", 4),  # died with its socket open
    ):
        ff, _ = _child(tail)
        try:
            assert ff.wait() == status
            assert ff.proc.poll() == status  # the exit, not a word, ended it
        finally:
            ff.close()


def _forked(output: Path, frames: np.ndarray) -> tuple[bytes, int, int | None]:
    """What a writer forked by a real template says on its socket for a job writing
    ``output``, how many frames the file holds when it says so, and its exit status
    (the template's word)."""
    template = Template(PYAV_TEMPLATE)
    mine, theirs = socket.socketpair()
    stderr = os.memfd_create("stderr")
    _, h, w, _ = frames.shape
    size = ["--size", f"{w}x{h}", "--rate", "24/1", "--crf", "18"]
    job = [*size, "--preset", "ultrafast", "--threads", "1", str(output)]
    try:
        child = template.fork(job, [], theirs.fileno(), stderr)
        theirs.close()
        assert child.stdin is not None
        child.stdin.write(frames.tobytes())
        child.stdin.close()
        mine.settimeout(60)
        said = mine.recv(64)
        held = 0
        if said:
            with av.open(str(output)) as container:
                held = container.streams.video[0].frames
        return said, held, child.wait(60)
    finally:
        mine.close()
        os.close(stderr)
        template.discard()


def test_a_forked_writer_says_it_is_done_once_its_output_is_whole(tmp_path):
    frames = np.random.default_rng(0).integers(0, 256, (5, 32, 48, 3), np.uint8)
    assert _forked(tmp_path / "a.mp4", frames) == (process.DONE, 5, 0)
    # A job that fails says nothing: its socket closes at its exit, and the status tells.
    said, _, status = _forked(tmp_path / "missing" / "b.mp4", frames)
    assert said == b"" and status != 0
    assert not os.path.exists(tmp_path / "missing")
