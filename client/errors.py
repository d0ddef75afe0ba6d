"""What the client makes of the server's errors: a refused stream batch, the retry hint of a full
queue, and which failures mean the replica went away (what `Retry` retries)."""

from __future__ import annotations

import grpc

_CODES = {code.value[0]: code for code in grpc.StatusCode}  # the wire's number -> grpc.StatusCode


def status_code(value: int) -> grpc.StatusCode:
    """The status code a stream's `refused` answer carries as a number."""
    return _CODES.get(value, grpc.StatusCode.UNKNOWN)


def retry_after_ms(err: grpc.RpcError) -> int | None:
    """The server's retry hint on RESOURCE_EXHAUSTED, in milliseconds (None if absent)."""
    trailers = err.trailing_metadata() if hasattr(err, "trailing_metadata") else None
    for key, value in trailers or ():
        if key == "retry-after-ms":
            return int(value)
    return None


class BatchRefused(Exception):
    """The server did not take one batch of a stream (its queue was full): raised by `result`
    for that batch only; the stream stays open. Send the items again after `retry_after_ms`."""

    def __init__(self, batch_id: int, code: grpc.StatusCode, details: str, retry_after_ms: int) -> None:
        super().__init__(f"batch {batch_id} refused ({code.name}): {details}")
        self.batch_id = batch_id
        self.code = code
        self.details = details
        self.retry_after_ms = retry_after_ms


def stream_reset(err: grpc.RpcError) -> bool:
    """A call whose HTTP/2 stream was reset under it (INTERNAL "Received RST_STREAM"): what a
    proxy such as Envoy does to a call whose replica dies after the call's response headers went
    through (a stream's at its open, a unary call's with its answer). The server never ends a
    call so: its own errors are a status in the trailers."""
    return err.code() == grpc.StatusCode.INTERNAL and "RST_STREAM" in (err.details() or "")


def replica_lost(err: grpc.RpcError) -> bool:
    """A call whose replica or connection went away: UNAVAILABLE, or its stream reset (`stream_reset`)."""
    return err.code() == grpc.StatusCode.UNAVAILABLE or stream_reset(err)
