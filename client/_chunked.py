"""A save of host frames over WHOLE_BYTES, handed over as the stream of chunks it is.

A whole-clip save shares the clip: host frames are copied into shared memory whole
before the worker reads the first one, so the caller holds a second copy of the clip
(1.5 GB for a 5 s 1344x768 float32 clip) for as long as the encode runs. Here each
output is a stream session (client._stream) written CHUNK_BYTES at a time, at most
MAX_CHUNK_FRAMES frames, through the session's two chunk buffers: the caller's extra
memory is two chunks whatever the clip's length, and the bytes are the same (a stream
session's file is byte-identical to the whole clip's save). Outputs go side by side,
under the worker's admission as one request's would.

Failures keep the encode request's contract: an output that fails does not stop the
others, whose files are complete; the first failure is raised with every output's
result (``results``).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from framewire.client._plan import Plan, blocking
from framewire.client._stream import StreamPlans
from framewire.core.errors import FramewireError
from framewire.core.frames import Frames, is_cuda
from framewire.core.wire import ErrorInfo, OutputResult

# A clip of host frames over this goes chunk by chunk: a save's extra memory here is at
# most this, or two chunks. Below it one request carries the clip (its copy is small).
WHOLE_BYTES = 64 << 20
# A chunk request costs about 1.7 ms of CPU (worker and caller together): 8 MiB chunks
# spent some 7 % of a 640x384 save's CPU on them, 16 MiB half that; two chunks stay small.
CHUNK_BYTES = 16 << 20  # 1 frame of 1344x768 float32, 3 of 832x480, 4 of 640x384
MAX_CHUNK_FRAMES = 8
POLL_S = 0.005  # while every output waits on the worker's answers


def chunked(videos: Sequence[Frames]) -> bool:
    """Whether a save of ``videos`` goes as stream sessions: every video in host memory
    (a CUDA tensor goes as an IPC handle, never copied), one at least over WHOLE_BYTES."""
    return not any(is_cuda(f.video) for f in videos) and any(f.nbytes > WHOLE_BYTES for f in videos)


def frames_per_chunk(videos: Sequence[Frames]) -> int:
    biggest = max(f.frame_bytes for f in videos)
    return max(1, min(MAX_CHUNK_FRAMES, CHUNK_BYTES // max(1, biggest)))


def _failed_result(path: str, exc: Exception) -> OutputResult:
    if isinstance(exc, FramewireError):
        error = ErrorInfo(code=exc.code, message=exc.message, detail=exc.detail)
    else:
        error = ErrorInfo(code="internal", message=str(exc))
    return OutputResult(path=path, ok=False, error=error)


def save_plan(
    writers: Sequence[StreamPlans[Any]], videos: Sequence[Frames], paths: Sequence[str]
) -> Plan[list[OutputResult]]:
    """Each of ``videos`` through its writer, then each closed; the writers ended and let
    go of whatever happens (a cancellation included).

    A writer is written to only when that does not wait on the worker (it has a free
    chunk buffer), and closed once the worker has read all its chunks: the worker may
    admit one output's encode only when another's is done (its CPU slots), so waiting
    on one output's answers while another holds the slots would wait until a session's
    idle bound. When every writer waits on the worker, the plan polls; a lone writer
    waits on its own answers instead (a poll's sleep was up to 5 ms of its end)."""
    step = frames_per_chunk(videos)
    lone = len(writers) == 1
    written = [0] * len(writers)
    failures: dict[int, Exception] = {}
    results: dict[int, OutputResult] = {}
    try:
        while len(results) + len(failures) < len(writers):
            progressed = False
            for i, (writer, frames) in enumerate(zip(writers, videos, strict=True)):
                if i in failures or i in results:
                    continue
                total = frames.dims[1]
                try:
                    if written[i] < total and (lone or writer._ready()):
                        yield from writer._write_plan(frames.span(written[i], written[i] + step))
                        written[i] = min(total, written[i] + step)
                        progressed = True
                    elif written[i] >= total and (lone or writer._all_read()):
                        results[i] = yield from writer._close_plan()
                        progressed = True
                except Exception as exc:  # this output's: the others go on
                    failures[i] = exc
                    progressed = True
                    yield from writer._end_plan()
            if not progressed:  # every writer waits on the worker's answers
                yield from blocking(time.sleep, POLL_S)
    except Exception:
        for writer in writers:
            yield from writer._end_plan()
            yield from writer._shut_plan()
        raise
    except BaseException:  # a cancellation: no step may be taken now, nothing waited for
        for writer in writers:
            writer._let_go()
        raise
    for writer in writers:
        yield from writer._shut_plan()
    if failures:
        first = failures[min(failures)]
        if isinstance(first, FramewireError):
            first.results = [
                results[i] if i in results else _failed_result(p, failures[i])
                for i, p in enumerate(paths)
            ]
        raise first
    return [results[i] for i in range(len(writers))]
