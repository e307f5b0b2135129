"""The worker's log lines, plain or JSON, each tagged with the id of the request it serves.

The id comes from the caller's ``x-request-id`` header (when it is a sane token)
or is made here; it is echoed in the response and kept in a context variable, so
every line logged while the request runs (uvicorn's access line, an encode's
ffmpeg failure on its worker thread) carries it.
"""

from __future__ import annotations

import json
import logging
import re
import secrets
from contextvars import ContextVar
from datetime import UTC, datetime

from framewire.service._ops.asgi import HttpMiddleware
from starlette.types import Message, Receive, Scope, Send

HEADER = "x-request-id"
request_id: ContextVar[str | None] = ContextVar("framewire_request_id", default=None)

# Ids end up in log lines and headers: anything else is replaced, not escaped.
_SANE_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:/=+-]{0,127}")
# Attributes every LogRecord has; the rest came in through ``extra=`` and are logged as fields.
_RECORD_FIELDS = frozenset(vars(logging.makeLogRecord({}))) | {"message", "asctime", "taskName"}
_IGNORED_EXTRAS = frozenset({"color_message"})  # uvicorn's colored copy of the message


def accept_request_id(given: str | None) -> str:
    if given is not None and _SANE_ID.fullmatch(given):
        return given
    return secrets.token_hex(8)


def _extras(record: logging.LogRecord) -> dict[str, object]:
    return {
        k: v
        for k, v in vars(record).items()
        if k not in _RECORD_FIELDS and k not in _IGNORED_EXTRAS and not k.startswith("_")
    }


def _timestamp(record: logging.LogRecord) -> str:
    return datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds")


class JsonFormatter(logging.Formatter):
    """One JSON object a line: time, level, logger, message, request_id, then any extras."""

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, object] = {
            "time": _timestamp(record),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        rid = request_id.get()
        if rid is not None:
            entry["request_id"] = rid
        entry.update(_extras(record))
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry, default=str)


# Control characters (newlines above all) in a message would let a request's path or
# name forge log lines: each is written as an escape instead.
_CONTROLS = {c: f"\\x{c:02x}" for c in (*range(0x20), 0x7F, *range(0x80, 0xA0))} | {
    0x0A: "\\n",
    0x0D: "\\r",
    0x09: "\\t",
}


def one_line(text: str) -> str:
    return text.translate(_CONTROLS)


class PlainFormatter(logging.Formatter):
    """``time LEVEL logger [request id] message key=value ...`` for people reading a terminal.

    One record is one line (a traceback apart): control characters are escaped.
    """

    def format(self, record: logging.LogRecord) -> str:
        rid = request_id.get()
        line = f"{_timestamp(record)} {record.levelname} {record.name}"
        if rid is not None:
            line += f" [{rid}]"
        line += f": {one_line(record.getMessage())}"
        for key, value in _extras(record).items():
            line += f" {key}={value!r}"
        if record.exc_info:
            line += "\n" + self.formatException(record.exc_info)
        return line


def configure_logging(fmt: str, level: int) -> None:
    """Send every logger (uvicorn's included) through one stderr handler in ``fmt``."""
    handler = logging.StreamHandler()
    handler.setFormatter(JsonFormatter() if fmt == "json" else PlainFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
    for name in ("uvicorn", "uvicorn.error", "uvicorn.access"):
        logger = logging.getLogger(name)
        logger.handlers.clear()
        logger.propagate = True
    logging.captureWarnings(True)  # library warnings in the same format, not raw on stderr


class RequestIds(HttpMiddleware):
    """Plain ASGI: picks the request's id, exposes it to logging, echoes it in the response."""

    async def http(self, scope: Scope, receive: Receive, send: Send) -> None:
        given = next(
            (v.decode("latin-1") for k, v in scope["headers"] if k == HEADER.encode()), None
        )
        rid = accept_request_id(given)

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = [*message.get("headers", ()), (HEADER.encode(), rid.encode())]
                message = {**message, "headers": headers}
            await send(message)

        token = request_id.set(rid)
        try:
            await self.app(scope, receive, send_with_id)
        finally:
            request_id.reset(token)
