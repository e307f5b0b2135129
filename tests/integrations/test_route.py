"""What every integration shares: the switch, one client per process (another after a
fork), the paths the worker may write."""

from __future__ import annotations

import os

import pytest
from framewire.integrations import _route
from framewire.integrations._route import Declined, Worker, enabled


@pytest.mark.parametrize(("value", "name", "on"), [
    ("", "sglang", False), ("sglang", "sglang", True), ("vllm-omni, SGLang", "sglang", True),
    ("sglang", "vllm-omni", False), ("all", "diffusers", True), ("sglangx", "sglang", False),
])  # fmt: skip
def test_only_what_framewire_integrations_names_is_on(monkeypatch, value, name, on):
    monkeypatch.setenv(_route.ENV, value)
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
