"""Outputs to an S3-compatible store: a real worker, moto's real S3 server on loopback,
and a proxy between them that fails, stalls or answers 5xx on demand.

The promise: the object is the file a local encode writes, byte for byte; it
appears only whole; a failed or stopped upload leaves no object, no multipart
upload and no spool file; a refused URL touches nothing.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from tests.support.cli import run_cli
from tests.support.http import http_client, http_get
from tests.support.identity import NOBODY, as_nobody, as_user, open_worker
from tests.support.media import make_clip, reference_mp4
from tests.support.objstore import (
    KEY_ID,
    SECRET,
    Moto,
    Proxy,
    moto_server,
    part_number,
    store_env,
)
from tests.support.processes import SPOOL, framewire_temps, spools
from tests.support.real import needs_root
from tests.support.requests import post_raw
from tests.support.segments import Segments
from tests.support.worker import Worker, Workers

pytestmark = pytest.mark.usefixtures("fresh")  # tests/service/store/conftest.py

BUCKET = "frames"
PART = 2048  # the small clip (~1.9 KiB) goes in one PUT, the long one in several parts
ARGS = (
    "--output-urls", f"s3://{BUCKET}/ok/,s3://no-such-bucket/",
    "--upload-part-bytes", str(PART), "--store-timeout-s", "1", "--store-attempts", "2",
)  # fmt: skip
SMALL = (6, 48, 64)
LONG = (40, 96, 128)


@pytest.fixture(scope="module")
def sworker(proxy: Proxy, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Worker]:
    started = Workers(lambda: tmp_path_factory.mktemp("worker"))
    yield started.start(*ARGS, env=store_env(proxy.endpoint))
    started.stop_all()


def encode(w: Worker, segments: Segments, path: str, dims: tuple[int, int, int], **over: Any):
    clip = make_clip(*dims)
    body = {"outputs": [{"source": segments.source(clip), "path": path, "fps": 24} | over]}
    with w.http() as h:
        return h.post("/v1/videos:encode", json=body), clip


def reference_sha(clip: Any, tmp_path: Path) -> str:
    return reference_mp4(clip, tmp_path / "ref.mp4")


def object_sha(moto: Moto, key: str) -> str:
    body = moto.client().get_object(Bucket=BUCKET, Key=key)["Body"].read()
    return hashlib.sha256(body).hexdigest()


def assert_nothing_left(moto: Moto, w: Worker) -> None:
    assert moto.leftovers(BUCKET) == ([], [])
    assert framewire_temps(w.outputs) == []


def test_one_put_is_the_local_file_byte_for_byte(sworker, moto, proxy, segments, tmp_path):
    r, clip = encode(sworker, segments, f"s3://{BUCKET}/ok/a.mp4", SMALL, presign_s=60)
    assert r.status_code == 200, r.text
    out = r.json()["outputs"][0]
    assert out["url"] == out["path"] == f"s3://{BUCKET}/ok/a.mp4"
    assert out["sha256"] == reference_sha(clip, tmp_path) == object_sha(moto, "ok/a.mp4")
    assert out["bytes"] < PART and proxy.count("PUT", "uploadId") == 0
    assert out["timings"]["upload_ms"] > 0
    # The presigned URL needs no credentials: a plain GET gets the same bytes.
    assert "X-Amz-Signature=" in out["presigned_url"] and "X-Amz-Expires=60" in out["presigned_url"]
    got = http_get(out["presigned_url"], timeout=30)
    assert got.status_code == 200 and hashlib.sha256(got.content).hexdigest() == out["sha256"]
    assert framewire_temps(sworker.outputs) == []


def test_a_large_output_goes_multipart_with_a_checksum_per_part(
    sworker, moto, proxy, segments, tmp_path
):
    r, clip = encode(sworker, segments, f"s3://{BUCKET}/ok/long.mp4", LONG)
    assert r.status_code == 200, r.text
    out = r.json()["outputs"][0]
    parts = proxy.count("PUT", "partNumber=")
    assert parts == -(-out["bytes"] // PART) >= 2
    assert out["sha256"] == reference_sha(clip, tmp_path) == object_sha(moto, "ok/long.mp4")
    head = moto.client().head_object(Bucket=BUCKET, Key="ok/long.mp4", ChecksumMode="ENABLED")
    assert head["ContentLength"] == out["bytes"]
    assert moto.leftovers(BUCKET) == (["ok/long.mp4"], [])


@pytest.mark.parametrize(
    ("path", "status", "code"),
    [
        (f"s3://{BUCKET}/other/a.mp4", 403, "url_not_allowed"),
        (f"s3://{BUCKET}/ok-not/a.mp4", 403, "url_not_allowed"),
        ("s3://elsewhere/ok/a.mp4", 403, "url_not_allowed"),
        (f"s3://{BUCKET}/ok/../a.mp4", 400, "bad_url"),
        (f"s3://{BUCKET}/ok/", 400, "bad_url"),
        ("s3://Bad_Bucket/ok/a.mp4", 400, "bad_url"),
        ("gs://frames/ok/a.mp4", 400, "bad_url"),
        (f"s3://{BUCKET}/ok/a.gif", 400, "unsupported_output_format"),
    ],
)
def test_urls_outside_the_allow_list_or_malformed_touch_nothing(
    sworker, moto, proxy, segments, path, status, code
):
    r, _ = encode(sworker, segments, path, SMALL)
    assert r.status_code == status, r.text
    assert r.json()["code"] == code
    assert proxy.seen == []
    assert_nothing_left(moto, sworker)


def test_presign_is_for_urls_only(sworker, segments):
    r, _ = encode(sworker, segments, "a.mp4", SMALL, presign_s=60)
    assert r.status_code == 400 and r.json()["code"] == "presign_needs_url", r.text
    assert not (sworker.outputs / "a.mp4").exists()


def test_a_store_that_fails_mid_upload_is_aborted(sworker, moto, proxy, segments):
    # The store stops answering from the second part on (connections reset), but is
    # still there for the abort: nothing of the upload may remain.
    proxy.plan = lambda m, t, n: "reset" if part_number(t) >= 2 else "pass"
    r, _ = encode(sworker, segments, f"s3://{BUCKET}/ok/cut.mp4", LONG)
    assert r.status_code == 503, r.text
    assert r.json()["outputs"][0]["error"]["code"] == "store_unavailable"
    assert [part_number(t) for _, t in proxy.seen].count(2) == 2  # --store-attempts 2
    assert proxy.count("DELETE", "uploadId=") == 1
    assert_nothing_left(moto, sworker)


def test_5xx_is_retried_then_succeeds(sworker, moto, proxy, segments, tmp_path):
    proxy.plan = lambda m, t, n: 503 if m == "PUT" and proxy.count("PUT", "") == 1 else "pass"
    r, clip = encode(sworker, segments, f"s3://{BUCKET}/ok/retry.mp4", SMALL)
    assert r.status_code == 200, r.text
    assert proxy.count("PUT", "ok/retry.mp4") == 2
    assert moto.leftovers(BUCKET) == (["ok/retry.mp4"], [])
    # The retried PUT stored the encode's bytes, whole: the result's and the oracle's.
    stored = object_sha(moto, "ok/retry.mp4")
    assert stored == r.json()["outputs"][0]["sha256"] == reference_sha(clip, tmp_path)


def test_5xx_past_the_attempts_is_store_unavailable(sworker, moto, proxy, segments):
    proxy.plan = lambda m, t, n: 500
    r, _ = encode(sworker, segments, f"s3://{BUCKET}/ok/down.mp4", SMALL)
    assert r.status_code == 502, r.text
    assert r.json()["outputs"][0]["error"]["code"] == "store_unavailable"
    assert proxy.count("PUT", "ok/down.mp4") == 2  # --store-attempts 2
    assert_nothing_left(moto, sworker)


def test_a_slow_store_is_a_timeout_and_the_worker_keeps_serving(sworker, moto, proxy, segments):
    proxy.plan = lambda m, t, n: "stall" if m == "PUT" else "pass"
    t0 = time.monotonic()
    r, _ = encode(sworker, segments, f"s3://{BUCKET}/ok/slow.mp4", SMALL)
    assert r.status_code == 504, r.text
    assert r.json()["outputs"][0]["error"]["code"] == "store_timeout"
    assert time.monotonic() - t0 < 15  # 2 attempts of 1 s, with backoff
    proxy.release.set()
    assert_nothing_left(moto, sworker)
    ok, _ = encode(sworker, segments, "after.mp4", SMALL)
    assert ok.status_code == 200, ok.text


def test_a_missing_bucket_is_a_clear_code(sworker, proxy, segments):
    r, _ = encode(sworker, segments, "s3://no-such-bucket/a.mp4", SMALL)
    assert r.status_code == 502, r.text
    assert r.json()["outputs"][0]["error"]["code"] == "store_no_bucket"
    assert framewire_temps(sworker.outputs) == []


def test_a_stream_session_uploads_on_finish(sworker, moto, segments, tmp_path):
    clip = make_clip(*LONG)
    _, frames, height, width = clip.shape
    with sworker.http() as h:
        opened = {"path": f"s3://{BUCKET}/ok/stream.mp4", "fps": 24, "dtype": "float32",
                  "height": height, "width": width, "presign_s": 30}  # fmt: skip
        r = h.post("/v1/streams", json=opened)
        assert r.status_code == 201, r.text
        sid = r.json()["id"]
        for t0 in range(0, frames, 7):
            chunk = segments.source(clip[:, t0 : t0 + 7].contiguous())
            r = h.post(f"/v1/streams/{sid}/frames", json={"first_frame": t0, "source": chunk})
            assert r.status_code == 200, r.text
        assert moto.leftovers(BUCKET) == ([], [])  # nothing before finish
        r = h.post(f"/v1/streams/{sid}/finish")
        assert r.status_code == 200, r.text
        out = r.json()
        assert h.get(f"/v1/streams/{sid}").json()["path"] == out["url"]
    assert out["sha256"] == reference_sha(clip, tmp_path) == object_sha(moto, "ok/stream.mp4")
    assert out["presigned_url"].startswith(moto.endpoint.rsplit(":", 1)[0])
    assert framewire_temps(sworker.outputs) == []


def test_the_cli_encodes_to_a_url(sworker, moto, tmp_path):
    clip = make_clip(*SMALL)
    np.save(tmp_path / "clip.npy", clip.numpy())
    url = f"s3://{BUCKET}/ok/cli.mp4"
    done = run_cli("encode", str(tmp_path / "clip.npy"), url, "--fps", "24",
                   "--url", sworker.uds_url, "--json")  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["path"] == url
    assert object_sha(moto, "ok/cli.mp4") == reference_sha(clip, tmp_path)


def _upload_in_background(w: Worker, segments: Segments, key: str) -> tuple[threading.Thread, list]:
    """POST an encode of the long clip to ``key`` from a thread; its answer lands in the list."""
    answer: list[httpx.Response] = []
    clip = make_clip(*LONG)
    body = {"outputs": [{"source": segments.source(clip), "path": f"s3://{BUCKET}/{key}",
                         "fps": 24}]}  # fmt: skip

    def post() -> None:
        with w.http() as h:
            answer.append(h.post("/v1/videos:encode", json=body))

    thread = threading.Thread(target=post)
    thread.start()
    return thread, answer


def _wait_for_part(proxy: Proxy, number: int) -> None:
    deadline = time.monotonic() + 30
    while not any(part_number(t) == number for _, t in proxy.seen):
        assert time.monotonic() < deadline, f"the upload never reached part {number}"
        time.sleep(0.02)


def test_sigterm_during_an_upload_aborts_it_past_the_grace(workers, moto, proxy, segments):
    w = workers.start(*ARGS, "--shutdown-grace", "0.5", env=store_env(proxy.endpoint))
    proxy.plan = lambda m, t, n: "stall" if part_number(t) == 2 else "pass"
    thread, answer = _upload_in_background(w, segments, "ok/term.mp4")
    _wait_for_part(proxy, 2)
    assert w.stop() == 0
    thread.join(timeout=30)
    assert answer and answer[0].status_code == 503, answer
    assert proxy.count("DELETE", "uploadId=") == 1
    assert_nothing_left(moto, w)


def test_sigterm_during_an_upload_lets_it_finish_within_the_grace(workers, moto, proxy, segments):
    w = workers.start(*ARGS, "--shutdown-grace", "20", env=store_env(proxy.endpoint))
    proxy.plan = lambda m, t, n: "stall" if part_number(t) == 2 else "pass"
    thread, answer = _upload_in_background(w, segments, "ok/drained.mp4")
    _wait_for_part(proxy, 2)
    w.proc.send_signal(signal.SIGTERM)
    time.sleep(0.5)
    proxy.plan = lambda m, t, n: "pass"  # the store answers again: the part is retried
    proxy.release.set()
    assert w.proc.wait(timeout=30) == 0  # one SIGTERM: drained, not forced
    thread.join(timeout=30)
    assert answer and answer[0].status_code == 200, answer
    assert moto.leftovers(BUCKET) == (["ok/drained.mp4"], [])
    assert framewire_temps(w.outputs) == []


def test_without_credentials_an_upload_is_store_denied_and_nothing_is_left(workers, moto, segments):
    env = store_env(moto.endpoint)
    del env["AWS_ACCESS_KEY_ID"], env["AWS_SECRET_ACCESS_KEY"]
    w = workers.start(*ARGS, "--log-level", "debug", env=env)
    r, _ = encode(w, segments, f"s3://{BUCKET}/ok/nokey.mp4", SMALL)
    assert r.status_code == 502, r.text
    assert r.json()["outputs"][0]["error"]["code"] == "store_denied"
    assert_nothing_left(moto, w)


@pytest.fixture(scope="module")
def auth_moto() -> Iterator[tuple[Moto, dict[str, str]]]:
    """A second moto server that checks signatures against its own IAM users."""
    import boto3

    with moto_server(INITIAL_NO_AUTH_ACTION_COUNT="3") as server:
        iam = boto3.client("iam", endpoint_url=server.endpoint, region_name="us-east-1",
                           aws_access_key_id="x", aws_secret_access_key="y")  # fmt: skip
        iam.create_user(UserName="fw")
        key = iam.create_access_key(UserName="fw")["AccessKey"]
        allow = {"Effect": "Allow", "Action": "s3:*", "Resource": "*"}
        policy = {"Version": "2012-10-17", "Statement": [allow]}
        iam.put_user_policy(UserName="fw", PolicyName="all", PolicyDocument=json.dumps(policy))
        good = {
            "AWS_ACCESS_KEY_ID": key["AccessKeyId"],
            "AWS_SECRET_ACCESS_KEY": key["SecretAccessKey"],
        }
        server.client(key["AccessKeyId"], key["SecretAccessKey"]).create_bucket(Bucket=BUCKET)
        yield server, good


@pytest.mark.parametrize("which", ["wrong key id", "wrong secret", "right"])
def test_credentials_are_checked_and_never_shown(workers, auth_moto, segments, which):
    server, good = auth_moto
    creds = {
        "wrong key id": {"AWS_ACCESS_KEY_ID": KEY_ID, "AWS_SECRET_ACCESS_KEY": SECRET},
        "wrong secret": {
            "AWS_ACCESS_KEY_ID": good["AWS_ACCESS_KEY_ID"],
            "AWS_SECRET_ACCESS_KEY": SECRET,
        },
        "right": good,
    }[which]
    w = workers.start(*ARGS, "--log-level", "debug", env=store_env(server.endpoint, **creds))
    r, _ = encode(w, segments, f"s3://{BUCKET}/ok/{which.replace(' ', '-')}.mp4", SMALL)
    with w.http() as h:
        info = h.get("/v1/info").text
    assert f"s3://{BUCKET}/ok/" in info
    if which == "right":
        assert r.status_code == 200, r.text
    else:
        assert r.status_code == 502, r.text
        assert r.json()["outputs"][0]["error"]["code"] == "store_denied"
    log = w.log.read_text()
    for secret in (SECRET, creds["AWS_SECRET_ACCESS_KEY"], creds["AWS_ACCESS_KEY_ID"]):
        assert secret not in r.text and secret not in info and secret not in log
    assert "store_denied" in log or which == "right"  # the failure was logged, without them
    server_client = server.client(good["AWS_ACCESS_KEY_ID"], good["AWS_SECRET_ACCESS_KEY"])
    keys = [o["Key"] for o in server_client.list_objects_v2(Bucket=BUCKET).get("Contents", [])]
    assert (f"ok/{which.replace(' ', '-')}.mp4" in keys) == (which == "right")


def test_a_worker_without_boto3_refuses_urls_and_serves_files(workers, segments, tmp_path):
    # boto3 made unimportable for that worker alone: the [s3] extra not installed.
    shadow = tmp_path / "shadow" / "boto3"
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text("raise ImportError('not installed here')\n")
    env = os.environ | {"PYTHONPATH": f"{shadow.parent}:{os.environ.get('PYTHONPATH', '')}"}
    w = workers.start(*ARGS, env=env)
    r, _ = encode(w, segments, f"s3://{BUCKET}/ok/a.mp4", SMALL)
    assert r.status_code == 503, r.text
    assert r.json()["outputs"][0]["error"]["code"] == "s3_not_installed"
    ok, _ = encode(w, segments, "a.mp4", SMALL)
    assert ok.status_code == 200, ok.text
    assert framewire_temps(w.outputs) == []


def test_the_client_passes_a_url_through(sworker, moto, tmp_path):
    from framewire.client import Client

    clip = make_clip(*SMALL)
    with Client(sworker.uds_url) as client:
        result = client.save_video(clip, f"s3://{BUCKET}/ok/client.mp4", fps=24, presign_s=30)
    assert result.url == f"s3://{BUCKET}/ok/client.mp4" and result.presigned_url
    assert result.sha256 == reference_sha(clip, tmp_path) == object_sha(moto, "ok/client.mp4")


def test_an_upload_holds_no_cpu_slot_while_it_waits(workers, moto, proxy, segments):
    # One CPU slot: an upload stuck on the store must not keep a file encode waiting.
    w = workers.start(*ARGS, "--cpu-slots", "1", "--small-encode-bytes", "0",
                      "--store-timeout-s", "5",
                      env=store_env(proxy.endpoint))  # fmt: skip
    proxy.plan = lambda m, t, n: "stall" if m == "PUT" else "pass"
    answer: list[httpx.Response] = []
    thread = threading.Thread(
        target=lambda: answer.append(encode(w, segments, f"s3://{BUCKET}/ok/held.mp4", SMALL)[0])
    )
    thread.start()
    deadline = time.monotonic() + 30
    while proxy.count("PUT", "ok/held.mp4") == 0:
        assert time.monotonic() < deadline, "the upload never started"
        time.sleep(0.02)
    t0 = time.monotonic()
    r, _ = encode(w, segments, "beside.mp4", SMALL)
    assert r.status_code == 200, r.text
    assert time.monotonic() - t0 < 4  # well inside the stalled upload's 5 s timeout
    assert not answer  # the upload is still waiting on the store
    # The store comes back: the dropped attempt is retried and the upload completes.
    proxy.plan = lambda m, t, n: "pass"
    proxy.release.set()
    thread.join(timeout=60)
    assert answer and answer[0].status_code == 200, answer[0].text
    assert moto.leftovers(BUCKET) == (["ok/held.mp4"], [])


def _squat(spool: Path, kind: str) -> None:
    """What another local user who may write the output root puts at the spool's name."""
    if kind == "directory":
        os.mkdir(spool)
        os.chmod(spool, 0o777)
    elif kind == "file":
        spool.write_bytes(b"")
    else:
        os.symlink("/tmp", spool)


