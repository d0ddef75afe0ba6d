"""The gRPC streams: ScoreStream (a query pinned, batches of items scored over it; or with
`loglikelihood`, each item's own likelihood) and EmbedStream (a prompt pinned, batches of inputs
embedded over it), each served by its request kind (engine/requests/kind.py) on the service's
device loop (service/core.py). service/server.py opens them, within its limit of open streams.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Callable
from typing import Any

import grpc

from prefixscore import prefix_key
from prefixscore.engine.loop.page_pins import StreamPin
from prefixscore.engine.loop.request import TokenizedRequest
from prefixscore.engine.loop.work_unit import WorkUnit
from prefixscore.engine.requests.invalid_input import InvalidInput
from prefixscore.engine.requests.kind import Done
from prefixscore.engine.requests.score import StreamSpec, Validated
from prefixscore.service.core import ScoringService, validated
from prefixscore.service.failures import Failure, internal_failure, invalid, unit_failure
from prefixscore.service.grpc_metadata import CallEnded, deadline_of, echo_prefix_key, input_key
from prefixscore.service.wire import (
    embed_input,
    embeddings,
    item_scores,
    items_of,
    parse,
    score_kind,
    stream_open_input,
)
from prefixscore.v1 import score_service_pb2 as pb

log = logging.getLogger("prefixscore.server")


def _client_gone(context: grpc.aio.ServicerContext) -> Failure | None:
    """The status of a call its client ended (deadline passed, cancelled, disconnected), or None
    while the client is still there."""
    remaining = context.time_remaining()
    if remaining is not None and remaining <= 0:
        return Failure(grpc.StatusCode.DEADLINE_EXCEEDED, "the client's deadline passed")
    if context.cancelled() or context.done():
        return Failure(grpc.StatusCode.CANCELLED, "the client went away")
    return None


# what the stream's handler is told, in order, by its reader task and the device loop
_StreamResponse = pb.ScoreStreamResponse | pb.EmbedStreamResponse


@dataclasses.dataclass(frozen=True)
class _Write:
    message: _StreamResponse  # to send as is (`opened`)


@dataclasses.dataclass(frozen=True)
class _Answer:
    message: _StreamResponse  # a batch's answer without device work: empty, or refused
    batch_id: int


@dataclasses.dataclass(frozen=True)
class _Batch:
    """A stream's batch, validated: its request, what usage counts for it, and its answer."""

    request: TokenizedRequest
    prompt_tokens: int
    answer: Callable[[WorkUnit, int], _StreamResponse]  # (its finished unit, batch id) -> the answer


@dataclasses.dataclass(frozen=True)
class _Scored:
    unit: WorkUnit  # a batch the device loop finished (its answer, or its error)
    batch: _Batch
    batch_id: int


@dataclasses.dataclass(frozen=True)
class _Ended:
    failure: Failure | None = None  # None: the client half-closed; else what ends the stream


_StreamEvent = _Write | _Answer | _Scored | _Ended


