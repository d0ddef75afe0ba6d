"""Issue 10: the service against careless and hostile clients and against faults, on loopback.

One server with small limits is shared by the module; faults are injected into the real
engine of that server (a device call that raises or returns NaN, a device loop that breaks)
and taken out again by monkeypatch. Tests that need the device to hold work use
`worker.paused()` or hold the engine's call lock, so what they observe is deterministic.
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
import time
import urllib.error
import urllib.request

import grpc
import jax.numpy as jnp
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase
from helpers.service import LABELS, scrape, server_config, wait_for
from hypothesis import given, settings
from hypothesis import strategies as st

from prefixscore.bench.faults import write_garbage
from prefixscore.client import BatchRefused, retry_after_ms
from prefixscore.service.process import ServerThread
from prefixscore.service.server import SERVICE
from prefixscore.v1 import score_service_pb2 as pb
from prefixscore.v1 import score_service_pb2_grpc as pb_grpc

Code = grpc.StatusCode
QUERY = "Hardening query: which of these is about rivers?"
LIMITS = dict(
    max_queue_items=256,
    max_queue_tokens=3000,
    max_request_tokens=2000,
    max_streams=3,
    max_pending_batches=2,
    stream_idle_timeout_s=1.5,
)


@pytest.fixture(scope="module")
def server(tiny_scorer):
    with ServerThread(server_config(tiny_scorer, **LIMITS)) as srv:
        yield srv


def ids(n: int, start: int = 100) -> list[int]:
    return list(range(start, start + n))


def _open(query: list[int] | str = QUERY) -> pb.ScoreStreamRequest:
    q = pb.Input(text=query) if isinstance(query, str) else pb.Input(token_ids=pb.TokenIds(ids=query))
    return pb.ScoreStreamRequest(open=pb.StreamOpen(query=q, label_token_ids=LABELS))


def _batch(batch_id: int, *texts: str) -> pb.ScoreStreamRequest:
    return pb.ScoreStreamRequest(batch=pb.ItemBatch(batch_id=batch_id, items=[pb.Input(text=t) for t in texts]))


def _held(messages: list[pb.ScoreStreamRequest], release: threading.Event):
    """The messages, then the request stream stays open (not half-closed) until `release`."""
    yield from messages
    release.wait(60)


def _internal_errors(server) -> float:
    metrics = scrape(server.server.metrics_port)
    return sum(v for k, v in metrics.items() if k.startswith("prefixscore_requests_total") and "code=INTERNAL" in k)


# ---- 1. the pinned prefix of a stream cancelled while its query is prefilled ----------------------
@pytest.mark.parametrize("end", ["cancel", "deadline"])
def test_stream_ended_during_its_prefill_unpins(server, stub, tiny_scorer, end, caplog):
    """...and its prefill, launched after the stream ended, settles nothing the stream dropped
    (the open's cancelled future: no `on_done callback failed ... InvalidStateError`)."""
    worker, engine = server.server.service.worker, server.server.service.worker.engine
    query = ids(200, 3000 if end == "cancel" else 4000)
    prefix = tiny_scorer.requests.query_ids(query)
    release = threading.Event()
    with engine.calls_lock:  # the device takes no call: the open waits in its prefill
        call = stub.ScoreStream(_held([_open(query)], release), timeout=None if end == "cancel" else 1.0)
        wait_for(lambda: worker.cache.pins(tuple(prefix)) >= 1, 30, "the open to pin its query")
        if end == "cancel":
            call.cancel()
        with pytest.raises(grpc.RpcError) as ended:
            next(call)
        assert ended.value.code() == (Code.CANCELLED if end == "cancel" else Code.DEADLINE_EXCEEDED)
        wait_for(lambda: server.server.grpc.streams == 0, 30, "the stream handler to end")
    release.set()
    wait_for(lambda: worker.cache.pins(tuple(prefix)) == 0, 30, "the prefix to be unpinned")
    assert scrape(server.server.metrics_port)["prefixscore_open_streams"] == 0
    # a request answered after it: the event loop ran the prefill's delivery before this answer's
    item = pb.Input(token_ids=pb.TokenIds(ids=[101, 102]))
    stub.Score(pb.ScoreRequest(query=_open(query).open.query, items=[item], label_token_ids=LABELS), timeout=60)
    failed = [r for r in caplog.records if r.levelno >= logging.ERROR and r.name.startswith("prefixscore")]
    assert not failed, [r.getMessage() + str(r.exc_info) for r in failed]


# ---- 2. streams are bounded: how many, how idle --------------------------------------------------
def test_streams_past_the_limit_are_refused_with_a_retry_hint(server, client):
    sessions = [client.stream(ids(5, 6000 + 10 * k), LABELS) for k in range(LIMITS["max_streams"])]
    try:
        with pytest.raises(grpc.RpcError) as refused:
            client.stream(QUERY, LABELS)
        assert refused.value.code() == Code.RESOURCE_EXHAUSTED, refused.value.details()
        assert "streams are open" in refused.value.details() and retry_after_ms(refused.value) > 0
    finally:
        for session in sessions:
            session.close()
    with client.stream(QUERY, LABELS) as session:  # room again
        assert len(session.send(["a river"])) == 1


def test_idle_stream_is_ended_and_unpinned(server, stub, tiny_scorer):
    query = ids(30, 7000)
    release = threading.Event()
    try:
        call = stub.ScoreStream(_held([_open(query)], release), timeout=60)
        assert next(call).HasField("opened")
        with pytest.raises(grpc.RpcError) as idle:
            next(call)  # nothing sent: the server ends the stream after its idle timeout
        assert idle.value.code() == Code.DEADLINE_EXCEEDED and "idle timeout" in idle.value.details()
    finally:
        release.set()
    worker = server.server.service.worker
    wait_for(lambda: worker.cache.pins(tuple(query)) == 0, 30, "the idle stream's prefix to be unpinned")
    assert scrape(server.server.metrics_port)["prefixscore_streams_idle_closed_total"] >= 1


# ---- 3. per-stream backpressure ------------------------------------------------------------------
def test_stream_that_is_not_read_stops_being_read(server, stub):
    """A client that sends 12 batches and reads nothing: the server takes max_pending_batches,
    then stops reading; once the client reads, every batch is answered."""
    worker = server.server.service.worker
    metric = "prefixscore_stream_backpressure_total"
    before = scrape(server.server.metrics_port).get(metric, 0)
    batches = [_batch(k, f"item {k}") for k in range(12)]
    with worker.paused():
        call = stub.ScoreStream(iter([_open(), *batches]), timeout=120)
        wait_for(lambda: scrape(server.server.metrics_port)[metric] > before, 30, "the reader to pause")
        assert worker.depth == LIMITS["max_pending_batches"]  # not one batch more was read
    answers = list(call)
    assert sorted(a.batch.batch_id for a in answers if a.HasField("batch")) == list(range(12))
    assert answers[-1].usage.items == 12


# ---- 4. worker supervision: NaN, device errors, a broken device loop -----------------------------
def test_nan_scores_are_internal_and_counted(server, client, monkeypatch):
    engine = server.server.service.worker.engine
    launch = engine.launch
    monkeypatch.setattr(engine, "launch", lambda plan: launch(plan) * jnp.nan)
    with pytest.raises(grpc.RpcError) as err:
        client.score(QUERY, ["a nan"], LABELS)
    assert err.value.code() == Code.INTERNAL and "non-finite" in err.value.details()
    assert "request id" in err.value.details()
    monkeypatch.undo()
    assert scrape(server.server.metrics_port)["prefixscore_nonfinite_scores_total"] == 1
    assert len(client.score(QUERY, ["fine again"], LABELS).scores) == 1


def test_device_error_reaches_the_client_without_internals(server, client, monkeypatch):
    engine = server.server.service.worker.engine

    def broken(plan):
        raise RuntimeError("/opt/secret/xla/kernel.cc:42 RESOURCE_EXHAUSTED: out of memory allocating 9 GiB")

    monkeypatch.setattr(engine, "launch", broken)
    with pytest.raises(grpc.RpcError) as err:
        client.score(QUERY, ["an oom"], LABELS)
    monkeypatch.undo()
    details = err.value.details()
    assert err.value.code() == Code.INTERNAL and "request id" in details
    assert "/opt/secret" not in details and "GiB" not in details and "RuntimeError" not in details
    assert len(client.score(QUERY, ["fine again"], LABELS).scores) == 1  # only that call failed


def _queued_together(stub, worker, requests: list[tuple[list[int], list[list[int]], list[int] | None]]) -> list:
    """Score futures of (query, items, labels) requests, all queued before the first call is
    planned, so they ride in one device call. labels None: the items' own likelihood (with the
    top 2 log-probs at each position)."""
    with worker.paused():
        calls = [
            stub.Score.future(
                pb.ScoreRequest(
                    query=pb.Input(token_ids=pb.TokenIds(ids=query)),
                    items=[pb.Input(token_ids=pb.TokenIds(ids=it)) for it in items],
                    label_token_ids=labels or [],
                    loglikelihood=labels is None,
                    top_logprobs=2 if labels is None else 0,
                ),
                timeout=120,
            )
            for query, items, labels in requests
        ]
        queued = sum(len(items) for _, items, _ in requests)
        wait_for(lambda: worker.depth == queued, 30, f"{len(requests)} queued requests")
    return calls


class _FailedReadBack:
    """What a call that fails on the device returns: reading it raises (np.asarray)."""

    def __array__(self, *args, **kwargs):
        raise RuntimeError("injected fault: the call failed on the device")


@pytest.mark.parametrize("where", ["launch", "read-back", "pool"])
def test_a_request_that_fails_calls_fails_alone(server, stub, tiny_scorer, monkeypatch, where):
    """16 requests in one device call, one of which makes every call carrying it fail (at
    launch, when its output is read, or taking the prefix pool with it as a call that
    fails after its launch does): that request alone gets INTERNAL, the 15 others the
    scores they get without the fault, and the server stays SERVING."""
    from prefixscore.engine.loop.isolation import root

    worker = server.server.service.worker
    engine = worker.engine
    rng = np.random.default_rng(7)
    queries = [rng.integers(100, 40000, 30).tolist() for _ in range(16)]
    items = [[rng.integers(100, 40000, int(n)).tolist() for n in rng.integers(2, 9, 3)] for _ in queries]
    culprit = tuple(queries[5])
    want = [np.array(tiny_scorer.score(q, its, LABELS)) for q, its in zip(queries, items, strict=True)]
    launch, carried = engine.launch, []

    def faulty(plan):
        requests = {root(span.ref).payload.prefix for span in plan.spans}
        carried.append(len(requests))
        if culprit not in requests:
            return launch(plan)
        if where == "launch":
            raise RuntimeError("injected fault: the call failed to launch")
        launch(plan)
        if where == "pool":  # the pool it was handed (donated) and returned is gone
            for part in engine._pool:
                part.delete()
        return _FailedReadBack()

    before = scrape(server.server.metrics_port)
    monkeypatch.setattr(engine, "launch", faulty)
    calls = _queued_together(stub, worker, [(q, its, LABELS) for q, its in zip(queries, items, strict=True)])
    for k, call in enumerate(calls):
        if k == 5:
            with pytest.raises(grpc.RpcError) as err:
                call.result()
            assert err.value.code() == Code.INTERNAL and "request id" in err.value.details()
            continue
        got = np.array([list(s.probabilities) for s in call.result().scores])
        np.testing.assert_allclose(got, want[k], rtol=1e-5, atol=1e-6)
    monkeypatch.undo()
    assert carried[0] == 16  # they did ride in one call
    after = scrape(server.server.metrics_port)
    assert after["prefixscore_failed_alone_total"] - before.get("prefixscore_failed_alone_total", 0) == 1
    assert after["prefixscore_failed_calls_total"] > before.get("prefixscore_failed_calls_total", 0)
    with grpc.insecure_channel(server.target) as channel:
        health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=SERVICE))
    assert health.status == health_pb2.HealthCheckResponse.SERVING
    assert (
        len(
            stub.Score(
                pb.ScoreRequest(
                    query=pb.Input(token_ids=pb.TokenIds(ids=list(culprit))),
                    items=[pb.Input(token_ids=pb.TokenIds(ids=[101, 102]))],
                    label_token_ids=LABELS,
                )
            ).scores
        )
        == 1
    )


