"""Issue 10's load round: a real server on loopback under 64 concurrent ScoreStreams with cancels,
deadlines, slow readers and abandoned streams mixed in, then a drain (SIGTERM) under load.

Every round checks: 0 lost (each batch of a stream that was not cut short is answered), 0 wrong
(each answer equals the in-process Scorer's scores for the same query and items), 0 leaked (open
streams, RPCs in flight, queued items and pinned prefixes back to zero, in the metrics and in the
prefix cache itself), no INTERNAL or UNKNOWN status, still SERVING; and this process's resident
memory (the server runs in it, on a thread) stays within 10% of its size after the first round.
"""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import random
import threading

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from helpers.service import LABELS, scrape, server_config, wait_for

from prefixscore.client import AsyncScoreClient, AsyncScoreStream
from prefixscore.client.score_client import stream_open
from prefixscore.service.process import ServerThread
from prefixscore.v1 import score_service_pb2_grpc as pb_grpc

Code = grpc.StatusCode
STREAMS = 64
ROUNDS = 3
# the server's stream idle timeout: abandoned streams end within a round. A normal stream is idle
# between its open being answered and its first batch; on a loaded 2-core runner (round 0 compiles
# while 64 streams open) one such gap passed 2 s in CI and the stream was ended, so this stays well
# above the scheduling stalls of such a machine
IDLE_S = 5.0
PENDING = 3  # max_pending_batches: slow readers hit backpressure
QUERIES = [tuple(range(200 + 97 * q, 200 + 97 * q + 12 + 4 * q)) for q in range(8)]  # token ids, 12..40
POOL = 16  # items per query, drawn from by the streams
ROUND_S = 90  # a round that has not ended by then is a hang


def _item(q: int, j: int) -> tuple[int, ...]:
    start = 3000 + 131 * q + 7 * j
    return tuple(range(start, start + 2 + (q + j) % 5))  # 2..6 tokens


@pytest.fixture(scope="module")
def expected(tiny_scorer) -> dict[tuple[int, tuple[int, ...]], np.ndarray]:
    """(query index, item) -> the in-process Scorer's scores: the oracle of every answer."""
    out = {}
    for q, query in enumerate(QUERIES):
        items = [_item(q, j) for j in range(POOL)]
        for item, scores in zip(items, tiny_scorer.score(list(query), [list(i) for i in items], LABELS), strict=True):
            out[(q, item)] = np.asarray(scores)
    return out


@pytest.fixture(scope="module")
def server(tiny_scorer, expected):
    cfg = server_config(tiny_scorer, stream_idle_timeout_s=IDLE_S, max_pending_batches=PENDING)
    with ServerThread(cfg) as srv:
        yield srv


@dataclasses.dataclass
class Outcome:
    kind: str
    answered: dict[int, list[list[float]]] = dataclasses.field(default_factory=dict)  # batch id -> scores
    sent: dict[int, list[tuple[int, ...]]] = dataclasses.field(default_factory=dict)  # batch id -> items
    must_answer: bool = True  # every sent batch must be answered (not cut short by the client or a deadline)
    code: Code | None = None  # the status that ended the stream, None for OK
    details: str = ""  # the status message, for a failure to show
    usage_items: int | None = None


KINDS = (
    *["normal"] * 6,
    "slow",
    "slow",
    "cancel_at_open",
    "cancel_after_open",
    "cancel_in_flight",
    "cancel_after_one",
    "short_deadline",
    "expired_deadline",
    "abandoned",
    "disconnect",
)
ALLOWED = {  # how each kind may end; anything else (INTERNAL above all) fails the round
    "normal": {None},
    "slow": {None},
    "cancel_at_open": {Code.CANCELLED},
    "cancel_after_open": {Code.CANCELLED},
    "cancel_in_flight": {Code.CANCELLED},
    "cancel_after_one": {Code.CANCELLED},
    "short_deadline": {None, Code.DEADLINE_EXCEEDED},
    "expired_deadline": {Code.DEADLINE_EXCEEDED},
    "abandoned": {Code.DEADLINE_EXCEEDED},  # the server's idle timeout ends it
    "disconnect": {Code.CANCELLED},
}


def _batches(rng: random.Random, q: int, n: int) -> list[list[tuple[int, ...]]]:
    return [[_item(q, rng.randrange(POOL)) for _ in range(rng.randint(1, 4))] for _ in range(n)]


