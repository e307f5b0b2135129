"""Audio handed over in memory, made into the WAV the engines give ffmpeg.

The reference is SGLang's route: float32 samples clamped to [-1, 1] (int16 as
they are), written by ``scipy.io.wavfile.write`` and given to ffmpeg as its
second input. :func:`wav_header` lays the file out exactly as scipy 1.x does
(a tested fact), so the WAV is built in a sealed memfd here and ffmpeg reads it
through ``/proc/self/fd`` like an audio file under the input roots. The
samples are read when the request is judged, a block at a time (no whole copy
beside the WAV): a stream session holds no lease on the caller's memory for its
whole life. Outputs naming the same samples
share one WAV (``audio_store``): nothing reads it through the shared descriptor's
file position (ffmpeg opens ``/proc/self/fd/N`` anew, the PyAV child ``pread``s).
"""

from __future__ import annotations

import fcntl
import os
import struct
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import numpy as np
from framewire.core.errors import BadRequest
from framewire.core.media.inputs import InputFile
from framewire.core.wire import AudioDType, AudioSource
from framewire.service._sources.frames import pread_full

WAVE_FORMAT_PCM, WAVE_FORMAT_IEEE_FLOAT = 1, 3
AUDIO_BLOCK_BYTES = 1 << 20  # samples are read and checked this much at a time
SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_WRITE | fcntl.F_SEAL_SEAL
NUMPY: dict[AudioDType, np.dtype[Any]] = {
    AudioDType.float32: np.dtype("<f4"),
    AudioDType.int16: np.dtype("<i2"),
}


def wav_header(dtype: AudioDType, channels: int, sample_rate: int, samples: int) -> bytes:
    """The bytes before the samples in the WAV ``scipy.io.wavfile.write`` writes."""
    floating = dtype is AudioDType.float32
    width = NUMPY[dtype].itemsize
    fmt = struct.pack(
        "<HHIIHH",
        WAVE_FORMAT_IEEE_FLOAT if floating else WAVE_FORMAT_PCM,
        channels,
        sample_rate,
        sample_rate * width * channels,
        channels * width,
        width * 8,
    )
    if floating:
        fmt += b"\x00\x00"  # cbSize: non-PCM formats carry it
    chunks = b"WAVE" + b"fmt " + struct.pack("<I", len(fmt)) + fmt
    if floating:
        chunks += b"fact" + struct.pack("<II", 4, samples)
    data = samples * channels * width
    chunks += b"data" + struct.pack("<I", data)
    return b"RIFF" + struct.pack("<I", len(chunks) + data) + chunks


def samples_of(raw: bytes | memoryview, src: AudioSource, *, clamp: bool) -> np.ndarray:
    """``src``'s samples (all of them, or a block of whole samples) as a (samples,
    channels) array; NaN or infinite ones refused; float32 clamped to [-1, 1] when
    ``clamp`` (SGLang's ``_normalize_audio_to_numpy``)."""
    samples = np.frombuffer(raw, NUMPY[src.dtype]).reshape(-1, src.channels)
    if src.dtype is AudioDType.float32:
        if not np.isfinite(samples).all():
            raise BadRequest(
                "the audio samples hold NaN or infinite values", code="audio_not_finite"
            )
        if clamp:
            samples = np.clip(samples, -1.0, 1.0)
    return samples


def sample_blocks(
    src: AudioSource, fd: int, offset: int, *, clamp: bool, digest: Any = None
) -> Iterator[np.ndarray]:
    """``src``'s samples at ``offset`` of ``fd``, read a block at a time (never all at
    once) and checked as :func:`samples_of` does; ``digest`` (a hashlib object) is fed
    the bytes as read."""
    frame = src.channels * src.dtype.itemsize
    step = max(1, AUDIO_BLOCK_BYTES // frame) * frame
    for start in range(0, src.byte_size, step):
        raw = read_exactly(fd, offset + start, min(step, src.byte_size - start))
        if digest is not None:
            digest.update(raw)
        yield samples_of(raw, src, clamp=clamp)


class MemoryAudio(InputFile):
    """A WAV of in-memory samples in a sealed memfd: an input ffmpeg opens like a file.

    ``data_offset`` is where the samples start (the ``vllm-omni`` profile's PyAV
    child maps them from there, unclamped).
    """

    def __init__(self, src: AudioSource, samples: np.ndarray | Iterable[np.ndarray]):
        """``samples``: all of them, or their blocks in order (:func:`sample_blocks`)."""
        header = wav_header(src.dtype, src.channels, src.sample_rate, src.samples)
        fd = os.memfd_create("framewire-audio", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.write(fd, header)
            for block in [samples] if isinstance(samples, np.ndarray) else samples:
                data = np.ascontiguousarray(block, NUMPY[src.dtype]).data.cast("B")
                written = 0
                while written < len(data):
                    written += os.write(fd, data[written:])
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, SEALS)
            os.lseek(fd, 0, os.SEEK_SET)
        except BaseException:
            os.close(fd)
            raise
        super().__init__(fd, "memory audio")
        self.source = src
        self.data_offset = len(header)
        # A lease of a WAV shared by several outputs (audio_store): closing it calls
        # this instead of closing the descriptor, which the store owns.
        self.release: Callable[[], None] | None = None

    def close(self) -> None:
        release, self.release = self.release, None
        if release is None:
            super().close()
        elif self.fd >= 0:
            self.fd = -1
            release()

    def pyav_spec(self) -> tuple[int, int, int, int, int]:
        """(fd, data offset, samples, channels, sample rate) for ``pyav_argv``."""
        s = self.source
        return self.fd, self.data_offset, s.samples, s.channels, s.sample_rate


def read_exactly(fd: int, offset: int, nbytes: int) -> bytes:
    """``nbytes`` at ``offset`` of ``fd``; a file shorter than that is the caller's fault."""
    out = bytearray(nbytes)
    got = pread_full(fd, memoryview(out), offset)
    if got < nbytes:
        raise BadRequest(
            f"the audio ends at byte {offset + got}, before its byte_size",
            code="segment_truncated",
        )
    return bytes(out)
