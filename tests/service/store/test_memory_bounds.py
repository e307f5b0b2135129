"""What memory outputs a worker holds, for whom and for how long: only for callers who can
take them, each caller within its share of the slots and the bytes, none dropping another's,
and each dropped by a timer once its time is up, with no other request to trigger it."""

from __future__ import annotations

import contextlib
import os
import time

import numpy as np
import torch
from framewire.core.fdsocket import take_output

from tests.support.identity import NOBODY, as_user, open_worker, post_json
from tests.support.media import make_clip
from tests.support.real import needs_root
from tests.support.worker import metric

pytestmark = needs_root
STRANGER = 4242  # a local user the worker does not serve on its fd socket


def memory_body(source: dict, names: list[str]) -> dict:
    return {"outputs": [{"source": source, "path": f"memory://{n}", "fps": 24} for n in names]}


def post(url: str, body: dict) -> tuple[int, list]:
    """A request as the caller it runs as: its status and each output's result or code."""
    import httpx

    with httpx.Client(timeout=60) as c:
        r = c.post(f"{url}/v1/videos:encode", json=body)
    answer = r.json()
    results = [o["handoff"] or o["error"]["code"] for o in answer.get("outputs", [])]
    return r.status_code, results or [answer.get("code")]


def held_memfds(pid: int) -> int:
    held = 0
    for fd in os.listdir(f"/proc/{pid}/fd"):
        with contextlib.suppress(FileNotFoundError):  # closed while counted
            held += os.readlink(f"/proc/{pid}/fd/{fd}").startswith("/memfd:framewire-output")
    return held


def test_a_caller_who_cannot_use_the_fd_socket_is_refused_memory_outputs(segments):
    source = segments.source(make_clip(frames=2, height=16, width=16))
    with open_worker() as w:
        status, code = as_user(STRANGER, post_json, w.tcp_url, "/v1/videos:encode",
                               memory_body(source, ["a.mp4"]))  # fmt: skip
        assert (status, code) == (403, "memory_output_refused")
        status, _ = as_user(NOBODY, post_json, w.tcp_url, "/v1/videos:encode",
                            memory_body(source, ["b.mp4"]))  # fmt: skip
        assert status == 200  # a user the fd socket serves may
        with w.http() as h:
            assert metric(h, "framewire_held_outputs") == 1
        assert held_memfds(w.pid) == 1


def test_each_caller_holds_its_share_and_none_drops_anothers(segments):
    source = segments.source(make_clip(frames=2, height=16, width=16))
    with open_worker("--max-held-outputs", "4") as w:
        mine = post(w.tcp_url, memory_body(source, ["rank.mp4"]))
        assert mine[0] == 200 and len(mine[1][0]) == 32  # the rank's ticket
        # Another user asks for more than its share (half of 4): two are held, the rest
        # refused, and the rank's output is still there.
        status, theirs = as_user(NOBODY, post, w.tcp_url,
                                 memory_body(source, [f"n{i}.mp4" for i in range(4)]))  # fmt: skip
        assert sum(len(r) == 32 for r in theirs) == 2, theirs
        assert [r for r in theirs if len(r) != 32] == ["user_share", "user_share"]
        status, again = as_user(NOBODY, post, w.tcp_url, memory_body(source, ["late.mp4"]))
        assert (status, again) == (429, ["user_share"])  # refused before its encode
        # A ticket is its caller's: another user taking it is told there is none.
        taken = as_user(NOBODY, take_output, mine[1][0], w.fd_socket, 10)
        assert taken == "raised NotFound('no output is held under that ticket (taken, or expired)')"
        assert take_output(mine[1][0], w.fd_socket, 10)[4:8] == b"ftyp"  # the rank's, intact
        # The other two slots are the rank's; past the slots, everyone waits (429).
        assert post(w.tcp_url, memory_body(source, ["r2.mp4", "r3.mp4"]))[0] == 200
        assert post(w.tcp_url, memory_body(source, ["r4.mp4"])) == (429, ["handoffs_full"])


def test_the_bytes_held_are_bounded_for_each_caller(segments):
    noise = np.random.default_rng(3).integers(0, 255, (3, 12, 128, 128), np.uint8)
    source = segments.source(torch.from_numpy(noise))
    with open_worker("--held-output-bytes", str(256 << 10)) as w:
        # Each output is about 90 KiB: a limited caller's 128 KiB holds one.
        answer = as_user(NOBODY, post, w.tcp_url, memory_body(source, ["a.mp4", "b.mp4"]))
        theirs = answer[1]
        assert sorted(len(r) for r in theirs) == [10, 32], theirs  # one ticket, one user_share
        with w.http() as h:
            held = metric(h, "framewire_held_output_bytes")
        assert 64 << 10 < held <= 128 << 10


def test_an_output_nobody_takes_is_dropped_on_time_with_nothing_else_happening(segments):
    source = segments.source(make_clip(frames=2, height=16, width=16))
    with open_worker("--held-output-ttl-s", "0.5") as w:
        assert post(w.tcp_url, memory_body(source, ["a.mp4", "b.mp4"]))[0] == 200
        assert held_memfds(w.pid) == 2
        time.sleep(1.5)  # no request at all meanwhile
        assert held_memfds(w.pid) == 0
        with w.http() as h:
            assert metric(h, "framewire_held_outputs") == 0
            assert metric(h, "framewire_held_outputs_expired_total") == 2