class StreamSession:
    """One stream (ScoreStream; EmbedStream below): a reader task takes client messages (open,
    then item batches) and submits work; the handler writes `opened`, each batch's answer as it
    completes, then the usage once the client half-closed and every batch was answered. What
    differs by kind: the messages, what the open pins, and a batch's validation and answer.

    Bounded (docs/operations.md): at most `max_pending_batches` batches accepted and not yet
    sent back; past that the reader stops reading, so HTTP/2 flow control pushes back on a
    client that sends without reading, and nothing piles up in server memory. A stream that
    neither sends (with nothing in flight) nor reads for `stream_idle_timeout_s` is ended."""

    method = "ScoreStream"
    request_type: type[pb.ScoreStreamRequest | pb.EmbedStreamRequest] = pb.ScoreStreamRequest
    response_type: type[_StreamResponse] = pb.ScoreStreamResponse

    def __init__(self, service: ScoringService, context: grpc.aio.ServicerContext) -> None:
        self.service = service
        self.context = context
        self.loop = asyncio.get_running_loop()
        self.events: asyncio.Queue[_StreamEvent] = asyncio.Queue()
        self.opened = False
        self.spec: StreamSpec | None = None
        self.kind: Any = None  # the open's kind (score or likelihood): its batches'
        self.pinned: StreamPin | None = None
        self.cached_tokens = 0
        self.prompt_tokens = 0  # usage: the prefix once, then what each batch adds
        self.items = 0
        self.outstanding: dict[int, WorkUnit] = {}  # id(unit) -> unit
        self.batch_ids: set[int] = set()  # batches accepted and not yet answered
        self.slots = asyncio.Semaphore(service.config.max_pending_batches)
        self.idle_s = service.config.stream_idle_timeout_s
        self.reader: asyncio.Task | None = None

    async def run(self, requests: Any) -> None:
        self.reader = asyncio.ensure_future(self._read(requests))
        eof = False
        while True:
            happened = await self.events.get()
            if isinstance(happened, _Write):
                await self._write(happened.message)
            elif isinstance(happened, _Answer):  # an empty batch, or one refused
                await self._write(happened.message)
                self._answered(happened.batch_id)
            elif isinstance(happened, _Scored):
                unit = happened.unit
                self.outstanding.pop(id(unit), None)
                if unit.reply.error is not None:
                    raise unit_failure(unit.reply.error)
                await self._write(happened.batch.answer(unit, happened.batch_id))
                self._answered(happened.batch_id)
            elif isinstance(happened, _Ended):
                if happened.failure is not None:
                    raise happened.failure
                eof = True
            if eof and not self.outstanding and not self.batch_ids:
                usage = pb.Usage(prompt_tokens=self.prompt_tokens, cached_tokens=self.cached_tokens, items=self.items)
                await self._write(self.response_type(usage=usage))
                return

    def _idle(self, what: str) -> Failure:
        self.service.metrics.streams_idle_closed.inc()
        return Failure(
            grpc.StatusCode.DEADLINE_EXCEEDED,
            f"stream: the client {what} for {self.idle_s:g} s (the server's stream idle timeout); stream ended",
        )

    async def _write(self, message: _StreamResponse) -> None:
        """Write, bounded: a client that reads nothing for the idle timeout loses the stream."""
        try:
            await asyncio.wait_for(self.context.write(message), self.idle_s)
        except asyncio.TimeoutError:
            raise self._idle("read no response") from None
        except CallEnded:
            # gRPC refuses a message on a call that is already over: the client cancelled, went
            # away or its deadline passed while its answer was computed (the context's flags can
            # lag behind). Its choice, not a server error: no ERROR log, no INTERNAL
            gone = _client_gone(self.context) or Failure(grpc.StatusCode.CANCELLED, "the client went away")
            log.debug("stream write dropped: %s", gone.message)
            raise gone from None

    def _answered(self, batch_id: int) -> None:
        self.batch_ids.discard(batch_id)
        self.slots.release()

    async def _next(self, messages: Any) -> bytes | None:
        """The next client message (None at the end), or the idle failure: a stream with nothing
        in flight that sends nothing for the idle timeout. Waiting for answers is not idle."""
        read = asyncio.ensure_future(messages.__anext__())
        try:
            while True:
                done, _ = await asyncio.wait({read}, timeout=self.idle_s)
                if done:
                    try:
                        return read.result()
                    except StopAsyncIteration:
                        return None
                if not self.batch_ids:
                    raise self._idle("sent nothing")
        finally:
            read.cancel()

    async def _read(self, requests: Any) -> None:
        messages = requests.__aiter__()
        try:
            while (raw := await self._next(messages)) is not None:
                msg = parse(self.request_type, raw)
                which = msg.WhichOneof("kind")
                if which == "open":
                    await self._open(msg.open)
                elif which == "batch":
                    if self.slots.locked():
                        self.service.metrics.stream_backpressure.inc()
                    await self.slots.acquire()  # backpressure: no reading past the unsent results
                    await self._batch(msg.batch)
                else:
                    raise InvalidInput("request", "set either open or batch")
            if not self.opened:
                raise InvalidInput("open", "the stream ended before it was opened; send open first")
            self.events.put_nowait(_Ended())
        except Failure as failure:
            self.events.put_nowait(_Ended(failure))
        except InvalidInput as err:
            self.events.put_nowait(_Ended(invalid(err)))
        except asyncio.CancelledError:
            raise
        except Exception as err:
            if self.context.cancelled() or self.context.done():
                # the client went away mid-read: its choice, not a server error (no ERROR log,
                # no INTERNAL inflating the error-ratio alert)
                log.debug("stream reader ended: the client went away (%s)", type(err).__name__)
                self.events.put_nowait(_Ended(Failure(grpc.StatusCode.CANCELLED, "the client went away")))
            else:
                self.events.put_nowait(_Ended(internal_failure("reading the stream failed", err)))

    async def _open(self, msg: Any) -> None:
        if self.opened:
            raise Failure(
                grpc.StatusCode.FAILED_PRECONDITION, "open: the stream is already open; send open once, first"
            )
        prefix, opened = await self._opening(msg)
        if prefix:
            # pin the prefix's pages (refused at once when the pool cannot hold them) and prefill
            # it now: its KV stays on the device while the stream is open. The pin is recorded
            # before the prefill is awaited, so a stream cancelled during it still unpins (close)
            self.pinned = self.service.pin(prefix)
            try:
                self.cached_tokens = await asyncio.wrap_future(self.pinned.ready)
            except Exception as err:  # WorkerStopped: UNAVAILABLE; a failed prefill: INTERNAL
                raise unit_failure(err) from err
        self.opened = True
        self.events.put_nowait(_Write(self.response_type(opened=opened(len(prefix), self.cached_tokens))))

    async def _opening(self, msg: pb.StreamOpen) -> tuple[tuple[int, ...], Callable[[int, int], Any]]:
        """The open validated: the prefix to pin, and its `opened` answer from (prefix tokens,
        cached tokens). A ScoreStream's prefix is its query."""
        await echo_prefix_key(input_key(msg.query))
        kinds = self.service.accepting()
        inp = stream_open_input(msg)
        self.kind = kinds[score_kind(inp)]
        spec = await validated(msg.ByteSize(), self.kind.stream_open, inp)
        self.spec = spec
        self.prompt_tokens = len(spec.prefix)
        label_ids = kinds.requests.head.label_token_ids(spec.label_ids)
        return spec.prefix, lambda prefix, cached: pb.StreamOpened(
            prefix_tokens=prefix, cached_tokens=cached, label_token_ids=label_ids
        )

    async def _checked(self, msg: pb.ItemBatch) -> _Batch:
        """A batch of the open stream, validated (its items over the stream's query)."""
        # the kind of the open: an open stream is served to its end, draining or not
        assert self.kind is not None and self.spec is not None
        spec, kind = self.spec, self.kind
        req = await validated(msg.ByteSize(), lambda: kind.stream_batch(spec, items_of(msg.items)))
        tokens = sum(len(it) for it in req.items) if not spec.item_first else req.prompt_tokens

        def answer(unit: WorkUnit, batch_id: int) -> pb.ScoreStreamResponse:
            result = kind.answer(Validated(req), [Done.of(unit)])
            return pb.ScoreStreamResponse(batch=pb.BatchScores(batch_id=batch_id, scores=item_scores(req, result)))

        return _Batch(req, tokens, answer)

    async def _batch(self, msg: pb.ItemBatch) -> None:
        if not self.opened:
            raise Failure(
                grpc.StatusCode.FAILED_PRECONDITION, "batch: items sent before the stream was opened; send open first"
            )
        batch_id = msg.batch_id
        if batch_id in self.batch_ids:
            # two answers with one id could not be told apart
            raise InvalidInput("batch_id", f"{batch_id} is already in flight on this stream; use a new id per batch")
        batch = await self._checked(msg) if msg.items else None
        self.batch_ids.add(batch_id)
        if batch is None:
            self.events.put_nowait(_Answer(self.response_type(batch={"batch_id": batch_id}), batch_id))
            return
        # the open counted this stream's prefix-cache lookup
        unit = self.service.unit(batch.request, self.method, deadline_of(self.context), counts_lookup=False)
        unit.reply.on_done = lambda u: self.events.put_nowait(_Scored(u, batch, batch_id))  # on this loop (_deliver)
        self.outstanding[id(unit)] = unit
        try:
            self.service.submit(unit)
        except Failure as failure:
            self.outstanding.pop(id(unit), None)
            if failure.code != grpc.StatusCode.RESOURCE_EXHAUSTED:
                raise
            # a full queue refuses this batch only: the stream, the batches it already has in
            # flight and the ones it sends later go on (a stream is long-lived; ending it would
            # throw away accepted work and the prefix's prefill)
            refused = pb.BatchRefused(
                batch_id=batch_id,
                code=failure.code.value[0],
                message=failure.message,
                retry_after_ms=failure.retry_after_ms or 0,
            )
            self.events.put_nowait(_Answer(self.response_type(refused=refused), batch_id))
            return
        # usage counts what is computed: a refused batch is not
        self.items += len(batch.request.items)
        self.prompt_tokens += batch.prompt_tokens

    def close(self) -> None:
        """Cancel queued work of an ended stream and unpin its prefix."""
        if self.reader is not None:
            self.reader.cancel()
        for unit in self.outstanding.values():
            self.service.cancel(unit)
        self.outstanding.clear()
        if self.pinned is not None:
            self.service.release(self.pinned)
            self.pinned = None


