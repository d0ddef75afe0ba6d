"""Python client of `prefixscore.v1.ScoreService`, sync (`ScoreClient`) and asyncio (`AsyncScoreClient`).

    from prefixscore.client import ScoreClient

    with ScoreClient("localhost:50051") as client:
        result = client.score("Is this relevant?", ["item one", "item two"], labels=["yes", "no"])
        result.scores  # [[p_yes, p_no], [p_yes, p_no]]
        with client.stream("Is this relevant?", labels=["yes", "no"]) as session:
            session.send(["item three"])          # one batch: its scores
            ids = [session.submit(b) for b in batches]  # pipelined: send all, then
            scores = [session.result(i) for i in ids]   # collect by batch id

Over TLS: `ScoreClient(target, credentials=tls_credentials(ca="ca.pem"))` (mutual TLS: also
`cert=` and `key=`); with token authentication: `token="..."` (sent as
`authorization: Bearer <token>` on every call).

Over many replicas without a proxy: `ScoreClient("ipv4:10.0.0.1:50051,10.0.0.2:50051", affinity="ring_hash")`
(or a headless Service's `dns:///` name) hashes each call's prefix key onto gRPC's own ring, so
every call over one query reaches the replica that caches it (see `ring_hash_service_config`).
With `retry=Retry()` a replica going away loses nothing: unary calls are retried by gRPC's retry
policy and a stream re-opens on another replica, re-sending the batches not yet answered.

Inputs are text or token ids, as in `Scorer.score`. Errors are `grpc.RpcError`
(`.code()`, `.details()`); a full server queue gives RESOURCE_EXHAUSTED with a
`retry-after-ms` trailing metadata entry (see `retry_after_ms`). On a stream, a full
queue refuses one batch only: its `result` raises `BatchRefused` (`.retry_after_ms`)
and the stream goes on.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import queue
import random
import time
from collections.abc import Iterator, Sequence
from typing import Any, Literal

import grpc
from grpc._cython import cygrpc  # the one error type grpcio's aio half-close leaks unwrapped

from prefixscore import prefix_key
from prefixscore.v1 import score_service_pb2 as pb
from prefixscore.v1 import score_service_pb2_grpc as pb_grpc

Text = str | Sequence[int]
CHANNEL_OPTIONS = [("grpc.max_receive_message_length", 64 << 20), ("grpc.max_send_message_length", 64 << 20)]
Affinity = Literal["ring_hash"] | None

# gRPC's ring hash hashes a request header of our choosing (`requestHashHeader`, gRFC A76) only
# while this variable is true: grpcio's C core reads it when a channel parses its service config,
# that is when the channel is created (setting it after `import grpc` is fine; changing it later
# does not affect existing channels). Without it the field is dropped and every call on the
# channel fails INTERNAL "hash attribute not present". It changes nothing for other channels.
RING_HASH_ENV = "GRPC_EXPERIMENTAL_RING_HASH_SET_REQUEST_HASH_KEY"
_TRUE = frozenset({"1", "t", "true", "y", "yes"})  # what the C core parses as true (case-insensitive)


@dataclasses.dataclass(frozen=True)
class Usage:
    prompt_tokens: int  # query + all items
    cached_tokens: int  # query tokens served from the server's prefix cache
    items: int


@dataclasses.dataclass(frozen=True)
class ScoreResult:
    scores: list[list[float]]  # [items][labels]
    usage: Usage
    label_token_ids: list[int]  # the labels scored (resolved by the server when label strings were sent)
    label_names: list[str] = dataclasses.field(default_factory=list)  # a classifier model's columns


@dataclasses.dataclass(frozen=True)
class RerankedDocument:
    index: int  # the document's index in the request
    relevance_score: float
    document: str


@dataclasses.dataclass(frozen=True)
class RerankResult:
    results: list[RerankedDocument]  # most relevant first
    usage: Usage
    template: str  # the server's reranker template


def rerank_request(
    query: str, documents: Sequence[str], instruction: str | None = None, top_n: int = 0, max_tokens_per_doc: int = 0
) -> pb.RerankRequest:
    """Build a RerankRequest message (documents are echoed back)."""
    if isinstance(documents, str):
        raise TypeError("documents: expected a list of strings, got a string")
    return pb.RerankRequest(
        query=query,
        documents=list(documents),
        instruction=instruction or "",
        top_n=top_n,
        return_documents=True,
        max_tokens_per_doc=max_tokens_per_doc,
    )


def _reranked(response: pb.RerankResponse) -> RerankResult:
    results = [RerankedDocument(r.index, r.relevance_score, r.document) for r in response.results]
    return RerankResult(results, _usage(response.usage), response.template)


def _input(value: Any, field: str) -> pb.Input:
    if isinstance(value, str):
        return pb.Input(text=value)
    try:
        ids = [int(t) for t in value]
    except TypeError as err:
        raise TypeError(f"{field}: expected a string or a sequence of token ids, got {type(value).__name__}") from err
    return pb.Input(token_ids=pb.TokenIds(ids=ids))


def _items(items: Sequence[Text]) -> list[pb.Input]:
    if isinstance(items, str):
        raise TypeError("items: expected a list of strings or of token-id lists, got a string")
    return [_input(it, f"items[{j}]") for j, it in enumerate(items)]


def _usage(msg: pb.Usage) -> Usage:
    return Usage(msg.prompt_tokens, msg.cached_tokens, msg.items)


def _scores(msgs: Sequence[pb.ItemScores]) -> list[list[float]]:
    return [list(m.probabilities) for m in msgs]


# a classifier's activation (Score's `activation`)
ACTIVATIONS = {
    "auto": pb.ACTIVATION_UNSPECIFIED,
    "none": pb.ACTIVATION_NONE,
    "sigmoid": pb.ACTIVATION_SIGMOID,
    "softmax": pb.ACTIVATION_SOFTMAX,
}


def score_request(
    query: Text,
    items: Sequence[Text],
    label_token_ids: Sequence[int] | None = None,
    apply_softmax: bool = False,
    item_first: bool = False,
    labels: Sequence[str] | None = None,
    activation: str = "auto",
) -> pb.ScoreRequest:
    """Build a ScoreRequest message. activation: a classifier model's auto, none, sigmoid or softmax."""
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation: {activation!r} is not one of {', '.join(ACTIVATIONS)}")
    return pb.ScoreRequest(
        query=_input(query, "query"),
        items=_items(items),
        label_token_ids=list(label_token_ids or ()),
        labels=list(labels or ()),
        apply_softmax=apply_softmax,
        item_first=item_first,
        activation=ACTIVATIONS[activation],
    )


