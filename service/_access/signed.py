"""Short-lived signed view URLs: what a browser, which cannot send the bearer token,
presents instead to watch one stream session.

The signature is an HMAC-SHA256 of the session id and the expiry under a secret
drawn when the worker starts: a URL names one session, stops working at its
expiry, and no URL outlives the worker that signed it.
"""

from __future__ import annotations

import hashlib
import hmac
import re
import secrets
import time
from urllib.parse import parse_qs, urlencode

VIEW_URL_TTL_S = 900
# The routes a signed URL opens: the watch page, the byte stream it plays, and the HLS
# playlist with its init segment, segments and parts (players fetch those by the URIs
# in the playlist, which carry the same query, and send no headers of their own).
VIEW_PATH = re.compile(
    r"/v1/streams/([0-9a-f]{16})/(?:watch|live\.mp4|live\.m3u8|live/[0-9a-z.]{1,32})"
)
# An expiry as signed: ASCII digits, as many as a Unix time needs. ``str.isdigit`` also
# takes other scripts' digits and superscripts, which ``int`` refuses or reads anew, and
# ``int`` refuses more than 4300 digits: a caller's URL must not make either raise.
EXPIRY = re.compile(r"[0-9]{1,20}")


class ViewSigner:
    def __init__(self, ttl_s: float = VIEW_URL_TTL_S):
        self._key = secrets.token_bytes(32)
        self.ttl_s = ttl_s

    def _sig(self, stream_id: str, expires: int) -> str:
        message = f"{stream_id}.{expires}".encode()
        return hmac.new(self._key, message, hashlib.sha256).hexdigest()

    def query(self, stream_id: str, now: float | None = None) -> str:
        """``exp=...&sig=...`` for ``stream_id``, valid for ``ttl_s`` from now."""
        expires = int((time.time() if now is None else now) + self.ttl_s)
        return urlencode({"exp": expires, "sig": self._sig(stream_id, expires)})

    def valid(self, stream_id: str, query_string: str) -> bool:
        """Whether ``query_string`` carries an unexpired signature for ``stream_id``."""
        return self.expiry(stream_id, query_string) is not None

    def expiry(self, stream_id: str, query_string: str) -> int | None:
        """When the signature ``query_string`` carries for ``stream_id`` expires; None if
        it carries no valid one."""
        query = parse_qs(query_string)
        exp, sig = query.get("exp", [""])[-1], query.get("sig", [""])[-1]
        if not EXPIRY.fullmatch(exp) or int(exp) < time.time():
            return None
        if not hmac.compare_digest(sig.encode(), self._sig(stream_id, int(exp)).encode()):
            return None
        return int(exp)

    def allows(self, path: str, query_string: str) -> bool:
        """Whether a request for ``path`` may go without the token: a view route of a
        session, with that session's valid signature."""
        match = VIEW_PATH.fullmatch(path)
        return match is not None and self.valid(match.group(1), query_string)
