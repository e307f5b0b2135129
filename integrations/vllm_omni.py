"""vLLM-omni (0.26.0 to 0.30.0) encodes its videos through the worker.

Loaded by vLLM-omni's ``load_omni_general_plugins`` (entry point ``framewire`` of
``vllm_omni.general_plugins``) in every diffusion rank, the stage process and the
API server; it acts only when ``FRAMEWIRE_INTEGRATIONS`` names ``vllm-omni``.
**Trap:** ``VLLM_PLUGINS``, when set, is an allow-list for vLLM's
``vllm.general_plugins`` and vLLM-omni's group alike: it must name ``framewire``
(and what vLLM-omni registers for its own models).

Replaced, each only where the probe finds it with the parameters verified at the
version installed (vLLM-omni calls its plugins without a ``try``: nothing here
raises):

- ``ChunkedMP4Encoder`` of ``diffusion/utils/media_utils`` (0.30 on), where
  ``chunked_video``'s ``ChunkedVideoMP4Session`` looks it up when it opens its
  encoders: each batch entry a stream session. A chunk is copied out when ``push``
  returns, so ``on_consumed`` fires then (exactly once, also when the push fails).
- ``ChunkedVideoMP4Session`` of ``chunked_video`` (0.30 on; ``decode_to_mp4`` makes
  it), a subclass of vLLM-omni's own: a session whose chunks are float32 on the host
  hands them to the worker as they are, and the worker quantizes them as vLLM-omni
  does (``integrations/_vllm_omni_session.py``); on a GPU vLLM-omni quantizes, and
  its encoders are the ones above. A module that imported the name before the
  plugin loaded keeps vLLM-omni's class.
- ``_encode_video_bytes`` (bound by name in ``video_api_utils`` and
  ``serving_video``): vLLM-omni's own frame preparation, then a stream session 8
  frames at a time. Its direct path hands PyAV planar ``gbrp`` frames, its legacy
  path ``rgb24``; both quantize as ``clip(0, 1) * 255`` rounded half to even, and
  libswscale gives the same YUV from both (the tests compare the bytes).
"""

from __future__ import annotations

import importlib
import logging
import os
import sys

from framewire.integrations import _vllm_omni_hooks as hooks
from framewire.integrations import _vllm_omni_session as session
from framewire.integrations._probe import Engine, Probe, Target
from framewire.integrations._route import guarded
from framewire.integrations._switch import enabled, say_once

VLLM_OMNI = Engine("vLLM-omni", "vllm-omni", ("0.26.0", "0.28.0", "0.30.0"))
EVERY = VLLM_OMNI.versions


def _at(versions: tuple[str, ...], shape: str) -> dict[str, str]:
    return dict.fromkeys(versions, shape)


ENCODER = (
    Target(
        hooks.MEDIA,
        "ChunkedMP4Encoder.__init__",
        _at(
            EVERY[2:],
            "(self, *, width, height, "
            "fps, audio_waveform=None, audio_sample_rate=None, max_pending=2, "
            "video_codec='h264', audio_codec='aac', crf='18', video_codec_options=None)",
        ),
    ),
    Target(
        hooks.MEDIA, "ChunkedMP4Encoder.push", _at(EVERY[2:], "(self, chunk, *, on_consumed=None)")
    ),
    Target(hooks.MEDIA, "ChunkedMP4Encoder.finish", _at(EVERY[2:], "(self)")),
    Target(hooks.MEDIA, "ChunkedMP4Encoder.abort", _at(EVERY[2:], "(self)")),
)
SESSION = (
    Target(
        hooks.CHUNKED,
        "ChunkedVideoMP4Session.__init__",
        _at(
            EVERY[2:],
            "(self, *, value_range, fps, audio_waveforms=None, audio_sample_rate=None, "
            "batch_frames=1, max_pending=2, video_codec_options=None, crop=None, "
            "transfer_slots=2)",
        ),
    ),
    Target(hooks.CHUNKED, "ChunkedVideoMP4Session.push", _at(EVERY[2:], "(self, chunk)")),
    Target(hooks.CHUNKED, "ChunkedVideoMP4Session.finish", _at(EVERY[2:], "(self)")),
    Target(hooks.CHUNKED, "ChunkedVideoMP4Session.abort", _at(EVERY[2:], "(self)")),
)
_BYTES = "video, fps, audio=None, audio_sample_rate=None, video_codec_options=None"
BYTES = Target(
    hooks.API,
    "_encode_video_bytes",
    {
        **_at(EVERY[:1], f"({_BYTES})"),
        **_at(EVERY[1:], f"({_BYTES}, frame_converter=None)"),
    },
)
# What the replacement of _encode_video_bytes calls of vLLM-omni's.
BYTES_CALLS = (
    Target(hooks.API, "_coerce_video_to_frames", _at(EVERY, "(video)")),
    Target(hooks.API, "_coerce_audio_to_numpy", _at(EVERY, "(audio)")),
    Target(hooks.API, "_resolve_audio_sample_rate", _at(EVERY[1:], "(audio, audio_sample_rate)")),
)
_replaced: list[str] = []  # the names replaced in this process