def stream_open(
    query: Text,
    label_token_ids: Sequence[int] | None = None,
    apply_softmax: bool = False,
    item_first: bool = False,
    labels: Sequence[str] | None = None,
    activation: str = "auto",
) -> pb.ScoreStreamRequest:
    """Build the opening message of a ScoreStream (activation: as in score_request)."""
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation: {activation!r} is not one of {', '.join(ACTIVATIONS)}")
    return pb.ScoreStreamRequest(
        open=pb.StreamOpen(
            query=_input(query, "query"),
            activation=ACTIVATIONS[activation],
            label_token_ids=list(label_token_ids or ()),
            labels=list(labels or ()),
            apply_softmax=apply_softmax,
            item_first=item_first,
        )
    )


def _file(path: str | None) -> bytes | None:
    if path is None:
        return None
    with open(path, "rb") as f:
        return f.read()


def tls_credentials(ca: str | None = None, cert: str | None = None, key: str | None = None) -> grpc.ChannelCredentials:
    """TLS channel credentials from PEM files: `ca` verifies the server (None: the system's roots);
    `cert` and `key` are this client's certificate for mutual TLS."""
    if (cert is None) != (key is None):
        raise ValueError("mutual TLS needs both a client certificate and its key")
    return grpc.ssl_channel_credentials(_file(ca), _file(key), _file(cert))


def ring_hash_service_config(min_ring_size: int = 1024, max_ring_size: int = 4096) -> str:
    """gRPC service config (JSON) for client-side consistent hashing on the prefix key header:
    each call goes to the replica at its key's place on a ring of the target's addresses, the
    next one on the ring while that one cannot connect. `min_ring_size` as Envoy's
    (deploy/envoy); the C core caps the ring at 4096 entries unless a channel option raises it."""
    ring = {"minRingSize": min_ring_size, "maxRingSize": max_ring_size, "requestHashHeader": prefix_key.HEADER}
    return json.dumps({"loadBalancingConfig": [{"ring_hash_experimental": ring}]})


