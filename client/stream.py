"""A ScoreStream session written once for the sync and the asyncio client (as steps, see steps.py):
batch ids, results kept until asked for, and failover: the batches sent and not yet answered,
sent again under their ids on a re-opened stream. The session classes (client/score_client.py)
only give it the I/O of one gRPC stream."""

from __future__ import annotations

import abc
import dataclasses
import time
from collections.abc import Awaitable, Callable, Sequence
from functools import partial
from typing import Any

import grpc

from prefixscore.client.errors import BatchRefused, replica_lost, status_code
from prefixscore.client.messages import (
    BatchResult,
    Metadata,
    Text,
    Usage,
    batch_results,
    items_message,
    usage,
    vectors,
)
from prefixscore.client.retry import Retry, remaining
from prefixscore.client.steps import Steps
from prefixscore.v1 import score_service_pb2 as pb
from prefixscore.v1 import score_service_pb2_grpc as pb_grpc


@dataclasses.dataclass(frozen=True)
class StreamKind:
    """What differs between the two streams (ScoreStream, EmbedStream) for a session."""

    rpc: str  # the stub's method
    request: type[pb.ScoreStreamRequest | pb.EmbedStreamRequest]  # a client message
    answer: Callable[[Any], BatchResult]  # a batch's answer message -> its result


KINDS = {
    pb.ScoreStreamRequest: StreamKind("ScoreStream", pb.ScoreStreamRequest, lambda batch: batch_results(batch.scores)),
    pb.EmbedStreamRequest: StreamKind("EmbedStream", pb.EmbedStreamRequest, lambda batch: vectors(batch.embeddings)),
}


