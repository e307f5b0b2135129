"""vLLM-omni's chunked pre-encode session with its host chunks quantized by the worker.

``ChunkedVideoMP4Session`` quantizes each ``BCTHW`` chunk where it lies
(``clamp(lo, hi).sub(lo).mul(255 / (hi - lo)).round()`` to uint8) and hands the
bytes to one ``ChunkedMP4Encoder`` per batch entry. On a GPU that is a few kernels;
on the host it is five passes of torch over float frames, about four CPU-seconds of
the engine's process for 120 frames at 1344x768. A session whose first chunk is a
float32 tensor on the host therefore hands each batch entry's float chunks to a
worker's stream session as they are (the ``vllm-omni`` profile with the session's
``value_range``: the same formula, the same bytes), and the quantization runs in the
worker. A session on a GPU keeps vLLM-omni's own quantization; its encoders are
framewire's (``_vllm_omni_hooks.ChunkedMP4Encoder``) all the same.

What framewire does not reproduce, and a worker that does not take the first chunk,
leave the whole session to vLLM-omni's own code (its encoders included, one log line).
"""

from __future__ import annotations

import contextlib
from typing import Any

from framewire.client import VideoWriter
from framewire.integrations import _vllm_omni_hooks as hooks
from framewire.integrations._route import failed, left
from framewire.integrations._switch import Declined, count
from framewire.integrations._worker import WORKER, checked

# A float chunk is handed over in pieces of at most this many bytes (whole frames): the
# client holds two such buffers, not two of the engine's chunk (8 frames at 1344x768 in
# float32 are 99 MB).
PIECE_BYTES = 16 << 20


def _host_float(chunk: Any) -> bool:
    """A 5-D float32 tensor in the host's memory (vLLM-omni's VAE output on a CPU)."""
    device = getattr(chunk, "device", None)
    return (
        getattr(device, "type", None) == "cpu"
        and str(getattr(chunk, "dtype", "")) == "torch.float32"
        and getattr(chunk, "ndim", 0) == 5
    )


class RoutedSession:
    """The part of framewire's ``ChunkedVideoMP4Session`` that is framewire's: put before
    vLLM-omni's own class (:func:`session_class`), whose methods run whenever the
    session is not routed. Its constructor is vLLM-omni's."""

    def __init__(self, **kw: Any) -> None:
        super().__init__(**kw)
        self._fw_kw = kw
        self._fw_writers: list[VideoWriter] = []
        self._fw_routed: bool | None = None  # decided at the first chunk
        self._fw_engine = False  # left to vLLM-omni whole

    def push(self, chunk: Any) -> None:
        """Queue one committed ``BCTHW`` chunk (vLLM-omni's ``push``)."""
        if self._fw_routed is None:
            self._fw_routed = _host_float(chunk) and self._fw_open(self._cropped(chunk))
            if self._fw_routed:
                return
        if not self._fw_routed:
            with self._engine_context():
                super().push(chunk)  # type: ignore[misc]
            return
        try:
            self._fw_write(self._cropped(chunk))
        except Exception as exc:
            raise failed("vllm-omni", exc) from None

    def finish(self) -> list[bytes]:
        """One MP4 per batch entry (vLLM-omni's ``finish``)."""
        if not self._fw_routed:
            with self._engine_context():
                videos: list[bytes] = super().finish()  # type: ignore[misc]
            return videos
        try:
            results = [checked(hooks.MEMORY, w.close()) for w in self._fw_writers]
        except Exception as exc:
            raise failed("vllm-omni", exc) from None
        videos = []
        for result in results:
            assert result.data is not None  # checked: a memory output's bytes
            count("vllm-omni:routed")
            videos.append(result.data)
        return videos

    def abort(self) -> None:
        if not self._fw_routed:
            super().abort()  # type: ignore[misc]
            return
        for writer in self._fw_writers:
            writer.abort()

    def _engine_context(self) -> contextlib.AbstractContextManager[None]:
        return hooks.left_to_engine() if self._fw_engine else contextlib.nullcontext()

    def _cropped(self, chunk: Any) -> Any:
        crop = self._fw_kw.get("crop")
        return chunk if crop is None else chunk[..., : crop[0], : crop[1]]

    def declined(self, batch: int, height: int, width: int) -> str | None:
        waves = self._fw_kw.get("audio_waveforms")
        if waves is not None and len(waves) != batch:
            return "one audio waveform per batch entry expected"  # vLLM-omni raises it
        rate = self._fw_kw.get("audio_sample_rate")
        options = self._fw_kw.get("video_codec_options")
        for wave in waves or [None] * batch:
            why = hooks.declined(width, height, wave, rate, "h264", "aac", "18", options)
            if why is not None:
                return why
        return None

    def _fw_open(self, first: Any) -> bool:
        """A stream session per batch entry, each given its first chunk (True); else the
        session is vLLM-omni's own, whole (False): no chunk went anywhere yet."""
        batch, _, _, height, width = (int(n) for n in first.shape)
        try:
            why = self.declined(batch, height, width)
            if why is not None:
                raise Declined(why)
            waves = self._fw_kw.get("audio_waveforms") or [None] * batch
            rate = self._fw_kw.get("audio_sample_rate") or 44100
            low, high = (float(v) for v in self._fw_kw["value_range"])
            client = WORKER.client()
            for wave in waves:
                options = self._fw_kw.get("video_codec_options")
                heard = None if wave is None else rate
                save = hooks.save_options(self._fw_kw["fps"], options, wave, heard)
                writer = client.open_video(
                    hooks.MEMORY, layout="CTHW", value_range=(low, high), **save
                )
                self._fw_writers.append(writer)
            self._fw_write(first)
            for writer in self._fw_writers:
                writer.flush()  # taken by the worker: from here on the chunks are its
        except Exception as exc:  # declined, no worker, another PyAV, framewire's own failure
            for writer in self._fw_writers:
                writer.abort()
            self._fw_writers.clear()
            left("vllm-omni", exc)
            self._fw_engine = True
            return False
        return True

    def _fw_write(self, chunk: Any) -> None:
        """Each batch entry's frames of ``chunk`` to its writer, whole frames at a time."""
        frames = int(chunk.shape[2])
        frame_bytes = int(chunk[0, :, 0].numel()) * int(chunk.element_size())
        step = max(1, PIECE_BYTES // frame_bytes)
        for index, writer in enumerate(self._fw_writers):
            for t0 in range(0, frames, step):
                writer.write(chunk[index, :, t0 : t0 + step])


_made: type | None = None


def session_class(original: type) -> type:
    """vLLM-omni's ``ChunkedVideoMP4Session`` (``original``) with framewire's ``push``,
    ``finish`` and ``abort`` before its own: an instance of vLLM-omni's class, all of
    its other methods and attributes its own."""
    global _made
    if _made is None:
        _made = type(
            "ChunkedVideoMP4Session",
            (RoutedSession, original),
            {"__doc__": original.__doc__, "__module__": __name__},
        )
    return _made