SERVICE_NAME = pb.DESCRIPTOR.services_by_name["ScoreService"].full_name
# The unary methods, safe to send again: scoring changes nothing on the server. ScoreStream is
# not among them: gRPC retries a stream only until its first answer, and our failover does more.
RETRIED_METHODS = ("Score", "Rerank", "GetModelInfo")


@dataclasses.dataclass(frozen=True)
class Retry:
    """What a client retries when a replica goes away (`ScoreClient(..., retry=Retry())`).

    Unary calls (Score, Rerank, GetModelInfo): gRPC's own retry policy in the channel's service
    config (`retry_service_config`), on UNAVAILABLE only, at most `attempts` tries of a call
    (the first included; gRPC caps it at 5), each try picked anew by the channel's load
    balancing (round_robin moves on to another replica; ring_hash hashes to the same one,
    passing it only once its connection failed; pick_first stays on its connection while up).
    Streams: `stream_reopens` re-opens over one stream's life (see `ScoreStream`). Backoff
    before a retry or re-open: random up to `initial_backoff_s`, times `backoff_multiplier` per
    try, at most `max_backoff_s` (gRPC's jitter)."""

    attempts: int = 3
    stream_reopens: int = 3
    initial_backoff_s: float = 0.1
    max_backoff_s: float = 2.0
    backoff_multiplier: float = 2.0

    def __post_init__(self) -> None:
        if not 2 <= self.attempts <= 5:
            raise ValueError(f"attempts: gRPC retries 2 to 5 tries of a call, got {self.attempts}")
        if self.stream_reopens < 0:
            raise ValueError(f"stream_reopens: expected >= 0, got {self.stream_reopens}")
        if not 0.001 <= self.initial_backoff_s <= self.max_backoff_s or self.backoff_multiplier <= 0:
            raise ValueError(f"backoff: expected 0.001 <= initial <= max and a positive multiplier: {self}")

    def backoff(self, tried: int) -> float:
        """Seconds to wait before try number `tried + 1` (`tried` >= 1), as gRPC does."""
        cap = min(self.initial_backoff_s * self.backoff_multiplier ** (tried - 1), self.max_backoff_s)
        return random.uniform(0, cap)


def retry_service_config(retry: Retry) -> str:
    """gRPC service config (JSON) retrying the unary methods on UNAVAILABLE (gRFC A6)."""
    policy = {
        "maxAttempts": retry.attempts,
        "initialBackoff": f"{retry.initial_backoff_s:.3f}s",
        "maxBackoff": f"{retry.max_backoff_s:.3f}s",
        "backoffMultiplier": retry.backoff_multiplier,
        "retryableStatusCodes": ["UNAVAILABLE"],
    }
    names = [{"service": SERVICE_NAME, "method": m} for m in RETRIED_METHODS]
    return json.dumps({"methodConfig": [{"name": names, "retryPolicy": policy}]})


def service_config(affinity: Affinity = None, retry: Retry | None = None) -> str | None:
    """The one service config of a client's channel: ring hash's load balancing and the retry
    policy merged (a channel takes a single `grpc.service_config`); None when neither is asked."""
    config: dict[str, Any] = {}
    if affinity == "ring_hash":
        config.update(json.loads(ring_hash_service_config()))
    if retry is not None:
        config.update(json.loads(retry_service_config(retry)))
    return json.dumps(config) if config else None


def _enable_request_hash_header() -> None:
    """Set RING_HASH_ENV before a ring-hash channel is created (see its comment): unset, it is
    set for this process; set to anything but true, the user turned it off, so refuse."""
    value = os.environ.get(RING_HASH_ENV)
    if value is None:
        os.environ[RING_HASH_ENV] = "true"
    elif value.lower() not in _TRUE:
        raise RuntimeError(
            f"affinity='ring_hash' needs {RING_HASH_ENV}=true (it is {value!r}): without it gRPC "
            "ignores the hash header and fails every call (INTERNAL: hash attribute not present)"
        )