@pytest.mark.parametrize("where", ["launch", "read-back"])
def test_a_failing_request_sharing_its_query_fails_alone(server, stub, tiny_scorer, monkeypatch, where):
    """A culprit and three co-riders over ONE query new to the cache, several items each, in one
    device call with the query's prefill: every call carrying the culprit's work fails (an
    out-of-memory keyed on its labels). The culprit alone gets INTERNAL, each co-rider the scores
    of a plain forward pass of query + item, and the server stays SERVING."""
    worker = server.server.service.worker
    engine = worker.engine
    rng = np.random.default_rng({"launch": 11, "read-back": 12}[where])
    query = rng.integers(100, 40000, 40).tolist()
    label_sets = [[5, 9], [28, 1017], [1017, 28, 3], [44, 45]]  # the culprit's first
    items = [[rng.integers(100, 40000, int(n)).tolist() for n in rng.integers(1, 7, 4)] for _ in label_sets]
    # sequential: one forward per item, no prefix cache (the query stays new to the server)
    want = [
        np.log(tiny_scorer.score(query, its, ls, mode="sequential")) for its, ls in zip(items, label_sets, strict=True)
    ]
    launch, carried = engine.launch, []

    def faulty(plan):
        riders = {tuple(span.ref.payload.label_ids) for span in plan.spans}
        carried.append(len(riders))
        if (5, 9) not in riders:
            return launch(plan)
        if where == "launch":
            raise RuntimeError("RESOURCE_EXHAUSTED: injected out of memory")
        launch(plan)
        # a call that fails on the device may leave garbage in the pages it wrote: the query's
        # pages must be prefilled again before a co-rider reads them
        write_garbage(engine, np.asarray(plan.inputs.prefill.write_pages))
        return _FailedReadBack()

    before = scrape(server.server.metrics_port)
    monkeypatch.setattr(engine, "launch", faulty)
    calls = _queued_together(stub, worker, [(query, its, ls) for its, ls in zip(items, label_sets, strict=True)])
    with pytest.raises(grpc.RpcError) as err:
        calls[0].result()
    assert err.value.code() == Code.INTERNAL and "request id" in err.value.details()
    for k in range(1, 4):
        got = np.log([list(s.probabilities) for s in calls[k].result().scores])
        np.testing.assert_allclose(got, want[k], rtol=0, atol=1e-4)
    monkeypatch.undo()
    assert carried[0] == 4  # they did ride in one call
    after = scrape(server.server.metrics_port)
    assert after["prefixscore_failed_alone_total"] - before.get("prefixscore_failed_alone_total", 0) == 1
    with grpc.insecure_channel(server.target) as channel:
        health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=SERVICE))
    assert health.status == health_pb2.HealthCheckResponse.SERVING


