"""The gRPC ScoreService end to end, on loopback, with tiny-qwen3 and small buckets.

One server is shared by the module (compiles are the slow part on CPU); tests
that need queued work hold the device worker with `worker.paused()`, so what is
queued, cancelled or expired is deterministic.
"""

from __future__ import annotations

import asyncio
import json
import random
import threading
import time

import grpc
import jax
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase
from helpers.service import LABELS, scrape, server_config, wait_for

from prefixscore.client import AsyncScoreClient, BatchRefused, ScoreClient, retry_after_ms
from prefixscore.engine.runtime.scoring_engine import ScoringEngine
from prefixscore.service.core import ScoringService, ServerConfig
from prefixscore.service.process import ServerThread
from prefixscore.service.server import SERVICE
from prefixscore.telemetry.metrics import ServiceMetrics
from prefixscore.v1 import score_service_pb2 as pb
from prefixscore.v1 import score_service_pb2_grpc as pb_grpc

MAX_QUEUE = 256
QUERY = "Which of these facts is about France?"
ITEMS = ["Paris is the capital.", "Bananas are yellow.", "The Loire is a river.", "Two plus two."]
Code = grpc.StatusCode


def config(scorer, **overrides) -> ServerConfig:
    return server_config(scorer, **{"max_queue_items": MAX_QUEUE, "reflection": True, **overrides})


@pytest.fixture(scope="module")
def server(tiny_scorer):
    with ServerThread(config(tiny_scorer)) as srv:
        yield srv


def ids(text_tokens: int, start: int = 100) -> list[int]:
    return list(range(start, start + text_tokens))


# ---- scores equal the in-process Scorer ----------------------------------------------------------
@pytest.mark.parametrize(
    "case",
    [
        dict(query=QUERY, items=ITEMS, label_token_ids=LABELS),
        dict(query=ids(20), items=[ids(3, 500), ids(7, 900), ids(1, 40)], label_token_ids=LABELS),
        dict(query=QUERY, items=ITEMS, label_token_ids=LABELS, apply_softmax=True),
        dict(query=QUERY, items=ITEMS[:2], label_token_ids=LABELS, item_first=True),
    ],
    ids=["text", "token-ids", "softmax", "item-first"],
)
def test_score_equals_in_process_scorer(client, tiny_scorer, case):
    expected = tiny_scorer.score(**case)
    result = client.score(**case)
    np.testing.assert_allclose(result.scores, expected, rtol=1e-6, atol=0)
    req = tiny_scorer.tokenize(
        case["query"],
        case["items"],
        case["label_token_ids"],
        case.get("apply_softmax", False),
        case.get("item_first", False),
    )
    assert result.usage.prompt_tokens == req.prompt_tokens
    assert result.usage.items == len(case["items"])
    assert result.label_token_ids == LABELS


def test_usage_counts_cached_prefix_tokens(client, tiny_scorer):
    query = "A query nobody sent before: is this cached?"
    prefix = tiny_scorer.tokenize(query, ["x"], LABELS).prefix
    first = client.score(query, ["one", "two"], LABELS)
    again = client.score(query, ["three"], LABELS)
    assert (first.usage.cached_tokens, again.usage.cached_tokens) == (0, len(prefix))


def test_label_strings_resolve_to_single_tokens(client, tiny_scorer):
    tok = tiny_scorer.model.tokenizer
    label_ids = [tok.token_id("yes"), tok.token_id("no")]
    result = client.score(QUERY, ITEMS[:2], labels=["yes", "no"])
    assert result.label_token_ids == label_ids
    np.testing.assert_allclose(result.scores, tiny_scorer.score(QUERY, ITEMS[:2], label_ids), rtol=1e-6)


def test_empty_items_return_no_scores(client):
    result = client.score(QUERY, [], LABELS)
    assert result.scores == [] and result.usage.items == 0


