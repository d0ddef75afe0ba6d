"""Request ids: accepted or made, and carried by every log line written while bound."""

import io
import json
import logging

from prefixscore.telemetry import logs, request_ids


def test_log_lines_carry_the_bound_request_id():
    logs.configure("json")
    handler = logging.getLogger("prefixscore").handlers[0]
    buf = io.StringIO()
    handler.setStream(buf)
    log = logging.getLogger("prefixscore.test")
    with request_ids.bound("req-1"):
        logs.event(log, "inside", n=1)
    logs.event(log, "outside")
    inside, outside = (json.loads(line) for line in buf.getvalue().splitlines())
    assert inside["request_id"] == "req-1" and inside["n"] == 1
    assert "request_id" not in outside


def test_client_ids_are_kept_when_well_formed_and_replaced_otherwise():
    assert request_ids.accept("trace-42:a/b") == "trace-42:a/b"
    for bad in (None, "", "has space", 'quote"', "x" * (request_ids.MAX_LENGTH + 1), "nl\n"):
        made = request_ids.accept(bad)
        assert made != bad and len(made) == 32 and int(made, 16) >= 0
