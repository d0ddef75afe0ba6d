"""One line of a batch file in (the OpenAI batch format), one line out (vLLM's run-batch format).

Input: `{"custom_id", "method": "POST", "url": "/v1/score" | "/v1/rerank" | "/v1/embeddings", "body"}`, the body
exactly as the HTTP API takes it. Output, one line per input line:

    {"id", "custom_id", "response": {"status_code", "request_id", "body"}, "error"}

`body` is the HTTP API's response body and `error` null on success; on failure `body` is null
and `error` the API's error body (`{"object": "error", "message", ...}`) or, for a line that
could not be read, its message (vLLM's `make_error_request_output`: status 400). A line whose
`custom_id` cannot be read is answered under `line:N` (N: its 1-based line number), so a resumed
run knows it was answered.
"""

from __future__ import annotations

import dataclasses
import json
import uuid
from typing import Any

from prefixscore import prefix_key

# the HTTP API's routes (service/http_api.py) -> what they do
ROUTES = {
    "/v1/score": "score",
    "/v1/rerank": "rerank",
    "/v2/rerank": "rerank",
    "/rerank": "rerank",
    "/v1/embeddings": "embed",
}


@dataclasses.dataclass(frozen=True)
class BatchLine:
    """A readable request line; the body is not validated yet (the backend validates it as the
    HTTP API does)."""

    number: int  # 1-based line number in the input file
    custom_id: str
    kind: str  # "score", "rerank" or "embed"
    body: dict[str, Any]

    @property
    def key(self) -> str:
        """The prefix key (prefix_key.py) of the query the line scores against: lines with
        one key share one prefill; "" when the body has no usable query (it fails validation)."""
        if self.kind == "embed":  # lines with one prompt share its prefill
            name = self.body.get("prompt_name")
            return prefix_key.for_embed(name) if name is None or isinstance(name, str) else ""
        query = self.body.get("query")
        if self.kind == "rerank":
            instruction = self.body.get("instruction")
            ok = isinstance(query, str) and (instruction is None or isinstance(instruction, str))
            return prefix_key.for_rerank(query, instruction) if ok else ""
        if isinstance(query, str):
            return prefix_key.for_score(query)
        if isinstance(query, list) and query and all(isinstance(t, int) and not isinstance(t, bool) for t in query):
            return prefix_key.for_score(query) if all(0 <= t < 1 << 31 for t in query) else ""
        return ""

    @property
    def items(self) -> int:
        """How many items (documents, inputs) the line scores, for progress."""
        if self.kind == "embed":
            inputs = self.body.get("input")
            if isinstance(inputs, list) and inputs and all(isinstance(t, int) for t in inputs):
                return 1  # one input's token ids
            return 1 if isinstance(inputs, str) else len(inputs) if isinstance(inputs, list) else 0
        many = self.body.get("documents" if self.kind == "rerank" else "items")
        return 1 if isinstance(many, str) else len(many) if isinstance(many, list) else 0


@dataclasses.dataclass(frozen=True)
class BadLine:
    """A line that is not a request: answered with an error line of its own."""

    number: int
    custom_id: str
    message: str


def parse(number: int, raw: bytes) -> BatchLine | BadLine:
    """A line of the input file -> the request, or why it is not one."""
    try:
        obj = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        return BadLine(number, f"line:{number}", f"line {number}: not JSON: {err}")
    if not isinstance(obj, dict):
        return BadLine(number, f"line:{number}", f"line {number}: expected a JSON object")
    custom_id = obj.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        return BadLine(number, f"line:{number}", f"line {number}: custom_id: expected a non-empty string")
    method = obj.get("method", "POST")
    if method != "POST":
        return BadLine(number, custom_id, f"method: only POST is supported, got {method!r}")
    url = obj.get("url")
    if url not in ROUTES:
        return BadLine(number, custom_id, f"url: {url!r} is not one of {', '.join(ROUTES)}")
    body = obj.get("body")
    if not isinstance(body, dict):
        return BadLine(number, custom_id, "body: expected a JSON object")
    return BatchLine(number, custom_id, ROUTES[url], body)


def answered(custom_id: str, request_id: str | None, body: Any) -> dict[str, Any]:
    """The output line of a request the API answered."""
    response = {"status_code": 200, "request_id": request_id or _request_id(), "body": body}
    return {"id": _line_id(), "custom_id": custom_id, "response": response, "error": None}


def failed(custom_id: str, request_id: str | None, status: int, error: Any) -> dict[str, Any]:
    """The output line of a request that failed: `error` is the API's error body, or a message;
    `request_id` None where no server saw it (a new one, as vLLM's)."""
    response = {"status_code": status, "request_id": request_id or _request_id(), "body": None}
    return {"id": _line_id(), "custom_id": custom_id, "response": response, "error": error}


def _request_id() -> str:
    return f"prefixscore-batch-{uuid.uuid4().hex}"


def _line_id() -> str:
    return f"prefixscore-{uuid.uuid4().hex}"