def _channel_options(
    options: Sequence[tuple[str, Any]], affinity: Affinity, retry: Retry | None = None
) -> list[tuple[str, Any]]:
    """The channel's options: ours, then the caller's; with affinity or retry, our service config."""
    if affinity not in (None, "ring_hash"):
        raise ValueError(f"affinity: expected None or 'ring_hash', got {affinity!r}")
    names = {name for name, _ in options}
    if affinity is not None and names & {"grpc.service_config", "grpc.lb_policy_name"}:
        clash = sorted(names & {"grpc.service_config", "grpc.lb_policy_name"})
        raise ValueError(f"affinity='ring_hash' sets the load balancing itself: drop the option(s) {clash}")
    if retry is not None and "grpc.service_config" in names:
        raise ValueError("retry sets the service config itself: drop the option grpc.service_config")
    config = service_config(affinity, retry)
    if config is None:
        return [*CHANNEL_OPTIONS, *options]
    if affinity is not None:
        _enable_request_hash_header()
    # resolution disabled: a service config from DNS (TXT records) would replace this one;
    # retries on explicitly (the default in grpcio for years, but a policy without it is inert)
    ours = [("grpc.service_config", config), ("grpc.service_config_disable_resolution", 1)]
    if retry is not None:
        ours.append(("grpc.enable_retries", 1))
    return [*CHANNEL_OPTIONS, *ours, *options]


def _metadata(token: str | None) -> tuple[tuple[str, str], ...] | None:
    return (("authorization", f"Bearer {token}"),) if token else None


def _keyed(metadata: tuple[tuple[str, str], ...] | None, key: str | None) -> tuple[tuple[str, str], ...] | None:
    """A call's metadata with its prefix key: a router (deploy/envoy) sends every call over one
    query to the replica that caches it (prefix_key.py). None: the client sends none."""
    return (*(metadata or ()), (prefix_key.HEADER, key)) if key is not None else metadata


def retry_after_ms(err: grpc.RpcError) -> int | None:
    """The server's retry hint on RESOURCE_EXHAUSTED, in milliseconds (None if absent)."""
    trailers = err.trailing_metadata() if hasattr(err, "trailing_metadata") else None
    for key, value in trailers or ():
        if key == "retry-after-ms":
            return int(value)
    return None


_CODES = {code.value[0]: code for code in grpc.StatusCode}


class BatchRefused(Exception):
    """The server did not take one batch of a stream (its queue was full): raised by `result`
    for that batch only; the stream stays open. Send the items again after `retry_after_ms`."""

    def __init__(self, batch_id: int, code: grpc.StatusCode, details: str, retry_after_ms: int) -> None:
        super().__init__(f"batch {batch_id} refused ({code.name}): {details}")
        self.batch_id = batch_id
        self.code = code
        self.details = details
        self.retry_after_ms = retry_after_ms


def _reset(err: grpc.RpcError) -> bool:
    """A call whose HTTP/2 stream was reset under it (INTERNAL "Received RST_STREAM"): what a
    proxy such as Envoy does to a call whose replica dies after the call's response headers went
    through (a stream's at its open, a unary call's with its answer). The server never ends a
    call so: its own errors are a status in the trailers."""
    return err.code() == grpc.StatusCode.INTERNAL and "RST_STREAM" in (err.details() or "")


def _lost(err: grpc.RpcError) -> bool:
    """A call whose replica or connection went away: UNAVAILABLE, or its stream reset (`_reset`)."""
    return err.code() == grpc.StatusCode.UNAVAILABLE or _reset(err)


def _remaining(deadline: float | None) -> float | None:
    return None if deadline is None else max(deadline - time.monotonic(), 0.0)


