"""Batch lines scored in this process by a `Scorer`: each body validated by the HTTP API's own
pydantic models and validation pass, its response built by the API's own functions
(service/http_schemas.py, http_bodies.py, http_errors.py), so a line's body is what
`POST /v1/score`, `/v1/rerank` or `/v1/embeddings` would answer.
What differs from sending the lines one by one is how they reach the device: a window's
requests are queued together (`EngineRunner.score_requests`), so one query's lines share one
prefill and their items fill the same device calls."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator
from typing import Any

from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ValidationError

from prefixscore.engine.loop.request import TokenizedRequest
from prefixscore.engine.loop.work_unit import WorkUnit
from prefixscore.engine.requests.invalid_input import InvalidInput
from prefixscore.engine.requests.kind import Done, Plan, RequestKind, served
from prefixscore.engine.scorer import Scorer
from prefixscore.offline.lines import BatchLine, answered, failed
from prefixscore.service import http_bodies, http_errors, http_schemas
from prefixscore.telemetry import request_ids

# the device work queued at once: a bound on the host memory of a window's scores
MAX_QUEUED_ITEMS = 16384


# a line's kind: its route's request model, that model as the kind's input, and the kind's name
_ROUTES = {
    "score": (http_schemas.ScoringRequest, http_bodies.score_input, "score"),
    "embed": (http_schemas.EmbeddingRequest, http_bodies.embed_input, "embed"),
    "rerank": (http_schemas.RerankRequest, http_bodies.rerank_input, "rerank"),
}


@dataclasses.dataclass
class _Checked:
    line: BatchLine
    body: BaseModel  # the route's request model
    kind: RequestKind
    checked: Plan

    @property
    def request(self) -> TokenizedRequest:
        (request,) = self.checked.requests  # the batch's kinds plan one engine request each
        return request


class ScorerBackend:
    def __init__(self, scorer: Scorer) -> None:
        self.scorer = scorer

    @property
    def prefills(self) -> int:
        """Prefix cache misses so far: the queries prefilled."""
        registry = self.scorer.runner.worker.metrics.registry
        return int(registry.get_sample_value("prefixscore_prefix_cache_misses_total") or 0)

    def answer(self, groups: list[list[BatchLine]]) -> Iterator[dict[str, Any]]:
        """The output line of every line of a window (groups of one prefix key each)."""
        ready: list[_Checked] = []
        for group in groups:
            for line in group:
                try:
                    ready.append(self._validate(line))
                except (ValidationError, InvalidInput) as err:
                    yield _error_line(line, err)
        chunk: list[_Checked] = []
        items = 0
        for c in ready:  # in group order: a query's lines ride in one chunk (or two, at a boundary)
            chunk.append(c)
            items += len(c.request.items)
            if items >= MAX_QUEUED_ITEMS:
                yield from self._run(chunk)
                chunk, items = [], 0
        yield from self._run(chunk)

    def _validate(self, line: BatchLine) -> _Checked:
        model, as_input, name = _ROUTES[line.kind]
        body = model.model_validate(line.body)
        kind = self.scorer.kinds[name]
        return _Checked(line, body, kind, kind.plan(as_input(body)))  # type: ignore[operator]

    def _run(self, chunk: list[_Checked]) -> Iterator[dict[str, Any]]:
        work = [c for c in chunk if c.request.items]
        try:
            units = self.scorer.runner.run_requests([c.request for c in work])
        except Exception:  # one request the pool cannot take fails the lot: run each alone
            for c in work:
                yield self._alone(c)
        else:
            done = {id(c): unit for c, unit in zip(work, units, strict=True)}
            for c in chunk:
                yield self._body(c, done.get(id(c)))

    def _alone(self, c: _Checked) -> dict[str, Any]:
        try:
            (unit,) = self.scorer.runner.run_requests([c.request])
        except Exception as err:
            rid = request_ids.new_id()
            error = http_schemas.ErrorResponse(message=f"{err}", type="InternalServerError", code=500)
            return failed(c.line.custom_id, rid, 500, error.model_dump())
        return self._body(c, unit)

    def _body(self, c: _Checked, unit: WorkUnit | None) -> dict[str, Any]:
        """The route's response body; `unit` None: a request with no items (no device work)."""
        rid = request_ids.new_id()
        model = c.body.model or self.scorer.model.name  # type: ignore[attr-defined]
        answer = served(c.kind, c.checked, [Done.of(unit)] if unit else [])
        result, cached = answer.result, answer.cached_tokens
        if c.line.kind == "embed":
            body = http_bodies.embed_response(c.checked, result, cached, model, c.body.encoding_format)  # type: ignore[arg-type, attr-defined]
            return answered(c.line.custom_id, rid, body.model_dump())
        if c.line.kind == "rerank":
            body = http_bodies.rerank_response(c.body, c.checked, result, cached, model, rid)  # type: ignore[arg-type]
        else:
            names = self.scorer.cfg.label_names
            response = http_bodies.score_response(c.checked, result, cached, model, names)  # type: ignore[arg-type]
            body = response.model_dump(exclude_none=True)
        return answered(c.line.custom_id, rid, body)


def _error_line(line: BatchLine, err: ValidationError | InvalidInput) -> dict[str, Any]:
    """The HTTP API's 400 (or 413) for a body it would refuse, from its own error mapping."""
    if isinstance(err, ValidationError):
        response = http_errors.bad_body(RequestValidationError(err.errors()))
    else:
        response = http_errors.invalid(err)
    return failed(line.custom_id, request_ids.new_id(), response.status_code, json.loads(bytes(response.body)))