@pytest.fixture
def open_base() -> Iterator[Path]:
    """A worker's base directory that other local users can reach (pytest's is 0700)."""
    base = Path(tempfile.mkdtemp(prefix="framewire-spool-"))
    base.chmod(0o755)
    yield base
    shutil.rmtree(base, ignore_errors=True)


def _swap(spool: Path, kind: str) -> None:
    """Another local user who may write the output root: the worker's spool renamed away,
    theirs put at its name."""
    os.rename(spool, spool.with_name("moved-away"))
    _squat(spool, kind)


@pytest.mark.parametrize("kind", ["directory", "file", "link"])
def test_another_user_cannot_take_the_spools_place(workers, moto, proxy, segments, open_base, kind):
    w = workers.start(*ARGS, root=open_base, env=store_env(proxy.endpoint))
    w.outputs.chmod(0o777)  # another local user may write the output root
    squat = w.outputs / SPOOL  # the one name a spool had; now each worker makes its own
    assert as_nobody(_squat, squat, kind) is None
    for path in (f"s3://{BUCKET}/ok/squat.mp4", "memory://squat.mp4"):
        r, _ = encode(w, segments, path, SMALL)
        assert r.status_code == 200, r.text
    [spool] = [p for p in spools(w.outputs) if p != squat]
    st = spool.lstat()
    assert st.st_uid == os.geteuid() and st.st_mode & 0o777 == 0o700
    # Swapped once made: the worker reaches its spool through the descriptor it holds.
    assert as_nobody(_swap, spool, kind) is None
    r, _ = encode(w, segments, f"s3://{BUCKET}/ok/swapped.mp4", SMALL)
    assert r.status_code == 200, r.text
    for theirs in (squat, spool):
        assert theirs.lstat().st_uid == NOBODY
        assert kind != "directory" or list(theirs.iterdir()) == []  # nothing of ours went in
    assert list((w.outputs / "moved-away").iterdir()) == []
    # Removed while empty: the worker makes another.
    (w.outputs / "moved-away").rmdir()
    r, _ = encode(w, segments, f"s3://{BUCKET}/ok/again.mp4", SMALL)
    assert r.status_code == 200, r.text
    assert len(spools(w.outputs)) == 3  # theirs at both names, and the worker's new one
    assert_nothing_left_but(moto, w, ["ok/again.mp4", "ok/squat.mp4", "ok/swapped.mp4"])


