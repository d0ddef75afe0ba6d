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
import queue
import time
from collections.abc import Awaitable, Iterator, Sequence
from typing import NoReturn

import grpc
from grpc._cython import cygrpc  # the one error type grpcio's aio half-close leaks unwrapped

# What the package has exported from this module (prefixscore.client, tests, bench) stays importable here
from prefixscore.client.channel import RING_HASH_ENV as RING_HASH_ENV
from prefixscore.client.channel import ring_hash_service_config as ring_hash_service_config
from prefixscore.client.channel import service_config as service_config
from prefixscore.client.channel import tls_credentials as tls_credentials
from prefixscore.client.core import ClientCore
from prefixscore.client.errors import BatchRefused as BatchRefused
from prefixscore.client.errors import retry_after_ms as retry_after_ms
from prefixscore.client.messages import BatchResult, Metadata, Text
from prefixscore.client.messages import EmbedResult as EmbedResult
from prefixscore.client.messages import Likelihood as Likelihood
from prefixscore.client.messages import RerankedDocument as RerankedDocument
from prefixscore.client.messages import RerankResult as RerankResult
from prefixscore.client.messages import ScoreResult as ScoreResult
from prefixscore.client.messages import Usage as Usage
from prefixscore.client.messages import rerank_request as rerank_request
from prefixscore.client.messages import score_request as score_request
from prefixscore.client.messages import stream_open as stream_open
from prefixscore.client.retry import Retry as Retry
from prefixscore.client.steps import run_awaiting, run_blocking
from prefixscore.client.stream import StreamCore
from prefixscore.v1 import score_service_pb2 as pb


class ScoreStream(StreamCore):
    """A sync ScoreStream session (from `ScoreClient.stream`): the query's KV stays pinned on
    the server until `close()`. Results may come back out of order; they are matched by id.
    An EmbedStream session (`ScoreClient.embed_stream`) is one too: its prompt pinned, each
    batch's result its inputs' embeddings [inputs][dimensions].

    Failover (a client with `retry=Retry(...)`): when the stream fails UNAVAILABLE (its replica
    killed or restarted, the connection lost, or ended after a GOAWAY at max connection age) or
    is reset under it (`replica_lost`: a proxy's stream whose replica died),
    the session opens a new stream on the same channel (its load balancing picks a replica that
    answers), sends the open again and then every batch sent and not yet answered, in order, and
    goes on: each batch is answered once, results already received are kept, not asked again.
    At most `Retry.stream_reopens` re-opens over the stream's life, within its `timeout` (one
    deadline for them all); past that, or on any other code, the error is raised as without
    failover. `reopens` counts them; `prefix_tokens`/`cached_tokens` are the last open's, and
    `close()`'s usage is what the replica that finished the stream served (the batches re-sent
    to it included): the usage of a replica that went away went with it."""

    _sleep = staticmethod(time.sleep)
    _run = staticmethod(run_blocking)
    _opens_when_made = True

    def _new_call(self) -> None:
        # gRPC's own thread reads the requests from this queue until a None
        self._requests: queue.Queue = queue.Queue()
        self._call = getattr(self._stub, self._kind.rpc)(
            self._outgoing(self._requests), timeout=self._timeout(), metadata=self._metadata
        )

    @staticmethod
    def _outgoing(requests: queue.Queue) -> Iterator[pb.ScoreStreamRequest]:
        while True:
            message = requests.get()
            if message is None:
                return
            yield message

    def _write(self, message: pb.ScoreStreamRequest) -> bool:
        self._requests.put(message)
        return True

    def _half_close(self) -> None:
        self._requests.put(None)

    def _read(self) -> pb.ScoreStreamResponse | None:
        try:
            return next(self._call)
        except StopIteration:
            return None
        except grpc.RpcError:
            self._requests.put(None)  # the call is over: release gRPC's thread reading our requests
            raise

    def submit(self, items: Sequence[Text]) -> int:
        """Send one batch of items without waiting; returns its batch id."""
        return self._run(self._submit_steps(items))

    def result(self, batch_id: int) -> BatchResult:
        """Wait for one submitted batch's scores [items][labels]; raises BatchRefused when the
        server refused that batch (its queue was full: retry it), the stream going on."""
        return self._run(self._result_steps(batch_id))

    def send(self, items: Sequence[Text]) -> BatchResult:
        """Score one batch of items: submit, then wait for its scores."""
        return self.result(self.submit(items))

    def close(self) -> Usage:
        """Half-close; waits for every outstanding batch (kept for `result`) and the stream's usage."""
        return self._run(self._close_steps())

    def cancel(self) -> None:
        self._requests.put(None)
        super().cancel()

    def __enter__(self) -> ScoreStream:
        return self

    def __exit__(self, exc_type: object, *_: object) -> None:
        if exc_type is None:
            self.close()
        else:
            self.cancel()