class StreamCore(abc.ABC):
    """What a stream session does, whatever waits on its I/O. A subclass gives the I/O of one gRPC
    stream (`_new_call`, `_write`, `_half_close`, `_read`: blocking calls or coroutine functions),
    how to wait (`_sleep`) and how to perform steps (`_run`)."""

    _sleep: Callable[[float], Any]  # time.sleep or asyncio.sleep
    _run: Callable[[Steps[Any]], Any]  # steps.run_blocking or steps.run_awaiting
    # A sync session opens in its constructor (the open's answer or error comes with it); an
    # asyncio one is opened by its client, which can await it (a constructor cannot)
    _opens_when_made: bool

    def __init__(
        self,
        stub: pb_grpc.ScoreServiceStub,
        opening: pb.ScoreStreamRequest,
        timeout: float | None,
        metadata: Metadata = None,
        retry: Retry | None = None,
    ) -> None:
        self._stub = stub
        self._metadata = metadata
        self.prefix_tokens = 0
        self.cached_tokens = 0
        self.label_token_ids: list[int] = []  # a ScoreStream's
        self.dimensions = 0  # an EmbedStream's: the components of each embedding
        self.usage: Usage | None = None
        self.opened = False
        self.reopens = 0  # times this stream re-opened on another replica (failover)
        self._opening = opening
        self._kind = KINDS[type(opening)]
        self._retry = retry
        self._deadline = None if timeout is None else time.monotonic() + timeout
        self._closed = False
        self._next_id = 1
        self._results: dict[int, BatchResult | BatchRefused] = {}
        # in submission order (dicts keep it): re-sent in that order on a re-opened stream. A
        # re-sent batch keeps its id: the server checks ids only against the batches in flight
        # on the same stream, so the caller's ids serve every stream and need no mapping.
        self._unanswered: dict[int, pb.ScoreStreamRequest] = {}
        self._call: Any = None  # the gRPC stream now open (set by `_new_call`)
        if self._opens_when_made:
            self._run(self._open_steps())

    # -- the I/O of one gRPC stream, given by the session classes

    @abc.abstractmethod
    def _new_call(self) -> None:
        """Start a gRPC stream (`self._call`) with `_timeout()` left; no waiting."""

    @abc.abstractmethod
    def _write(self, message: pb.ScoreStreamRequest) -> bool | Awaitable[bool]:
        """Send one message; False if the call is over (the next read meets its status)."""

    @abc.abstractmethod
    def _half_close(self) -> None | Awaitable[None]:
        """Tell the server no more messages come on this call."""

    @abc.abstractmethod
    def _read(self) -> pb.ScoreStreamResponse | None | Awaitable[pb.ScoreStreamResponse | None]:
        """The next answer; None when the call ended OK; raises the call's error otherwise."""

    # -- the session's logic, as steps

    def _open_steps(self) -> Steps[None]:
        """Start the first stream and wait for its `opened` (or the error that refused the open)."""
        yield from self._start_steps()
        if not (yield from self._receive_steps()) or not self.opened:
            raise RuntimeError("ScoreStream: the server did not acknowledge the open")

    def _start_steps(self) -> Steps[None]:
        """Open a stream: the open and the unanswered batches sent first, then the half-close if
        `close()` was called already."""
        self._new_call()
        for message in self._resent():
            if not (yield partial(self._write, message)):
                return  # the call is over: the next read re-opens (sending the rest again) or raises
        if self._closed:
            yield self._half_close

    def _receive_steps(self) -> Steps[bool]:
        """Take one answer; False when the stream ended. A stream lost under it re-opens (`_may_reopen`)."""
        while True:
            try:
                response = yield self._read
            except grpc.RpcError as err:
                if not self._may_reopen(err):
                    raise
                assert self._retry is not None
                yield partial(self._sleep, self._retry.backoff(self.reopens))
                yield from self._start_steps()
                continue
            if response is None:
                return False
            self._take(response)
            return True

    def _submit_steps(self, items: Sequence[Text]) -> Steps[int]:
        message = self._batch(items)
        yield partial(self._write, message)
        return message.batch.batch_id

    def _result_steps(self, batch_id: int) -> Steps[BatchResult]:
        while batch_id not in self._results:
            if not (yield from self._receive_steps()):
                raise RuntimeError(f"ScoreStream ended without an answer to batch {batch_id}")
        return self._pop(batch_id)

    def _close_steps(self) -> Steps[Usage]:
        if not self._closed:
            self._closed = True
            yield self._half_close
            while (yield from self._receive_steps()):
                pass
        assert self.usage is not None, "the stream ended without usage"
        return self.usage

    def cancel(self) -> None:
        self._closed = True
        self._call.cancel()

    # -- bookkeeping

    def _pop(self, batch_id: int) -> BatchResult:
        result = self._results.pop(batch_id)
        if isinstance(result, BatchRefused):
            raise result
        return result

    def _batch(self, items: Sequence[Text]) -> pb.ScoreStreamRequest | pb.EmbedStreamRequest:
        batch_id, self._next_id = self._next_id, self._next_id + 1
        message = self._kind.request(batch=pb.ItemBatch(batch_id=batch_id, items=items_message(items)))
        self._unanswered[batch_id] = message
        return message

    def _resent(self) -> list[pb.ScoreStreamRequest]:
        """What a (re-)opened stream sends: the open, then the batches not yet answered."""
        return [self._opening, *self._unanswered.values()]

    def _timeout(self) -> float | None:
        return remaining(self._deadline)

    def _may_reopen(self, err: grpc.RpcError) -> bool:
        """Whether the stream that failed with `err` opens again: failover on, the replica or its
        connection gone (`replica_lost`), re-opens left and time left before the deadline."""
        if self._retry is None or not replica_lost(err):
            return False
        if self.reopens >= self._retry.stream_reopens or self._timeout() == 0.0:
            return False
        self.reopens += 1
        self.opened = False
        return True

    def _take(self, response: pb.ScoreStreamResponse | pb.EmbedStreamResponse) -> None:
        kind = response.WhichOneof("kind")
        if kind == "opened":
            opened = response.opened
            self.opened = True
            self.prefix_tokens = opened.prefix_tokens
            self.cached_tokens = opened.cached_tokens
            if isinstance(opened, pb.StreamOpened):
                self.label_token_ids = list(opened.label_token_ids)
            else:
                self.dimensions = opened.dimensions
        elif kind == "batch":
            self._unanswered.pop(response.batch.batch_id, None)
            self._results[response.batch.batch_id] = self._kind.answer(response.batch)
        elif kind == "refused":
            r = response.refused
            self._unanswered.pop(r.batch_id, None)  # an answer too: the caller decides to send it again
            self._results[r.batch_id] = BatchRefused(r.batch_id, status_code(r.code), r.message, r.retry_after_ms)
        elif kind == "usage":
            self.usage = usage(response.usage)