class _Session:
    """State shared by the sync and async stream sessions: batch ids, stashed results, and for
    failover the batches sent and not yet answered (the ones a re-opened stream sends again)."""

    def __init__(
        self,
        stub: pb_grpc.ScoreServiceStub,
        opening: pb.ScoreStreamRequest,
        timeout: float | None,
        metadata: tuple[tuple[str, str], ...] | None = None,
        retry: Retry | None = None,
    ) -> None:
        self._stub = stub
        self._metadata = metadata
        self.prefix_tokens = 0
        self.cached_tokens = 0
        self.label_token_ids: list[int] = []
        self.usage: Usage | None = None
        self.opened = False
        self.reopens = 0  # times this stream re-opened on another replica (failover)
        self._opening = opening
        self._retry = retry
        self._deadline = None if timeout is None else time.monotonic() + timeout
        self._closed = False
        self._next_id = 1
        self._results: dict[int, list[list[float]] | BatchRefused] = {}
        # in submission order (dicts keep it): re-sent in that order on a re-opened stream. A
        # re-sent batch keeps its id: the server checks ids only against the batches in flight
        # on the same stream, so the caller's ids serve every stream and need no mapping.
        self._unanswered: dict[int, pb.ScoreStreamRequest] = {}

    def _pop(self, batch_id: int) -> list[list[float]]:
        result = self._results.pop(batch_id)
        if isinstance(result, BatchRefused):
            raise result
        return result

    def _batch(self, items: Sequence[Text]) -> pb.ScoreStreamRequest:
        batch_id, self._next_id = self._next_id, self._next_id + 1
        message = pb.ScoreStreamRequest(batch=pb.ItemBatch(batch_id=batch_id, items=_items(items)))
        self._unanswered[batch_id] = message
        return message

    def _resent(self) -> list[pb.ScoreStreamRequest]:
        """What a (re-)opened stream sends: the open, then the batches not yet answered."""
        return [self._opening, *self._unanswered.values()]

    def _timeout(self) -> float | None:
        return _remaining(self._deadline)

    def _may_reopen(self, err: grpc.RpcError) -> bool:
        """Whether the stream that failed with `err` opens again: failover on, the replica or its
        connection gone (`_lost`), re-opens left and time left before the deadline."""
        if self._retry is None or not _lost(err):
            return False
        if self.reopens >= self._retry.stream_reopens or self._timeout() == 0.0:
            return False
        self.reopens += 1
        self.opened = False
        return True

    def _take(self, response: pb.ScoreStreamResponse) -> None:
        kind = response.WhichOneof("kind")
        if kind == "opened":
            self.opened = True
            self.prefix_tokens = response.opened.prefix_tokens
            self.cached_tokens = response.opened.cached_tokens
            self.label_token_ids = list(response.opened.label_token_ids)
        elif kind == "batch":
            self._unanswered.pop(response.batch.batch_id, None)
            self._results[response.batch.batch_id] = _scores(response.batch.scores)
        elif kind == "refused":
            r = response.refused
            code = _CODES.get(r.code, grpc.StatusCode.UNKNOWN)
            self._unanswered.pop(r.batch_id, None)  # an answer too: the caller decides to send it again
            self._results[r.batch_id] = BatchRefused(r.batch_id, code, r.message, r.retry_after_ms)
        elif kind == "usage":
            self.usage = _usage(response.usage)