def test_stream_equals_scorer_and_pins_the_prefix(server, client, tiny_scorer):
    query = "Stream query: rank these against France."
    prefix = tiny_scorer.tokenize(query, ["x"], LABELS).prefix
    cache = server.server.service.worker.cache
    with client.stream(query, LABELS) as session:
        assert (session.prefix_tokens, session.cached_tokens) == (len(prefix), 0)
        assert cache.pins(prefix) >= 1  # the KV stays on the device while the stream is open
        first = session.send(ITEMS[:2])
        pending = [session.submit(ITEMS[2:3]), session.submit(ITEMS[3:])]
        rest = [session.result(i) for i in reversed(pending)]  # matched by batch id, any order
    usage = session.usage
    np.testing.assert_allclose(first + rest[1] + rest[0], tiny_scorer.score(query, ITEMS, LABELS), rtol=1e-5)
    item_tokens = sum(len(t) for t in tiny_scorer.requests.item_ids(ITEMS, "text"))
    assert (usage.prompt_tokens, usage.cached_tokens, usage.items) == (len(prefix) + item_tokens, 0, 4)
    wait_for(lambda: cache.pins(prefix) == 0, 10, "the stream's prefix to be unpinned")
    with client.stream(query, LABELS) as again:  # the KV is still cached
        assert again.cached_tokens == len(prefix)
        np.testing.assert_allclose(again.send(["Paris"]), tiny_scorer.score(query, ["Paris"], LABELS), rtol=1e-5)


def test_stream_with_token_ids_and_item_first(client, tiny_scorer):
    with client.stream(ids(12), LABELS) as session:
        got = session.send([ids(2, 700), ids(5, 800)])
    np.testing.assert_allclose(got, tiny_scorer.score(ids(12), [ids(2, 700), ids(5, 800)], LABELS), rtol=1e-5)
    with client.stream(QUERY, LABELS, item_first=True) as session:
        assert session.prefix_tokens == 0
        got = session.send(ITEMS[:2])
    expected = tiny_scorer.score(QUERY, ITEMS[:2], LABELS, item_first=True)
    np.testing.assert_allclose(got, expected, rtol=1e-5)


# ---- items' own likelihood -----------------------------------------------------------------------
def assert_likelihoods_equal(got, want, top: int) -> None:
    """The wire's likelihoods (client records) equal the in-process ItemLikelihoods (float32 on the
    wire and in process: equal to float32 rounding of the same engine's numbers)."""
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(g.token_logprobs, w.logprobs, rtol=1e-6, atol=0)
        assert abs(g.logprob - w.total) <= 1e-5 * max(1.0, abs(w.total))
        assert g.greedy == w.greedy.tolist() and g.is_greedy == w.is_greedy
        if not top:
            assert g.top_logprobs == []
            continue
        assert [[t for t, _ in row] for row in g.top_logprobs] == w.top_ids[:, :top].tolist()
        np.testing.assert_allclose([[p for _, p in row] for row in g.top_logprobs], w.top_logprobs[:, :top], rtol=1e-6)


@pytest.mark.parametrize(("query", "items", "top"), [(QUERY, ITEMS, 3), (ids(20), [ids(3, 500), ids(1, 40)], 0)])
def test_loglikelihood_equals_in_process_scorer_sync_async_and_streamed(server, client, tiny_scorer, query, items, top):
    """Score with `loglikelihood` (sync and asyncio clients) and a likelihood stream answer each
    item's own likelihood as the in-process Scorer computes it (itself checked against
    transformers: tests/test_likelihood.py), with the top log-probs asked for and the usage."""
    want = tiny_scorer.loglikelihood_tokens(query, items)
    result = client.loglikelihood(query, items, top_logprobs=top)
    assert result.scores == [] and result.label_token_ids == []
    assert_likelihoods_equal(result.likelihoods, want, top)
    context = len(tiny_scorer.requests.start_ids) * isinstance(query, str) + len(tiny_scorer.requests.query_ids(query))
    assert result.usage.prompt_tokens == context + sum(len(w.tokens) for w in want)
    assert result.usage.items == len(items)

    async def via_asyncio():
        async with AsyncScoreClient(server.target) as aclient:
            return await aclient.loglikelihood(query, items, top_logprobs=top)

    assert_likelihoods_equal(asyncio.run(via_asyncio()).likelihoods, want, top)
    with client.stream(query, loglikelihood=True, top_logprobs=top) as session:
        assert session.prefix_tokens == context - 1  # the query's last token starts each item
        got = session.send(items[:1]) + session.send(items[1:])
    assert_likelihoods_equal(got, want, top)