async def _submit(session: AsyncScoreStream, out: Outcome, items: list[tuple[int, ...]]) -> int:
    batch_id = await session.submit([list(i) for i in items])
    out.sent[batch_id] = items
    return batch_id


async def _collect(session: AsyncScoreStream, out: Outcome, batch_id: int) -> None:
    out.answered[batch_id] = await session.result(batch_id)


async def _ended(session_or_call) -> Code:
    """The status a stream ended with (the client's own cancel included), without raising."""
    call = session_or_call._call if isinstance(session_or_call, AsyncScoreStream) else session_or_call
    return await call.code()


async def _one_stream(
    k: int, round_: int, clients: list[AsyncScoreClient], target: str, abandoned: list[AsyncScoreStream]
) -> Outcome:
    kind = KINDS[k % len(KINDS)]
    rng = random.Random(1000 * round_ + k)
    q = rng.randrange(len(QUERIES))
    query = list(QUERIES[q])
    out = Outcome(kind, must_answer=kind in ("normal", "slow"))
    client = clients[k % len(clients)]
    code: Code = Code.OK
    try:
        if kind == "cancel_at_open":
            # the raw call: cancelled before the open is answered (maybe during its prefill)
            call = client._stub.ScoreStream(metadata=client._metadata)
            await call.write(stream_open(query, LABELS))
            await asyncio.sleep(rng.random() * 0.02)
            call.cancel()
            code = await _ended(call)
        elif kind == "disconnect":
            # a client that goes away without a word: its own connection closes under the stream
            async with AsyncScoreClient(target) as own:
                session = await own.stream(query, LABELS)
                await _submit(session, out, _batches(rng, q, 1)[0])
            code = await _ended(session)
        elif kind == "abandoned":
            # sends, then never reads, half-closes or cancels: only the server can end it. The call
            # is kept, untouched, until the server has settled (open streams back to zero)
            session = await client.stream(query, LABELS)
            for items in _batches(rng, q, 2):
                await _submit(session, out, items)
            abandoned.append(session)
            code = Code.DEADLINE_EXCEEDED  # what the server ends it with (checked by its metrics)
        elif kind == "expired_deadline":
            session = await client.stream(query, LABELS, timeout=0.3 + rng.random() * 0.3)
            await _collect(session, out, await _submit(session, out, _batches(rng, q, 1)[0]))
            code = await _ended(session)  # held open past the deadline
        elif kind == "short_deadline":
            session = await client.stream(query, LABELS, timeout=0.05 + rng.random() * 0.5)
            ids = [await _submit(session, out, items) for items in _batches(rng, q, 3)]
            for batch_id in ids:
                await _collect(session, out, batch_id)
            out.usage_items = (await session.close()).items
        elif kind == "cancel_after_open":
            session = await client.stream(query, LABELS)
            session.cancel()
            code = await _ended(session)
        elif kind == "cancel_in_flight":
            session = await client.stream(query, LABELS)
            for items in _batches(rng, q, 2):
                await _submit(session, out, items)
            session.cancel()
            code = await _ended(session)
        elif kind == "cancel_after_one":
            session = await client.stream(query, LABELS)
            ids = [await _submit(session, out, items) for items in _batches(rng, q, 3)]
            await _collect(session, out, ids[0])
            session.cancel()
            code = await _ended(session)
        else:  # normal and slow: pipelined batches, every one answered
            session = await client.stream(query, LABELS)
            n = 2 * PENDING + 1 if kind == "slow" else 3
            ids = [await _submit(session, out, items) for items in _batches(rng, q, n)]
            for batch_id in ids:
                if kind == "slow":
                    await asyncio.sleep(0.05)  # reads slower than the device answers
                await _collect(session, out, batch_id)
            out.usage_items = (await session.close()).items
    except grpc.aio.AioRpcError as err:
        code = err.code()
        out.details = err.details() or ""
        if code == Code.INTERNAL and "execute_batch" in err.debug_error_string() and kind.endswith("_deadline"):
            # grpcio's client reports INTERNAL ('Failed "execute_batch"') for a write it sends as
            # the call's deadline passes: the client's own race with its deadline, not a status
            # from the server (whose INTERNAL always names a request id)
            code = Code.DEADLINE_EXCEEDED
    out.code = None if code == Code.OK else code
    return out