def register() -> None:
    """The plugin's entry point. Replaces what probes as verified, only when
    ``FRAMEWIRE_INTEGRATIONS`` names ``vllm-omni``; never raises."""
    if enabled("vllm-omni"):
        guarded("the vLLM-omni integration's registration", _register)


def _register() -> None:
    probe = Probe(VLLM_OMNI)
    if probe.wanted(ENCODER[0]) and probe.allows(ENCODER):
        media = importlib.import_module(hooks.MEDIA)
        replacement = hooks.replace_chunked(media.ChunkedMP4Encoder)
        for name in (hooks.MEDIA, hooks.CHUNKED):
            # chunked_video took the name with ``from ... import`` (if it was imported
            # already; imported later, it takes the replacement from media_utils).
            module = sys.modules.get(name) if name == hooks.CHUNKED else media
            if module is not None:
                setattr(module, "ChunkedMP4Encoder", replacement)  # noqa: B010
        _replaced.append(f"{hooks.MEDIA}.ChunkedMP4Encoder")
        if probe.allows(SESSION):
            # Its host chunks quantized by the worker; a session on a GPU stays
            # vLLM-omni's, with the encoders above.
            chunked = importlib.import_module(hooks.CHUNKED)
            own = chunked.ChunkedVideoMP4Session
            if not issubclass(own, session.RoutedSession):
                vars(chunked)["ChunkedVideoMP4Session"] = session.session_class(own)
            _replaced.append(f"{hooks.CHUNKED}.ChunkedVideoMP4Session")
    calls = [t for t in BYTES_CALLS if probe.wanted(t)]
    if probe.allows((BYTES, *calls)):
        api = importlib.import_module(hooks.API)
        if not getattr(api._encode_video_bytes, hooks.MARK, False):
            wrapped = hooks.encode_bytes(api._encode_video_bytes, probe.version)
            # Bound by name in both: serving_video took it with ``from ... import`` (if it
            # was imported already; imported later, it takes the wrapped one from here).
            for name in (hooks.API, hooks.SERVING):
                if name in sys.modules:
                    setattr(sys.modules[name], "_encode_video_bytes", wrapped)  # noqa: B010
        _replaced.append(f"{hooks.API}._encode_video_bytes")
    check()


def hooked() -> dict[str, bool]:
    """Whether each name framewire replaced in this process holds framewire's now."""
    found = {}
    for dotted in _replaced:
        module, _, name = dotted.rpartition(".")
        held = getattr(sys.modules.get(module), name, None)
        ours = isinstance(held, type) and issubclass(held, session.RoutedSession)
        found[dotted] = ours or held is hooks.ChunkedMP4Encoder or getattr(held, hooks.MARK, False)
    return found


def check() -> dict[str, bool]:
    """Log once what is routed (or that a replacement did not take)."""
    found = hooked()
    url = os.environ.get("FRAMEWIRE_URL") or "the default address"
    routed = [n.rpartition(".")[2] for n, ok in found.items() if ok]
    if routed:
        say_once(
            "vllm-omni:routes",
            "framewire: vLLM-omni's %s encode through the worker at "
            "%s; every other save runs vLLM-omni's own code",
            " and ".join([", ".join(routed[:-1]), routed[-1]] if len(routed) > 1 else routed),
            url,
        )
    missing = [n for n, ok in found.items() if not ok]
    if missing:
        say_once(
            "vllm-omni:missing",
            "framewire: not replaced in vLLM-omni: %s",
            missing,
            level=logging.ERROR,
        )
    return found