@pytest.mark.parametrize("culprit", ["score", "likelihood"])
def test_likelihood_requests_fail_alone_and_ride_unharmed(server, stub, tiny_scorer, monkeypatch, culprit):
    """Likelihood and score requests over one query new to the cache, in one device call (token
    rows beside label rows), where every call carrying the culprit's work fails when read back:
    the culprit alone gets INTERNAL; each likelihood co-rider gets, token by token, the log-probs
    of a request served alone without the fault, and each score co-rider its scores."""
    from prefixscore.engine.loop.isolation import root

    worker = server.server.service.worker
    engine = worker.engine
    rng = np.random.default_rng({"score": 21, "likelihood": 22}[culprit])
    query = rng.integers(100, 40000, 40).tolist()
    kinds = [[5, 9], None, [28, 1017], None] if culprit == "score" else [None, [5, 9], None, [28, 1017]]
    items = [[rng.integers(100, 40000, int(n)).tolist() for n in rng.integers(1, 7, 4)] for _ in kinds]
    launch, carried = engine.launch, []

    def is_culprit(request) -> bool:  # by its first item (a likelihood item starts with the query's last token)
        first = request.payload.items[0]
        return items[0][0] in (first, first[1:])

    def faulty(plan):
        requests = {id(root(span.ref)): root(span.ref) for span in plan.spans}
        carried.append(len(requests))
        if not any(is_culprit(request) for request in requests.values()):
            return launch(plan)
        launch(plan)
        return _FailedReadBack()

    monkeypatch.setattr(engine, "launch", faulty)
    calls = _queued_together(stub, worker, list(zip([query] * 4, items, kinds, strict=True)))
    with pytest.raises(grpc.RpcError) as err:
        calls[0].result()
    assert err.value.code() == Code.INTERNAL and "request id" in err.value.details()
    answers = [calls[k].result() for k in range(1, 4)]
    monkeypatch.undo()
    assert carried[0] == 4  # they did ride in one call
    for k, answer in zip(range(1, 4), answers, strict=True):
        if kinds[k] is None:
            want = tiny_scorer.loglikelihood_tokens(query, items[k])
            for got, w in zip(answer.scores, want, strict=True):
                np.testing.assert_allclose(got.likelihood.token_logprobs, w.logprobs, rtol=0, atol=1e-5)
                assert [list(t.token_ids) for t in got.likelihood.top_logprobs] == w.top_ids[:, :2].tolist()
        else:
            want = np.log(tiny_scorer.score(query, items[k], kinds[k], mode="sequential"))
            got = np.log([list(s.probabilities) for s in answer.scores])
            np.testing.assert_allclose(got, want, rtol=0, atol=1e-4)


