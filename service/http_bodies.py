"""One HTTP body in, one response body out, for the routes (service/http_api.py) and
`prefixscore batch` (offline/): a request model as a request kind's input (engine/requests/kind.py),
and the kind's result as the response model. Nothing here knows the service or the event loop."""

from __future__ import annotations

import base64
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from prefixscore.engine.requests.classify import ClassifyInput, ValidatedClassify
from prefixscore.engine.requests.embedding import EmbedInput, ValidatedEmbed
from prefixscore.engine.requests.invalid_input import InvalidInput
from prefixscore.engine.requests.rerank import RerankInput, ValidatedRerank
from prefixscore.engine.requests.score import ScoreInput, Validated
from prefixscore.engine.requests.templates import Ranked
from prefixscore.engine.requests.truncation import Truncation
from prefixscore.service.http_schemas import (
    CachedTokens,
    ClassifyData,
    ClassifyRequest,
    ClassifyResponse,
    ClassifyUsage,
    EmbeddingData,
    EmbeddingRequest,
    EmbeddingResponse,
    EmbeddingUsage,
    EmbedRequest,
    RerankRequest,
    ScoringRequest,
    ScoringResponse,
    ScoringUsage,
)


def score_input(body: ScoringRequest) -> ScoreInput:
    """A /v1/score body as the score kind's input."""
    items = [body.items] if isinstance(body.items, str) else body.items
    return ScoreInput(
        query=body.query,
        items=items,
        label_token_ids=body.label_token_ids or (),
        labels=body.labels or (),
        apply_softmax=body.apply_softmax,
        item_first=body.item_first,
        truncate=body.truncate,
        truncation_side=body.truncation_side,
        query_truncation=body.query_truncation,
        max_query_tokens=body.max_query_tokens,
        check_tokenization=body.check_tokenization,
        activation=body.activation or "auto",
        messages=body.messages,
    )


def score_response(
    checked: Validated, scores: np.ndarray, cached: int, model: str, label_names: Sequence[str] = ()
) -> ScoringResponse:
    """The /v1/score response of a validated request and its scores [items, labels];
    label_names: a classifier's (its scores' columns), none for a causal LM."""
    req = checked.request
    return ScoringResponse(
        scores=scores.tolist(),
        model=model,
        usage=_score_usage(req.prompt_tokens, cached, len(req.items), checked.truncation),
        joined_tokenization_differs=checked.joined_differs,
        label_names=list(label_names) or None,
    )


def _score_usage(prompt_tokens: int, cached: int, items: int, t: Truncation) -> ScoringUsage:
    return ScoringUsage(
        prompt_tokens=prompt_tokens,
        total_tokens=prompt_tokens,
        prompt_tokens_details=CachedTokens(cached_tokens=cached),
        items=items,
        truncated_query_tokens=t.query_tokens,
        truncated_items=list(t.items),
        truncated_item_tokens=t.item_tokens,
    )


def rerank_input(body: RerankRequest) -> RerankInput:
    """A /v1/rerank body as the rerank kind's input."""
    return RerankInput(
        query=body.query,
        documents=[d if isinstance(d, str) else d.text for d in body.documents],
        instruction=body.instruction,
        top_n=body.top_n,
        return_documents=body.return_documents,
        max_tokens_per_doc=body.max_tokens_per_doc,
        truncate=body.truncate,
        truncation_side=body.truncation_side,
        check_tokenization=body.check_tokenization,
    )


def rerank_response(
    body: RerankRequest, checked: ValidatedRerank, ranked: list[Ranked], cached: int, model: str, rid: str
) -> dict[str, Any]:
    """The /v1/rerank response of a validated request and its ranked documents, as plain data
    (`RerankResponse`'s shape): a model per result cost more host time than the rest of the response."""
    req = checked.scored.request
    results: list[dict[str, Any]] = []
    differs = checked.scored.joined_differs
    for r in ranked:
        result: dict[str, Any] = {"index": r.index, "relevance_score": r.relevance_score}
        if body.return_documents:
            doc = body.documents[r.index]
            result["document"] = {"text": doc} if isinstance(doc, str) else doc.model_dump()
        if differs:
            result["joined_tokenization_differs"] = differs[r.index]
        results.append(result)
    t = checked.scored.truncation
    usage = {
        "prompt_tokens": req.prompt_tokens,
        "total_tokens": req.prompt_tokens,
        "cached_tokens": cached,
        "documents": len(req.items),
        "truncated_documents": list(t.items),
        "truncated_tokens": t.item_tokens,
    }
    return {"id": f"rerank-{rid}", "model": model, "results": results, "usage": usage}


def embed_input(body: EmbeddingRequest) -> EmbedInput:
    """A /v1/embeddings body as the input of the embedding validation (engine/requests/embedding.py)."""
    return EmbedInput(
        body.input,
        body.prompt_name,
        body.prompt,
        body.dimensions,
        body.normalize,
        body.truncate,
        body.truncation_direction,
    )


def tei_embed_input(body: EmbedRequest) -> EmbedInput:
    """A TEI /embed body as the input of the embedding validation."""
    direction = body.truncation_direction.lower()
    return EmbedInput(body.inputs, body.prompt_name, None, body.dimensions, body.normalize, body.truncate, direction)


def embed_response(
    checked: ValidatedEmbed, embeddings: np.ndarray, cached: int, model: str, encoding_format: str
) -> EmbeddingResponse:
    """OpenAI's /v1/embeddings response; `embeddings`: [inputs, dimensions] float32. base64 is the
    little-endian float32 bytes of each vector, as the OpenAI SDK decodes it."""
    if encoding_format == "base64":
        vectors: list = [base64.b64encode(row.astype("<f4").tobytes()).decode() for row in embeddings]
    else:
        vectors = embeddings.tolist()
    data = [EmbeddingData(index=j, embedding=vector) for j, vector in enumerate(vectors)]
    usage = EmbeddingUsage(
        prompt_tokens=checked.prompt_tokens,
        total_tokens=checked.prompt_tokens,
        prompt_tokens_details=CachedTokens(cached_tokens=cached),
    )
    return EmbeddingResponse(data=data, model=model, usage=usage)


def classify_input(body: ClassifyRequest, labels: Sequence[str]) -> ClassifyInput:
    """A /v1/classify body as the classify kind's input; `labels`: a
    causal LM's label strings (the server's --classify-labels). vLLM's `use_activation: false` is
    activation 'none'."""
    activation = body.activation or ("none" if body.use_activation is False else "auto")
    if body.use_activation is False and activation != "none":
        raise InvalidInput("use_activation", f"false contradicts activation {activation!r}")
    return ClassifyInput(body.input, body.truncate_prompt_tokens, activation, labels, body.messages)


def classify_response(
    checked: ValidatedClassify, scores: np.ndarray, cached: int, model: str, rid: str
) -> ClassifyResponse:
    """The /v1/classify response of a validated request; `scores`: [inputs, labels]."""
    names = checked.label_names
    data = [
        ClassifyData(index=j, label=names[int(row.argmax())], probs=row.tolist(), num_classes=len(names))
        for j, row in enumerate(scores)
    ]
    usage = ClassifyUsage(
        prompt_tokens=checked.prompt_tokens,
        total_tokens=checked.prompt_tokens,
        prefix_tokens=len(checked.request.prefix),
        prompt_tokens_details=CachedTokens(cached_tokens=cached),
        truncated_inputs=list(checked.truncated_inputs),
    )
    return ClassifyResponse(id=f"classify-{rid}", created=int(time.time()), model=model, data=data, usage=usage)
