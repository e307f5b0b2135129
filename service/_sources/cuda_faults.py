"""CUDA errors, each answered with a stable code; a GPU whose context one poisoned is
marked unusable for the rest of the worker's life.

torch raises CUDA's errors as ``RuntimeError`` (``torch.AcceleratorError`` since 2.8)
whose message starts "CUDA error:". Some are sticky: after an illegal address, a
failed launch or an ECC error, the process's context on that device fails every later
call, and only a new process recovers. A request that meets one is answered 500
``cuda_error``; the device is recorded here, every later CUDA request for it is refused
503 ``cuda_device_unusable`` before anything touches it (clients then save from the
host, or locally), and ``/healthz`` and readiness answer 503 so that the supervisor
restarts the worker (host encodes meanwhile are served and drained as ever). Running
out of GPU memory is not sticky: 503 ``gpu_out_of_memory``, retried later.

A process has one context per device, so this record is the process's, one for all.
"""

from __future__ import annotations

import logging
import threading

from framewire.core.errors import FramewireError, Overloaded, Unavailable

log = logging.getLogger("framewire.cuda")

# What torch's message says for the errors that leave the context unusable (CUDA's
# own descriptions of cudaErrorIllegalAddress, ...LaunchFailure, ...MisalignedAddress,
# ...Assert, ...ECCUncorrectable, ...IllegalInstruction, ...HardwareStackError,
# ...InvalidPc, ...LaunchTimeout).
STICKY = (
    "illegal memory access",
    "unspecified launch failure",
    "misaligned address",
    "device-side assert",
    "uncorrectable ecc",
    "illegal instruction",
    "hardware stack error",
    "invalid program counter",
    "launch timed out",
)


def is_cuda_error(exc: BaseException) -> bool:
    return type(exc).__name__ in ("AcceleratorError", "OutOfMemoryError") or (
        isinstance(exc, RuntimeError) and "CUDA error" in str(exc)
    )


class CudaHealth:
    """The devices a sticky CUDA error made unusable, by index, with why."""

    def __init__(self) -> None:
        self._lost: dict[int, str] = {}
        self._lock = threading.Lock()

    def lost(self) -> dict[int, str]:
        with self._lock:
            return dict(self._lost)

    def check(self, index: int) -> None:
        """Refuse CUDA work on ``index`` if a sticky error made it unusable."""
        why = self.lost().get(index)
        if why is not None:
            raise Unavailable(
                f"GPU cuda:{index} is unusable in this worker since a CUDA error ({why}); "
                "a restart of the worker recovers it",
                code="cuda_device_unusable",
            )

    def failed(self, index: int, exc: BaseException) -> FramewireError:
        """What a CUDA error on ``index`` is answered with; a sticky one marks it."""
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        if type(exc).__name__ == "OutOfMemoryError":
            return Overloaded(
                f"GPU cuda:{index} is out of memory: {first}", code="gpu_out_of_memory"
            )
        if any(s in str(exc).lower() for s in STICKY):
            with self._lock:
                known = index in self._lost
                self._lost.setdefault(index, first)
            if not known:
                log.error(
                    "GPU cuda:%d is unusable from now on (%s): CUDA requests for it "
                    "are refused and /healthz answers 503 until the worker restarts",
                    index,
                    first,
                )
        return FramewireError(f"CUDA failed on cuda:{index}: {first}", code="cuda_error")

    def clear(self) -> None:
        with self._lock:
            self._lost.clear()


HEALTH = CudaHealth()


class classified:
    """Context manager: a CUDA error raised in the block becomes its stable code (and a
    sticky one marks ``index``); anything else passes through as it is. Work on a device
    already marked is refused first, unless ``refuse`` is false (cleanup still runs)."""

    def __init__(self, index: int, *, refuse: bool = True):
        self.index, self.refuse = index, refuse

    def __enter__(self) -> None:
        if self.refuse:
            HEALTH.check(self.index)

    def __exit__(self, kind: object, exc: BaseException | None, tb: object) -> None:
        if exc is not None and not isinstance(exc, FramewireError) and is_cuda_error(exc):
            raise HEALTH.failed(self.index, exc) from exc
