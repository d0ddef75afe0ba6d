"""Structured logs: one JSON object (or key=value line) per event, to stderr.

Use `event(log, "name", key=value, ...)`; the fields land as top-level keys, so
log pipelines can filter on them (e.g. `event == "ready"`).
"""

from __future__ import annotations

import json
import logging
import sys
import time
from typing import Any

from prefixscore.telemetry import request_ids

_FIELDS = "prefixscore_fields"


def _fields(record: logging.LogRecord) -> dict[str, Any]:
    """The event's fields, with the request id bound where it was logged (if any)."""
    fields = dict(getattr(record, _FIELDS, {}))
    rid = getattr(record, "request_id", None)
    if rid is not None:
        fields.setdefault("request_id", rid)
    return fields


class _RequestIdFilter(logging.Filter):
    """Stamps each record with the request id bound in the logging context (request_ids.bound)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if getattr(record, "request_id", None) is None:
            record.request_id = request_ids.current()
        return True


class JsonFormatter(logging.Formatter):
    """{"ts": ..., "level": ..., "logger": ..., "event": ..., **fields}"""

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "ts": round(record.created, 3),
            "level": record.levelname.lower(),
            "logger": record.name,
            "event": record.getMessage(),
        }
        out.update(_fields(record))
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str)


class KeyValueFormatter(logging.Formatter):
    """ts=... level=... event=... key=value ..."""

    def format(self, record: logging.LogRecord) -> str:
        ts = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
        parts = [f"ts={ts}", f"level={record.levelname.lower()}", f"event={record.getMessage()}"]
        for key, value in _fields(record).items():
            text = value if isinstance(value, str) else json.dumps(value, default=str, separators=(",", ":"))
            quote = not text or any(c in text for c in ' ="')
            parts.append(f"{key}={json.dumps(text) if quote else text}")
        line = " ".join(parts)
        if record.exc_info:
            line += "\n" + self.formatException(record.exc_info)
        return line


def configure(fmt: str = "json", level: str = "INFO") -> None:
    """Route the `prefixscore` loggers to stderr in `fmt` ("json" or "text")."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else KeyValueFormatter())
    handler.addFilter(_RequestIdFilter())
    root = logging.getLogger("prefixscore")
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    root.propagate = False


def event(log: logging.Logger, name: str, level: int = logging.INFO, **fields: Any) -> None:
    """Log event `name` with structured `fields`."""
    log.log(level, name, extra={_FIELDS: fields})