def assert_nothing_left_but(moto: Moto, w: Worker, keys: list[str]) -> None:
    assert moto.leftovers(BUCKET) == (keys, [])
    assert framewire_temps(w.outputs) == []


def test_the_bytes_uploaded_are_the_bytes_encoded_or_nothing_is_stored(
    workers, moto, proxy, segments
):
    # The spooled file changes in place while its parts go out (only the worker's own
    # uid can do that now): the upload must not complete with other bytes.
    # Parts of 1 KiB, the first one held: the last part is read once it is let go.
    w = workers.start(*ARGS, "--store-timeout-s", "10", "--upload-part-bytes", "1024",
                      env=store_env(proxy.endpoint))  # fmt: skip
    proxy.plan = lambda m, t, n: "stall" if part_number(t) == 1 else "pass"
    thread, answer = _upload_in_background(w, segments, "ok/changed.mp4")
    _wait_for_part(proxy, 1)
    [spool] = spools(w.outputs)
    [spooled] = spool.iterdir()
    assert spooled.stat().st_size > 4 * 1024  # 5 parts or more: 4 go out before part 1 ends
    with open(spooled, "r+b") as f:
        f.seek(-8, os.SEEK_END)
        f.write(b"ATTACKER")
    proxy.plan = lambda m, t, n: "pass"
    proxy.release.set()
    thread.join(timeout=60)
    assert answer, "no answer"
    assert answer[0].status_code == 502, answer[0].text
    assert answer[0].json()["outputs"][0]["error"]["code"] == "upload_failed"
    assert proxy.count("POST", "uploadId=") == 0  # never completed
    assert proxy.count("DELETE", "uploadId=") == 1
    assert_nothing_left(moto, w)