class EmbedSession(StreamSession):
    """One EmbedStream: the open's prompt (its shared run, engine/requests/embedding.py) pinned, each
    batch's inputs embedded over it as Embed embeds a request's."""

    method = "EmbedStream"
    request_type = pb.EmbedStreamRequest
    response_type = pb.EmbedStreamResponse

    def __init__(self, service: ScoringService, context: grpc.aio.ServicerContext) -> None:
        super().__init__(service, context)
        self.open_msg = pb.EmbedStreamOpen()

    async def _opening(self, msg: pb.EmbedStreamOpen) -> tuple[tuple[int, ...], Callable[[int, int], Any]]:
        await echo_prefix_key(prefix_key.for_embed(msg.prompt_name if msg.HasField("prompt_name") else None))
        self.kind = self.service.accepting()["embed"]
        self.open_msg = msg
        prompt = await validated(msg.ByteSize(), self.kind.stream_open, embed_input(msg))
        return prompt.prefix, lambda prefix, cached: pb.EmbedStreamOpened(
            prefix_tokens=prefix, cached_tokens=cached, dimensions=prompt.dimensions
        )

    async def _checked(self, msg: pb.ItemBatch) -> _Batch:
        kind = self.kind  # the open's: an open stream is served to its end, draining or not
        checked = await validated(msg.ByteSize(), kind.plan, embed_input(self.open_msg, msg.items))

        def answer(unit: WorkUnit, batch_id: int) -> pb.EmbedStreamResponse:
            vectors = kind.answer(checked, [Done.of(unit)])
            return pb.EmbedStreamResponse(
                batch=pb.BatchEmbeddings(
                    batch_id=batch_id, embeddings=embeddings(vectors), truncated_items=checked.truncated
                )
            )

        return _Batch(checked.request, checked.prompt_tokens, answer)
