"""Whose an object is, and who may write over it.

Files have owners and mode bits the worker judges its callers by; objects have
neither, and the worker's store credentials would write any key under an
allowed prefix for anyone. So the worker stores its writer's uid with every
object (user metadata ``framewire-owner``) and writes over an object only for
that uid, or for a caller who may act for everyone (``Access.admin``: root, the
worker's own uid, a token holder it cannot identify). An object that carries no
owner, put there by anything but the worker, is an admin's to replace.

The owner is looked up (``HeadObject``) while the request is judged, before any
encode; the upload is then conditional on the object still being the one that
was judged (``If-Match`` its ETag, or ``If-None-Match: *`` where there was
none), so an object written by someone else in between is not overwritten: 409
``output_busy``. A presigned URL is only ever given for the object just written.
"""

from __future__ import annotations

from dataclasses import dataclass

from framewire.core.errors import Forbidden
from framewire.service._access.peers import Access
from framewire.service._access.urls import ObjectUrl

OWNER_META = "framewire-owner"  # x-amz-meta-framewire-owner
WORKER = "worker"  # the owner of what a caller judged as the worker wrote


@dataclass(frozen=True)
class Found:
    """An object as ``HeadObject`` found it."""

    etag: str
    owner: str | None  # None: not written through a worker


@dataclass(frozen=True)
class OwnedUrl(ObjectUrl):
    """An object URL judged for its caller: stored with ``owner``, over ``etag``."""

    owner: str = WORKER
    etag: str | None = None  # the object that may be replaced; None: none may be there


def condition(url: OwnedUrl) -> dict[str, str]:
    """The condition of a write: over the judged object, or where none is."""
    return {"IfNoneMatch": "*"} if url.etag is None else {"IfMatch": url.etag}


def judge_owner(url: ObjectUrl, access: Access, found: Found | None) -> OwnedUrl:
    """``url`` as ``access``'s caller may write it, given what is stored there now."""
    caller = access.owner(str(url))
    me = WORKER if caller is None else str(caller)
    if found is None:
        return OwnedUrl(url.bucket, url.key, owner=me)
    if found.owner == me or access.admin:
        return OwnedUrl(url.bucket, url.key, owner=found.owner or me, etag=found.etag)
    whose = "no known owner" if found.owner is None else _who(found.owner)
    raise Forbidden(
        f"output URL {url} is an object of {whose}; the caller ({_who(me)}) may not replace it",
        code="caller_not_permitted",
    )


def _who(owner: str) -> str:
    return "the worker" if owner == WORKER else f"uid {owner}"
