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
from prefixscore.engine.requests.embedding import ValidatedEmbed
from prefixscore.engine.requests.validation import InvalidInput, Validated, ValidatedRerank
from prefixscore.engine.scorer import Scorer
from prefixscore.offline.lines import BatchLine, answered, failed
from prefixscore.service import http_bodies, http_errors, http_schemas
from prefixscore.telemetry import request_ids

# the device work queued at once: a bound on the host memory of a window's scores
MAX_QUEUED_ITEMS = 16384


@dataclasses.dataclass
class _Checked:
    line: BatchLine
    body: BaseModel  # the route's request model
    checked: Validated | ValidatedRerank | ValidatedEmbed

    @property
    def request(self) -> TokenizedRequest:
        c = self.checked
        return c.scored.request if isinstance(c, ValidatedRerank) else c.request


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
        validator = self.scorer.validator
        if line.kind == "score":
            body = http_schemas.ScoringRequest.model_validate(line.body)
            return _Checked(line, body, validator.score(http_bodies.score_input(body)))
        if line.kind == "embed":
            body = http_schemas.EmbeddingRequest.model_validate(line.body)
            return _Checked(line, body, self.scorer.embeddings.validate(http_bodies.embed_input(body)))
        body = http_schemas.RerankRequest.model_validate(line.body)
        return _Checked(line, body, validator.rerank(http_bodies.rerank_input(body)))

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
        scores, cached = (unit.reply.answer, unit.reply.cached_tokens) if unit is not None else (None, 0)
        if isinstance(c.checked, ValidatedEmbed):
            assert unit is not None  # an embedding request has inputs
            vectors = c.checked.finish(unit.reply.answer)
            body = http_bodies.embed_response(c.checked, vectors, cached, model, c.body.encoding_format)  # type: ignore[attr-defined]
            return answered(c.line.custom_id, rid, body.model_dump())
        if isinstance(c.checked, ValidatedRerank):
            body = http_bodies.rerank_response(c.body, c.checked, scores, cached, model, rid)  # type: ignore[arg-type]
        else:
            names = self.scorer.cfg.label_names
            body = http_bodies.score_response(c.checked, scores, cached, model, names).model_dump(exclude_none=True)
        return answered(c.line.custom_id, rid, body)


def _error_line(line: BatchLine, err: ValidationError | InvalidInput) -> dict[str, Any]:
    """The HTTP API's 400 (or 413) for a body it would refuse, from its own error mapping."""
    if isinstance(err, ValidationError):
        response = http_errors.bad_body(RequestValidationError(err.errors()))
    else:
        response = http_errors.invalid(err)
    return failed(line.custom_id, request_ids.new_id(), response.status_code, json.loads(bytes(response.body)))
