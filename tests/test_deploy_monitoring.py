"""deploy/prometheus and deploy/grafana against the real server.

Static: `promtool check rules` and the rules' unit tests pass, the dashboard is well formed,
and nothing in a rule, panel or HPA names a metric that telemetry/metrics.py does not declare.

End to end: `prefixscore serve --model tiny-qwen3` on loopback, a real Prometheus (Debian's
package) scraping it every second with the recording and alerting rules loaded, traffic from
the client (including bad requests, so error-code series exist); then every dashboard query
(variables substituted), every recording rule (its expression and its recorded series) and
every alert expression (comparisons in `bool` form) returns data through the HTTP API, and
every metric and label value they name appears in a real /metrics scrape.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from pathlib import Path

import pytest
import yaml
from helpers.deploy import (
    DASHBOARD,
    DEPLOY,
    K8S,
    RULE_FILES,
    SERVE_COMMAND,
    dashboard_panels,
    dashboard_queries,
    load_dashboard,
    load_rules,
    referenced_series,
    run,
    sample_names,
    service_exposition,
    substitute_grafana,
    tool,
    with_bool,
)
from helpers.prerequisites import missing
from helpers.service import SERVE_BUCKETS

RULE_TESTS = sorted((DEPLOY / "prometheus" / "tests").glob("*.test.yml"))
SCRAPE_LABELS = {"cluster": "e2e", "namespace": "prefixscore-e2e", "pod": "prefixscore-e2e-0"}
JOB = "prefixscore"
# the test servers' small shape buckets: the tiny model compiles in seconds on a shared CPU
SERVE_FLAGS = [*SERVE_BUCKETS, "--log-format", "text"]
LABEL_IDS = [1, 2]


def all_queries() -> list[tuple[str, str]]:
    """(where, PromQL) for every dashboard query and rule expression, plus the HPA metric."""
    out = [(f"dashboard: {w}", e) for w, e in dashboard_queries(load_dashboard())]
    for var in load_dashboard()["templating"]["list"]:
        if var["type"] == "query":
            q = var["query"]["query"] if isinstance(var["query"], dict) else var["query"]
            out.append((f"variable {var['name']}", re.sub(r"^label_values\((.*),\s*\w+\)$", r"\1", q)))
    out += [(f"rule {r.get('record') or r.get('alert')}", r["expr"]) for r in load_rules()]
    for path in K8S.rglob("hpa.yaml"):
        for metric in yaml.safe_load(path.read_text())["spec"]["metrics"]:
            name = metric["pods"]["metric"]["name"]
            out.append((f"{path.relative_to(K8S)}", name.split("|")[1] if "|" in name else name))
    return out


# ---- static --------------------------------------------------------------------------
def test_promtool_check_rules():
    result = run([tool("promtool"), "check", "rules", *map(str, RULE_FILES)])
    assert result.returncode == 0, result.stdout + result.stderr
    assert len(RULE_FILES) == 2


def test_promtool_rule_unit_tests():
    assert RULE_TESTS
    result = run([tool("promtool"), "test", "rules", *map(str, RULE_TESTS)])
    assert result.returncode == 0, result.stdout + result.stderr


def test_alerts_cover_the_issue():
    alerts = {r["alert"]: r for r in load_rules() if "alert" in r}
    for needle in (
        "ErrorRatio",
        "P99Latency",
        "QueueSaturated",
        "PrefixCacheHitRateCollapse",
        "NoTrafficScored",
        "CompilationsInSteadyState",
    ):
        assert any(needle in name for name in alerts), needle
    for name, rule in alerts.items():
        assert rule["labels"]["severity"] in ("critical", "warning"), name
        assert rule["annotations"]["summary"] and rule["annotations"]["description"], name


def test_dashboard_structure():
    dash = load_dashboard()
    assert dash["uid"] and dash["title"] and dash["schemaVersion"] >= 36
    variables = {v["name"]: v for v in dash["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    assert variables["model"]["type"] == "query"
    assert variables["model"]["datasource"]["uid"] == "${datasource}"
    panels = [p for p in dashboard_panels(dash) if p["type"] != "row"]
    assert len({p["id"] for p in dashboard_panels(dash)}) == len(list(dashboard_panels(dash)))
    cells: set[tuple[int, int]] = set()
    for p in dashboard_panels(dash):
        g = p["gridPos"]
        assert 0 <= g["x"] and g["x"] + g["w"] <= 24, p["title"]
        mine = {(x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])}
        assert not mine & cells, f"panel {p['title']!r} overlaps another"
        cells |= mine
    for p in panels:
        assert p["datasource"]["uid"] == "${datasource}", p["title"]
        assert p["targets"], p["title"]
        for t in p["targets"]:
            assert t["datasource"]["uid"] == "${datasource}" and t["expr"].strip(), p["title"]
            assert "$model" in t["expr"], f"{p['title']}: not filtered by the model variable"
    titles = " | ".join(p["title"].lower() for p in panels)
    for topic in (
        "items scored",
        "by status",
        "latency",
        "first scored batch",
        "batch size",
        "padding",
        "queue depth",
        "hit rate",
        "cache bytes",
        "compilations",
        "by pod",
    ):
        assert topic in titles, topic


def test_grafana_provisioning_files():
    ds = yaml.safe_load((DEPLOY / "grafana/provisioning/datasources/prefixscore-prometheus.yaml").read_text())
    assert ds["apiVersion"] == 1 and ds["datasources"][0]["type"] == "prometheus"
    dashboards = yaml.safe_load((DEPLOY / "grafana/provisioning/dashboards/prefixscore.yaml").read_text())
    provider = dashboards["providers"][0]
    assert provider["type"] == "file" and provider["options"]["path"]


def test_no_reference_to_an_unexported_metric():
    """Against the metrics the server declares (telemetry/metrics.py); the e2e test repeats this
    against a real scrape."""
    exported = sample_names(service_exposition())
    recorded = {r["record"] for r in load_rules() if "record" in r}
    for where, expr in all_queries():
        for name in referenced_series(expr):
            if ":" in name:
                assert name in recorded, f"{where}: {name} is not a recording rule"
            else:
                assert name in exported, f"{where}: {name} is not exported by the server"


def test_status_codes_in_queries_are_grpc_codes():
    import grpc

    codes = set(grpc.StatusCode.__members__)
    for where, expr in all_queries():
        for values in re.findall(r'code=~?"([^"]*)"', expr):
            for code in values.split("|"):
                assert code in codes, f"{where}: {code} is no gRPC status code name"


# ---- end to end ----------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http_get(url: str, timeout: float = 10) -> bytes:
    with urllib.request.urlopen(url, timeout=timeout) as response:  # noqa: S310 (loopback only)
        return response.read()


def serve_binary() -> str:
    path = Path(sys.executable).parent / SERVE_COMMAND[0]
    if not path.is_file():
        missing(f"the `{SERVE_COMMAND[0]}` command", "pip install -e .")
    return str(path)


def stop(proc: subprocess.Popen, timeout: float = 20) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)


class Stack:
    def __init__(self, prom_url: str, metrics_url: str, model: str, scrape: str):
        self.prom_url, self.metrics_url, self.model, self.scrape = prom_url, metrics_url, model, scrape

    def query(self, expr: str) -> list[dict]:
        body = json.loads(http_get(f"{self.prom_url}/api/v1/query?" + urllib.parse.urlencode({"query": expr})))
        assert body["status"] == "success", body
        return body["data"]["result"]


def wait_until(check, timeout: float, what: str, proc: subprocess.Popen | None = None, log: Path | None = None):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            pytest.fail(f"{what}: process exited {proc.returncode}\n{log.read_text()[-4000:] if log else ''}")
        try:
            if check():
                return
        except Exception:  # noqa: BLE001 - not up yet
            pass
        time.sleep(0.5)
    pytest.fail(f"timed out after {timeout}s waiting for {what}\n{log.read_text()[-4000:] if log else ''}")


def send_traffic(target: str) -> None:
    """A bounded mix: repeated and new queries (prefix cache hits and misses), a stream, and
    bad requests (INVALID_ARGUMENT), spread over a few seconds so the 1 s scrapes see it move."""
    import grpc

    from prefixscore.client import ScoreClient

    items = ["a red apple", "a blue car", "green tea", "the old house", "a fast train"]
    with ScoreClient(target) as client:
        client.model_info(timeout=30)
        for round_ in range(6):
            client.score("Is this item a fruit? Answer yes or no.", items, label_token_ids=LABEL_IDS, timeout=60)
            client.score(f"Query number {round_}: is it fast?", items[:3], label_token_ids=LABEL_IDS, timeout=60)
            if round_ % 2 == 0:
                with client.stream(
                    "Is this item a fruit? Answer yes or no.", label_token_ids=LABEL_IDS, timeout=60
                ) as stream:
                    stream.send(items[:2])
                    stream.send(items[2:])
            for bad in (dict(label_token_ids=[10**9]), dict(label_token_ids=[])):
                with pytest.raises(grpc.RpcError) as err:
                    client.score("bad request", items[:1], timeout=30, **bad)
                assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value
            time.sleep(1.0)


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    prometheus = tool("prometheus")
    binary = serve_binary()
    tmp = tmp_path_factory.mktemp("e2e")
    port, metrics_port, prom_port = free_port(), free_port(), free_port()
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",  # the run's compile cache: a shape another test compiled is loaded
        "JAX_PLATFORMS": "cpu",
    }
    server_log = tmp / "server.log"
    server = subprocess.Popen(
        [
            binary,
            SERVE_COMMAND[1],
            "--model",
            "tiny-qwen3",
            "--dtype",
            "float32",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--metrics-port",
            str(metrics_port),
            *SERVE_FLAGS,
        ],
        stdout=server_log.open("w"),
        stderr=subprocess.STDOUT,
        env=env,
    )
    config = {
        "global": {"scrape_interval": "1s", "scrape_timeout": "1s", "evaluation_interval": "1s"},
        "rule_files": [str(p) for p in RULE_FILES],
        "scrape_configs": [
            {"job_name": JOB, "static_configs": [{"targets": [f"127.0.0.1:{metrics_port}"], "labels": SCRAPE_LABELS}]}
        ],
    }
    (tmp / "prometheus.yml").write_text(yaml.safe_dump(config))
    prom_log = tmp / "prometheus.log"
    prom = subprocess.Popen(
        [
            prometheus,
            f"--config.file={tmp / 'prometheus.yml'}",
            f"--storage.tsdb.path={tmp / 'tsdb'}",
            f"--web.listen-address=127.0.0.1:{prom_port}",
            "--storage.tsdb.retention.time=1h",
            "--log.level=warn",
        ],
        stdout=prom_log.open("w"),
        stderr=subprocess.STDOUT,
    )
    try:
        prom_url = f"http://127.0.0.1:{prom_port}"
        wait_until(lambda: http_get(f"{prom_url}/-/ready"), 60, "Prometheus ready", prom, prom_log)

        channel = grpc.insecure_channel(f"127.0.0.1:{port}")
        health = health_pb2_grpc.HealthStub(channel)

        def serving() -> bool:
            for service in ("", "prefixscore.v1.ScoreService"):
                reply = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=2)
                if reply.status != health_pb2.HealthCheckResponse.SERVING:
                    return False
            return True

        wait_until(serving, 240, "the server's health SERVING", server, server_log)
        channel.close()
        # the background warm-up traces its shapes in Python: on a saturated 2-core runner a scrape
        # waiting on it outlasts the 1 s scrape timeout, and the gauges read as stale (no data)
        warmed_up = lambda: "event=warmed_up" in server_log.read_text()  # noqa: E731
        wait_until(warmed_up, 300, "the background warm-up", server, server_log)

        try:
            send_traffic(f"127.0.0.1:{port}")
        except Exception as err:  # noqa: BLE001 - show the server's side of it
            pytest.fail(f"traffic failed: {err!r}\n--- server log ---\n{server_log.read_text()[-4000:]}")
        metrics_url = f"http://127.0.0.1:{metrics_port}/metrics"
        scrape = http_get(metrics_url).decode()
        model = re.search(r'prefixscore_model_info\{[^}]*model="([^"]+)"', scrape).group(1)
        result = Stack(prom_url, metrics_url, model, scrape)

        # every recording rule evaluated after the traffic was scraped
        def rules_caught_up() -> bool:
            return bool(result.query("prefixscore:items_scored:rate5m > 0")) and bool(
                result.query("prefixscore:request_duration_seconds:p99_rate5m")
            )

        wait_until(rules_caught_up, 60, "recording rules over the traffic", prom, prom_log)
        time.sleep(2.5)  # two more rule evaluations: alert rules read recorded series
        yield result
    finally:
        stop(prom)
        stop(server)


def test_e2e_real_scrape_has_every_referenced_metric_and_label_value(stack):
    exported = sample_names(stack.scrape)
    for where, expr in all_queries():
        for name in referenced_series(expr):
            if ":" not in name:
                assert name in exported, f"{where}: {name} is not in a real /metrics scrape"
    # exact label matchers on server metrics name values the server really emits
    samples = [line for line in stack.scrape.splitlines() if line and not line.startswith("#")]
    for where, expr in all_queries():
        for metric, matchers in re.findall(r"(prefixscore_[a-z_]+)\{([^}]*)\}", expr):
            for label, value in re.findall(r'(\w+)="([^"$]+)"', matchers):
                pattern = re.compile(rf'^{metric}\{{[^}}]*{label}="{re.escape(value)}"')
                assert any(pattern.match(s) for s in samples), f"{where}: no {metric}{{{label}={value!r}}} scraped"


def test_e2e_every_dashboard_query_returns_data(stack):
    variables = {"model": stack.model, "datasource": "prometheus"}
    values = json.loads(
        http_get(
            f"{stack.prom_url}/api/v1/label/model/values?"
            + urllib.parse.urlencode({"match[]": "prefixscore_model_info"})
        )
    )["data"]
    assert stack.model in values, "the model variable's query offers the served model"
    empty = []
    queries = dashboard_queries(load_dashboard())
    for where, expr in queries:
        if not stack.query(substitute_grafana(expr, variables)):
            empty.append(where)
    assert not empty, f"panel queries without data: {empty}"
    assert len(queries) >= 30
    # the model filter filters: another model's name gives nothing
    where, expr = queries[0]
    assert not stack.query(substitute_grafana(expr, {**variables, "model": "no-such-model"})), where


def test_e2e_every_rule_loads_and_returns_data(stack):
    body = json.loads(http_get(f"{stack.prom_url}/api/v1/rules"))
    loaded = [r for g in body["data"]["groups"] for r in g["rules"]]
    assert len(loaded) == len(load_rules())
    bad = [(r["name"], r.get("lastError")) for r in loaded if r["health"] != "ok"]
    assert not bad, bad
    empty = []
    for rule in load_rules():
        if "record" in rule:
            if not stack.query(rule["expr"]):
                empty.append(f"{rule['record']} (expr)")
            if not stack.query(rule["record"]):
                empty.append(f"{rule['record']} (recorded series)")
        elif not stack.query(with_bool(rule["expr"])):
            empty.append(f"{rule['alert']} (bool form)")
    assert not empty, f"rules without data: {empty}"


def test_e2e_values_match_the_traffic(stack):
    def value(expr: str) -> float:
        (sample,) = stack.query(expr)
        return float(sample["value"][1])

    assert value("sum(prefixscore_items_scored_total)") > 0
    codes = {r["metric"]["code"] for r in stack.query("prefixscore:requests:rate5m")}
    assert {"OK", "INVALID_ARGUMENT"} <= codes, codes
    assert value("prefixscore:request_errors:ratio_rate5m") == 0, "client mistakes are no server errors"
    assert 0 < value("prefixscore:prefix_cache_hit_ratio:rate5m") < 1
    firing = [r["metric"]["alertname"] for r in stack.query('ALERTS{alertstate="firing"}')]
    assert "PrefixscoreHighErrorRatio" not in firing and "PrefixscoreStalled" not in firing


def test_dashboard_file_is_plain_json():
    text = DASHBOARD.read_text()
    assert json.loads(text) and text.endswith("\n")
