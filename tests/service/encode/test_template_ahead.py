"""What the PyAV template does ahead of a job, so that a job finds it done: the imports
a writer would make (none is left for a job), and a writer forked ahead (a spare) that
takes the next job, replaced when it dies, never outliving the template."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from framewire.client import Client
from framewire.core.media.adopted import Adopted
from framewire.service._encode.forks import Template
from framewire.service._encode.profiles import PYAV_TEMPLATE

from tests.support.media import make_clip
from tests.support.processes import child_pids
from tests.support.pyav_forks import (
    dead,
    group_nice_of,
    named,
    running_writer,
    spare_of,
    until,
    wait_for_template,
    write,
)


def test_a_writers_job_imports_nothing_the_template_has_not(tmp_path):
    """Whatever a job imports (PyAV imports some of its modules on first use), each
    writer forked from the template imports again: the template's import of the writer
    holds all of them, and a job imports none."""
    script = (
        "import importlib.util, json, os, sys\n"
        f"spec = importlib.util.spec_from_file_location('t', {PYAV_TEMPLATE[-1]!r})\n"
        "template = importlib.util.module_from_spec(spec)\n"
        "spec.loader.exec_module(template)\n"
        "before = set(sys.modules)\n"
        "code = template.writer.run(sys.argv[1:])\n"
        "print(json.dumps([code, sorted(set(sys.modules) - before)]))\n"
    )
    frames = make_clip(2, 48, 64).mul(255).round().byte().permute(1, 2, 3, 0).numpy()
    out = tmp_path / "v.mp4"
    size = ["--size", "64x48", "--rate", "24/1", "--crf", "18", "--preset", "ultrafast"]
    argv = [*size, "--threads", "0", str(out)]
    run = [sys.executable, "-P", "-c", script, *argv]
    ran = subprocess.run(run, input=frames.tobytes(), capture_output=True, timeout=60)
    assert ran.returncode == 0, ran.stderr
    code, imported = json.loads(ran.stdout.splitlines()[-1])
    assert code == 0 and out.stat().st_size > 0
    assert imported == []


def test_the_next_job_goes_to_a_spare_forked_ahead(workers):
    """Once no writer has run for SPARE_AFTER_S the template forks a writer ahead, in a
    session of its own already; the next encode's job goes to it (no fork on that
    encode's path), with the encode's priority and the same bytes. A spare killed
    before its job is reaped and replaced; the spare goes with the template."""
    w = workers.start(yielding=True)
    clip = make_clip(frames=6, height=48, width=64)
    with Client(w.uds_url, local_fallback=False) as c:
        first = write(c, "a.mp4", clip)  # afresh: no template yet
        template = wait_for_template(w)
        spare = spare_of(template)
        assert os.getsid(spare) == spare != os.getsid(template)
        writer, forked = running_writer(c, template, "b.mp4", clip)
        assert forked == spare
        until(lambda: group_nice_of(forked) == 19, 3, "the writer's group is not at 19")
        second = writer.close()
        following = until(
            lambda: named(child_pids(template), "pyav-spare") - {spare}, 10, "no spare again"
        )
        [killed] = following
        os.kill(killed, signal.SIGKILL)
        until(lambda: not Path(f"/proc/{killed}").exists(), 10, "the spare was not reaped")
        third = write(c, "c.mp4", clip)  # forked for it, or given to a spare forked since
        last = spare_of(template)
        assert killed != last and not dead(last)
    assert first.sha256 == second.sha256 == third.sha256
    w.stop()
    assert not Path(f"/proc/{last}").exists()


def test_an_idle_spare_goes_with_a_killed_template_and_a_killed_worker(workers, tmp_path):
    """A spare waiting for a job never outlives its template: its job's socket ends with
    the template (and the parent-death signal kills it besides), and the template ends
    it when the worker is gone (the worker's socket's end)."""
    w = workers.start(root=tmp_path / "a")
    clip = make_clip(frames=6, height=48, width=64)
    with Client(w.uds_url, local_fallback=False) as c:
        write(c, "a.mp4", clip)
        template = wait_for_template(w)
        spare = spare_of(template)
        os.kill(template, signal.SIGKILL)
        until(lambda: dead(spare), 10, "the spare outlived its template")
        write(c, "b.mp4", clip)  # afresh; another template is started after it
        following = wait_for_template(w, frozenset({template}))
        spare = spare_of(following)
        os.kill(w.pid, signal.SIGKILL)
        w.proc.wait()
        until(lambda: dead(spare) and dead(following), 10, "the spare or its template lives on")


def test_a_spare_found_dead_as_its_job_comes_is_replaced_by_a_fork(tmp_path):
    """The spare dies, and a job comes, before the template looks (both in one of its
    polls): the job gets a writer forked for it, and the dead spare's stale word is
    taken for nothing else (its pidfd's number may be the new writer's): the template
    answers another job while that writer runs, and says each writer's status as it
    ends."""
    template = Template(PYAV_TEMPLATE)
    pid = template.process.proc.pid
    running: list[Adopted] = []
    fds: list[int] = []

    def job() -> Adopted:
        word, theirs = socket.socketpair()
        stderr = os.memfd_create("stderr")
        fds.extend([word.detach(), stderr])
        size = ["--size", "64x48", "--rate", "24/1", "--crf", "18", "--threads", "1"]
        argv = [*size, str(tmp_path / f"{len(fds)}.mp4")]
        try:
            return template.fork(argv, [], theirs.fileno(), stderr)
        finally:
            theirs.close()

    def ended(writer: Adopted) -> None:
        assert writer.stdin is not None
        writer.stdin.write(bytes(64 * 48 * 3))
        writer.stdin.close()
        assert writer.wait(10) == 0

    def after_a_dead_spare() -> Adopted:
        spare = spare_of(pid)
        time.sleep(0.3)  # the template back in its poll, the spare's pidfd in it
        os.kill(pid, signal.SIGSTOP)
        os.kill(spare, signal.SIGKILL)
        until(lambda: dead(spare), 10, "the spare lives on")
        with ThreadPoolExecutor(1) as pool:
            first = pool.submit(job)
            time.sleep(0.2)  # the job waits in the socket beside the spare's death
            os.kill(pid, signal.SIGCONT)
            running.append(first.result(timeout=10))
        assert running[-1].pid != spare
        return running[-1]

    try:
        writer = after_a_dead_spare()
        running.append(job())  # answered while that writer waits for its frames
        ended(writer)
        ended(running[-1])
        ended(after_a_dead_spare())  # its status comes with no other job after it
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGCONT)
        for each in running:
            each.release()
        template.discard()
        for fd in fds:
            os.close(fd)
