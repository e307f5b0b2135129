"""A real S3-compatible server on loopback (moto's standalone server), and a proxy before it
that the tests steer: it fails, stalls or answers 5xx to chosen requests while the store
behind it keeps its state, so a test can list what an interrupted upload left."""

from __future__ import annotations

import http.client
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlsplit

from tests.support.worker import free_port

KEY_ID, SECRET = "AKIAFRAMEWIRETEST01", "framewire/test+secret/Zq9vXw3yTuP8"


def store_env(endpoint: str, **over: str) -> dict[str, str]:
    """A worker's environment: the endpoint and dummy credentials, no files, no IMDS."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    return (
        env
        | {
            "AWS_ENDPOINT_URL": endpoint,
            "AWS_ACCESS_KEY_ID": KEY_ID,
            "AWS_SECRET_ACCESS_KEY": SECRET,
            "AWS_DEFAULT_REGION": "us-east-1",
            "AWS_CONFIG_FILE": "/nonexistent",
            "AWS_SHARED_CREDENTIALS_FILE": "/nonexistent",
            "AWS_EC2_METADATA_DISABLED": "true",
        }
        | over
    )


@dataclass
class Moto:
    proc: subprocess.Popen[bytes]
    endpoint: str

    def client(self, key_id: str = KEY_ID, secret: str = SECRET) -> Any:
        import boto3

        return boto3.client(
            "s3",
            endpoint_url=self.endpoint,
            aws_access_key_id=key_id,
            aws_secret_access_key=secret,
            region_name="us-east-1",
        )

    def leftovers(self, bucket: str) -> tuple[list[str], list[str]]:
        """(object keys, keys of multipart uploads not completed nor aborted)."""
        c = self.client()
        keys = [o["Key"] for o in c.list_objects_v2(Bucket=bucket).get("Contents", [])]
        uploads = [u["Key"] for u in c.list_multipart_uploads(Bucket=bucket).get("Uploads", [])]
        return keys, uploads


@contextmanager
def moto_server(**env: str) -> Iterator[Moto]:
    """moto's S3 server on a free loopback port (parts may be as small as 1 KiB)."""
    port = free_port()
    full = os.environ | {"S3_UPLOAD_PART_MIN_SIZE": "1024"} | env
    cmd = [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)]
    proc = subprocess.Popen(cmd, env=full, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                assert proc.poll() is None and time.monotonic() < deadline, "moto did not start"
                time.sleep(0.05)
        yield Moto(proc, f"http://127.0.0.1:{port}")
    finally:
        proc.terminate()
        proc.wait(timeout=10)


# What the proxy does with the store's answer before it sends it on: (status, headers, body)
# in, the same out.
Answer = tuple[int, list[tuple[str, str]], bytes]
Edit = Callable[[Answer], Answer]

# What the proxy does with a request: "pass", "reset" (close without an answer), "stall"
# (never answer), "trickle" (answer 200 itself, one byte a second until released, storing
# nothing),
# an HTTP status to answer with, or an Edit of the store's answer.
Plan = Callable[[str, str, int], "str | int | Edit"]


def part_number(target: str) -> int:
    """The part an UploadPart request sends (0 for any other request)."""
    query = parse_qs(urlsplit(target).query)
    return int(query["partNumber"][0]) if "partNumber" in query else 0


def always_pass(method: str, target: str, n: int) -> str | int | Edit:
    return "pass"


@dataclass
class Proxy:
    """An HTTP proxy on loopback before ``upstream``; ``plan`` decides each request's fate."""

    upstream: str
    plan: Plan = always_pass
    seen: list[tuple[str, str]] = field(default_factory=list)
    at: list[float] = field(default_factory=list)  # when each of ``seen`` came (monotonic)
    # Requests the store answered: (method, target, body bytes, when the answer came).
    answered: list[tuple[str, str, int, float]] = field(default_factory=list)
    rate: float | None = None  # bytes a second through the link, all requests together
    _link_free: float = 0.0  # when the link has sent what it was given (monotonic)
    trickled: list[float] = field(default_factory=list)  # when each trickled answer ended
    server: ThreadingHTTPServer | None = None
    release: threading.Event = field(default_factory=threading.Event)

    @property
    def endpoint(self) -> str:
        assert self.server is not None
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def count(self, method: str, fragment: str) -> int:
        return sum(1 for m, t in self.seen if m == method and fragment in t)

    def reset(self) -> None:
        """Pass everything, forget what was seen."""
        self.plan = always_pass
        self.seen[:], self.at[:], self.trickled[:], self.answered[:] = [], [], [], []
        self.release.clear()

    def carry(self, size: int, lock: threading.Lock) -> None:
        """Hold a request's body as long as the link (``rate``) takes to carry it, behind
        what it carries already: concurrent requests share the bandwidth."""
        if self.rate is None:
            return
        with lock:
            start = max(time.monotonic(), self._link_free)
            self._link_free = start + size / self.rate
            until = self._link_free
        time.sleep(max(0.0, until - time.monotonic()))

    def parts_before(self, when: float) -> list[int]:
        """The part numbers of the UploadPart requests that came before ``when``."""
        return [part_number(t) for (m, t), at in zip(self.seen, self.at, strict=True)
                if m == "PUT" and part_number(t) and at < when]  # fmt: skip


def _handler(proxy: Proxy) -> type[BaseHTTPRequestHandler]:
    host, port = proxy.upstream.removeprefix("http://").split(":")
    lock = threading.Lock()
    link = threading.Lock()  # the bandwidth's schedule

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"  # keeps botocore's connections, answers 100-continue

        def log_message(self, *args: Any) -> None:
            pass

        def _any(self) -> None:
            length = int(self.headers.get("Content-Length", 0) or 0)
            body = self.rfile.read(length) if length else b""
            with lock:
                proxy.seen.append((self.command, self.path))
                proxy.at.append(time.monotonic())
                n = len(proxy.seen)
            action = proxy.plan(self.command, self.path, n)
            if action == "reset":
                self.close_connection = True
                self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\1\0\0\0\0\0\0\0")
                return
            if action == "trickle":
                self._trickle(b'HTTP/1.1 200 OK\r\nETag: "0"\r\nContent-Length: 0\r\n\r\n')
                return
            if action == "stall":
                proxy.release.wait(60)
                self.close_connection = True
                return
            if isinstance(action, int):
                text = b"<Error><Code>InternalError</Code><Message>no</Message></Error>"
                if action == 503:
                    text = b"<Error><Code>SlowDown</Code><Message>slow</Message></Error>"
                self.send_response(action)
                self.send_header("Content-Length", str(len(text)))
                self.end_headers()
                self.wfile.write(text)
                return
            headers = {k: v for k, v in self.headers.items() if k.lower() != "expect"}
            proxy.carry(len(body), link)
            conn = http.client.HTTPConnection(host, int(port), timeout=60)
            try:
                conn.request(self.command, self.path, body=body, headers=headers)
                answer = conn.getresponse()
                got: Answer = (answer.status, answer.getheaders(), answer.read())
            finally:
                conn.close()
            with lock:
                proxy.answered.append((self.command, self.path, len(body), time.monotonic()))
            if callable(action):
                got = action(got)
            status, kept, data = got
            self.send_response(status)
            for k, v in kept:
                if k.lower() not in ("content-length", "connection", "transfer-encoding"):
                    self.send_header(k, v)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(data)

        def _trickle(self, answer: bytes) -> None:
            """The whole answer, one byte a second, until the worker hangs up or the
            test lets go; the time it ended is noted."""
            self.close_connection = True
            try:
                for byte in answer:
                    if proxy.release.wait(1):
                        break
                    self.wfile.write(bytes([byte]))
                    self.wfile.flush()
            except OSError:
                pass
            proxy.trickled.append(time.monotonic())

        do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _any

    return Handler


@contextmanager
def proxy_to(upstream: str) -> Iterator[Proxy]:
    proxy = Proxy(upstream)
    proxy.server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(proxy))
    proxy.server.daemon_threads = True
    thread = threading.Thread(target=proxy.server.serve_forever, daemon=True)
    thread.start()
    try:
        yield proxy
    finally:
        proxy.release.set()
        proxy.server.shutdown()
        proxy.server.server_close()
        thread.join(timeout=10)
