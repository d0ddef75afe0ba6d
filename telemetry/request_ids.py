"""Request ids: one id per client request, carried in logs and errors.

Clients may send their own id (HTTP header or gRPC metadata key
`x-request-id`); when absent, the server makes one. The id is bound to the
handling task with a context variable, so every log line written while the
request is handled carries it (see `logs.py`), and a client-facing error can
name it instead of internals.
"""

from __future__ import annotations

import contextlib
import contextvars
import re
import uuid
from collections.abc import Iterator

HEADER = "x-request-id"  # HTTP header and gRPC metadata key (lower case, as gRPC requires)
MAX_LENGTH = 128
# Printable ASCII without spaces or quotes: safe to echo in headers and log lines.
_ACCEPTED = re.compile(r"[A-Za-z0-9._:/+=@-]{1,128}")  # 128: MAX_LENGTH

_current: contextvars.ContextVar[str | None] = contextvars.ContextVar("prefixscore_request_id", default=None)


def new_id() -> str:
    """A fresh id: 32 hex digits."""
    return uuid.uuid4().hex


def accept(sent: str | None) -> str:
    """The client's id when it is well formed, else a fresh one (a bad id is replaced, not an error)."""
    if sent is not None and _ACCEPTED.fullmatch(sent):
        return sent
    return new_id()


def current() -> str | None:
    """The id of the request being handled in this context, if any."""
    return _current.get()


@contextlib.contextmanager
def bound(request_id: str) -> Iterator[str]:
    """Bind `request_id` for the duration of the block (logs written inside carry it)."""
    token = _current.set(request_id)
    try:
        yield request_id
    finally:
        _current.reset(token)