def test_a_device_whose_calls_keep_failing_goes_not_serving(tiny_scorer):
    """Every call fails, whatever it carries: after MAX_FAILED_CALLS_IN_A_ROW the loop stops,
    every request is answered (none left hanging) and the process exits 1."""
    from prefixscore.engine.loop.recovery import MAX_FAILED_CALLS_IN_A_ROW

    srv = ServerThread(server_config(tiny_scorer, metrics_port=None)).start()
    try:
        worker = srv.server.service.worker

        def dead(plan):
            raise RuntimeError("injected fault: the device is gone")

        worker.engine.launch = dead  # this server's engine dies with it
        stub = pb_grpc.ScoreServiceStub(grpc.insecure_channel(srv.target))
        with worker.paused():
            calls = [
                stub.Score.future(
                    pb.ScoreRequest(
                        query=pb.Input(token_ids=pb.TokenIds(ids=ids(20, 300 + 50 * k))),
                        items=[pb.Input(token_ids=pb.TokenIds(ids=[7, k]))],
                        label_token_ids=LABELS,
                    ),
                    timeout=60,
                )
                for k in range(MAX_FAILED_CALLS_IN_A_ROW)
            ]
            wait_for(lambda: worker.depth == len(calls), 30, "queued requests")
        codes = []
        for call in calls:
            with pytest.raises(grpc.RpcError) as err:
                call.result()
            codes.append(err.value.code())
        assert set(codes) <= {Code.INTERNAL, Code.UNAVAILABLE} and Code.UNAVAILABLE in codes
        wait_for(srv.server._stopped.is_set, 60, "the server to stop")
        assert srv.server.exit_code == 1
    finally:
        srv.stop()
        worker.engine.__dict__.pop("launch", None)  # the engine is the module's: launch as it was


