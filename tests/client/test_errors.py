"""The one map between an error's class, its HTTP status and its fd-socket code."""

from __future__ import annotations

import pytest
from framewire.core.errors import (
    FD_CODES,
    HIERARCHY,
    BadRequest,
    Forbidden,
    FramewireError,
    InsufficientStorage,
    MediaError,
    Overloaded,
    Unauthorized,
    Unavailable,
    error_class,
    rebuild,
)


def test_every_class_round_trips_by_status_and_by_name():
    statuses = [cls.status for cls in HIERARCHY]
    assert len(set(statuses)) == len(statuses), "two classes share a status"
    for cls in HIERARCHY:
        assert error_class(status=cls.status) is cls
        assert error_class(name=cls.__name__) is cls
        assert cls.fd_code in FD_CODES
    assert error_class(status=418) is FramewireError  # a newer worker's: still an error
    assert error_class(name="SystemExit") is FramewireError  # never outside the hierarchy


def test_fd_codes_are_the_six_of_the_protocol():
    codes = {"bad_request", "forbidden", "not_found", "decode_failed", "overloaded", "unavailable"}
    assert codes == FD_CODES
    assert error_class(fd_code="decode_failed") is MediaError
    assert error_class(fd_code="bad_request") is BadRequest
    # A worker out of room (regions, descriptors) is not a media failure.
    assert error_class(fd_code=Unavailable.fd_code) is Unavailable
    assert error_class(fd_code=InsufficientStorage.fd_code) is Unavailable


@pytest.mark.parametrize("cls", HIERARCHY)
def test_every_class_is_rebuilt_alike_with_its_detail(cls):
    exc = rebuild(cls, "m", code="c", detail="tail", retry_after=3.0)
    assert (type(exc), exc.message, exc.code, exc.detail, exc.retry_after) == (
        cls, "m", "c", "tail", 3.0
    )  # fmt: skip


def test_overloaded_waits_a_second_unless_told_and_401_is_its_own():
    assert rebuild(Overloaded, "busy").retry_after == 1.0
    assert Unauthorized.status == 401 and issubclass(Unauthorized, Forbidden)
