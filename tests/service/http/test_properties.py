"""Property tests: the wire descriptors and the fd socket's request parser under random input.

Descriptors either validate, and then describe exactly the bytes they claim, or
raise pydantic's ValidationError and nothing else. The fd socket answers every
malformed line with ``ok: false`` / ``bad_request`` (an oversize line too) and
keeps serving, whatever a connection sends or however it ends.
"""

from __future__ import annotations

import base64
import json
import math
import socket
from pathlib import Path
from typing import Any

import pytest
from framewire.core.wire import (
    MAX_FRAMES,
    MAX_SIDE,
    CudaIpcSource,
    DecodeRequest,
    DType,
    EncodeRequest,
    Layout,
    ShmSource,
    contiguous_strides,
)
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from tests.support.refclips import RawConnection
from tests.support.worker import Worker

FAST = settings(
    max_examples=60,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)

UUID = "GPU-0b3c7e9a-1d2f-4a5b-8c6d-7e8f9a0b1c2d"
HANDLE = base64.b64encode(bytes(64)).decode()

dtypes = st.sampled_from([d.value for d in DType])
layouts = st.sampled_from([lay.value for lay in Layout])
# Around the limits, plus anything an int can be.
sizes = st.one_of(
    st.integers(-3, 40),
    st.sampled_from([MAX_FRAMES, MAX_FRAMES + 1, MAX_SIDE, MAX_SIDE + 1, 2**31, 2**63, 2**80]),
    st.integers(),
)
json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)


@st.composite
def valid_tensors(draw: st.DrawFn) -> dict[str, Any]:
    layout = Layout(draw(layouts))
    frames = draw(st.integers(1, MAX_FRAMES))
    height, width = draw(st.integers(1, MAX_SIDE)), draw(st.integers(1, MAX_SIDE))
    return {
        "dtype": draw(dtypes),
        "layout": layout.value,
        "shape": list(layout.shape(frames, height, width)),
    }


@given(valid_tensors(), st.integers(0, 2**63))
@FAST
def test_valid_shm_descriptors_describe_their_bytes(tensor: dict[str, Any], offset: int) -> None:
    nbytes = math.prod(tensor["shape"]) * DType(tensor["dtype"]).itemsize
    src = ShmSource.model_validate(
        tensor | {"key": "/framewire-x", "offset": offset, "byte_size": nbytes}
    )
    assert src.nbytes == nbytes
    assert src.frames * src.height * src.width * 3 == math.prod(src.shape)
    assert Layout(tensor["layout"]).shape(src.frames, src.height, src.width) == tuple(src.shape)
    # and one byte either way is refused
    for wrong in (nbytes - 1, nbytes + 1):
        with pytest.raises(ValidationError):
            ShmSource.model_validate(tensor | {"key": "/framewire-x", "byte_size": wrong})


@given(
    shape=st.lists(sizes, min_size=0, max_size=6),
    dtype=st.one_of(dtypes, st.text(max_size=10), json_values),
    layout=st.one_of(layouts, st.text(max_size=6)),
    offset=sizes,
    byte_size=sizes,
    key=st.one_of(st.just("/framewire-x"), st.text(max_size=12)),
)
@FAST
def test_random_shm_descriptors_validate_or_raise_validation_error(
    shape: list[int], dtype: Any, layout: str, offset: int, byte_size: int, key: str
) -> None:
    raw = {"kind": "shm", "key": key, "offset": offset, "byte_size": byte_size}
    raw |= {"dtype": dtype, "shape": shape, "layout": layout}
    try:
        src = ShmSource.model_validate(raw)
    except ValidationError:
        return
    channels, frames, height, width = src.layout.dims(tuple(src.shape))
    assert channels == 3 and 1 <= frames <= MAX_FRAMES
    assert 1 <= height <= MAX_SIDE and 1 <= width <= MAX_SIDE
    assert src.offset >= 0 and src.byte_size == src.nbytes
    assert src.nbytes == math.prod(shape) * src.dtype.itemsize


@given(
    tensor=valid_tensors(),
    stride=st.one_of(st.none(), st.lists(st.integers(-2, 2**40), min_size=0, max_size=5)),
    tensor_offset=st.one_of(st.integers(0, 1 << 20), st.integers()),
    storage=st.one_of(st.integers(1, 1 << 32), st.integers()),
)
@FAST
def test_cuda_descriptors_never_reach_past_their_storage(
    tensor: dict[str, Any], stride: list[int] | None, tensor_offset: int, storage: int
) -> None:
    raw = tensor | {"kind": "cuda_ipc", "device_uuid": UUID, "handle": HANDLE}
    raw |= {"stride": stride, "tensor_offset": tensor_offset, "storage_size_bytes": storage}
    try:
        src = CudaIpcSource.model_validate(raw)
    except ValidationError:
        return
    strides = stride if stride is not None else contiguous_strides(tensor["shape"])
    assert src.strides == strides and all(s >= 0 for s in strides)
    last = tensor_offset + sum((n - 1) * s for n, s in zip(src.shape, strides, strict=True))
    assert 0 < (last + 1) * src.dtype.itemsize <= storage


