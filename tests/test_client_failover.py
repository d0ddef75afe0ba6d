"""Nothing lost when a replica goes away: with `retry=Retry()` the client's unary calls are
retried by gRPC's own retry policy on another replica, and a ScoreStream whose replica is
killed under it re-opens on another one, re-sends the batches not yet answered and finishes
there, every batch answered once. Three `prefixscore serve` subprocesses (a real SIGKILL and a
real SIGTERM drain): one killed under open streams, one that survives, one draining."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import signal
import subprocess
import time
from collections.abc import Iterator

import grpc
import numpy as np
import pytest
from helpers.service import LABELS, SERVE, ServerLog, scrape, serve_process, wait_for

from prefixscore.client import AsyncScoreClient, Retry, ScoreClient
from prefixscore.client.channel import channel_options, ring_hash_service_config, service_config
from prefixscore.client.errors import replica_lost

QUERY = "Is this sentence about rivers?"
BATCHES = [
    ["The Seine flows through Paris."],
    ["Cats sleep a lot.", "The Nile is long."],
    ["A river bank."],
    ["Mountains are high.", "Streams join rivers.", "Bread."],
    ["The Danube reaches the Black Sea."],
]


@dataclasses.dataclass
class Replica:
    proc: subprocess.Popen
    events: ServerLog
    port: int = 0
    metrics_port: int = 0

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def event(self, name: str) -> dict | None:
        return next((e for e in list(self.events) if e.get("event") == name), None)

    def open_streams(self) -> float:
        return scrape(self.metrics_port)["prefixscore_open_streams"]


@pytest.fixture(scope="module")
def replicas() -> Iterator[list[Replica]]:
    """Three replicas, started together (their start-ups overlap)."""
    started = [Replica(*serve_process(SERVE)) for _ in range(3)]
    try:
        for r in started:
            listening = wait_for(lambda r=r: r.event("listening") or r.proc.poll() is not None, 120, "listening")
            assert r.proc.poll() is None, f"serve exited: {r.events}"
            r.port, r.metrics_port = listening["port"], listening["metrics_port"]
        for r in started:
            wait_for(lambda r=r: r.event("ready") or r.proc.poll() is not None, 300, "ready")
            assert r.proc.poll() is None, f"serve exited: {r.events}"
        yield started
    finally:
        for r in started:
            if r.proc.poll() is None:
                r.proc.kill()
                r.proc.wait(30)


def _target(*replicas: Replica) -> str:
    return "ipv4:" + ",".join(r.address for r in replicas)


def test_unary_calls_are_retried_by_grpc_on_another_replica(replicas) -> None:
    """A draining replica (SIGTERM, kept draining by an open stream) answers UNAVAILABLE "retry
    on another replica": round_robin over it and a live one fails every other call without
    retry, and none with it (gRPC's retry picks again, reaching the live replica)."""
    _, live, draining = replicas
    expected = ScoreClient(live.address).score(QUERY, BATCHES[0], LABELS, timeout=60).scores
    # the open stream keeps the replica draining, port open, until it is closed below
    with ScoreClient(draining.address) as holder, holder.stream(QUERY, label_token_ids=LABELS):
        draining.proc.send_signal(signal.SIGTERM)
        wait_for(lambda: draining.event("draining"), 30, "the draining event")
        round_robin = [("grpc.lb_policy_name", "round_robin")]
        failed = []
        with ScoreClient(_target(draining, live), options=round_robin) as plain:
            for _ in range(6):
                try:
                    plain.score(QUERY, BATCHES[0], LABELS, timeout=60)
                except grpc.RpcError as err:
                    failed.append((err.code(), err.details()))
        assert failed and all(code == grpc.StatusCode.UNAVAILABLE for code, _ in failed), failed
        with ScoreClient(_target(draining, live), options=round_robin, retry=Retry(attempts=5)) as retrying:
            # round_robin picks among the replicas connected so far: give the live one time to
            # connect, or every try of the first call could meet the draining one alone
            grpc.channel_ready_future(retrying._channel).result(timeout=30)
            time.sleep(0.5)
            for _ in range(6):
                scores = retrying.score(QUERY, BATCHES[0], LABELS, timeout=60).scores
                np.testing.assert_allclose(scores, expected, rtol=1e-5)
            assert retrying.model_info(timeout=60).model
    draining.proc.wait(60)


def test_a_stream_finishes_on_another_replica_when_its_replica_is_killed(replicas) -> None:
    """Three streams on one replica (pick_first over [doomed, live] puts them there): a sync and
    an async one with failover, a plain one. Each has its first batch answered; the replica is
    stopped (SIGSTOP: what is sent now stays in flight), four more batches are submitted, and
    it is killed. The plain stream fails UNAVAILABLE; the failover ones re-open on the live
    replica, which answers exactly the four batches in flight (its usage), each like a unary call."""
    doomed, live, _ = replicas
    with ScoreClient(live.address) as direct:
        expected = [direct.score(QUERY, batch, LABELS, timeout=60).scores for batch in BATCHES]
    target = _target(doomed, live)
    retry = Retry(stream_reopens=2)
    loop = asyncio.new_event_loop()
    with ScoreClient(target, retry=retry) as client, ScoreClient(target) as plain_client:
        stream = client.stream(QUERY, label_token_ids=LABELS, timeout=120)
        plain = plain_client.stream(QUERY, label_token_ids=LABELS, timeout=120)

        async def open_async():
            aclient = AsyncScoreClient(target, retry=retry)
            return aclient, await aclient.stream(QUERY, label_token_ids=LABELS, timeout=120)

        aclient, astream = loop.run_until_complete(open_async())
        try:
            assert doomed.open_streams() == 3 and live.open_streams() == 0
            firsts = [
                stream.send(BATCHES[0]),
                plain.send(BATCHES[0]),
                loop.run_until_complete(astream.send(BATCHES[0])),
            ]

            doomed.proc.send_signal(signal.SIGSTOP)
            ids = [stream.submit(b) for b in BATCHES[1:]]
            plain_ids = [plain.submit(b) for b in BATCHES[1:]]
            async_ids = [loop.run_until_complete(astream.submit(b)) for b in BATCHES[1:]]
            doomed.proc.kill()
            doomed.proc.wait(30)

            with pytest.raises(grpc.RpcError) as lost:
                plain.result(plain_ids[0])
            assert lost.value.code() == grpc.StatusCode.UNAVAILABLE, lost.value

            got = [firsts[0]] + [stream.result(i) for i in ids]
            usage = stream.close()
            agot = [firsts[2]] + [loop.run_until_complete(astream.result(i)) for i in async_ids]
            ausage = loop.run_until_complete(astream.close())
        finally:
            loop.run_until_complete(aclient.close())
            loop.close()
    for answers in (got, agot):
        for scores, want in zip(answers, expected, strict=True):
            np.testing.assert_allclose(scores, want, rtol=1e-5)
    in_flight = sum(len(b) for b in BATCHES[1:])
    assert (stream.reopens, astream.reopens) == (1, 1)
    assert usage.items == ausage.items == in_flight, (usage, ausage)  # the first batch was not sent again
    assert live.open_streams() == 0


def test_one_service_config_carries_ring_hash_and_the_retry_policy() -> None:
    merged = json.loads(service_config("ring_hash", Retry(attempts=4)))
    assert merged["loadBalancingConfig"] == json.loads(ring_hash_service_config())["loadBalancingConfig"]
    (method,) = merged["methodConfig"]
    assert {n["method"] for n in method["name"]} == {"Score", "Rerank", "Embed", "GetModelInfo"}  # not ScoreStream
    assert method["retryPolicy"]["maxAttempts"] == 4
    assert method["retryPolicy"]["retryableStatusCodes"] == ["UNAVAILABLE"]
    assert service_config(None, None) is None
    options = dict(channel_options((), None, Retry()))
    assert options["grpc.enable_retries"] == 1 and "loadBalancingConfig" not in options["grpc.service_config"]
    with pytest.raises(ValueError, match="grpc.service_config"):
        channel_options([("grpc.service_config", "{}")], None, Retry())
    with pytest.raises(ValueError, match="attempts"):
        Retry(attempts=6)  # gRPC would silently cap it at 5


class _Failed(grpc.RpcError):
    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        self._code, self._details = code, details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details


def test_a_stream_reset_under_it_counts_as_its_replica_lost() -> None:
    """Envoy resets a stream (RST_STREAM, INTERNAL_ERROR) whose replica dies after the stream's
    headers went through: the stream re-opens on that, as on UNAVAILABLE; a status the server
    sent (INTERNAL in the trailers) or any other code does not (bench/failover.py runs it)."""
    reset = "Stream removed (RST_STREAM (Received RST_STREAM with error code 2))"
    assert replica_lost(_Failed(grpc.StatusCode.UNAVAILABLE, "Connection reset"))
    assert replica_lost(_Failed(grpc.StatusCode.INTERNAL, reset))
    assert not replica_lost(_Failed(grpc.StatusCode.INTERNAL, "Score failed (request id 1)"))
    assert not replica_lost(_Failed(grpc.StatusCode.CANCELLED, reset))


def test_a_unary_call_reset_under_it_is_sent_again_with_retry_only() -> None:
    """A Score whose replica died while its answer was on the way (Envoy resets the call: gRPC's
    policy cannot retry it, headers came) is sent again, at most `attempts` tries; without
    `retry`, or for a status the server sent, it is not."""
    reset = _Failed(grpc.StatusCode.INTERNAL, "Stream removed (RST_STREAM (Received RST_STREAM with error code 2))")
    calls: list[float | None] = []

    def flaky(request: object, timeout: float | None, metadata: object) -> str:
        calls.append(timeout)
        if len(calls) < 3:
            raise reset
        return "answer"

    def always_reset(request: object, timeout: float | None, metadata: object) -> str:
        calls.append(timeout)
        raise reset

    def internal(request: object, timeout: float | None, metadata: object) -> str:
        calls.append(timeout)
        raise _Failed(grpc.StatusCode.INTERNAL, "Score failed (request id 1)")

    retry = Retry(attempts=3, initial_backoff_s=0.001, max_backoff_s=0.001)
    with ScoreClient("127.0.0.1:1", retry=retry) as client:
        assert client._unary(flaky, None, 30.0, None) == "answer"
        assert len(calls) == 3 and all(t is not None and 0 < t <= 30.0 for t in calls)
        calls.clear()
        with pytest.raises(grpc.RpcError):  # reset every time: three tries, then the error
            client._unary(always_reset, None, None, None)
        assert len(calls) == 3
        calls.clear()
        with pytest.raises(grpc.RpcError):
            client._unary(internal, None, None, None)
        assert len(calls) == 1
    with ScoreClient("127.0.0.1:1") as client:
        calls.clear()
        with pytest.raises(grpc.RpcError):
            client._unary(always_reset, None, None, None)
        assert len(calls) == 1