def _without_upload_id(answer):
    status, headers, body = answer
    return status, headers, re.sub(rb"<UploadId>[^<]*</UploadId>", b"", body)


def _without_etag(answer):
    status, headers, body = answer
    return status, [(k, v) for k, v in headers if k.lower() != "etag"], body


def _html(answer):
    return 200, [("Content-Type", "text/html")], b"<html><body><p>Welcome</p></body></html>"


@pytest.mark.parametrize(
    ("edit", "what"),
    [
        (_without_upload_id, "create"),
        (_html, "create"),
        (_without_etag, "part"),
        (_html, "part"),
    ],
)
def test_a_store_answering_without_what_it_must_is_a_store_code(
    sworker, moto, proxy, segments, edit, what
):
    def plan(method: str, target: str, n: int):
        create = method == "POST" and target.endswith("?uploads")
        return edit if (create if what == "create" else part_number(target) == 1) else "pass"

    proxy.plan = plan
    r, _ = encode(sworker, segments, f"s3://{BUCKET}/ok/odd.mp4", LONG)
    assert r.status_code == 502, r.text
    assert r.json()["outputs"][0]["error"]["code"] == "store_bad_answer"
    keys, uploads = moto.leftovers(BUCKET)
    assert keys == []
    if what == "part":  # the upload the worker knows of is aborted
        assert uploads == [] and proxy.count("DELETE", "uploadId=") == 1
    else:  # one it was never told of is the bucket's lifecycle rule's
        c = moto.client()
        for upload in c.list_multipart_uploads(Bucket=BUCKET).get("Uploads", []):
            c.abort_multipart_upload(Bucket=BUCKET, Key=upload["Key"], UploadId=upload["UploadId"])
    assert framewire_temps(sworker.outputs) == []
    ok, _ = encode(sworker, segments, "after-odd.mp4", SMALL)
    assert ok.status_code == 200, ok.text


