"""A host tensor's frames copied into a shared buffer (framewire.core.frames.copy_into):
numpy's copy on the caller's thread, never torch's intra-op pool (whose OpenMP threads
spin between copies on the cores the worker encodes on), and the same bytes, strided,
half precision and grad-requiring tensors included; bfloat16, which numpy has not,
stays with torch."""

from __future__ import annotations

import pytest
import torch
from framewire.core.frames import copy_into, describe


def _copied(video: torch.Tensor) -> bytes:
    frames = describe(video, "CTHW")
    buffer = bytearray(frames.nbytes)  # writable, as a shared mapping is
    copy_into(buffer, frames)
    return bytes(buffer)


CASES = {
    "float32-strided": lambda c: c[:, 1:3],  # a time slice of a larger clip
    "float16": lambda c: c.to(torch.float16),
    "uint8": lambda c: (c * 255).to(torch.uint8),
    "requires-grad": lambda c: c.clone().requires_grad_(),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_host_tensor_is_copied_by_numpy_with_its_own_bytes(monkeypatch, case):
    video = CASES[case](torch.rand(3, 4, 16, 24, generator=torch.Generator().manual_seed(1)))
    want = video.detach().contiguous().numpy().tobytes()

    def refused(*args: object, **kwargs: object) -> None:
        raise AssertionError("torch's copy ran")

    monkeypatch.setattr(torch.Tensor, "copy_", refused)
    assert _copied(video) == want


def test_bfloat16_is_copied_by_torch(monkeypatch):
    video = torch.rand(3, 2, 8, 8).to(torch.bfloat16)
    want = video.contiguous().view(torch.uint8).numpy().tobytes()
    copies: list[int] = []
    own = torch.Tensor.copy_

    def counted(self: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
        copies.append(1)
        return own(self, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(torch.Tensor, "copy_", counted)
    assert _copied(video) == want and copies == [1]