class ScoreStream(_Session):
    """A sync ScoreStream session (from `ScoreClient.stream`): the query's KV stays pinned on
    the server until `close()`. Results may come back out of order; they are matched by id.

    Failover (a client with `retry=Retry(...)`): when the stream fails UNAVAILABLE (its replica
    killed or restarted, the connection lost, or ended after a GOAWAY at max connection age) or
    is reset under it (`_lost`: a proxy's stream whose replica died),
    the session opens a new stream on the same channel (its load balancing picks a replica that
    answers), sends the open again and then every batch sent and not yet answered, in order, and
    goes on: each batch is answered once, results already received are kept, not asked again.
    At most `Retry.stream_reopens` re-opens over the stream's life, within its `timeout` (one
    deadline for them all); past that, or on any other code, the error is raised as without
    failover. `reopens` counts them; `prefix_tokens`/`cached_tokens` are the last open's, and
    `close()`'s usage is what the replica that finished the stream served (the batches re-sent
    to it included): the usage of a replica that went away went with it."""

    def __init__(
        self,
        stub: pb_grpc.ScoreServiceStub,
        opening: pb.ScoreStreamRequest,
        timeout: float | None,
        metadata: tuple[tuple[str, str], ...] | None = None,
        retry: Retry | None = None,
    ) -> None:
        super().__init__(stub, opening, timeout, metadata, retry)
        self._start()
        self._receive_one()  # the `opened` answer, or the error that refused the open
        if not self.opened:
            raise RuntimeError("ScoreStream: the server did not acknowledge the open")

    def _start(self) -> None:
        """Open a stream: the open and the unanswered batches queued first, then the half-close
        if `close()` was called already."""
        self._requests: queue.Queue = queue.Queue()
        for message in self._resent():
            self._requests.put(message)
        if self._closed:
            self._requests.put(None)
        self._call = self._stub.ScoreStream(
            self._outgoing(self._requests), timeout=self._timeout(), metadata=self._metadata
        )

    @staticmethod
    def _outgoing(requests: queue.Queue) -> Iterator[pb.ScoreStreamRequest]:
        while True:
            message = requests.get()
            if message is None:
                return
            yield message

    def _receive_one(self) -> bool:
        while True:
            try:
                self._take(next(self._call))
                return True
            except StopIteration:
                return False
            except grpc.RpcError as err:
                self._requests.put(None)  # the call is over: release gRPC's thread reading our requests
                if not self._may_reopen(err):
                    raise
                assert self._retry is not None
                time.sleep(self._retry.backoff(self.reopens))
                self._start()

    def submit(self, items: Sequence[Text]) -> int:
        """Send one batch of items without waiting; returns its batch id."""
        message = self._batch(items)
        self._requests.put(message)
        return message.batch.batch_id

    def result(self, batch_id: int) -> list[list[float]]:
        """Wait for one submitted batch's scores [items][labels]; raises BatchRefused when the
        server refused that batch (its queue was full: retry it), the stream going on."""
        while batch_id not in self._results:
            if not self._receive_one():
                raise RuntimeError(f"ScoreStream ended without an answer to batch {batch_id}")
        return self._pop(batch_id)

    def send(self, items: Sequence[Text]) -> list[list[float]]:
        """Score one batch of items: submit, then wait for its scores."""
        return self.result(self.submit(items))

    def close(self) -> Usage:
        """Half-close; waits for every outstanding batch (kept for `result`) and the stream's usage."""
        if not self._closed:
            self._closed = True
            self._requests.put(None)
            while self._receive_one():
                pass
        assert self.usage is not None, "the stream ended without usage"
        return self.usage

    def cancel(self) -> None:
        self._closed = True
        self._requests.put(None)
        self._call.cancel()

    def __enter__(self) -> ScoreStream:
        return self

    def __exit__(self, exc_type: object, *_: object) -> None:
        if exc_type is None:
            self.close()
        else:
            self.cancel()