def _trickle_puts(method: str, target: str, n: int) -> str:
    return "trickle" if method == "PUT" else "pass"


def _trickled(workers, proxy, segments, key: str, *flags: str) -> tuple[Worker, dict]:
    """A worker whose store answers every PUT one byte a second, and an encode to ``key``."""
    w = workers.start(*ARGS, *flags, env=store_env(proxy.endpoint))
    proxy.plan = _trickle_puts
    source = segments.source(make_clip(*SMALL))
    body = {"outputs": [{"source": source, "path": f"s3://{BUCKET}/{key}", "fps": 24}]}
    return w, body


def test_a_store_that_trickles_its_answer_is_timed_out(workers, moto, proxy, segments):
    # One byte a second: each read gets its byte within the 2 s timeout, the answer never
    # comes whole. Each attempt is bounded as a whole: 2 attempts of ~2 s, with backoff.
    w, body = _trickled(workers, proxy, segments, "ok/drip.mp4", "--store-timeout-s", "2")
    t0 = time.monotonic()
    with http_client(uds=str(w.uds), timeout=30) as h:
        r = h.post("http://framewire/v1/videos:encode", json=body)
    assert r.status_code == 504, r.text
    assert r.json()["outputs"][0]["error"]["code"] == "store_timeout"
    assert time.monotonic() - t0 < 15
    assert proxy.count("PUT", "ok/drip.mp4") == 2  # --store-attempts 2
    proxy.release.set()
    assert_nothing_left(moto, w)
    ok, _ = encode(w, segments, "after-drip.mp4", SMALL)
    assert ok.status_code == 200, ok.text


