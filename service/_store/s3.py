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
``PARTS_IN_FLIGHT`` at a time; memory held is that many parts, whatever the
file's size.
"""

from __future__ import annotations

import base64
import hashlib
import logging
import os
import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from framewire.core.errors import Cancelled, FramewireError, StoreError, Unavailable
from framewire.service._access.urls import ObjectUrl
from framewire.service._settings import Settings
from framewire.service._store.deadline import Deadlines
from framewire.service._store.faults import missing, store_error
from framewire.service._store.owners import OWNER_META, Found, OwnedUrl

PARTS_IN_FLIGHT = 4
log = logging.getLogger("framewire.store")
CONTENT_TYPES = {".mp4": "video/mp4", ".m4v": "video/mp4", ".mov": "video/quicktime"}


def _custom_endpoint() -> bool:
    return bool(os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL"))


def _b64(digest: bytes) -> str:
    return base64.b64encode(digest).decode()


def _changed() -> StoreError:
    return StoreError(
        "the spooled file is not what was encoded; nothing was stored", code="upload_failed"
    )


def _field(answer: dict[str, Any], name: str, op: str) -> str:
    """``name`` of a successful answer: a store (or something posing as one) that leaves
    it out answered nothing an upload can go on with."""
    value = answer.get(name)
    if not isinstance(value, str) or not value:
        raise StoreError(
            f"the object store answered {op} without its {name}", code="store_bad_answer"
        )
    return value


@dataclass(frozen=True)
class _Upload:
    """One upload: the ``size`` bytes of ``fd``, which must hash to ``sha256`` (hex), to
    ``url`` through ``client``; ``cancel`` set stops it."""

    client: Any
    fd: int
    size: int
    sha256: str
    url: OwnedUrl
    cancel: threading.Event

    def check(self) -> None:
        if self.cancel.is_set():
            raise Cancelled(f"the upload to {self.url} was stopped")

    def content_type(self) -> dict[str, str]:
        return {"ContentType": CONTENT_TYPES.get(self.url.suffix, "application/octet-stream")}


@dataclass(frozen=True)
class Uploaded:
    parts: int  # 0: one PUT
    checksum: str  # what the store reports for the object (base64 sha256, "-N" if composite)


class S3Store:
    """The store's client, made on first use (boto3 is an extra: ``framewire[s3]``)."""

    def __init__(self, settings: Settings):
        self.part_bytes = settings.upload_part_bytes
        self._timeout = settings.store_timeout_s
        self._attempts = settings.store_attempts
        self._client: Any = None
        self._lock = threading.Lock()
        self._parts = ThreadPoolExecutor(PARTS_IN_FLIGHT, thread_name_prefix="framewire-part")
        self._deadlines = Deadlines(settings.store_timeout_s)

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
            raise self._failed(exc, "connecting") from None
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
            raise self._failed(exc, "presigning") from None

    def found(self, url: ObjectUrl) -> Found | None:
        """The object at ``url`` now (its ETag and owner), None if there is none."""
        try:
            answer = self.client().head_object(Bucket=url.bucket, Key=url.key)
        except Exception as exc:
            if missing(exc):
                return None
            raise self._failed(exc, "HeadObject") from None
        meta = answer.get("Metadata")
        owner = meta.get(OWNER_META) if isinstance(meta, dict) else None
        return Found(_field(answer, "ETag", "HeadObject"), owner)

    def upload(
        self, fd: int, size: int, sha256: str, url: OwnedUrl, cancel: threading.Event
    ) -> Uploaded:
        """The ``size`` bytes of ``fd`` stored at ``url``, with its owner, only over the
        object it was judged against; ``sha256`` (hex) is what they must hash to.
        ``cancel`` set stops it (``Cancelled``), also in the middle of a request: nothing
        is left stored (the abort and delete that ensure it are not stopped, only
        bounded)."""
        up = _Upload(self.client(), fd, size, sha256, url, cancel)
        return self._put(up) if size < self.part_bytes else self._multipart(up)

    def _failed(self, exc: Exception, op: str) -> FramewireError:
        """What a failed request of this thread is answered with."""
        return store_error(exc, op, late=self._deadlines.timed_out())

    def _request(self, up: _Upload, op: str, call: Callable[..., Any], **params: Any) -> Any:
        """``call``, the client's method for ``op``, on ``up``'s object: bounded by the
        deadlines and cut when ``up`` is stopped; a failure is answered as ``op``'s."""
        try:
            with self._deadlines.stopped_by(up.cancel):
                return call(Bucket=up.url.bucket, Key=up.url.key, **params)
        except Exception as exc:
            raise self._failed(exc, op) from None

    def _put(self, up: _Upload) -> Uploaded:
        up.check()
        body = os.pread(up.fd, up.size, 0)  # below the part size: bounded
        if len(body) != up.size or hashlib.sha256(body).hexdigest() != up.sha256:
            raise _changed()
        want = _b64(bytes.fromhex(up.sha256))
        answer = self._request(
            up,
            "PutObject",
            up.client.put_object,
            Body=body,
            ChecksumSHA256=want,
            Metadata={OWNER_META: up.url.owner},
            **_over(up.url),
            **up.content_type(),
        )
        self._verify(up.client, up.url, answer, want, hashlib.md5(body).hexdigest())
        return Uploaded(0, want)

    def _multipart(self, up: _Upload) -> Uploaded:
        up.check()
        started = self._request(
            up,
            "CreateMultipartUpload",
            up.client.create_multipart_upload,
            ChecksumAlgorithm="SHA256",
            Metadata={OWNER_META: up.url.owner},
            **up.content_type(),
        )
        upload_id = _field(started, "UploadId", "CreateMultipartUpload")
        try:
            return self._parts_of(up, upload_id)
        except BaseException:
            self._abort(up.client, up.url, upload_id)
            raise

    def _parts_of(self, up: _Upload, upload_id: str) -> Uploaded:
        Part = tuple[dict[str, Any], bytes, bytes]  # (what Complete lists, sha256, md5)
        parts: list[Part] = []
        pending: deque[Future[Part]] = deque()
        whole = hashlib.sha256()  # of the bytes sent, in order: must be the encode's

        def send(number: int, body: bytes) -> Part:
            # Hashed on the part's own thread: hashlib lets go of the GIL, parts hash at once.
            sha, md5 = hashlib.sha256(body).digest(), hashlib.md5(body).digest()
            answer = self._request(  # its deadline kept on this part's own thread
                up,
                "UploadPart",
                up.client.upload_part,
                UploadId=upload_id,
                PartNumber=number,
                Body=body,
                ChecksumSHA256=_b64(sha),
            )
            etag = _field(answer, "ETag", "UploadPart")
            entry = {"PartNumber": number, "ETag": etag, "ChecksumSHA256": _b64(sha)}
            return entry, sha, md5

        try:
            for number, at in enumerate(range(0, up.size, self.part_bytes), start=1):
                up.check()
                while len(pending) >= PARTS_IN_FLIGHT:
                    parts.append(pending.popleft().result())
                body = os.pread(up.fd, min(self.part_bytes, up.size - at), at)
                if not body:
                    raise _changed()
                whole.update(body)
                pending.append(self._parts.submit(send, number, body))
                del body
            while pending:
                parts.append(pending.popleft().result())
        finally:
            for future in pending:  # a part failed or the upload was stopped
                future.cancel()
            for future in pending:
                if not future.cancelled():
                    future.exception()  # wait: no part may land after the abort
        up.check()
        if whole.hexdigest() != up.sha256:
            raise _changed()  # the caller aborts: no object
        answer = self._request(
            up,
            "CompleteMultipartUpload",
            up.client.complete_multipart_upload,
            UploadId=upload_id,
            MultipartUpload={"Parts": [entry for entry, _, _ in parts]},
            **_over(up.url),
        )
        n = len(parts)
        want = f"{_b64(hashlib.sha256(b''.join(sha for _, sha, _ in parts)).digest())}-{n}"
        etag = f"{hashlib.md5(b''.join(md5 for _, _, md5 in parts)).hexdigest()}-{n}"
        self._verify(up.client, up.url, answer, want, etag)
        return Uploaded(n, want)

    def _verify(
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

    def _abort(self, client: Any, url: ObjectUrl, upload_id: str) -> None:
        try:
            client.abort_multipart_upload(Bucket=url.bucket, Key=url.key, UploadId=upload_id)
        except Exception as exc:
            # The store is gone: its lifecycle rule (AbortIncompleteMultipartUpload) is
            # what takes the parts back then; say so without the store's words.
            log.warning(
                "could not abort the multipart upload to %s: %s", url, self._failed(exc, "abort")
            )

    def _delete(self, client: Any, url: ObjectUrl) -> None:
        try:
            client.delete_object(Bucket=url.bucket, Key=url.key)
        except Exception as exc:
            raise self._failed(exc, "DeleteObject") from None

    def close(self) -> None:
        self._parts.shutdown(wait=True, cancel_futures=True)
        self._deadlines.close()


def _over(url: OwnedUrl) -> dict[str, str]:
    """The condition of a write: over the judged object, or where none is."""
    return {"IfNoneMatch": "*"} if url.etag is None else {"IfMatch": url.etag}