def test_loglikelihood_refuses_label_options_by_name(client):
    for field, options in {
        "labels": dict(labels=["yes"]),
        "apply_softmax": dict(apply_softmax=True),
        "top_logprobs": dict(top_logprobs=21),
    }.items():
        request = pb.ScoreRequest(query=pb.Input(text=QUERY), items=[pb.Input(text="x")], loglikelihood=True, **options)
        with pytest.raises(grpc.RpcError) as err:
            pb_grpc.ScoreServiceStub(client._channel).Score(request)
        assert err.value.code() == Code.INVALID_ARGUMENT and err.value.details().startswith(f"{field}:"), field


def test_score_cli_prints_likelihoods(server, tiny_scorer, capsys):
    from prefixscore import cli

    args = ["score", "--target", server.target, "-q", QUERY, "-i", ITEMS[0], "-i", ITEMS[1], "--loglikelihood"]
    assert cli.main([*args, "--top-logprobs", "2", "--json"]) == 0
    printed = json.loads(capsys.readouterr().out)
    want = tiny_scorer.loglikelihood_tokens(QUERY, ITEMS[:2])
    assert [round(x["logprob"], 4) for x in printed["likelihoods"]] == [round(w.total, 4) for w in want]
    assert [len(row) for row in printed["likelihoods"][0]["top_logprobs"]] == [2] * len(want[0].tokens)
    assert cli.main(args) == 0
    table = capsys.readouterr().out
    assert "logprob" in table and f"{want[1].total:.6g}" in table


# ---- many clients at once ------------------------------------------------------------------------
def test_32_concurrent_clients_are_batched_together(server, tiny_scorer):
    rng = random.Random(7)
    queries = [f"Shared query {k}: which item matches?" for k in range(6)]
    words = ["red", "apple", "river", "Paris", "car", "blue sky", "green", "seven"]
    unary = [(queries[k % 6], [rng.choice(words) for _ in range(rng.randint(1, 4))]) for k in range(24)]
    streams = [
        (queries[k % 6], [[rng.choice(words) for _ in range(rng.randint(1, 3))] for _ in range(3)]) for k in range(8)
    ]
    total = sum(len(items) for _, items in unary) + sum(len(b) for _, batches in streams for b in batches)
    largest_request = max([len(items) for _, items in unary] + [len(b) for _, bs in streams for b in bs])
    before = scrape(server.server.metrics_port)

    async def run_stream(client: AsyncScoreClient, query: str, batches: list[list[str]]):
        async with await client.stream(query, LABELS) as session:
            ids_ = [await session.submit(b) for b in batches]
            return [await session.result(i) for i in ids_]

    async def main():
        async with AsyncScoreClient(server.target) as client:
            worker = server.server.service.worker
            with worker.paused():  # hold the device until every client's items are queued
                tasks = [asyncio.ensure_future(client.score(q, items, LABELS)) for q, items in unary]
                tasks += [asyncio.ensure_future(run_stream(client, q, b)) for q, b in streams]
                while worker.depth < total:
                    await asyncio.sleep(0.02)
            return await asyncio.gather(*tasks)

    results = asyncio.run(asyncio.wait_for(main(), 180))
    for (query, items), result in zip(unary, results[:24], strict=True):
        np.testing.assert_allclose(result.scores, tiny_scorer.score(query, items, LABELS), rtol=1e-5)
    for (query, batches), got in zip(streams, results[24:], strict=True):
        for batch, scores in zip(batches, got, strict=True):
            np.testing.assert_allclose(scores, tiny_scorer.score(query, batch, LABELS), rtol=1e-5)
    after = scrape(server.server.metrics_port)
    delta = lambda name: after.get(name, 0.0) - before.get(name, 0.0)  # noqa: E731
    assert delta("prefixscore_items_scored_total") == total
    batches = delta("prefixscore_device_batch_size_count")
    small = delta(f"prefixscore_device_batch_size_bucket{{le={float(largest_request)}}}")
    assert batches - small >= 1, "no device batch was larger than the largest single request"
    assert batches < total / largest_request  # far fewer device calls than requests would need alone


