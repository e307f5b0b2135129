"""Which objects the worker may write: ``s3://bucket/key`` under configured URL prefixes.

An output path with a scheme (``s3://``) names an object, not a file. It is
judged like a file path against the roots: the URL must be well formed (400
``bad_url``) and lie under one of ``FRAMEWIRE_OUTPUT_URLS`` (403
``url_not_allowed``), whose prefixes end at a ``/`` so that ``s3://b/clips/``
never admits ``s3://b/clips-private/``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from framewire.core.errors import BadRequest, Forbidden
from framewire.core.media.argv import OUTPUT_EXTENSIONS

SCHEME = "s3://"
# S3's own bucket naming rules (3-63 lowercase letters, digits, dots, hyphens).
_BUCKET = re.compile(r"[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]")
MAX_KEY_BYTES = 1024  # S3's limit on a key


@dataclass(frozen=True)
class ObjectUrl:
    bucket: str
    key: str

    def __str__(self) -> str:
        return f"{SCHEME}{self.bucket}/{self.key}"

    @property
    def suffix(self) -> str:
        """The key's extension, lowercased: the encoder picks the container from it."""
        name = self.key.rsplit("/", 1)[-1]
        return "." + name.rsplit(".", 1)[-1].lower() if "." in name else ""


def is_url(raw: str) -> bool:
    """Whether an output path names an object (any ``scheme://``) rather than a file."""
    return "://" in raw


def _split(raw: str) -> tuple[str, str]:
    if not raw.startswith(SCHEME):
        scheme = raw.split("://", 1)[0]
        raise BadRequest(f"output URL scheme {scheme!r}: only s3:// is served", code="bad_url")
    bucket, _, key = raw[len(SCHEME) :].partition("/")
    if not _BUCKET.fullmatch(bucket) or ".." in bucket:
        raise BadRequest(f"output URL {raw!r}: {bucket!r} is not a bucket name", code="bad_url")
    return bucket, key


def parse_url(raw: str) -> ObjectUrl:
    """``s3://bucket/key`` naming one object (400 ``bad_url`` if it does not)."""
    bucket, key = _split(raw)
    parts = key.split("/")
    if not key or not parts[-1] or any(p in ("", ".", "..") for p in parts):
        raise BadRequest(f"output URL {raw!r} names no object", code="bad_url")
    if len(key.encode("utf-8", "surrogatepass")) > MAX_KEY_BYTES or any(
        ord(c) < 0x20 or 0xD800 <= ord(c) < 0xE000 for c in key
    ):
        raise BadRequest(f"output URL {raw!r}: not a usable object key", code="bad_url")
    url = ObjectUrl(bucket, key)
    if url.suffix not in OUTPUT_EXTENSIONS:
        raise BadRequest(
            f"output URL {raw!r}: the key must end in one of {', '.join(OUTPUT_EXTENSIONS)}",
            code="unsupported_output_format",
        )
    return url


def check_prefix(raw: str) -> str:
    """A configured prefix, as compared: ``s3://bucket/`` or ``s3://bucket/some/prefix/``."""
    bucket, key = _split(raw)
    if key and not key.endswith("/"):
        raise ValueError(f"{raw!r} must end with '/' (a prefix, not an object)")
    return f"{SCHEME}{bucket}/{key}"


def judge_url(raw: str, allowed: list[str]) -> ObjectUrl:
    """The object ``raw`` names, if the worker may write it."""
    url = parse_url(raw)
    if not any(str(url).startswith(prefix) for prefix in allowed):
        raise Forbidden(
            f"output URL {raw!r} is outside the allowed URL prefixes (FRAMEWIRE_OUTPUT_URLS)",
            code="url_not_allowed",
        )
    return url