async def _round(server: ServerThread, round_: int) -> tuple[list[Outcome], dict[str, float]]:
    """One round of STREAMS streams; returns their outcomes and the server's settled metrics."""
    clients = [AsyncScoreClient(server.target) for _ in range(4)]  # several connections, many streams each
    abandoned: list[AsyncScoreStream] = []
    try:
        tasks = [_one_stream(k, round_, clients, server.target, abandoned) for k in range(STREAMS)]
        outcomes = await asyncio.wait_for(asyncio.gather(*tasks), ROUND_S)
        # the abandoned streams' clients are still there, silent: the server must end them itself
        metrics = await asyncio.to_thread(_settled, server)
        for session in abandoned:
            session.cancel()
        return outcomes, metrics
    finally:
        for client in clients:
            await client.close()


def _check(outcomes: list[Outcome], expected: dict) -> dict[str, int]:
    """0 lost, 0 wrong; returns how many batches each kind had answered."""
    answered: dict[str, int] = {}
    for k, out in enumerate(outcomes):
        assert out.code in ALLOWED[out.kind], f"stream {k} ({out.kind}) ended {out.code}: {out.details}"
        if out.must_answer:
            assert set(out.answered) == set(out.sent), f"stream {k} ({out.kind}) lost batches"
            assert out.usage_items == sum(len(items) for items in out.sent.values())
        for batch_id, scores in out.answered.items():
            items = out.sent[batch_id]
            want = [expected[_key(item)] for item in items]
            np.testing.assert_allclose(scores, want, rtol=1e-5, err_msg=f"stream {k} batch {batch_id}")
        answered[out.kind] = answered.get(out.kind, 0) + len(out.answered)
    return answered


def _key(item: tuple[int, ...]) -> tuple[int, tuple[int, ...]]:
    q = (item[0] - 3000) // 131  # _item's start: 3000 + 131 q + 7 j, j < POOL so 7 j < 131
    return q, item


def _settled(server: ServerThread) -> dict[str, float]:
    """Wait (bounded) until nothing is open, in flight, queued or pinned; returns the scrape."""
    srv = server.server
    names = (
        "prefixscore_open_streams",
        "prefixscore_inflight_requests",
        "prefixscore_queue_depth",
        "prefixscore_prefix_cache_pinned",
        "prefixscore_queued_requests",
        "prefixscore_running_requests",
    )

    def idle() -> dict[str, float] | None:
        metrics = scrape(srv.metrics_port)
        return metrics if all(metrics[n] == 0 for n in names) else None

    try:
        metrics = wait_for(idle, 30, "streams, RPCs, queue and pins back to zero")
    except AssertionError:
        metrics = scrape(srv.metrics_port)
        raise AssertionError({n: metrics[n] for n in names}) from None
    cache = srv.service.engine.prefix_cache
    assert cache.pinned == 0 and all(e.pins == 0 for e in cache._entries.values())
    assert srv.grpc.streams == 0 and srv.service.inflight == 0
    return metrics


def _rss_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS in /proc/self/status")


def _errors(metrics: dict[str, float]) -> float:
    return sum(
        v
        for k, v in metrics.items()
        if k.startswith("prefixscore_requests_total") and ("code=INTERNAL" in k or "code=UNKNOWN" in k)
    )


def test_64_streams_with_cancels_deadlines_slow_readers_and_abandoned_ones(server, expected):
    rss = []
    for round_ in range(ROUNDS):
        outcomes, metrics = asyncio.run(_round(server, round_))
        answered = _check(outcomes, expected)
        assert answered["normal"] > 0 and answered["slow"] > 0  # the round did score
        assert _errors(metrics) == 0
        abandoned = sum(out.kind == "abandoned" for out in outcomes)
        assert metrics["prefixscore_streams_idle_closed_total"] >= (round_ + 1) * abandoned
        with grpc.insecure_channel(server.target) as channel:
            health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest())
        assert health.status == health_pb2.HealthCheckResponse.SERVING
        gc.collect()
        rss.append(_rss_bytes())
    assert scrape(server.server.metrics_port)["prefixscore_stream_backpressure_total"] > 0  # slow readers pushed
    # no growth past 10% of the first round's size (round 1 compiles and warms caches, so later
    # rounds may well be smaller: the allocator gives compile-time memory back), and no growth
    # once warm. A drop is no leak: this is the pytest worker's whole RSS, which also frees what
    # earlier test files left (one CI-like run fell 11% between rounds 2 and 3)
    assert max(rss[1:]) <= 1.10 * rss[0], f"resident memory after each round: {rss}"
    assert rss[2] - rss[1] <= 0.10 * rss[1], f"resident memory after each round: {rss}"