def test_broken_device_loop_goes_not_serving_and_exits_non_zero(tiny_scorer):
    srv = ServerThread(server_config(tiny_scorer, metrics_port=None)).start()
    try:
        worker = srv.server.service.worker
        with grpc.insecure_channel(srv.target) as channel:
            watch = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest(service=SERVICE))
            assert next(watch).status == health_pb2.HealthCheckResponse.SERVING

            def broken(opens_only=False):
                raise RuntimeError("planner bug")

            with worker.paused():
                worker.batcher.next_call = broken  # this worker's own batcher: the loop itself breaks
                call = pb_grpc.ScoreServiceStub(channel).Score.future(
                    pb.ScoreRequest(query=pb.Input(text=QUERY), items=[pb.Input(text="x")], label_token_ids=LABELS)
                )
                wait_for(lambda: worker.depth == 1, 30, "a queued request")
            with pytest.raises(grpc.RpcError) as err:
                call.result(60)
            assert err.value.code() == Code.UNAVAILABLE  # told to go elsewhere, not left hanging
            assert next(watch).status == health_pb2.HealthCheckResponse.NOT_SERVING
        wait_for(srv.server._stopped.is_set, 60, "the server to stop")
        assert srv.server.exit_code == 1
    finally:
        srv.stop()


# ---- 5. work before rejection: sizes checked before tokenizing; the queue in tokens --------------
def test_oversized_text_is_refused_before_tokenizing(server, stub, tiny_scorer, monkeypatch):
    tokenizer = tiny_scorer.model.tokenizer
    calls = []
    size = lambda x: len(x) if isinstance(x, str) else sum(map(len, x))  # noqa: E731
    for name in ("encode", "encode_many"):
        real = getattr(tokenizer, name)
        monkeypatch.setattr(tokenizer, name, lambda x, real=real: calls.append(size(x)) or real(x))
    big = "river " * 150_000  # 900,000 characters: under max_text_chars, surely over the context
    requests = [
        pb.ScoreRequest(query=pb.Input(text=big), items=[pb.Input(text="a")], label_token_ids=LABELS),
        pb.ScoreRequest(query=pb.Input(text="q"), items=[pb.Input(text=big)] * 4, label_token_ids=LABELS),
    ]
    for request in requests:
        with pytest.raises(grpc.RpcError) as err:
            stub.Score(request, timeout=60)
        assert err.value.code() == Code.INVALID_ARGUMENT, err.value.details()
    assert max(calls, default=0) < 10  # only the short query was tokenized


