"""Uploads to an S3-compatible store with boto3: one PUT, or a multipart upload.

The bytes sent are read from one open file and hashed as they are read: unless
they hash to the sha256 the encode reported, nothing is stored (a single PUT is
not sent, a multipart upload is aborted before it completes) and the upload fails
with ``upload_failed``. Then two checks that the object's bytes are those sent,
both against what the store itself computed or verified:

- Every request carries the SHA-256 of its bytes (``x-amz-checksum-sha256``):
  a single PUT's is the whole object's, the very sha256 the result reports, and
  a store that verifies checksums (AWS S3, MinIO) refuses other bytes
  (``BadDigest``). A multipart upload's parts carry their own; the object's is
  then the composite ``sha256(part digests)-N``, compared with the one computed
  here from the same parts.
- The ETag the store answers is the MD5 of what it stored (of a PUT; for a
  multipart upload, the MD5 of the parts' MD5s and ``-N``), except under KMS or
  customer-key encryption. It is compared with the MD5 computed here while the
  file was read, so a store that ignores checksums still cannot keep other bytes.

A mismatch deletes the object: 502 ``store_checksum_mismatch``. A multipart
upload that fails or is cancelled at any step is aborted, so no part stays
stored (and billed) in the bucket.

Requests are made on worker threads: boto3 is blocking, and an upload is I/O
bound (the GIL is released while sockets send). The parts of one upload go out
``PARTS_IN_FLIGHT`` at a time (service/_store/multipart.py), most of them while
the file is still encoded (service/_store/early.py); memory held is that many
parts, whatever the file's size.
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading
from collections.abc import Callable
from typing import Any

from framewire.core.errors import FramewireError, StoreError, Unavailable
from framewire.service._access.urls import ObjectUrl
from framewire.service._settings import Settings
from framewire.service._store.deadline import Deadlines
from framewire.service._store.faults import answered, changed_file, missing, store_error
from framewire.service._store.multipart import (
    PARTS_IN_FLIGHT,
    Multipart,
    Started,
    Upload,
    Uploaded,
    b64,
)
from framewire.service._store.owners import OWNER_META, Found, OwnedUrl, condition

log = logging.getLogger("framewire.store")


def _custom_endpoint() -> bool:
    return bool(os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL"))


class S3Store:
    """The store's client, made on first use (boto3 is an extra: ``framewire[s3]``)."""

    def __init__(self, settings: Settings):
        self.part_bytes = settings.upload_part_bytes
        self._timeout = settings.store_timeout_s
        self._attempts = settings.store_attempts
        self._client: Any = None
        self._lock = threading.Lock()
        self._deadlines = Deadlines(settings.store_timeout_s)
        self.multipart = Multipart(self)

    def client(self) -> Any:
        with self._lock:
            if self._client is None:
                self._client = self._make()
            return self._client

    def _make(self) -> Any:
        try:
            import boto3
            from botocore.config import Config
        except ImportError as exc:
            raise Unavailable(
                "this worker cannot write object URLs: install framewire[s3] (boto3)",
                code="s3_not_installed",
            ) from exc
        # Their debug lines carry request headers (the key id among them): never logged.
        for name in ("boto3", "botocore", "urllib3"):
            logging.getLogger(name).setLevel(logging.WARNING)
        config = Config(
            connect_timeout=self._timeout,
            read_timeout=self._timeout,
            retries={"mode": "standard", "total_max_attempts": self._attempts},
            s3={
                # S3-compatible stores behind AWS_ENDPOINT_URL (MinIO, Ceph) expect paths.
                "addressing_style": "path" if _custom_endpoint() else "auto",
                # The body is covered by its x-amz-checksum-sha256, a signed header the
                # store checks: a second SHA-256 of it for the signature buys nothing.
                "payload_signing_enabled": False,
            },
            signature_version="s3v4",  # presigned URLs too (SigV2 is long deprecated)
            request_checksum_calculation="when_required",
            response_checksum_validation="when_required",
            max_pool_connections=PARTS_IN_FLIGHT * 4,
        )
        # Endpoint, region and credentials: the standard AWS variables and files.
        try:
            client = boto3.session.Session().client("s3", config=config)
        except Exception as exc:
            raise self.failed(exc, "connecting") from None
        self._deadlines.install(client)
        return client

    def presign(self, url: ObjectUrl, seconds: int) -> str:
        """An HTTPS (or the endpoint's scheme) GET URL of the object, valid ``seconds``."""
        try:
            return str(
                self.client().generate_presigned_url(
                    "get_object", Params={"Bucket": url.bucket, "Key": url.key}, ExpiresIn=seconds
                )
            )
        except Exception as exc:
            raise self.failed(exc, "presigning") from None

    def found(self, url: ObjectUrl) -> Found | None:
        """The object at ``url`` now (its ETag and owner), None if there is none."""
        try:
            answer = self.client().head_object(Bucket=url.bucket, Key=url.key)
        except Exception as exc:
            if missing(exc):
                return None
            raise self.failed(exc, "HeadObject") from None
        meta = answer.get("Metadata")
        owner = meta.get(OWNER_META) if isinstance(meta, dict) else None
        return Found(answered(answer, "ETag", "HeadObject"), owner)

    def upload(
        self,
        fd: int,
        size: int,
        sha256: str,
        url: OwnedUrl,
        cancel: threading.Event,
        started: Started | None = None,
    ) -> Uploaded:
        """The ``size`` bytes of ``fd`` stored at ``url``, with its owner, only over the
        object it was judged against; ``sha256`` (hex) is what they must hash to.
        ``cancel`` set stops it (``Cancelled``), also in the middle of a request: nothing
        is left stored (the abort and delete that ensure it are not stopped, only
        bounded). ``started``: the multipart upload its parts sent early went to (each
        is checked against the file; one that differs is sent again)."""
        up = Upload(self.client(), url, cancel, fd, size, sha256)
        if started is None and size < self.part_bytes:
            return self._put(up)
        return self.multipart.finish(up, started or self.multipart.begin(up))

    def failed(self, exc: Exception, op: str) -> FramewireError:
        """What a failed request of this thread is answered with."""
        return store_error(exc, op, late=self._deadlines.timed_out())

    def request(self, up: Upload, op: str, call: Callable[..., Any], **params: Any) -> Any:
        """``call``, the client's method for ``op``, on ``up``'s object: bounded by the
        deadlines and cut when ``up`` is stopped; a failure is answered as ``op``'s."""
        try:
            with self._deadlines.stopped_by(up.cancel):
                return call(Bucket=up.url.bucket, Key=up.url.key, **params)
        except Exception as exc:
            raise self.failed(exc, op) from None

    def _put(self, up: Upload) -> Uploaded:
        up.check()
        body = os.pread(up.fd, up.size, 0)  # below the part size: bounded
        if len(body) != up.size or hashlib.sha256(body).hexdigest() != up.sha256:
            raise changed_file()
        want = b64(bytes.fromhex(up.sha256))
        answer = self.request(
            up,
            "PutObject",
            up.client.put_object,
            Body=body,
            ChecksumSHA256=want,
            Metadata={OWNER_META: up.url.owner},
            **condition(up.url),
            **up.content_type(),
        )
        self.verify(up.client, up.url, answer, want, hashlib.md5(body).hexdigest())
        return Uploaded(0, want)

    def verify(
        self, client: Any, url: ObjectUrl, answer: dict[str, Any], sha256: str, etag: str
    ) -> None:
        """The object deleted and refused if what the store reports differs from the file."""
        encrypted = answer.get("SSECustomerAlgorithm") or "kms" in str(
            answer.get("ServerSideEncryption", "")
        )
        got_etag = str(answer.get("ETag", "")).strip('"')
        if answer.get("ChecksumSHA256", sha256) == sha256 and (encrypted or got_etag == etag):
            return
        self._delete(client, url)
        raise StoreError(
            f"the object store reports other bytes for {url} than were sent; it was deleted",
            code="store_checksum_mismatch",
        )

    def abort(self, up: Upload, upload_id: str) -> None:
        """Abort the multipart upload (bounded, never stopped: no part may stay)."""
        self._abort(up.client, up.url, upload_id)

    def _abort(self, client: Any, url: ObjectUrl, upload_id: str) -> None:
        try:
            client.abort_multipart_upload(Bucket=url.bucket, Key=url.key, UploadId=upload_id)
        except Exception as exc:
            # The store is gone: its lifecycle rule (AbortIncompleteMultipartUpload) is
            # what takes the parts back then; say so without the store's words.
            log.warning(
                "could not abort the multipart upload to %s: %s", url, self.failed(exc, "abort")
            )

    def _delete(self, client: Any, url: ObjectUrl) -> None:
        try:
            client.delete_object(Bucket=url.bucket, Key=url.key)
        except Exception as exc:
            raise self.failed(exc, "DeleteObject") from None

    def close(self) -> None:
        self.multipart.close()
        self._deadlines.close()
