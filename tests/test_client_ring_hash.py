"""Many replicas, one cache, no proxy: `ScoreClient(target, affinity="ring_hash")` over three
in-process replicas. gRPC's own ring hash (gRFC A76) hashes the `x-prefixscore-prefix-key`
header the client sends, so every call over one query reaches one replica, the one that caches
it. The replicas are started as in tests/test_prefix_affinity.py, without Envoy in front."""

from __future__ import annotations

import asyncio
import os
import socket

import grpc
import pytest
from helpers.service import ITEMS, LABELS, serving_replicas

from prefixscore.client.channel import RING_HASH_ENV, channel_options, ring_hash_service_config
from prefixscore.client.score_client import AsyncScoreClient, ScoreClient
from prefixscore.v1 import score_service_pb2 as pb
from prefixscore.v1 import score_service_pb2_grpc as pb_grpc

QUERY_TOKENS = 40


@pytest.fixture(scope="module")
def replicas(tiny_scorer):
    with serving_replicas(tiny_scorer) as servers:
        yield servers


@pytest.fixture(autouse=True)
def env_unset(monkeypatch) -> None:
    """Each test starts without RING_HASH_ENV (the client sets it) and leaves the process as it was."""
    monkeypatch.setenv(RING_HASH_ENV, "unset below")  # recorded, so teardown restores the original
    monkeypatch.delenv(RING_HASH_ENV)


def _target(replicas, *extra_ports: int) -> str:
    """One gRPC target naming every replica (what a headless Service's DNS name resolves to)."""
    ports = [srv.server.port for srv in replicas] + list(extra_ports)
    return "ipv4:" + ",".join(f"127.0.0.1:{p}" for p in ports)


def _lookups(replicas) -> list[float]:
    """Prefix-cache lookups per replica: one hit or one miss per Score request, counted before it
    is answered (the request counters move only once the answer is sent, racing the client)."""
    m = [srv.server.service.metrics for srv in replicas]
    return [x.cache_hits._value.get() + x.cache_misses._value.get() for x in m]


def _query(base: int, q: int) -> list[int]:
    return list(range(base + 37 * q, base + 37 * q + QUERY_TOKENS))


def _traffic(replicas, client: ScoreClient, base: int, queries: int = 12, repeats: int = 3):
    """Each query `repeats` times, one call at a time: {query: [replica of each call]} and
    {query: [cached tokens of each call]}."""
    where: dict[int, list[int]] = {}
    cached: dict[int, list[int]] = {}
    for q in range(queries):
        for _ in range(repeats):
            before = _lookups(replicas)
            usage = client.score(_query(base, q), ITEMS, LABELS, timeout=60).usage
            moved = [i for i, (a, b) in enumerate(zip(before, _lookups(replicas), strict=True)) if b > a]
            assert len(moved) == 1, moved
            where.setdefault(q, []).append(moved[0])
            cached.setdefault(q, []).append(usage.cached_tokens)
    return where, cached


def test_ring_hash_sends_every_call_of_a_query_to_one_replica(replicas) -> None:
    """Twelve queries, three calls each: each query's calls on one replica, more than one replica
    used, every repeat a cache hit (the ideal, 2 of 3). Controls over the same three addresses:
    the default (pick_first) sends everything to one replica; round_robin spreads the calls
    and misses most repeats."""
    with ScoreClient(_target(replicas), affinity="ring_hash") as client:
        where, cached = _traffic(replicas, client, base=10_000)
        client.model_info(timeout=30)  # a call without a key: a random place on the ring, still answered
    assert all(len(set(w)) == 1 for w in where.values()), where
    assert len({w[0] for w in where.values()}) >= 2, f"twelve keys all on one replica: {where}"
    assert all(c == [0, QUERY_TOKENS, QUERY_TOKENS] for c in cached.values()), cached

    with ScoreClient(_target(replicas)) as default:
        where, _ = _traffic(replicas, default, base=12_000)
    assert len({r for w in where.values() for r in w}) == 1, f"pick_first spread the calls: {where}"

    with ScoreClient(_target(replicas), options=[("grpc.lb_policy_name", "round_robin")]) as spread:
        where, cached = _traffic(replicas, spread, base=14_000)
    assert len({r for w in where.values() for r in w}) == 3, where
    hits = sum(1 for c in cached.values() for tokens in c[1:] if tokens == QUERY_TOKENS)
    assert hits < 2 * len(cached), f"round_robin kept every query on one replica: {where}"