class ScoreClient:
    """Sync client. `target`: "host:port" (or any gRPC target: `dns:///name:port`,
    `ipv4:a:p,b:p`); `credentials`: TLS (see `tls_credentials`), None for plaintext; `token`: a
    bearer token; `affinity="ring_hash"`: over a target of many replicas, send every call over
    one query to one replica, the one that caches it (`ring_hash_service_config`; sets
    RING_HASH_ENV for the process if unset); `send_prefix_key=False`: calls carry no prefix key
    (a router then spreads them as it would any client's); `retry=Retry()`: unary calls retried
    by gRPC on UNAVAILABLE and streams re-opened on another replica (see `Retry`, `ScoreStream`).
    Use as a context manager or call `close()`."""

    def __init__(
        self,
        target: str,
        options: Sequence[tuple[str, Any]] = (),
        credentials: grpc.ChannelCredentials | None = None,
        token: str | None = None,
        affinity: Affinity = None,
        send_prefix_key: bool = True,
        retry: Retry | None = None,
    ) -> None:
        self.target = target
        self._send_key = send_prefix_key
        self._retry = retry
        opts = _channel_options(options, affinity, retry)
        if credentials is None:
            self._channel = grpc.insecure_channel(target, options=opts)
        else:
            self._channel = grpc.secure_channel(target, credentials, options=opts)
        self._metadata = _metadata(token)
        self._stub = pb_grpc.ScoreServiceStub(self._channel)

    def score(
        self,
        query: Text,
        items: Sequence[Text],
        label_token_ids: Sequence[int] | None = None,
        apply_softmax: bool = False,
        item_first: bool = False,
        labels: Sequence[str] | None = None,
        timeout: float | None = None,
        activation: str = "auto",
    ) -> ScoreResult:
        """Probabilities [items][labels] of each label as the next token after query + item."""
        request = score_request(query, items, label_token_ids, apply_softmax, item_first, labels, activation)
        metadata = _keyed(self._metadata, prefix_key.for_score(query) if self._send_key else None)
        response = self._unary(self._stub.Score, request, timeout, metadata)
        return ScoreResult(
            _scores(response.scores),
            _usage(response.usage),
            list(response.label_token_ids),
            list(response.label_names),
        )

    def stream(
        self,
        query: Text,
        label_token_ids: Sequence[int] | None = None,
        apply_softmax: bool = False,
        item_first: bool = False,
        labels: Sequence[str] | None = None,
        timeout: float | None = None,
        activation: str = "auto",
    ) -> ScoreStream:
        """Open a ScoreStream session over `query` (returns once the server has its KV on the device)."""
        opening = stream_open(query, label_token_ids, apply_softmax, item_first, labels, activation)
        return ScoreStream(
            self._stub,
            opening,
            timeout,
            _keyed(self._metadata, prefix_key.for_score(query) if self._send_key else None),
            self._retry,
        )

    def rerank(
        self,
        query: str,
        documents: Sequence[str],
        instruction: str | None = None,
        top_n: int = 0,
        max_tokens_per_doc: int = 0,
        timeout: float | None = None,
    ) -> RerankResult:
        """Documents sorted by the server template's relevance to `query` (top_n: only the first N)."""
        request = rerank_request(query, documents, instruction, top_n, max_tokens_per_doc)
        metadata = _keyed(self._metadata, prefix_key.for_rerank(query, instruction) if self._send_key else None)
        return _reranked(self._unary(self._stub.Rerank, request, timeout, metadata))

    def _unary(self, method: Any, request: Any, timeout: float | None, metadata: Any) -> Any:
        """One Score or Rerank call. With `retry`, one whose stream was reset under it (`_reset`:
        its replica died while its answer was on the way, past what gRPC's policy and a proxy
        retry) is sent again, within `attempts` tries and `timeout` (scoring changes nothing)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        tried = 1
        while True:
            try:
                return method(request, timeout=_remaining(deadline), metadata=metadata)
            except grpc.RpcError as err:
                if self._retry is None or not _reset(err) or tried >= self._retry.attempts:
                    raise
                time.sleep(self._retry.backoff(tried))
                tried += 1

    def model_info(self, timeout: float | None = None) -> pb.GetModelInfoResponse:
        return self._stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=timeout, metadata=self._metadata)

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> ScoreClient:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()


class AsyncScoreStream(_Session):
    """An asyncio ScoreStream session (from `AsyncScoreClient.stream`); same methods as
    coroutines, and the same failover as `ScoreStream`."""

    async def _open(self) -> None:
        """Start the first stream and wait for its `opened` (or the error that refused the open)."""
        await self._start()
        if not await self._receive_one() or not self.opened:
            raise RuntimeError("ScoreStream: the server did not acknowledge the open")

    async def _start(self) -> None:
        self._call = self._stub.ScoreStream(timeout=self._timeout(), metadata=self._metadata)
        for message in self._resent():
            if not await self._write(message):
                return
        if self._closed:
            await self._half_close()

    async def _write(self, message: pb.ScoreStreamRequest) -> bool:
        """Send one message; False if the call is over. Then the message stays unanswered and
        the next read meets the call's status: it re-opens there (sending it again) or raises."""
        try:
            await self._call.write(message)
            return True
        except (grpc.aio.AioRpcError, asyncio.InvalidStateError):
            if not self._call.done():  # a write after close(): the caller's mistake
                raise
            return False

    async def _half_close(self) -> None:
        try:
            await self._call.done_writing()
        except cygrpc.ExecuteBatchError:
            # grpcio raises its core's batch error when the call ends (its deadline passes, the
            # server's status arrives) while the half-close is in flight. The call's status is
            # what the caller must see: wait for it; the next read raises it (or re-opens).
            await self._call.code()

    async def _receive_one(self) -> bool:
        while True:
            try:
                response = await self._call.read()
                if response is grpc.aio.EOF and await self._call.code() != grpc.StatusCode.OK:
                    await self._call.read()  # the status is in: reading again raises it
            except grpc.aio.AioRpcError as err:
                if not self._may_reopen(err):
                    raise
                assert self._retry is not None
                await asyncio.sleep(self._retry.backoff(self.reopens))
                await self._start()
                continue
            if response is grpc.aio.EOF:
                return False
            self._take(response)
            return True

    async def submit(self, items: Sequence[Text]) -> int:
        message = self._batch(items)
        await self._write(message)
        return message.batch.batch_id

    async def result(self, batch_id: int) -> list[list[float]]:
        while batch_id not in self._results:
            if not await self._receive_one():
                raise RuntimeError(f"ScoreStream ended without an answer to batch {batch_id}")
        return self._pop(batch_id)

    async def send(self, items: Sequence[Text]) -> list[list[float]]:
        return await self.result(await self.submit(items))

    async def close(self) -> Usage:
        if not self._closed:
            self._closed = True
            await self._half_close()
            while await self._receive_one():
                pass
        assert self.usage is not None, "the stream ended without usage"
        return self.usage

    def cancel(self) -> None:
        self._closed = True
        self._call.cancel()

    async def __aenter__(self) -> AsyncScoreStream:
        return self

    async def __aexit__(self, exc_type: object, *_: object) -> None:
        if exc_type is None:
            await self.close()
        else:
            self.cancel()


