"""What an endpoint needs from the worker, handed over as FastAPI dependencies."""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Request
from framewire.service._access.peers import Access
from framewire.service._http.connections import peer_of
from framewire.service._parts import Parts

# Coroutines, though nothing here waits: FastAPI runs a plain ``def`` dependency on its
# thread pool, a hop (and its wake-ups) on every request for a dictionary lookup.


async def parts_of(request: Request) -> Parts:
    parts: Parts = request.app.state.parts
    return parts


async def access_of(request: Request) -> Access:
    """Whom a request acts for: its peer, and whether it presented the token (when one
    is set, every request that gets this far did)."""
    parts: Parts = request.app.state.parts
    return Access(peer_of(request.scope), trusted=parts.settings.token is not None)


WorkerParts = Annotated[Parts, Depends(parts_of)]
Caller = Annotated[Access, Depends(access_of)]
