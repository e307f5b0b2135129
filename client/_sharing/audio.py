"""A caller's waveform handed over like frames: a sealed memfd on the fd handover, else a
named shm segment. Audio is small next to video, so it is always copied once."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any, TypeVar

import numpy as np
from framewire.client._sharing.fd import FdRegions, Memfd
from framewire.core.frames import waveform
from framewire.core.shm import Segment
from framewire.core.wire import AudioDType, RegionAudio, ShmAudio, refusal
from pydantic import BaseModel, ValidationError

T = TypeVar("T", bound=BaseModel)


@contextlib.contextmanager
def shared_audio(
    audio: Any, sample_rate: int | None, regions: FdRegions | None
) -> Iterator[str | ShmAudio | RegionAudio | None]:
    """What an output's ``audio`` is on the wire: a path as it is, samples shared for the
    time of the request (released on exit)."""
    if audio is None or isinstance(audio, (str, os.PathLike)):
        yield None if audio is None else os.fspath(audio)
        return
    if sample_rate is None:
        raise ValueError("audio samples need audio_sample_rate=")
    samples = waveform(audio)
    fields: dict[str, Any] = {
        "dtype": AudioDType(samples.dtype.name),
        "shape": list(samples.shape),
        "sample_rate": int(sample_rate),
        "byte_size": samples.nbytes,
    }
    raw = samples.reshape(-1).view(np.uint8)
    if regions is not None:
        with Memfd(samples.nbytes) as memfd:
            memfd.write_bytes(raw)
            held = regions.register(memfd.fd, 0, samples.nbytes)
            try:
                yield _wire(RegionAudio, region=held.name, **fields)
            finally:
                with contextlib.suppress(Exception):  # gone with the connection already
                    regions.unregister(held)
        return
    with Segment(samples.nbytes) as segment:
        segment.write_bytes(raw)
        yield _wire(ShmAudio, key=segment.key, **fields)


def _wire(model: type[T], **fields: Any) -> T:
    """The audio's wire description; what the worker would refuse (a sample rate outside
    its bounds, say) refused here, with the worker's code."""
    try:
        return model(**fields)
    except ValidationError as exc:
        raise refusal(exc) from None