def test_request_over_the_token_limit_is_invalid(stub):
    items = [pb.Input(token_ids=pb.TokenIds(ids=ids(100, 500))) for _ in range(25)]  # 2,500 tokens
    with pytest.raises(grpc.RpcError) as err:
        stub.Score(
            pb.ScoreRequest(query=pb.Input(token_ids=pb.TokenIds(ids=ids(5))), items=items, label_token_ids=LABELS)
        )
    assert err.value.code() == Code.INVALID_ARGUMENT and err.value.details().startswith("items")


def test_queue_capacity_counts_tokens(server, stub, client):
    worker = server.server.service.worker

    def request(n_items: int) -> pb.ScoreRequest:
        items = [pb.Input(token_ids=pb.TokenIds(ids=ids(100, 600 + k))) for k in range(n_items)]
        return pb.ScoreRequest(query=pb.Input(token_ids=pb.TokenIds(ids=ids(5))), items=items, label_token_ids=LABELS)

    with worker.paused():
        held = stub.Score.future(request(18))  # 1,800 of 3,000 tokens, 18 of 256 items
        wait_for(lambda: worker.depth == 18, 30, "18 queued items")
        with pytest.raises(grpc.RpcError) as refused:
            stub.Score(request(15))  # 15 items fit the item queue; 1,500 tokens do not
        assert refused.value.code() == Code.RESOURCE_EXHAUSTED and "tokens" in refused.value.details()
        assert retry_after_ms(refused.value) > 0
    assert len(held.result(120).scores) == 18


def test_full_queue_refuses_one_stream_batch_and_the_stream_goes_on(server, stub, client):
    """Issue finding 7: RESOURCE_EXHAUSTED on one ItemBatch used to end the whole stream, batches
    already accepted included. Now that batch alone is refused (code, message, retry hint) and the
    batches before and after it are scored."""
    worker = server.server.service.worker
    query = ids(5, 8000)

    def tokens(n_items: int, start: int) -> list[list[int]]:
        return [ids(100, start + 3 * k) for k in range(n_items)]

    with worker.paused():
        held = stub.Score.future(  # 1,800 of the 3,000 queued tokens
            pb.ScoreRequest(
                query=pb.Input(token_ids=pb.TokenIds(ids=ids(5))),
                items=[pb.Input(token_ids=pb.TokenIds(ids=t)) for t in tokens(18, 600)],
                label_token_ids=LABELS,
            )
        )
        wait_for(lambda: worker.depth == 18, 30, "18 queued items")
        session = client.stream(query, LABELS)
        before = session.submit(tokens(1, 900))  # fits: 1,900 tokens queued
        refused = session.submit(tokens(15, 1000))  # 1,500 more do not
        with pytest.raises(BatchRefused) as err:
            session.result(refused)  # answered at once, while the device is still held
        assert err.value.batch_id == refused and err.value.code == Code.RESOURCE_EXHAUSTED
        assert "tokens" in err.value.details and err.value.retry_after_ms > 0
        after = session.submit(tokens(1, 1100))  # the stream is still open and takes batches
        wait_for(lambda: worker.depth == 20, 30, "the batches around the refused one queued")
    assert len(session.result(before)) == 1 and len(session.result(after)) == 1
    assert session.close().items == 2  # the refused batch was not scored
    assert len(held.result(120).scores) == 18
    with client.stream(query, LABELS) as again:  # the refused batch can be sent again
        assert len(again.send(tokens(15, 1000))) == 15


# ---- 6. exposure: reflection, the metrics endpoint -----------------------------------------------
def test_reflection_is_off_by_default(server):
    with grpc.insecure_channel(server.target) as channel:
        with pytest.raises(grpc.RpcError) as err:
            ProtoReflectionDescriptorDatabase(channel).get_services()
    assert err.value.code() == Code.UNIMPLEMENTED


def test_metrics_endpoint_serves_only_metrics(server):
    port = server.server.metrics_port
    assert "prefixscore_requests_total" in urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics").read().decode()
    for path in ("/", "/debug", "/metrics/../x"):
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(f"http://127.0.0.1:{port}{path}")
        assert err.value.code == 404