def _wait_for_put(proxy: Proxy) -> None:
    deadline = time.monotonic() + 30
    while proxy.count("PUT", "ok/") == 0:
        assert time.monotonic() < deadline, "the upload never started"
        time.sleep(0.02)


def test_a_trickling_upload_stops_when_its_caller_leaves(workers, moto, proxy, segments):
    w, body = _trickled(workers, proxy, segments, "ok/left.mp4", "--store-timeout-s", "60")
    caller = post_raw(w.uds, body)
    deadline = time.monotonic() + 60  # the encode first, however loaded the host
    while proxy.count("PUT", "ok/left.mp4") < 1:
        assert time.monotonic() < deadline, "the upload never started"
        time.sleep(0.05)
    caller.close()  # the caller leaves while its upload trickles
    deadline = time.monotonic() + 15
    while not proxy.trickled:  # the worker hangs up on the store: the trickle ends
        assert time.monotonic() < deadline, "the upload went on after its caller left"
        time.sleep(0.1)
    assert proxy.count("PUT", "ok/left.mp4") == 1  # stopped, not retried
    assert_nothing_left(moto, w)
    ok, _ = encode(w, segments, "after-left.mp4", SMALL)
    assert ok.status_code == 200, ok.text


def test_sigterm_stops_a_trickling_upload_past_the_grace(workers, moto, proxy, segments):
    w = workers.start(*ARGS, "--store-timeout-s", "60", "--shutdown-grace", "3",
                      env=store_env(proxy.endpoint))  # fmt: skip
    proxy.plan = _trickle_puts
    answer: list[httpx.Response] = []
    thread = threading.Thread(
        target=lambda: answer.append(encode(w, segments, f"s3://{BUCKET}/ok/term.mp4", SMALL)[0])
    )
    thread.start()
    _wait_for_put(proxy)
    w.proc.send_signal(signal.SIGTERM)
    t0 = time.monotonic()
    try:
        code = w.proc.wait(timeout=15)
    except subprocess.TimeoutExpired:
        code = None
    assert code == 0, f"the worker still ran {time.monotonic() - t0:.0f} s after SIGTERM"
    thread.join(timeout=30)
    assert answer and answer[0].status_code == 503, answer
    assert_nothing_left(moto, w)