@given(json_values)
@FAST
def test_arbitrary_json_is_a_validation_error_or_a_request(value: Any) -> None:
    for model in (EncodeRequest, DecodeRequest, ShmSource, CudaIpcSource):
        try:
            model.model_validate(value)
        except ValidationError:
            pass


# --- the fd socket's parser, against a real worker -----------------------------------------


def fd_path(worker: Worker) -> Path:
    return worker.uds.parent / "fd.sock"


def still_serving(worker: Worker) -> None:
    assert worker.proc.poll() is None, worker.log.read_text()
    with RawConnection(fd_path(worker)) as conn:
        assert conn.call({"op": "ping"})[0]["ok"] is True


def is_request(line: bytes) -> bool:
    """Whether ``line`` happens to be a ping or decode, which would not be a bad request."""
    try:
        message = json.loads(line)
    except (ValueError, RecursionError):
        return False
    return isinstance(message, dict) and message.get("op") in ("ping", "decode")


def assert_bad_request(header: dict[str, Any], fds: list[int]) -> None:
    assert (header["ok"], header["code"], fds) == (False, "bad_request", []), header


@given(st.binary(max_size=300).map(lambda b: b.replace(b"\n", b"")))
@FAST
def test_binary_garbage_is_a_bad_request(worker: Worker, line: bytes) -> None:
    assume(not is_request(line))
    with RawConnection(fd_path(worker)) as conn:
        assert_bad_request(*conn.call(line + b"\n"))
        assert conn.call({"op": "ping"})[0]["ok"] is True


@given(json_values)
@FAST
def test_json_that_is_not_a_request_is_a_bad_request(worker: Worker, value: Any) -> None:
    line = json.dumps(value).encode()
    assume(not is_request(line))
    with RawConnection(fd_path(worker)) as conn:
        assert_bad_request(*conn.call(line + b"\n"))


@given(st.dictionaries(st.text(max_size=10), json_values, max_size=5))
@FAST
def test_malformed_decode_requests_are_bad_requests(worker: Worker, fields: dict[str, Any]) -> None:
    message = fields | {"op": "decode"}
    try:
        DecodeRequest.model_validate(message)
    except ValidationError:
        pass
    else:  # a well-formed request is not what this property is about
        assume(False)
    with RawConnection(fd_path(worker)) as conn:
        assert_bad_request(*conn.call(json.dumps(message).encode() + b"\n"))


@given(st.integers(64 << 10, 400 << 10), st.binary(min_size=1, max_size=1))
@settings(max_examples=12, deadline=None, derandomize=True, database=None)
def test_oversized_lines_are_refused_once(worker: Worker, size: int, byte: bytes) -> None:
    assume(byte != b"\n")
    with RawConnection(fd_path(worker)) as conn:
        conn.send(byte * (size + 1) + b"\n")
        assert_bad_request(*conn.reply())
        assert conn.call({"op": "ping"})[0]["ok"] is True


@given(
    st.sampled_from([b'{"op": "ping"}', b'{"op": "decode", "path": "/x"}', b"\xff\x00", b"{"]),
    st.data(),
)
@FAST
def test_partial_lines_then_half_close(worker: Worker, full: bytes, data: st.DataObject) -> None:
    cut = data.draw(st.integers(1, len(full)))
    partial = full[:cut]
    with RawConnection(fd_path(worker)) as conn:
        conn.send(partial)
        conn.sock.shutdown(socket.SHUT_WR)  # a last line without its newline is still a line
        header, fds = conn.reply()
        if is_request(partial) and json.loads(partial)["op"] == "ping":
            assert header["ok"] is True
        else:
            assert_bad_request(header, fds)
        assert conn.sock.recv(1) == b""  # and then the worker closes
    still_serving(worker)


@given(st.integers(1, 200), st.booleans())
@FAST
def test_client_that_closes_mid_reply(worker: Worker, requests: int, linger_reset: bool) -> None:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(str(fd_path(worker)))
    sock.sendall(b'{"op": "ping"}\n{"op": 1}\n' * requests)
    if linger_reset:
        sock.recv(2)  # read into the middle of the first reply
    sock.close()
    still_serving(worker)