def test_the_endpoint_pickers_gauges_count_queued_and_running_requests(server, client, monkeypatch):
    """What a gateway's endpoint picker reads to choose a replica: requests queued while the
    device is held, running while their call is on the device, the pool's pages in use by
    their queries, the page size and count; all back to zero once answered."""
    worker, port = server.server.service.worker, server.server.metrics_port
    cache = worker.engine.prefix_cache
    launch, on_device, release = worker.engine.launch, threading.Event(), threading.Event()

    def held_launch(plan):
        probs = launch(plan)
        on_device.set()
        release.wait(60)
        return probs

    monkeypatch.setattr(worker.engine, "launch", held_launch)
    queries = [f"{QUERY} ({k}) {'gauge ' * 40}" for k in range(3)]
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        with worker.paused():
            answers = [pool.submit(client.score, q, ["an item"], LABELS) for q in queries]
            wait_for(lambda: scrape(port)["prefixscore_queued_requests"] == 3, 30, "three queued requests")
            queued = scrape(port)
            assert queued["prefixscore_running_requests"] == 0
            # the three queries' pages are pinned, and so are those of the queries they take leading
            # tokens from; idle cached queries (earlier tests') count as free
            held: set[int] = set()
            for e in cache._entries.values():
                lender = e if e.pins > 0 else None
                while lender is not None:
                    held.update(lender.pages)
                    lender = lender.lender
            assert held
            assert queued["prefixscore_prefix_pool_usage_ratio"] == pytest.approx(len(held) / cache.total_pages)
        assert on_device.wait(60)
        wait_for(lambda: scrape(port)["prefixscore_queued_requests"] == 0, 30, "the requests planned")
        assert scrape(port)["prefixscore_running_requests"] == 3  # one call carries all three
        release.set()
        for answer in answers:
            assert len(answer.result(60).scores) == 1
    idle = scrape(port)
    assert (idle["prefixscore_queued_requests"], idle["prefixscore_running_requests"]) == (0, 0)
    assert idle["prefixscore_prefix_pool_usage_ratio"] == 0  # cached, unpinned: free to evict
    info = f"prefixscore_prefix_pool_info{{block_size={cache.page_tokens},num_gpu_blocks={cache.total_pages}}}"
    assert idle[info] == 1


def test_limits_are_in_model_info(client):
    limits = client.model_info().limits
    assert (limits.max_queue_tokens, limits.max_request_tokens, limits.max_streams) == (3000, 2000, 3)
    assert (limits.max_pending_batches, limits.stream_idle_timeout_ms) == (2, 1500)
    assert limits.max_concurrent_rpcs > 0 and limits.keepalive_time_ms > 0 and limits.max_connection_age_ms > 0
    assert limits.max_message_bytes == 64 << 20 and limits.pool_bytes > 0


# ---- 7. the smaller items ------------------------------------------------------------------------
def test_duplicate_batch_id_in_flight_is_invalid(server, stub):
    with server.server.service.worker.paused():
        with pytest.raises(grpc.RpcError) as err:
            list(stub.ScoreStream(iter([_open(), _batch(7, "a"), _batch(7, "b")]), timeout=60))
    assert err.value.code() == Code.INVALID_ARGUMENT and err.value.details().startswith("batch_id")


def test_empty_stream_is_invalid(stub):
    with pytest.raises(grpc.RpcError) as err:
        list(stub.ScoreStream(iter([]), timeout=60))
    assert err.value.code() == Code.INVALID_ARGUMENT and err.value.details().startswith("open")


def test_too_many_items_is_invalid_not_retryable(stub):
    items = [pb.Input(text="x")] * (LIMITS["max_queue_items"] + 1)
    with pytest.raises(grpc.RpcError) as err:
        stub.Score(pb.ScoreRequest(query=pb.Input(text=QUERY), items=items, label_token_ids=LABELS))
    assert err.value.code() == Code.INVALID_ARGUMENT and retry_after_ms(err.value) is None


def _one_stream_answered(client) -> bool:
    """A stream opened and one batch answered; False when refused for the stream limit."""
    try:
        with client.stream(QUERY, LABELS) as session:
            return len(session.send(["after"])) == 1
    except grpc.RpcError as err:
        if err.code() != Code.RESOURCE_EXHAUSTED or "streams are open" not in err.details():
            raise
        time.sleep(retry_after_ms(err) / 1000)
        return False


