"""Audio handed over in memory, made into the WAV the engines give ffmpeg.

The reference is SGLang's route: float32 samples clamped to [-1, 1] (int16 as
they are), written by ``scipy.io.wavfile.write`` and given to ffmpeg as its
second input. :func:`wav_header` lays the file out exactly as scipy 1.x does
(a tested fact), so the WAV is built in a sealed memfd here and ffmpeg reads it
through ``/proc/self/fd`` like an audio file under the input roots. The
samples are read once, when the request is judged: a stream session holds no
lease on the caller's memory for its whole life.
"""

from __future__ import annotations

import fcntl
import os
import struct
from typing import Any

import numpy as np
from framewire.client._errors import BadRequest
from framewire.client._media.inputs import InputFile
from framewire.client.wire import AudioDType, AudioSource
from framewire.service._sources.frames import pread_full

WAVE_FORMAT_PCM, WAVE_FORMAT_IEEE_FLOAT = 1, 3
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
    """``src``'s samples as a (samples, channels) array; NaN or infinite ones refused;
    float32 clamped to [-1, 1] when ``clamp`` (SGLang's ``_normalize_audio_to_numpy``)."""
    samples = np.frombuffer(raw, NUMPY[src.dtype]).reshape(src.samples, src.channels)
    if src.dtype is AudioDType.float32:
        if not np.isfinite(samples).all():
            raise BadRequest(
                "the audio samples hold NaN or infinite values", code="audio_not_finite"
            )
        if clamp:
            samples = np.clip(samples, -1.0, 1.0)
    return samples


class MemoryAudio(InputFile):
    """A WAV of in-memory samples in a sealed memfd: an input ffmpeg opens like a file.

    ``data_offset`` is where the samples start (the ``vllm-omni`` profile's PyAV
    child maps them from there, unclamped).
    """

    def __init__(self, src: AudioSource, samples: np.ndarray):
        header = wav_header(src.dtype, src.channels, src.sample_rate, src.samples)
        fd = os.memfd_create("framewire-audio", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.write(fd, header)
            data = np.ascontiguousarray(samples, NUMPY[src.dtype]).data.cast("B")
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
            f"the audio ends {nbytes - got} bytes short of its byte_size",
            code="segment_truncated",
        )
    return bytes(out)
