"""deploy/observability: the rules under promtool, the Operator's objects against the
manifests they watch, and a real Prometheus scraping a real worker (with its token) under a
short load, through which every rule and every dashboard query is run, each metric it reads
having to exist. The worker uploads to moto's S3 server on loopback, so that its uploads'
counter has series too.

Grafana itself is not installable here (Debian ships no package of it, and nothing is
downloaded): the dashboard's JSON is checked for the structure Grafana's provisioning reads,
and its queries run against the Prometheus above with the template variables substituted.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from framewire.client import Client, Conflict, StoreError

from tests.support import REPO
from tests.support.apt import apt_install
from tests.support.http import http_client
from tests.support.media import make_clip
from tests.support.objstore import Moto, moto_server, store_env
from tests.support.real import unavailable
from tests.support.worker import Worker, free_port, metric

KIT = REPO / "deploy" / "observability"
KUBE = REPO / "deploy" / "kubernetes"
RULES = KIT / "rules.yaml"
DASHBOARD = KIT / "grafana-dashboard.json"
PROMETHEUS_RULE = KIT / "prometheusrule.yaml"
DOCS = REPO / "docs" / "deployment.md"
JOB = "framewire"  # the scrape job rules.yaml selects
ROWS = ["Encodes", "Streams", "Decodes", "Store", "Live", "Resources"]
DEADLINE_S = 30  # any one wait below
BUCKET = "framewire-metrics"  # made on moto; the load uploads there
MISSING = "framewire-missing"  # allowed by the worker's --output-urls, never made
# Families the worker exports that no panel charts, and why.
UNCHARTED = {
    "process_virtual_memory_bytes": "address space, not memory: CUDA's and each mapped memfd's",
    "process_start_time_seconds": "a restart shows as `up` dropping (and as the pod's restarts)",
}
GENERATED = (
    "# Generated from rules.yaml, the rules' one copy: do not edit. Written by\n"
    "#   .venv/bin/python -m tests.deploy.test_observability\n"
    "# (tests/deploy/test_observability.py fails while this file differs from it).\n"
)


def rules() -> list[dict[str, Any]]:
    return [
        rule for group in yaml.safe_load(RULES.read_text())["groups"] for rule in group["rules"]
    ]


def alerts() -> set[str]:
    return {rule["alert"] for rule in rules() if "alert" in rule}


def dashboard() -> dict[str, Any]:
    loaded: dict[str, Any] = json.loads(DASHBOARD.read_text())
    return loaded


def panels() -> list[dict[str, Any]]:
    return [p for p in dashboard()["panels"] if p["type"] != "row"]


def variable(name: str) -> dict[str, Any]:
    [found] = [v for v in dashboard()["templating"]["list"] if v["name"] == name]
    return found


def prometheus_rule() -> str:
    """prometheusrule.yaml as rules.yaml makes it."""
    doc = {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "PrometheusRule",
        "metadata": {"name": "framewire", "labels": {"app.kubernetes.io/name": "framewire"}},
        "spec": {"groups": yaml.safe_load(RULES.read_text())["groups"]},
    }
    return GENERATED + yaml.safe_dump(doc, sort_keys=False, width=100)


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression selects: what is left once strings, label
    matchers, ranges and grouping clauses are gone, less functions and keywords."""
    text = re.sub(r'"(?:\\.|[^"\\])*"|\'(?:\\.|[^\'\\])*\'|`[^`]*`', " ", expr)
    text = re.sub(r"\{[^}]*\}|\[[^\]]*\]", " ", text)
    text = re.sub(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", text)
    keywords = {"and", "or", "unless", "bool", "offset", "group_left", "group_right", "inf", "nan"}
    names = set()
    for m in re.finditer(r"[A-Za-z_:][\w:]*", text):
        before = text[m.start() - 1] if m.start() else " "
        called = text[m.end() :].lstrip().startswith("(")
        if not (before.isalnum() or before in "._$" or called or m.group() in keywords):
            names.add(m.group())
    return names


# --- the files ---------------------------------------------------------------------------------


def test_metric_names_are_read_from_expressions():
    expr = (
        'sum by (le) (rate(a_bucket{x="y", z=~"1e3"}[5m])) / on (job) group_left b:c:d > 0.5e3'
        " and up offset 1h or vector(0) * histogram_quantile(0.9, e)"
    )
    assert metric_names(expr) == {"a_bucket", "b:c:d", "up", "e"}


def test_the_prometheus_rule_is_rules_yaml():
    assert PROMETHEUS_RULE.read_text() == prometheus_rule(), (
        "prometheusrule.yaml is not rules.yaml's: run .venv/bin/python -m "
        "tests.deploy.test_observability"
    )


def test_records_follow_the_naming_convention_and_alerts_say_what_they_mean():
    for rule in rules():
        if "record" in rule:
            assert re.fullmatch(r"framewire:[a-z0-9_]+:[a-z0-9_]+", rule["record"]), rule
        else:
            assert rule["alert"].startswith("Framewire")
            assert rule["labels"]["severity"] in {"critical", "warning", "info"}
            assert {"summary", "description"} <= set(rule["annotations"])


def test_every_alert_is_tested_firing_and_not_firing():
    cases: dict[str, set[bool]] = {}
    for test in yaml.safe_load((KIT / "rules.test.yaml").read_text())["tests"]:
        for case in test.get("alert_rule_test", []):
            cases.setdefault(case["alertname"], set()).add(bool(case.get("exp_alerts")))
    assert {name: {True, False} for name in alerts()} == cases


def test_the_dashboard_has_the_structure_grafana_provisions():
    d = dashboard()
    assert d["uid"] and d["title"] and isinstance(d["schemaVersion"], int)
    source = variable("datasource")
    assert (source["type"], source["query"]) == ("datasource", "prometheus")
    for name in ("job", "instance"):
        assert variable(name)["type"] == "query"
        assert variable(name)["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
    assert variable("instance")["includeAll"] and variable("instance")["multi"]
    everything = d["panels"]
    ids = [p["id"] for p in everything]
    assert len(ids) == len(set(ids)), "panel ids repeat"
    assert [p["title"] for p in everything if p["type"] == "row"] == ROWS
    assert everything[0]["type"] == "row"
    occupied: set[tuple[int, int]] = set()
    for p in everything:
        grid = p["gridPos"]
        assert set(grid) == {"h", "w", "x", "y"} and 0 <= grid["x"] < grid["x"] + grid["w"] <= 24
        cells = {(x, y) for x in range(grid["x"], grid["x"] + grid["w"])
                 for y in range(grid["y"], grid["y"] + grid["h"])}  # fmt: skip
        assert not cells & occupied, f"panel {p['title']!r} overlaps another"
        occupied |= cells
        if p["type"] == "row":
            assert p["panels"] == [] and not p["collapsed"]  # its panels follow it
            continue
        assert p["type"] in {"timeseries", "stat"}, p["title"]
        assert p["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
        assert p["targets"], p["title"]
        refs = [t["refId"] for t in p["targets"]]
        assert len(refs) == len(set(refs))
        for t in p["targets"]:
            assert t["datasource"] == p["datasource"] and t["expr"]
            # Every query narrowed to the chosen job (and instances, where it has them).
            assert 'job="$job"' in t["expr"], t["expr"]
    # Rows in order down the page, each panel below its own row's header.
    tops = [p["gridPos"]["y"] for p in everything if p["type"] == "row"]
    assert tops == sorted(tops)
    row = -1
    for p in everything:
        if p["type"] == "row":
            row += 1
        else:
            assert tops[row] < p["gridPos"]["y"] < [*tops, 10**6][row + 1], p["title"]


def test_grafana_provisioning_points_at_the_dashboard():
    spec = yaml.safe_load((KIT / "grafana-provisioning.yaml").read_text())
    assert spec["apiVersion"] == 1
    [provider] = spec["providers"]
    assert provider["type"] == "file" and provider["options"]["path"]


def test_the_operator_objects_match_the_manifests():
    kustomization = yaml.safe_load((KIT / "kustomization.yaml").read_text())
    assert kustomization["kind"] == "Component"
    assert sorted(kustomization["resources"]) == ["prometheusrule.yaml", "servicemonitor.yaml"]
    [dashboards] = kustomization["configMapGenerator"]
    assert dashboards["files"] == [DASHBOARD.name]
    # Offered, commented out, beside expandable-segments.
    assert "#   - ../observability" in (KUBE / "kustomization.yaml").read_text()
    monitor = yaml.safe_load((KIT / "servicemonitor.yaml").read_text())
    service = yaml.safe_load((KUBE / "service.yaml").read_text())
    daemonset = yaml.safe_load((KUBE / "daemonset.yaml").read_text())
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    assert monitor["spec"]["selector"]["matchLabels"] == service["metadata"]["labels"]
    assert service["metadata"]["labels"][monitor["spec"]["jobLabel"]] == JOB
    [endpoint] = monitor["spec"]["endpoints"]
    assert endpoint["port"] in {port["name"] for port in service["spec"]["ports"]}
    assert (
        endpoint["path"]
        == daemonset["spec"]["template"]["metadata"]["annotations"]["prometheus.io/path"]
    )
    # The token the worker is started with.
    [container] = daemonset["spec"]["template"]["spec"]["containers"]
    [token] = [e for e in container["env"] if e["name"] == "FRAMEWIRE_TOKEN"]
    assert endpoint["authorization"] == {
        "type": "Bearer", "credentials": token["valueFrom"]["secretKeyRef"]
    }  # fmt: skip
    rule = yaml.safe_load(PROMETHEUS_RULE.read_text())
    assert (rule["apiVersion"], rule["kind"]) == ("monitoring.coreos.com/v1", "PrometheusRule")


# --- promtool and a real Prometheus ------------------------------------------------------------


@pytest.fixture(scope="module")
def prometheus_installed() -> None:
    """Debian's prometheus (the server and promtool): installed when missing. Where it
    cannot be, CI (CI=true) fails; elsewhere the tests that need it skip."""
    missing = apt_install(
        ["prometheus"], lambda: all(map(shutil.which, ("prometheus", "promtool")))
    )
    if missing is not None:
        unavailable(f"no prometheus can be installed here: {missing}")


def promtool(*args: str) -> str:
    done = subprocess.run(
        ["promtool", *args], cwd=KIT, capture_output=True, text=True, timeout=DEADLINE_S
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def test_promtool_checks_and_tests_the_rules(prometheus_installed):
    assert f"SUCCESS: {len(rules())} rules found" in promtool("check", "rules", RULES.name)
    assert "SUCCESS" in promtool("test", "rules", "rules.test.yaml")


@contextmanager
def prometheus(root: Path, target: Worker, token: str) -> Iterator[httpx.Client]:
    """A Prometheus on loopback scraping ``target`` every second with ``token``, and
    evaluating rules.yaml as often; its HTTP API, once it is ready."""
    root.mkdir()
    (root / "token").write_text(token)
    config = {
        "global": {"scrape_interval": "1s", "scrape_timeout": "1s", "evaluation_interval": "1s"},
        "rule_files": [str(RULES)],
        "scrape_configs": [{
            "job_name": JOB,
            "authorization": {"credentials_file": str(root / "token")},
            "static_configs": [{"targets": [f"127.0.0.1:{target.port}"]}],
        }],
    }  # fmt: skip
    (root / "prometheus.yml").write_text(yaml.safe_dump(config))
    port = free_port()
    argv = ["prometheus", f"--config.file={root / 'prometheus.yml'}",
            f"--storage.tsdb.path={root / 'data'}", f"--web.listen-address=127.0.0.1:{port}",
            "--log.level=warn"]  # fmt: skip
    with open(root / "prometheus.log", "wb") as log:
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
    try:
        with http_client(f"http://127.0.0.1:{port}", timeout=10) as api:
            deadline = time.monotonic() + DEADLINE_S
            while True:
                assert proc.poll() is None, (root / "prometheus.log").read_text()
                try:
                    if api.get("/-/ready").status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                assert time.monotonic() < deadline, "prometheus never became ready"
                time.sleep(0.1)
            yield api
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=DEADLINE_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def query(api: httpx.Client, expr: str) -> list[dict[str, Any]]:
    answer = api.get("/api/v1/query", params={"query": expr})
    body = answer.json()
    assert answer.status_code == 200 and body["status"] == "success", (expr, body)
    result: list[dict[str, Any]] = body["data"]["result"]
    return result


def load(worker: Worker, token: str) -> None:
    """A little of everything the metrics count: encodes, a refused one, a 404, object
    uploads (one stored, one to a bucket that does not exist), a live stream session with
    a viewer that leaves early and an HLS player, an aborted session, a reference decode
    and its cache hit."""
    clip = make_clip(frames=8)
    with Client(worker.uds_url, token=token, fd_socket=worker.fd_socket,
                local_fallback=False) as client, worker.http(token) as h:  # fmt: skip
        client.save_videos([clip, make_clip(frames=8, seed=1)], ["a.mp4", "b.mp4"], fps=24)
        client.save_video(clip, "c.mp4", fps=24)
        # memory:// outputs are held, not uploaded: only s3:// ones count as uploads.
        client.save_video(clip, f"s3://{BUCKET}/c.mp4", fps=24)
        with pytest.raises(StoreError):
            client.save_video(clip, f"s3://{MISSING}/c.mp4", fps=24)
        with pytest.raises(Conflict):
            client.save_video(clip, "refused.mp4", fps=24, encoder="ffmpeg-sha256:" + "0" * 64)
        assert h.get("/v1/streams/not-a-session").status_code == 404
        with client.open_video("live.mp4", fps=24, live=True) as writer:
            writer.write(clip[:, :4])
            with h.stream("GET", f"/v1/streams/{writer.id}/live.mp4") as viewer:
                assert viewer.status_code == 200
                deadline = time.monotonic() + DEADLINE_S
                while metric(h, "framewire_live_viewers") < 1:
                    assert time.monotonic() < deadline, "the viewer never joined"
                    time.sleep(0.02)
            deadline = time.monotonic() + DEADLINE_S
            while metric(h, "framewire_live_viewers") > 0:  # it left: dropped, "gone"
                assert time.monotonic() < deadline, "the viewer was never let go"
                time.sleep(0.02)
            writer.write(clip[:, 4:])
        # The ended view, as an HLS player reads it: a playlist, a blocking reload, the init.
        hls = f"/v1/streams/{writer.id}/live"
        text = h.get(f"{hls}.m3u8").text
        assert h.get(f"{hls}.m3u8", params={"_HLS_msn": 0}).status_code == 200
        [init] = re.findall(r'#EXT-X-MAP:URI="([^"?]+)', text)
        assert h.get(f"/v1/streams/{writer.id}/{init}").status_code == 200
        aborted = client.open_video("aborted.mp4", fps=24)
        aborted.write(clip[:, :4])
        aborted.abort()
        shutil.copy(worker.outputs / "a.mp4", worker.inputs / "ref.mp4")
        for _ in range(2):  # a decode, then the cache
            with client.decode_reference(worker.inputs / "ref.mp4", fps=24, width=32, height=24,
                                         local_fallback=False) as ref:  # fmt: skip
                assert ref.shape == (8, 24, 32, 3)


@pytest.fixture
def store() -> Iterator[Moto]:
    """moto's S3 server with the bucket the load uploads to (about a second to start)."""
    with moto_server() as server:
        server.client().create_bucket(Bucket=BUCKET)
        yield server


def test_prometheus_scrapes_a_worker_and_every_query_reads_what_it_exports(
    prometheus_installed, workers, store, tmp_path
):
    token = "observability-token"
    urls = f"s3://{BUCKET}/,s3://{MISSING}/"
    worker = workers.start("--token", token, "--output-urls", urls, env=store_env(store.endpoint))
    with prometheus(tmp_path / "prometheus", worker, token) as api:
        load(worker, token)
        loaded = time.time()
        records = {r["record"] for r in rules() if "record" in r}
        deadline = time.monotonic() + DEADLINE_S
        while True:  # two scrapes after the load (rate() needs two samples), every rule run
            scraped = query(api, f'timestamp(up{{job="{JOB}"}} == 1)')
            recorded = query(api, 'count by (__name__) ({__name__=~"framewire:.+"})')
            evaluated = {r["metric"]["__name__"] for r in recorded}
            if scraped and float(scraped[0]["value"][1]) > loaded + 2 and evaluated >= records:
                break
            assert time.monotonic() < deadline, f"scraped {scraped}, evaluated {evaluated}"
            time.sleep(0.2)
        instance = f"127.0.0.1:{worker.port}"
        # As Grafana fills a regex variable into a PromQL string: escaped, then its
        # backslashes doubled.
        escaped = re.escape(instance).replace("\\", "\\\\")
        substitute = {"$job": JOB, "$instance": escaped, "$__rate_interval": "1m"}
        targets = []
        for p in panels():
            for t in p["targets"]:
                expr = t["expr"]
                for name, value in substitute.items():
                    expr = expr.replace(name, value)
                targets.append((p["title"], expr))
        # Prometheus ran every rule without an error; records and panels have data, alerts
        # need only evaluate (none need fire here).
        ran = [r for g in api.get("/api/v1/rules").json()["data"]["groups"] for r in g["rules"]]
        assert sorted((r["name"], r["health"]) for r in ran) == sorted(
            (rule.get("record") or rule["alert"], "ok") for rule in rules()
        )
        for rule in rules():
            found = query(api, rule["expr"])
            assert "alert" in rule or found, f"{rule['record']} is empty"
        for title, expr in targets:
            assert query(api, expr), f"panel {title!r}: {expr} is empty"
        # Every metric any of them reads is one Prometheus got from the worker (or made).
        shown = set().union(*(metric_names(expr) for _, expr in targets))
        used = shown.union(*(metric_names(r["expr"]) for r in rules()))
        for name in sorted(used):
            assert query(api, f'count({{__name__="{name}"}}) > 0'), f"no series named {name}"
        # Each bound a query reads is one the worker exports.
        bounds = {r["metric"]["setting"] for r in query(api, f'framewire_limit{{job="{JOB}"}}')}
        wanted = set(re.findall(r'setting="(\w+)"', RULES.read_text() + DASHBOARD.read_text()))
        assert wanted and wanted <= bounds, wanted - bounds
        assert [r["value"][1] for r in query(api, f'framewire_ready{{job="{JOB}"}}')] == ["1"]
        # Both uploads, by result: the series appear only once an upload ends, and only
        # s3:// outputs are uploads (memory:// ones are held for the client).
        uploads = query(api, f'framewire_store_uploads_total{{job="{JOB}"}}')
        assert {r["metric"]["result"]: r["value"][1] for r in uploads} == {
            "ok": "1", "store_no_bucket": "1"
        }  # fmt: skip
        # The dashboard's variables find this worker.
        for name, value in (("job", JOB), ("instance", instance)):
            asked = re.fullmatch(r"label_values\((.+), (\w+)\)", variable(name)["query"]["query"])
            assert asked is not None, name
            selector, label = asked.groups()
            found = api.get(
                f"/api/v1/label/{label}/values", params={"match[]": selector.replace("$job", JOB)}
            ).json()
            assert value in found["data"], (name, found)
        # Every metric the worker exports has a panel.
        with worker.http(token) as h:
            families = re.findall(r"^# TYPE (\S+) ", h.get("/metrics").text, re.MULTILINE)
        # Less the creation times prometheus-client adds to each counter and histogram.
        family = re.compile(r"_(total|bucket|count|sum)$")
        exported = {family.sub("", name) for name in families if not name.endswith("_created")}
        assert set(UNCHARTED) <= exported, "UNCHARTED names a family the worker lacks"
        charted = {family.sub("", name) for name in shown}
        assert exported - charted - set(UNCHARTED) == set(), "not shown"
        # docs/deployment.md's "Metrics" lists exactly those.
        section = DOCS.read_text().split("\n## Metrics\n", 1)[1].split("\n## ", 1)[0]
        listed = re.findall(r"`((?:framewire|process)_\w+)", section)
        assert {family.sub("", name) for name in listed} == exported


if __name__ == "__main__":  # writes prometheusrule.yaml from rules.yaml
    PROMETHEUS_RULE.write_text(prometheus_rule())