def test_client_going_away_is_not_an_internal_error(server, stub, client):
    """Streams cancelled at every stage: none counts as INTERNAL, nothing stays pinned."""
    before = _internal_errors(server)
    worker = server.server.service.worker
    for k in range(6):
        release = threading.Event()
        messages = [_open(), *[_batch(j, f"gone {j}") for j in range(k)]]
        call = stub.ScoreStream(_held(messages, release), timeout=60)
        if k % 2:
            next(call)  # opened: cancel after the open was answered
        call.cancel()
        release.set()
    wait_for(lambda: server.server.grpc.streams == 0, 30, "the cancelled streams to end")
    # still serving streams. A cancelled call's handler may start after the count went to 0 (and
    # end once it reads the cancellation): a client that honours the retry hint gets in; one that
    # leaked a slot would be refused until the timeout
    wait_for(lambda: _one_stream_answered(client), 30, "a stream opened after the cancelled ones")
    assert _internal_errors(server) == before
    wait_for(lambda: all(e.pins == 0 for e in worker.cache._entries.values()), 30, "every prefix unpinned")


def test_model_info_while_draining_is_unavailable(tiny_scorer):
    srv = ServerThread(server_config(tiny_scorer, metrics_port=None)).start()
    try:
        worker = srv.server.service.worker
        with grpc.insecure_channel(srv.target) as channel:
            stub = pb_grpc.ScoreServiceStub(channel)
            health = health_pb2_grpc.HealthStub(channel)
            assert stub.GetModelInfo(pb.GetModelInfoRequest()).model == "tiny-qwen3"
            with worker.paused():  # an in-flight request keeps the drain going
                inflight = stub.Score.future(
                    pb.ScoreRequest(query=pb.Input(text=QUERY), items=[pb.Input(text="x")], label_token_ids=LABELS)
                )
                wait_for(lambda: worker.depth == 1, 30, "a queued request")
                drain = threading.Thread(target=srv.drain, args=(60,))
                drain.start()
                not_serving = health_pb2.HealthCheckResponse.NOT_SERVING
                wait_for(lambda: health.Check(health_pb2.HealthCheckRequest()).status == not_serving, 30, "draining")
                with pytest.raises(grpc.RpcError) as err:
                    stub.GetModelInfo(pb.GetModelInfoRequest())
                assert err.value.code() == Code.UNAVAILABLE
            assert len(inflight.result(60).scores) == 1
            drain.join(60)
    finally:
        srv.stop()


# ---- fuzz: protobuf requests, well-formed or not, against the real server ------------------------
_ids = st.lists(st.integers(-(2**31), 2**31 - 1) | st.integers(0, 60_000), max_size=12)
_input = st.one_of(
    st.builds(lambda t: pb.Input(text=t), st.text(max_size=40)),
    st.builds(lambda v: pb.Input(token_ids=pb.TokenIds(ids=v)), _ids),
    st.just(pb.Input()),
)
_request = st.builds(
    lambda q, items, label_ids, labels, softmax, first: pb.ScoreRequest(
        query=q, items=items, label_token_ids=label_ids, labels=labels, apply_softmax=softmax, item_first=first
    ),
    _input,
    st.lists(_input, max_size=4),
    _ids,
    st.lists(st.sampled_from(["yes", "no", "", "not one token", "\x00"]), max_size=2),
    st.booleans(),
    st.booleans(),
)
_bytes = st.one_of(_request.map(lambda r: r.SerializeToString()), st.binary(max_size=64))


@settings(max_examples=60, deadline=None, derandomize=True)
@given(raw=_bytes)
def test_fuzzed_requests_get_precise_statuses(server, raw):
    with grpc.insecure_channel(server.target) as channel:
        for method in ("Score", "GetModelInfo"):
            call = channel.unary_unary(f"/{SERVICE}/{method}")
            try:
                call(raw, timeout=60)
            except grpc.RpcError as err:
                assert err.code() not in (Code.INTERNAL, Code.UNKNOWN, Code.DEADLINE_EXCEEDED), err.details()
        stream = channel.stream_stream(f"/{SERVICE}/ScoreStream")
        try:
            list(stream(iter([raw, raw]), timeout=60))
        except grpc.RpcError as err:
            assert err.code() not in (Code.INTERNAL, Code.UNKNOWN, Code.DEADLINE_EXCEEDED), err.details()
        status = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest()).status
        assert status == health_pb2.HealthCheckResponse.SERVING