# --- whose an object is -------------------------------------------------------------------

RANK = 65533  # a rank's uid; NOBODY is another local user on the same host


def encode_as(uid: int, w: Worker, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    """POST ``body`` to the worker's Unix socket from a child running as ``uid``."""

    def post() -> tuple[int, dict[str, Any]]:
        with http_client("http://framewire", uds=w.uds, timeout=60) as c:
            r = c.post("/v1/videos:encode", json=body)
            return r.status_code, r.json()

    answer = as_user(uid, post)
    assert isinstance(answer, tuple), answer
    return answer


@needs_root
def test_an_object_is_replaced_and_presigned_only_for_its_writer(moto, proxy, segments):
    url = f"s3://{BUCKET}/ok/rank.mp4"
    uids = f"{os.getuid()},{RANK},{NOBODY}"
    with open_worker(*ARGS, "--allowed-uids", uids, env=store_env(proxy.endpoint)) as w:
        first = segments.source(make_clip(*SMALL))
        second = segments.source(make_clip(*SMALL, seed=1))

        def body(source: dict[str, Any]) -> dict[str, Any]:
            return {"outputs": [{"source": source, "path": url, "fps": 24, "presign_s": 60}]}

        status, got = encode_as(RANK, w, body(first))
        assert status == 200, got
        rank_sha = object_sha(moto, "ok/rank.mp4")
        # Another user may neither replace the rank's object nor get a URL that reads it.
        status, got = encode_as(NOBODY, w, body(second))
        assert (status, got.get("code")) == (403, "caller_not_permitted"), got
        assert "presigned_url" not in json.dumps(got)
        assert object_sha(moto, "ok/rank.mp4") == rank_sha
        # Its writer may; so may root (who may act for everyone), and the owner stays.
        status, got = encode_as(RANK, w, body(second))
        assert status == 200 and got["outputs"][0]["presigned_url"], got
        with w.http() as h:
            assert h.post("/v1/videos:encode", json=body(first)).status_code == 200
        head = moto.client().head_object(Bucket=BUCKET, Key="ok/rank.mp4")
        assert head["Metadata"] == {"framewire-owner": str(RANK)}
        # The other user's own objects are its own.
        mine = {"outputs": [{"source": second, "path": f"s3://{BUCKET}/ok/nobody.mp4", "fps": 24}]}
        assert encode_as(NOBODY, w, mine)[0] == 200
        assert moto.leftovers(BUCKET) == (["ok/nobody.mp4", "ok/rank.mp4"], [])
        assert framewire_temps(w.outputs) == []


def test_an_object_written_by_another_meanwhile_is_not_replaced(sworker, moto, proxy, segments):
    # Someone else puts the object after the request was judged (nothing there) and
    # before its upload completes: the upload is refused, theirs stays, nothing is left.
    placed: list[str] = []

    def plan(method: str, target: str, n: int) -> str:
        if part_number(target) == 1 and not placed:
            moto.client().put_object(Bucket=BUCKET, Key="ok/raced.mp4", Body=b"theirs")
            placed.append(target)
        return "pass"

    proxy.plan = plan
    r, _ = encode(sworker, segments, f"s3://{BUCKET}/ok/raced.mp4", LONG)
    assert r.status_code == 409, r.text
    assert r.json()["outputs"][0]["error"]["code"] == "output_busy"
    body = moto.client().get_object(Bucket=BUCKET, Key="ok/raced.mp4")["Body"].read()
    assert body == b"theirs"
    assert moto.leftovers(BUCKET) == (["ok/raced.mp4"], [])
    assert framewire_temps(sworker.outputs) == []
