"""What a stream refuses of a chunk while the session goes on: order, dtype, shape, count."""

from __future__ import annotations

from framewire.core.errors import BadRequest, Conflict
from framewire.core.wire import StreamChunk, StreamOpen
from framewire.service._sources.frames import Geometry


def refuse_misfit(received: int, g: Geometry, spec: StreamOpen, chunk: StreamChunk) -> None:
    """A chunk out of order or of another geometry is refused; the session goes on."""
    src = chunk.source
    if chunk.first_frame != received:
        raise Conflict(
            f"chunk starts at frame {chunk.first_frame}; the stream has received "
            f"{received} frames, so the next chunk starts at {received}",
            code="out_of_order",
        )
    if src.dtype is not g.dtype:
        raise BadRequest(f"chunk of {src.dtype}; the stream is {g.dtype}", code="bad_dtype")
    if src.layout is not g.layout or (src.height, src.width) != (g.height, g.width):
        raise BadRequest(
            f"chunk of {src.width}x{src.height} in {src.layout}; the stream is "
            f"{g.width}x{g.height} in {g.layout}",
            code="bad_shape",
        )
    expected = spec.frames
    if expected is not None and received + src.frames > expected:
        raise BadRequest(
            f"the stream was opened for {expected} frames; this chunk would make "
            f"{received + src.frames}",
            code="too_many_frames",
        )