def test_a_stream_closed_as_its_deadline_passes_ends_with_a_status(server):
    """close() racing the call's deadline: the caller sees DEADLINE_EXCEEDED (or its usage), never
    grpcio's internal batch error from a half-close the deadline overtook, nor the INTERNAL status
    grpcio gives a call whose send (the open's, here) the deadline overtook. Two threads contending
    for the interpreter lock slow the event loop as a loaded runner does, so that the send's
    failure and the call's end come in together (without it the INTERNAL came 0 in 600 times on
    an idle machine, 4 in 120 on CI's runner; with it and deadlines of 10-30 ms, 10 in 60 before
    the client's fix)."""

    async def main() -> dict[str, int]:
        outcomes: dict[str, int] = {}
        async with AsyncScoreClient(server.target) as client:
            rng = random.Random(3)
            for _ in range(60):
                deadline = 0.01 + rng.random() * 0.02
                try:
                    session = await client.stream(QUERIES[0], LABELS, timeout=deadline)
                    await asyncio.sleep(deadline + (rng.random() - 0.5) * 0.006)
                    await session.close()
                    outcome = "usage"
                except grpc.aio.AioRpcError as err:
                    outcome = err.code().name
                outcomes[outcome] = outcomes.get(outcome, 0) + 1
        return outcomes

    done = threading.Event()

    def contend() -> None:
        while not done.is_set():
            sum(range(2000))

    contenders = [threading.Thread(target=contend, daemon=True) for _ in range(2)]
    for contender in contenders:
        contender.start()
    try:
        outcomes = asyncio.run(main())
    finally:
        done.set()
        for contender in contenders:
            contender.join()
    assert set(outcomes) <= {"usage", "DEADLINE_EXCEEDED"}, outcomes
    assert outcomes.get("DEADLINE_EXCEEDED", 0) > 0  # the race was run


def test_drain_under_load_loses_no_accepted_batch(tiny_scorer, expected):
    """SIGTERM's drain with streams mid-flight: every batch already accepted is answered, open
    streams may finish, new streams get UNAVAILABLE, health goes NOT_SERVING, then it stops."""
    srv = ServerThread(server_config(tiny_scorer, stream_idle_timeout_s=30)).start()
    try:
        worker = srv.server.service.worker
        drained = threading.Event()

        async def main() -> None:
            async with AsyncScoreClient(srv.target) as client:
                rng = random.Random(5)
                sessions, sent = [], []
                with worker.paused():  # hold the device: what the drain finds is accepted and queued
                    for k in range(16):
                        q = k % len(QUERIES)
                        session = await client.stream(list(QUERIES[q]), LABELS)
                        batches = {}
                        for items in _batches(rng, q, 2):
                            batches[await session.submit([list(i) for i in items])] = items
                        sessions.append(session)
                        sent.append(batches)
                    total = sum(len(items) for batches in sent for items in batches.values())
                    while worker.depth < total:
                        await asyncio.sleep(0.02)
                    drain = asyncio.get_running_loop().run_in_executor(None, lambda: (srv.drain(60), drained.set()))
                    with grpc.insecure_channel(srv.target) as channel:
                        health = health_pb2_grpc.HealthStub(channel)
                        not_serving = health_pb2.HealthCheckResponse.NOT_SERVING
                        while health.Check(health_pb2.HealthCheckRequest()).status != not_serving:
                            await asyncio.sleep(0.02)
                        with pytest.raises(grpc.RpcError) as refused:
                            list(pb_grpc.ScoreServiceStub(channel).ScoreStream(iter([stream_open("q", LABELS)])))
                        assert refused.value.code() == Code.UNAVAILABLE
                    assert not drained.is_set()  # the drain waits for the open streams
                # the device runs again: every accepted batch is answered, each stream ends with its usage
                for session, batches in zip(sessions, sent, strict=True):
                    for batch_id, items in batches.items():
                        scores = await session.result(batch_id)
                        np.testing.assert_allclose(scores, [expected[_key(i)] for i in items], rtol=1e-5)
                    usage = await session.close()
                    assert usage.items == sum(len(items) for items in batches.values())
                await drain

        asyncio.run(asyncio.wait_for(main(), ROUND_S))
        assert drained.is_set() and srv.server.stopped
        assert srv.server.exit_code == 0
        assert srv.server.service.engine.prefix_cache.pinned == 0
    finally:
        srv.stop()