class AsyncScoreClient:
    """asyncio client with the methods (and arguments, `affinity` and `retry` included) of ScoreClient as coroutines."""

    def __init__(
        self,
        target: str,
        options: Sequence[tuple[str, Any]] = (),
        credentials: grpc.ChannelCredentials | None = None,
        token: str | None = None,
        affinity: Affinity = None,
        send_prefix_key: bool = True,
        retry: Retry | None = None,
    ) -> None:
        self.target = target
        self._send_key = send_prefix_key
        self._retry = retry
        opts = _channel_options(options, affinity, retry)
        if credentials is None:
            self._channel = grpc.aio.insecure_channel(target, options=opts)
        else:
            self._channel = grpc.aio.secure_channel(target, credentials, options=opts)
        self._metadata = _metadata(token)
        self._stub = pb_grpc.ScoreServiceStub(self._channel)

    async def score(
        self,
        query: Text,
        items: Sequence[Text],
        label_token_ids: Sequence[int] | None = None,
        apply_softmax: bool = False,
        item_first: bool = False,
        labels: Sequence[str] | None = None,
        timeout: float | None = None,
        activation: str = "auto",
    ) -> ScoreResult:
        request = score_request(query, items, label_token_ids, apply_softmax, item_first, labels, activation)
        metadata = _keyed(self._metadata, prefix_key.for_score(query) if self._send_key else None)
        response = await self._unary(self._stub.Score, request, timeout, metadata)
        return ScoreResult(
            _scores(response.scores),
            _usage(response.usage),
            list(response.label_token_ids),
            list(response.label_names),
        )

    async def stream(
        self,
        query: Text,
        label_token_ids: Sequence[int] | None = None,
        apply_softmax: bool = False,
        item_first: bool = False,
        labels: Sequence[str] | None = None,
        timeout: float | None = None,
        activation: str = "auto",
    ) -> AsyncScoreStream:
        session = AsyncScoreStream(
            self._stub,
            stream_open(query, label_token_ids, apply_softmax, item_first, labels, activation),
            timeout,
            _keyed(self._metadata, prefix_key.for_score(query) if self._send_key else None),
            self._retry,
        )
        await session._open()
        return session

    async def rerank(
        self,
        query: str,
        documents: Sequence[str],
        instruction: str | None = None,
        top_n: int = 0,
        max_tokens_per_doc: int = 0,
        timeout: float | None = None,
    ) -> RerankResult:
        request = rerank_request(query, documents, instruction, top_n, max_tokens_per_doc)
        metadata = _keyed(self._metadata, prefix_key.for_rerank(query, instruction) if self._send_key else None)
        return _reranked(await self._unary(self._stub.Rerank, request, timeout, metadata))

    async def _unary(self, method: Any, request: Any, timeout: float | None, metadata: Any) -> Any:
        """As `ScoreClient._unary`."""
        deadline = None if timeout is None else time.monotonic() + timeout
        tried = 1
        while True:
            try:
                return await method(request, timeout=_remaining(deadline), metadata=metadata)
            except grpc.RpcError as err:
                if self._retry is None or not _reset(err) or tried >= self._retry.attempts:
                    raise
                await asyncio.sleep(self._retry.backoff(tried))
                tried += 1

    async def model_info(self, timeout: float | None = None) -> pb.GetModelInfoResponse:
        return await self._stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=timeout, metadata=self._metadata)

    async def close(self) -> None:
        await self._channel.close()

    async def __aenter__(self) -> AsyncScoreClient:
        return self

    async def __aexit__(self, *_: object) -> None:
        await self.close()
