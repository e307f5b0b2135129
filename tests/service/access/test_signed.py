"""Signed view URLs: one session's view routes, until the expiry, under this worker's key."""

from __future__ import annotations

import time

from framewire.service._access.signed import VIEW_URL_TTL_S, ViewSigner

SID = "0123456789abcdef"


def test_a_signature_opens_one_sessions_view_routes_until_it_expires():
    signer = ViewSigner()
    query = signer.query(SID)
    assert signer.allows(f"/v1/streams/{SID}/watch", query)
    assert signer.allows(f"/v1/streams/{SID}/live.mp4", query)
    for hls in ("live.m3u8", "live/init.mp4", "live/3.m4s", "live/3.11.m4s"):
        assert signer.allows(f"/v1/streams/{SID}/{hls}", query)
    assert not signer.allows(f"/v1/streams/{SID}/live/a/b.m4s", query)  # one name below
    assert not signer.allows(f"/v1/streams/{SID}/live", query)
    assert not signer.allows(f"/v1/streams/{SID}", query)  # not the API
    assert not signer.allows(f"/v1/streams/{SID}/finish", query)
    assert not signer.allows("/v1/streams/fedcba9876543210/watch", query)  # not another's
    assert not ViewSigner().allows(f"/v1/streams/{SID}/watch", query)  # not another worker's
    expired = signer.query(SID, now=time.time() - VIEW_URL_TTL_S - 1)
    assert not signer.valid(SID, expired)
    later = query.replace("exp=", "exp=9")  # a later expiry, the same signature
    assert not signer.valid(SID, later)
    assert not signer.valid(SID, "") and not signer.valid(SID, "exp=x&sig=y")