class ScoreClient(ClientCore[ScoreResult, RerankResult, ScoreStream]):
    """Sync client. `target`: "host:port" (or any gRPC target: `dns:///name:port`,
    `ipv4:a:p,b:p`); `credentials`: TLS (see `tls_credentials`), None for plaintext; `token`: a
    bearer token; `affinity="ring_hash"`: over a target of many replicas, send every call over
    one query to one replica, the one that caches it (`ring_hash_service_config`; sets
    RING_HASH_ENV for the process if unset); `send_prefix_key=False`: calls carry no prefix key
    (a router then spreads them as it would any client's); `retry=Retry()`: unary calls retried
    by gRPC on UNAVAILABLE and streams re-opened on another replica (see `Retry`, `ScoreStream`).
    Use as a context manager or call `close()`. Its calls are `ClientCore`'s."""

    _insecure_channel = staticmethod(grpc.insecure_channel)
    _secure_channel = staticmethod(grpc.secure_channel)
    _sleep = staticmethod(time.sleep)
    _run = staticmethod(run_blocking)

    def _open_stream(
        self, opening: pb.ScoreStreamRequest | pb.EmbedStreamRequest, timeout: float | None, metadata: Metadata
    ) -> ScoreStream:
        return ScoreStream(self._stub, opening, timeout, metadata, self._retry)

    def model_info(self, timeout: float | None = None) -> pb.GetModelInfoResponse:
        return self._stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=timeout, metadata=self._metadata)

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> ScoreClient:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()


# grpcio's own status for a call whose send failed in its core (grpc/aio/_call.py `_write`)
GRPCIO_SEND_FAILED = "Internal error from Core"
# how long a stream waits for the core's status to replace it when that may still come: the core
# has ended the call by then, so its status is a completion away (a bound, not a wait one expects
# to reach)
CORE_STATUS_WAIT_S = 2.0
CORE_STATUS_POLL_S = 0.005


class AsyncScoreStream(StreamCore):
    """An asyncio ScoreStream session (from `AsyncScoreClient.stream`); same methods as
    coroutines, and the same failover as `ScoreStream`."""

    _sleep = staticmethod(asyncio.sleep)
    _run = staticmethod(run_awaiting)
    _opens_when_made = False

    def _new_call(self) -> None:
        self._call = getattr(self._stub, self._kind.rpc)(timeout=self._timeout(), metadata=self._metadata)

    async def _write(self, message: pb.ScoreStreamRequest) -> bool:
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

    async def _read(self) -> pb.ScoreStreamResponse | None:
        try:
            response = await self._call.read()
            if response is grpc.aio.EOF and await self._call.code() != grpc.StatusCode.OK:
                await self._call.read()  # the status is in: reading again raises it
        except grpc.aio.AioRpcError as err:
            if err.details() != GRPCIO_SEND_FAILED:
                raise
            await self._raise_core_status(err)
        return None if response is grpc.aio.EOF else response

    async def _raise_core_status(self, err: grpc.aio.AioRpcError) -> NoReturn:
        """Raise what ended the call in place of grpcio's INTERNAL for a send that the call's end
        overtook. grpcio sets that status over the core's when the send's failure comes in second
        (the core's status is then lost) and the core's sets over it when it comes in second. On
        CI's loaded runner, 4 in 120 of the deadline race (test_load_round) saw the INTERNAL."""
        if self._deadline is not None and time.monotonic() >= self._deadline:
            raise grpc.aio.AioRpcError(
                grpc.StatusCode.DEADLINE_EXCEEDED,
                err.initial_metadata(),
                err.trailing_metadata(),
                details="Deadline Exceeded",
                debug_error_string="a send the call's deadline overtook",
            ) from None
        waited = 0.0
        while waited < CORE_STATUS_WAIT_S and await self._call.details() == GRPCIO_SEND_FAILED:
            await asyncio.sleep(CORE_STATUS_POLL_S)
            waited += CORE_STATUS_POLL_S
        if await self._call.details() != GRPCIO_SEND_FAILED:
            await self._call.read()  # the core's status is in: reading raises it
        raise err

    async def submit(self, items: Sequence[Text]) -> int:
        return await self._run(self._submit_steps(items))

    async def result(self, batch_id: int) -> BatchResult:
        return await self._run(self._result_steps(batch_id))

    async def send(self, items: Sequence[Text]) -> BatchResult:
        return await self.result(await self.submit(items))

    async def close(self) -> Usage:
        return await self._run(self._close_steps())

    async def __aenter__(self) -> AsyncScoreStream:
        return self

    async def __aexit__(self, exc_type: object, *_: object) -> None:
        if exc_type is None:
            await self.close()
        else:
            self.cancel()


class AsyncScoreClient(ClientCore[Awaitable[ScoreResult], Awaitable[RerankResult], Awaitable[AsyncScoreStream]]):
    """asyncio client with the methods (and arguments, `affinity` and `retry` included) of ScoreClient as coroutines."""

    _insecure_channel = staticmethod(grpc.aio.insecure_channel)
    _secure_channel = staticmethod(grpc.aio.secure_channel)
    _sleep = staticmethod(asyncio.sleep)
    _run = staticmethod(run_awaiting)

    async def _open_stream(
        self, opening: pb.ScoreStreamRequest | pb.EmbedStreamRequest, timeout: float | None, metadata: Metadata
    ) -> AsyncScoreStream:
        session = AsyncScoreStream(self._stub, opening, timeout, metadata, self._retry)
        await session._run(session._open_steps())
        return session

    async def model_info(self, timeout: float | None = None) -> pb.GetModelInfoResponse:
        return await self._stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=timeout, metadata=self._metadata)

    async def close(self) -> None:
        await self._channel.close()

    async def __aenter__(self) -> AsyncScoreClient:
        return self

    async def __aexit__(self, *_: object) -> None:
        await self.close()