def test_one_call_is_answered_in_one_hand_off_to_the_event_loop(server, monkeypatch):
    """The requests finished by one device call reach the event loop together (one wake-up),
    not one thread hop per request."""
    worker = server.server.service.worker
    handed: list[list[str]] = []
    deliver = worker._deliver

    def recording(units):
        handed.append([u.ticket.method for u in units])
        deliver(units)

    monkeypatch.setattr(worker, "_deliver", recording)

    async def main():
        async with AsyncScoreClient(server.target) as client:
            with worker.paused():  # all eight queued before the call is planned
                tasks = [asyncio.ensure_future(client.score(f"hand-off {k}", ["a", "b c"], LABELS)) for k in range(8)]
                while worker.depth < 16:
                    await asyncio.sleep(0.02)
            return await asyncio.gather(*tasks)

    results = asyncio.run(asyncio.wait_for(main(), 120))
    assert all(len(r.scores) == 2 for r in results)
    assert handed == [["Score"] * 8]


# ---- admission control, cancellation, deadlines --------------------------------------------------
def test_full_queue_is_refused_with_a_retry_hint(server, client, stub):
    worker = server.server.service.worker
    with worker.paused():
        held = stub.Score.future(
            pb.ScoreRequest(
                query=pb.Input(text=QUERY),
                items=[pb.Input(text=f"item {k}") for k in range(200)],
                label_token_ids=LABELS,
            )
        )
        wait_for(lambda: worker.depth == 200, 30, "200 queued items")
        with pytest.raises(grpc.RpcError) as refused:
            client.score(QUERY, [f"more {k}" for k in range(100)], LABELS)
        assert refused.value.code() == Code.RESOURCE_EXHAUSTED
        assert "retry after" in refused.value.details()
        assert retry_after_ms(refused.value) > 0
        with client.stream(QUERY, LABELS) as session:  # a stream's batch: refused alone, the stream goes on
            with pytest.raises(BatchRefused) as refused_batch:
                session.send([f"s {k}" for k in range(100)])
            assert refused_batch.value.code == Code.RESOURCE_EXHAUSTED and refused_batch.value.retry_after_ms > 0
    assert len(held.result(timeout=120).scores) == 200


def test_cancelled_request_leaves_the_queue_unscored(server, stub):
    worker = server.server.service.worker
    port = server.server.metrics_port
    before = scrape(port)
    with worker.paused():
        call = stub.Score.future(
            pb.ScoreRequest(query=pb.Input(text=QUERY), items=[pb.Input(text="cancel me")] * 5, label_token_ids=LABELS)
        )
        wait_for(lambda: worker.depth == 5, 30, "5 queued items")
        call.cancel()
        wait_for(lambda: worker.depth == 0, 30, "the cancelled items to leave the queue")
    key = "prefixscore_requests_total{code=CANCELLED,method=Score}"
    wait_for(lambda: scrape(port).get(key, 0) == before.get(key, 0) + 1, 10, "a CANCELLED request")
    assert scrape(port)["prefixscore_items_scored_total"] == before["prefixscore_items_scored_total"]


def test_cancelled_stream_drops_its_batches_and_unpins(server, client, tiny_scorer):
    worker = server.server.service.worker
    query = "A stream that the client abandons."
    prefix = tiny_scorer.tokenize(query, ["x"], LABELS).prefix
    session = client.stream(query, LABELS)  # its prefill is a device call: before the pause
    with worker.paused():
        session.submit(["a", "b", "c"])
        wait_for(lambda: worker.depth == 3, 30, "3 queued stream items")
        session.cancel()
        wait_for(lambda: worker.depth == 0, 30, "the stream's items to leave the queue")
    wait_for(lambda: worker.cache.pins(prefix) == 0, 10, "the stream's prefix to be unpinned")


