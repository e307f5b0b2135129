"""One rank-like client process, stepped by its parent over stdin/stdout.

    python -m tests.decode_client FD_SOCKET VIDEO FPS WIDTH HEIGHT

Prints ``ready`` once imported and connected-capable, waits for ``go``, asks
the worker for the decode, reads every byte (so every page is mapped), prints
one JSON line, waits for ``measure``, prints its PSS of the mapping, waits for
``exit``. The parent holds all processes at each step, so the measurement is
taken while all of them hold the mapping.
"""

from __future__ import annotations

import hashlib
import json
import sys

from framewire.client import Client

from tests.support.refclips import mapping_pss_kib


def step(expected: str) -> None:
    line = sys.stdin.readline().strip()
    if line != expected:
        raise SystemExit(f"expected {expected!r}, got {line!r}")


def main() -> None:
    sock, video, fps, width, height = sys.argv[1:6]
    print("ready", flush=True)
    step("go")
    with (
        Client(fd_socket=sock, timeout=60) as client,
        client.decode_reference(
            video, fps=float(fps), width=int(width), height=int(height), local_fallback=False
        ) as ref,
    ):
        digest = hashlib.sha256(ref.frames).hexdigest()
        answer = {"sha256": digest, "nbytes": ref.nbytes, "cached": ref.cached}
        print(json.dumps(answer | {"source": ref.source}), flush=True)
        step("measure")
        print(json.dumps({"pss_kib": mapping_pss_kib()}), flush=True)
        step("exit")


if __name__ == "__main__":
    main()
