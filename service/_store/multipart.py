"""Multipart uploads: parts sent a few at a time, each with its SHA-256, checked and
completed; parts may go before the file is whole (service/_store/early.py).

The bytes stored are the file's: every part of the file is read and hashed in order when
its upload completes, a part sent early is reused only if its SHA-256 is that of the
same bytes of the finished file (else it is sent again), and the whole must hash to the
encode's sha256, or the upload is aborted before it completes.
"""

from __future__ import annotations

import base64
import hashlib
import os
import threading
from collections import deque
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Protocol

from framewire.core.errors import Cancelled
from framewire.service._access.urls import ObjectUrl
from framewire.service._store.faults import answered, changed_file
from framewire.service._store.owners import OWNER_META, OwnedUrl, condition

PARTS_IN_FLIGHT = 4
CONTENT_TYPES = {".mp4": "video/mp4", ".m4v": "video/mp4", ".mov": "video/quicktime"}


def b64(digest: bytes) -> str:
    return base64.b64encode(digest).decode()


@dataclass(frozen=True)
class Upload:
    """One upload: the ``size`` bytes of ``fd``, which must hash to ``sha256`` (hex), to
    ``url`` through ``client``; ``cancel`` set stops it. Parts sent while the file is
    still written (service/_store/early.py) go before its size and digest are known."""

    client: Any
    url: OwnedUrl
    cancel: threading.Event
    fd: int = -1
    size: int = 0
    sha256: str = ""

    def check(self) -> None:
        if self.cancel.is_set():
            raise Cancelled(f"the upload to {self.url} was stopped")

    def content_type(self) -> dict[str, str]:
        return {"ContentType": CONTENT_TYPES.get(self.url.suffix, "application/octet-stream")}


@dataclass(frozen=True)
class Uploaded:
    parts: int  # 0: one PUT
    checksum: str  # what the store reports for the object (base64 sha256, "-N" if composite)


# A part sent: what CompleteMultipartUpload lists of it, its sha256 and md5 (digests).
Part = tuple[dict[str, Any], bytes, bytes]


def stop_parts(sending: Iterable[Future[Part]]) -> None:
    """Cancel the parts not yet on their way and wait for those that are: no part may
    land after the abort that follows."""
    futures = list(sending)
    for future in futures:
        future.cancel()
    for future in futures:
        if not future.cancelled():
            future.exception()  # waits; a part's failure is the caller's to report


@dataclass
class Started:
    """A multipart upload begun, and the parts already sent (by part number)."""

    upload_id: str
    sent: dict[int, Part]


class Store(Protocol):
    """What multipart uploads ask of their store (service/_store/s3.py's S3Store)."""

    part_bytes: int

    def request(self, up: Upload, op: str, call: Callable[..., Any], **params: Any) -> Any: ...

    def verify(
        self, client: Any, url: ObjectUrl, answer: dict[str, Any], sha256: str, etag: str
    ) -> None: ...

    def abort(self, up: Upload, upload_id: str) -> None: ...


class Multipart:
    """The multipart uploads of one store; their parts go out on one pool of
    :data:`PARTS_IN_FLIGHT` threads."""

    def __init__(self, store: Store):
        self.store = store
        self._parts = ThreadPoolExecutor(PARTS_IN_FLIGHT, thread_name_prefix="framewire-part")

    def begin(self, up: Upload) -> Started:
        """A multipart upload to ``up.url``, with its owner, no part sent yet."""
        up.check()
        answer = self.store.request(
            up,
            "CreateMultipartUpload",
            up.client.create_multipart_upload,
            ChecksumAlgorithm="SHA256",
            Metadata={OWNER_META: up.url.owner},
            **up.content_type(),
        )
        return Started(answered(answer, "UploadId", "CreateMultipartUpload"), {})

    def send_part(self, up: Upload, upload_id: str, number: int, body: bytes) -> Part:
        """Part ``number`` of the upload, ``body``, with its SHA-256 for the store to
        check; hashed on the calling thread (hashlib lets go of the GIL)."""
        sha, md5 = hashlib.sha256(body).digest(), hashlib.md5(body).digest()
        answer = self.store.request(  # its deadline kept on this part's own thread
            up,
            "UploadPart",
            up.client.upload_part,
            UploadId=upload_id,
            PartNumber=number,
            Body=body,
            ChecksumSHA256=b64(sha),
        )
        etag = answered(answer, "ETag", "UploadPart")
        return {"PartNumber": number, "ETag": etag, "ChecksumSHA256": b64(sha)}, sha, md5

    def submit(self, fn: Callable[..., Part], *args: Any) -> Future[Part]:
        """``fn`` on the parts' pool (PARTS_IN_FLIGHT threads, every upload's)."""
        return self._parts.submit(fn, *args)

    def finish(self, up: Upload, started: Started) -> Uploaded:
        """The rest of ``up``'s parts sent, each early one checked against the file (sent
        again if it differs), the whole hashed in order, then CompleteMultipartUpload;
        aborted on any failure."""
        try:
            return self._parts_of(up, started)
        except BaseException:
            self.store.abort(up, started.upload_id)
            raise

    def _parts_of(self, up: Upload, started: Started) -> Uploaded:
        parts: list[Part] = []
        pending: deque[Future[Part]] = deque()
        whole = hashlib.sha256()  # of the bytes sent, in order: must be the encode's
        upload_id = started.upload_id
        try:
            for number, at in enumerate(range(0, up.size, self.store.part_bytes), start=1):
                up.check()
                while len(pending) >= PARTS_IN_FLIGHT:
                    parts.append(pending.popleft().result())
                body = os.pread(up.fd, min(self.store.part_bytes, up.size - at), at)
                if not body:
                    raise changed_file()
                whole.update(body)
                early = started.sent.get(number)
                if early is not None and early[1] == hashlib.sha256(body).digest():
                    done: Future[Part] = Future()  # sent early, and these are its bytes
                    done.set_result(early)
                    pending.append(done)
                else:
                    pending.append(self._parts.submit(self.send_part, up, upload_id, number, body))
                del body
            while pending:
                parts.append(pending.popleft().result())
        finally:
            stop_parts(pending)  # a part failed or the upload was stopped
        up.check()
        if whole.hexdigest() != up.sha256:
            raise changed_file()  # the caller aborts: no object
        answer = self.store.request(
            up,
            "CompleteMultipartUpload",
            up.client.complete_multipart_upload,
            UploadId=upload_id,
            MultipartUpload={"Parts": [entry for entry, _, _ in parts]},
            **condition(up.url),
        )
        n = len(parts)
        want = f"{b64(hashlib.sha256(b''.join(sha for _, sha, _ in parts)).digest())}-{n}"
        etag = f"{hashlib.md5(b''.join(md5 for _, _, md5 in parts)).hexdigest()}-{n}"
        self.store.verify(up.client, up.url, answer, want, etag)
        return Uploaded(n, want)

    def close(self) -> None:
        self._parts.shutdown(wait=True, cancel_futures=True)