def test_deadline_exceeded_removes_queued_work(server, client):
    worker = server.server.service.worker
    before = scrape(server.server.metrics_port)["prefixscore_items_scored_total"]
    with worker.paused():
        with pytest.raises(grpc.RpcError) as late:
            client.score(QUERY, ["too late"] * 3, LABELS, timeout=0.5)
        assert late.value.code() == Code.DEADLINE_EXCEEDED
        wait_for(lambda: worker.depth == 0, 30, "expired items to leave the queue")
    client.score(QUERY, ["in time"], LABELS, timeout=60)
    assert scrape(server.server.metrics_port)["prefixscore_items_scored_total"] == before + 1


# ---- bad input -----------------------------------------------------------------------------------
DEFAULT_QUERY = pb.Input(text=QUERY)
DEFAULT_ITEMS = (pb.Input(text="an item"),)


def _req(query=DEFAULT_QUERY, items=DEFAULT_ITEMS, **kw) -> pb.ScoreRequest:
    kw.setdefault("label_token_ids", LABELS)
    return pb.ScoreRequest(query=query, items=list(items), **kw)


def _ids(values) -> pb.Input:
    return pb.Input(token_ids=pb.TokenIds(ids=values))


BAD_REQUESTS = {
    "missing query": (pb.ScoreRequest(items=[pb.Input(text="a")], label_token_ids=LABELS), "query"),
    "empty query": (_req(query=pb.Input(text="")), "query"),
    "empty query, no items": (_req(query=pb.Input(text=""), items=()), "query"),
    "empty item": (_req(items=[pb.Input(text="ok"), pb.Input(text="")]), "items[1]"),
    "input with no kind": (_req(items=[pb.Input()]), "items[0]"),
    "no labels": (_req(label_token_ids=[]), "label_token_ids"),
    "label id out of range": (_req(label_token_ids=[49152]), "label_token_ids"),
    "negative label id": (_req(label_token_ids=[-1]), "label_token_ids"),
    "too many labels": (_req(label_token_ids=[1] * 257), "label_token_ids"),
    "ids and label strings": (_req(labels=["yes"]), "labels"),
    "multi-token label string": (_req(label_token_ids=[], labels=["yes", "not one token"]), "labels[1]"),
    "mixed text and ids items": (_req(items=[pb.Input(text="a"), _ids([5])]), "items"),
    "text query, id items": (_req(items=[_ids([5])]), "items"),
    "item token out of range": (_req(query=_ids([5, 6]), items=[_ids([1, 99999])]), "items[0]"),
    "oversized text": (_req(query=pb.Input(text="x" * 1_000_001)), "query"),
    "query over the context": (_req(query=_ids([7] * 9000), items=[_ids([5])]), "query"),
    "query over the largest bucket": (_req(query=_ids([7] * 600), items=[_ids([5])]), "query"),
    "query + item over the context": (_req(query=_ids([7]), items=[_ids([5] * 600)]), "items[0]"),
    "item_first sequence over the largest bucket": (
        _req(query=_ids([7] * 500), items=[_ids([5] * 20)], item_first=True),
        "items[0]",
    ),
}


@pytest.mark.parametrize("name", list(BAD_REQUESTS))
def test_bad_input_is_invalid_argument_naming_the_field(stub, name):
    request, field = BAD_REQUESTS[name]
    with pytest.raises(grpc.RpcError) as err:
        stub.Score(request, timeout=60)
    assert err.value.code() == Code.INVALID_ARGUMENT, err.value.details()
    assert err.value.details().startswith(field), err.value.details()


def test_too_many_items_and_undecodable_bytes(server, stub, client):
    with pytest.raises(grpc.RpcError) as err:
        stub.Score(_req(items=[pb.Input(text="x")] * (MAX_QUEUE + 1)))
    assert err.value.code() == Code.INVALID_ARGUMENT and err.value.details().startswith("items")
    with grpc.insecure_channel(server.target) as channel:
        raw = channel.unary_unary(f"/{SERVICE}/Score")
        with pytest.raises(grpc.RpcError) as err:
            raw(b"\xff\xff\xff\xff")  # wrong types on the wire
    assert err.value.code() == Code.INVALID_ARGUMENT and err.value.details().startswith("request")
    assert client.score(QUERY, ["still serving"], LABELS).usage.items == 1  # the worker survived