def test_async_client_and_streams_land_on_the_same_replica(replicas) -> None:
    """The ring depends only on the addresses: an AsyncScoreClient (its own channel) sends a
    query where the sync client did, and a ScoreStream opens on it with the query cached."""
    with ScoreClient(_target(replicas), affinity="ring_hash") as client:
        where, _ = _traffic(replicas, client, base=16_000, queries=6, repeats=1)

    async def run() -> dict[int, int]:
        placed = {}
        async with AsyncScoreClient(_target(replicas), affinity="ring_hash") as aclient:
            for q in range(6):
                before = _lookups(replicas)
                usage = (await aclient.score(_query(16_000, q), ITEMS, LABELS, timeout=60)).usage
                assert usage.cached_tokens == QUERY_TOKENS, (q, usage)
                placed[q] = next(i for i, (a, b) in enumerate(zip(before, _lookups(replicas), strict=True)) if b > a)
                stream = await aclient.stream(_query(16_000, q), LABELS, timeout=60)
                async with stream:
                    assert stream.cached_tokens == QUERY_TOKENS
                    await stream.send(ITEMS)
        return placed

    assert asyncio.run(run()) == {q: w[0] for q, w in where.items()}


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_dead_address_on_the_ring_passes_its_keys_to_the_next_replica(replicas) -> None:
    """A fourth address that refuses connections (a replica gone): keys whose place on the ring
    is its go to the next replica on the ring, all of one key's calls to the same one; no call
    fails. (24 queries: all of them missing the dead quarter of the ring is a 1-in-1000 chance.)"""
    with ScoreClient(_target(replicas, _closed_port()), affinity="ring_hash") as client:
        where, cached = _traffic(replicas, client, base=18_000, queries=24)
    assert all(len(set(w)) == 1 for w in where.values()), where
    assert all(c == [0, QUERY_TOKENS, QUERY_TOKENS] for c in cached.values()), cached


def test_the_environment_variable(replicas, monkeypatch) -> None:
    """Unset, the client sets it (C core reads it when the channel is created); set false, the
    client refuses with the reason. Without it gRPC itself drops `requestHashHeader` and fails
    every call: if that assertion fails, grpcio now enables gRFC A76 by default and the
    variable's handling in client/score_client.py can go."""
    with ScoreClient(_target(replicas), affinity="ring_hash") as client:
        client.score(_query(20_000, 0), ITEMS, LABELS, timeout=60)
    assert os.environ[RING_HASH_ENV] == "true"

    monkeypatch.setenv(RING_HASH_ENV, "false")
    with pytest.raises(RuntimeError, match=RING_HASH_ENV):
        ScoreClient(_target(replicas), affinity="ring_hash")
    options = [("grpc.service_config", ring_hash_service_config())]
    with grpc.insecure_channel(_target(replicas), options=options) as channel:
        stub = pb_grpc.ScoreServiceStub(channel)
        request = pb.ScoreRequest(query=pb.Input(text="q"), items=[pb.Input(text="a")], label_token_ids=LABELS)
        with pytest.raises(grpc.RpcError) as failed:
            stub.Score(request, metadata=(("x-prefixscore-prefix-key", "00000000"),), timeout=30)
    assert failed.value.code() == grpc.StatusCode.INTERNAL and "hash attribute" in failed.value.details()


def test_bad_options_are_refused() -> None:
    with pytest.raises(ValueError, match="affinity"):
        channel_options((), "round_robin")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="grpc.lb_policy_name"):
        channel_options([("grpc.lb_policy_name", "round_robin")], "ring_hash")
