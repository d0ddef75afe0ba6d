"""What every gRPC call of the ScoreService carries beside its messages: its initial metadata
(the request id, and the prefix key once the request is parsed), its deadline, and the error
grpc.aio raises when a message is written on a call that has already ended."""

from __future__ import annotations

import contextvars
import logging
import time

import grpc

from prefixscore import prefix_key
from prefixscore.telemetry import request_ids
from prefixscore.v1 import score_service_pb2 as pb

log = logging.getLogger("prefixscore.server")

try:  # what grpc.aio raises when a message is written on a call that has already ended
    from grpc._cython.cygrpc import ExecuteBatchError as CallEnded
except ImportError:  # pragma: no cover (another grpcio layout: such writes count as INTERNAL)
    CallEnded = type("CallEnded", (Exception,), {})


class InitialMetadata:
    """An RPC's initial metadata: its request id, and its prefix key once the request is parsed
    (prefix_key.py). Sent once, before the first response or the status: a stream
    sends it at its open, as soon as it knows the key; a unary call's goes with its answer or
    its status (the wrapper), so that the call has no headers while it runs (retryable)."""

    def __init__(self, context: grpc.aio.ServicerContext, rid: str) -> None:
        self.context = context
        self.rid = rid
        self.key: str | None = None
        self.sent = False

    async def send(self, key: str | None = None) -> None:
        if self.sent:
            return
        self.sent = True
        key = key or self.key
        pairs = ((request_ids.HEADER, self.rid),) + (((prefix_key.HEADER, key),) if key else ())
        try:
            await self.context.send_initial_metadata(pairs)
        except Exception as err:  # noqa: BLE001 - the call ended first (deadline, cancel, a client gone)
            # nothing can reach the client any more; what ended the call is its status, not this
            log.debug("initial metadata not sent, the call had ended: %s: %s", type(err).__name__, err)


ECHO: contextvars.ContextVar[InitialMetadata] = contextvars.ContextVar("prefixscore_initial_metadata")


async def echo_prefix_key(key: str) -> None:
    """Send the running RPC's initial metadata with its prefix key (see _InitialMetadata)."""
    await ECHO.get().send(key)


def answer_with_prefix_key(key: str) -> None:
    """A unary RPC's prefix key, echoed in the initial metadata sent with its answer, not now:
    until a call has response headers, a proxy (Envoy's retry_on reset) and the client's retry
    policy may send it to another replica, so a replica killed under it loses no request."""
    ECHO.get().key = key


def input_key(query: pb.Input) -> str:
    return prefix_key.for_score(query.text if query.WhichOneof("kind") == "text" else query.token_ids.ids)


def deadline_of(context: grpc.aio.ServicerContext) -> float | None:
    """The call's deadline on time.monotonic() (None: the client set none)."""
    remaining = context.time_remaining()
    return None if remaining is None else time.monotonic() + remaining