def _open(**kw) -> pb.ScoreStreamRequest:
    kw.setdefault("label_token_ids", LABELS)
    return pb.ScoreStreamRequest(open=pb.StreamOpen(query=pb.Input(text=QUERY), **kw))


def _batch(*items: pb.Input) -> pb.ScoreStreamRequest:
    return pb.ScoreStreamRequest(batch=pb.ItemBatch(batch_id=1, items=list(items)))


BAD_STREAMS = {
    "items before open": ([_batch(pb.Input(text="a"))], Code.FAILED_PRECONDITION, "batch"),
    "second open": ([_open(), _open()], Code.FAILED_PRECONDITION, "open"),
    "bad open": ([_open(label_token_ids=[10**6])], Code.INVALID_ARGUMENT, "label_token_ids"),
    "bad item": ([_open(), _batch(_ids([1]))], Code.INVALID_ARGUMENT, "items"),
    "too many items": ([_open(), _batch(*[pb.Input(text="x")] * (MAX_QUEUE + 1))], Code.INVALID_ARGUMENT, "items"),
    "empty message": ([_open(), pb.ScoreStreamRequest()], Code.INVALID_ARGUMENT, "request"),
}


@pytest.mark.parametrize("name", list(BAD_STREAMS))
def test_bad_stream_input(stub, name):
    messages, code, field = BAD_STREAMS[name]
    with pytest.raises(grpc.RpcError) as err:
        list(stub.ScoreStream(iter(messages), timeout=60))
    assert err.value.code() == code, err.value.details()
    assert err.value.details().startswith(field), err.value.details()


# ---- model info, health, reflection --------------------------------------------------------------
def test_model_info(client, tiny_scorer):
    info = client.model_info()
    assert (info.model, info.family, info.vocab_size, info.dtype) == ("tiny-qwen3", "qwen3", 49152, "float32")
    assert info.context_length == 8192 and info.has_tokenizer and list(info.devices) == ["cpu:0"]
    assert info.limits.max_items == MAX_QUEUE and info.limits.max_queue_items == MAX_QUEUE
    assert info.limits.max_sequence_tokens == tiny_scorer.engine.buckets.context
    assert info.limits.max_item_tokens == tiny_scorer.engine.buckets.context
    # full precision: nothing 8-bit, every weight's bytes on the one device
    assert (info.quantization, info.activation_quantization, dict(info.quantized_projections)) == ("none", "", {})
    assert info.weight_bytes_per_device == sum(leaf.nbytes for leaf in jax.tree.leaves(tiny_scorer.model.params))


def test_health_serving_and_reflection_lists_services(server):
    with grpc.insecure_channel(server.target) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        for name in ("", SERVICE):
            status = health.Check(health_pb2.HealthCheckRequest(service=name)).status
            assert status == health_pb2.HealthCheckResponse.SERVING
        db = ProtoReflectionDescriptorDatabase(channel)
        services = set(db.get_services())
        assert {SERVICE, "grpc.health.v1.Health", "grpc.reflection.v1alpha.ServerReflection"} <= services
        file = db.FindFileContainingSymbol(SERVICE)
        assert file.name == "prefixscore/v1/score_service.proto"


