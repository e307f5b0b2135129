"""The local fallback's encoder comes through the core's seam (an entry point the
service declares): installed, it is the service's; missing or broken, a save that finds
no worker says what to install, with the outage's code."""

from __future__ import annotations

from importlib.metadata import EntryPoint

import framewire.core.local as seam
import numpy as np
import pytest
from framewire.client import Client, Unavailable
from framewire.core.local import GROUP, local_encoder

from tests.support.worker import free_port


def test_the_installed_provider_is_the_services_local_encoder():
    from framewire.service import LocalEncoder

    assert isinstance(local_encoder(None), LocalEncoder)


@pytest.mark.parametrize(
    "points",
    [[], [EntryPoint("service", "framewire_not_installed._local:LocalEncoder", GROUP)]],
    ids=["none-declared", "provider-missing"],
)
def test_without_a_provider_a_save_with_no_worker_says_what_to_install(
    monkeypatch, tmp_path, points
):
    monkeypatch.setattr(seam, "entry_points", lambda group: points if group == GROUP else [])
    video = np.zeros((1, 2, 16, 16), dtype=np.float32)
    url = f"http://127.0.0.1:{free_port()}"
    with (
        Client(url, fd_socket=tmp_path / "none.sock") as c,
        pytest.raises(Unavailable, match=r"install framewire\[service\]") as raised,
    ):
        c.save_video(video, tmp_path / "out.mp4", fps=8)
    assert raised.value.code == "unavailable"
    assert list(tmp_path.iterdir()) == []  # nothing written, nothing left
