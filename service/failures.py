"""The one error type the service's core hands a transport (`Failure`: a canonical status code,
gRPC's names, which HTTP maps to its statuses, with a message for the client and an optional
retry hint), and how the core's own errors become one."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator

import grpc

from prefixscore.engine.loop.admission import QueueFull
from prefixscore.engine.loop.batcher import NonFiniteScores
from prefixscore.engine.loop.device_loop import DeadlineExpired, WorkerStopped
from prefixscore.engine.requests.invalid_input import InvalidInput
from prefixscore.telemetry import request_ids

log = logging.getLogger("prefixscore.server")


class StartupFailed(RuntimeError):
    """The model could not be loaded or compiled."""


class Failure(Exception):
    """The one error the core hands a transport: ends a request with `code` (gRPC's canonical
    codes; HTTP maps each to a status) and `message`. `retry_after_ms`: when the client may
    retry (admission refusals), sent as gRPC trailing metadata or an HTTP Retry-After."""

    def __init__(self, code: grpc.StatusCode, message: str, retry_after_ms: int | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.retry_after_ms = retry_after_ms


def invalid(err: InvalidInput) -> Failure:
    # INVALID_ARGUMENT also past a size limit: RESOURCE_EXHAUSTED tells clients to retry, and
    # the same request can never succeed (HTTP says 413 for it, from `err.too_large`)
    code = grpc.StatusCode.FAILED_PRECONDITION if err.precondition else grpc.StatusCode.INVALID_ARGUMENT
    return Failure(code, str(err))


def internal_failure(what: str, err: BaseException) -> Failure:
    """INTERNAL that says what failed, not how: paths and device details go to the log only,
    under the request id the client is given to find them."""
    rid = request_ids.current() or request_ids.new_id()
    log.error("%s (request id %s): %s: %s", what, rid, type(err).__name__, err, exc_info=err)
    return Failure(grpc.StatusCode.INTERNAL, f"{what}; request id {rid} (details in the server log)")


def unit_failure(err: BaseException) -> Failure:
    """The status of a unit the device loop finished with an error."""
    if isinstance(err, DeadlineExpired):
        return Failure(grpc.StatusCode.DEADLINE_EXCEEDED, str(err))
    if isinstance(err, WorkerStopped):
        return Failure(grpc.StatusCode.UNAVAILABLE, str(err))
    if isinstance(err, NonFiniteScores):
        return internal_failure("the model produced non-finite scores (NaN or Inf)", err)
    return internal_failure("the device call failed", err)


@contextlib.contextmanager
def admission() -> Iterator[None]:
    """Admission control refusals as failures: RESOURCE_EXHAUSTED with a retry hint."""
    try:
        yield
    except QueueFull as full:
        raise Failure(grpc.StatusCode.RESOURCE_EXHAUSTED, f"server busy: {full}", full.retry_after_ms) from full
    except WorkerStopped as err:
        raise Failure(grpc.StatusCode.UNAVAILABLE, str(err)) from err