def test_health_transitions_and_graceful_drain(server, tiny_scorer, monkeypatch):
    """NOT_SERVING while loading, SERVING when ready, NOT_SERVING on drain; in-flight work finishes."""
    gate = threading.Event()
    startup = ScoringService._startup
    monkeypatch.setattr(ScoringService, "_startup", lambda self: (gate.wait(60), startup(self))[1])
    srv = ServerThread(config(tiny_scorer, metrics_port=None)).start(wait_ready=False)
    try:
        with grpc.insecure_channel(srv.target) as channel:
            health = health_pb2_grpc.HealthStub(channel)
            stub = pb_grpc.ScoreServiceStub(channel)
            check = lambda: health.Check(health_pb2.HealthCheckRequest(service=SERVICE)).status  # noqa: E731
            watch = health.Watch(health_pb2.HealthCheckRequest(service=SERVICE))
            assert next(watch).status == health_pb2.HealthCheckResponse.NOT_SERVING
            assert check() == health_pb2.HealthCheckResponse.NOT_SERVING
            with pytest.raises(grpc.RpcError) as loading:
                stub.Score(_req())
            assert loading.value.code() == Code.UNAVAILABLE
            gate.set()
            assert next(watch).status == health_pb2.HealthCheckResponse.SERVING
            srv.wait_ready(60)

            worker = srv.server.service.worker
            with worker.paused():
                inflight = stub.Score.future(_req(items=[pb.Input(text=t) for t in ITEMS]))
                wait_for(lambda: worker.depth == len(ITEMS), 30, "queued in-flight items")
                drain = threading.Thread(target=srv.drain, args=(60,))
                drain.start()
                wait_for(lambda: check() == health_pb2.HealthCheckResponse.NOT_SERVING, 10, "NOT_SERVING")
                with pytest.raises(grpc.RpcError) as refused:
                    stub.Score(_req())
                assert refused.value.code() == Code.UNAVAILABLE
            result = inflight.result(timeout=120)  # the in-flight request finishes during the drain
            np.testing.assert_allclose(
                [list(s.probabilities) for s in result.scores], tiny_scorer.score(QUERY, ITEMS, LABELS), rtol=1e-5
            )
            watch.cancel()
            drain.join(60)
            assert srv.server.stopped
    finally:
        gate.set()
        srv.stop()


# ---- metrics -------------------------------------------------------------------------------------
def test_metrics_after_traffic(server, client, tiny_scorer):
    port = server.server.metrics_port
    query = "Metrics query, sent three times."
    prefix = tiny_scorer.tokenize(query, ["x"], LABELS).prefix
    items = ["one", "two words", "three more words"]
    item_tokens = sum(len(t) for t in tiny_scorer.requests.item_ids(items, "text"))
    before = scrape(port)
    client.score(query, items, LABELS)  # prefix cache miss: prefill
    client.score(query, items, LABELS)  # hit
    with client.stream(query, LABELS) as session:  # hit
        session.send(items)
    with pytest.raises(grpc.RpcError):
        client.score(query, items, [10**6])
    after = scrape(port)
    delta = lambda name: after.get(name, 0.0) - before.get(name, 0.0)  # noqa: E731

    # every metric of ServiceMetrics is exported under its name, but the known-answer check's
    # gauge: absent until the check has run, which needs a warm-up (this server has none)
    not_run = "prefixscore_template_check_passed"
    names = {family.name for family in ServiceMetrics().registry.collect()} - {not_run}
    exported = {key.split("{")[0] for key in after}
    for name in names:
        assert any(e == name or e.startswith(name + "_") for e in exported), name
    assert not_run not in exported

    assert delta("prefixscore_items_scored_total") == 9
    assert delta("prefixscore_requests_total{code=OK,method=Score}") == 2
    assert delta("prefixscore_requests_total{code=OK,method=ScoreStream}") == 1
    assert delta("prefixscore_requests_total{code=INVALID_ARGUMENT,method=Score}") == 1
    assert delta("prefixscore_request_duration_seconds_count{method=Score}") == 3
    assert delta("prefixscore_time_to_first_batch_seconds_count{method=Score}") == 2
    assert delta("prefixscore_time_to_first_batch_seconds_count{method=ScoreStream}") == 1
    assert delta("prefixscore_prefix_cache_misses_total") == 1
    assert delta("prefixscore_prefix_cache_hits_total") == 2
    assert delta("prefixscore_tokens_total{kind=prefix}") == len(prefix)
    assert delta("prefixscore_tokens_total{kind=item}") == 3 * item_tokens
    # each token needed once: the query on its miss (not on the hit, nor on the stream's open that
    # hit), every item's tokens each time; the refused request asked for nothing
    assert delta("prefixscore_requested_tokens_total") == len(prefix) + 3 * item_tokens
    assert delta("prefixscore_device_batch_size_sum") == 9
    # the prefill rode in the first request's call (no call of its own); the stream's open hit
    assert delta("prefixscore_device_batch_duration_seconds_count{kind=items}") == 3
    padding = delta("prefixscore_padding_tokens_total")
    assert padding > 0 and delta("prefixscore_device_batch_padding_ratio_count") == 3
    # what ran: each call's real tokens and the padding in their tiles, at most its buckets (the
    # planner's count against the tiles decoder.per_tile runs: tests/test_planner_batcher_page_book.py)
    real = delta("prefixscore_tokens_total{kind=prefix}") + delta("prefixscore_tokens_total{kind=item}")
    assert real < delta("prefixscore_computed_tokens_total") <= real + padding
    assert after["prefixscore_queue_depth"] == 0 and after["prefixscore_open_streams"] == 0
    assert after["prefixscore_inflight_requests"] == 0
    assert after["prefixscore_prefix_cache_entries"] >= 1 and after["prefixscore_prefix_cache_bytes"] > 0
    # compilations since this server started: 0 when the shared engine was already warm
    # (steady state compiling nothing is proven in tests/test_compile.py); seconds follow the count
    compiled = after["prefixscore_compilations_total"]
    assert compiled >= 0 and (after["prefixscore_compile_seconds_total"] > 0) == (compiled > 0)
    info = "prefixscore_model_info{devices=cpu:0,dp_size=1,dtype=float32,family=qwen3,model=tiny-qwen3,tp_size=1}"
    assert after[info] == 1
    assert after["prefixscore_mesh_devices{axis=model}"] == after["prefixscore_mesh_devices{axis=data}"] == 1


