"""The object store the upload tests share: moto's S3 server on loopback with the bucket,
a proxy in front of it that a test can make fail, slow or stall, and ``fresh``: a test
starting with a proxy that passes everything, leaving an empty bucket."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.support.objstore import Moto, Proxy, moto_server, proxy_to


def bucket_of(request: pytest.FixtureRequest) -> str:
    """The bucket the test's module names (its ``BUCKET``)."""
    return str(request.module.BUCKET)


@pytest.fixture(scope="module")
def moto(request: pytest.FixtureRequest) -> Iterator[Moto]:
    with moto_server() as server:
        server.client().create_bucket(Bucket=bucket_of(request))
        yield server


@pytest.fixture(scope="module")
def proxy(moto: Moto) -> Iterator[Proxy]:
    with proxy_to(moto.endpoint) as p:
        yield p


@pytest.fixture
def fresh(proxy: Proxy, moto: Moto, request: pytest.FixtureRequest) -> Iterator[None]:
    """A proxy that passes everything and, after the test, an empty bucket (the modules
    that use the store ask for it for every test)."""
    proxy.reset()
    yield
    proxy.release.set()
    client = moto.client()
    bucket = bucket_of(request)
    for key in moto.leftovers(bucket)[0]:
        client.delete_object(Bucket=bucket, Key=key)