def test_compilations_show_when_scraped_while_no_request_runs(server):
    """A compile in the process (a background warm-up's, say) is in the next scrape, not first
    at the next device call: a program new to the run (its constant from the clock, so the
    persistent cache cannot hold it) compiled while the server is idle moves the count by one."""
    port = server.server.metrics_port
    before = scrape(port)
    scale = float(time.time_ns() % 1_000_003) + 0.5
    jax.jit(lambda x: x * scale + 1.0)(np.arange(7.0)).block_until_ready()
    after = scrape(port)
    assert after["prefixscore_compilations_total"] == before["prefixscore_compilations_total"] + 1
    assert after["prefixscore_compile_seconds_total"] > before["prefixscore_compile_seconds_total"]


def test_prefix_pool_is_never_exceeded(tiny_scorer):
    """A pool of 5 pages (128 tokens each): a stream pins 3 for its query, a second stream whose
    query needs 3 more is refused at open with RESOURCE_EXHAUSTED and a retry hint (never an
    out-of-memory), unary requests that fit still run, and once the first stream closes its
    query is evicted (least recently used) for the next one."""
    model = tiny_scorer.model
    engine = ScoringEngine(model.cfg, model.params, "float32", tiny_scorer.engine.buckets, pool_bytes=1)
    assert engine.pool_pages == engine.buckets.max_pages + 1 == 5
    with ServerThread(config(tiny_scorer, engine=engine)) as srv, ScoreClient(srv.target) as client:
        first = client.stream(ids(300), LABELS)
        first.__enter__()
        assert len(first.send([ids(3, 7)])[0]) == 2
        with pytest.raises(grpc.RpcError) as refused:
            with client.stream(ids(300, 1000), LABELS) as second:
                second.send([ids(3)])
        assert refused.value.code() == Code.RESOURCE_EXHAUSTED
        assert "prefix pool full" in refused.value.details() and retry_after_ms(refused.value) > 0
        assert len(client.score(ids(100, 2000), [ids(4)], LABELS).scores) == 1  # 1 page: fits
        first.__exit__(None, None, None)
        with client.stream(ids(300, 1000), LABELS) as second:
            assert len(second.send([ids(3)])[0]) == 2
        metrics = scrape(srv.server.metrics_port)
        assert metrics["prefixscore_prefix_cache_evictions_total"] >= 1
        assert metrics["prefixscore_prefix_pool_bytes"] == engine.pool_bytes
        assert metrics["prefixscore_prefix_cache_bytes"] <= engine.pool_bytes
