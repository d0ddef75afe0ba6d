"""Proto messages <-> the inputs and results of the request kinds (engine/requests/kind.py).

This module only moves fields: every check is the kind's own validation, which HTTP and the
in-process `Scorer` share (its `InvalidInput` becomes INVALID_ARGUMENT in service/server.py: a
size limit too, retrying cannot help).
"""

from __future__ import annotations

from collections.abc import Sequence

import grpc
import numpy as np
from google.protobuf.message import DecodeError, Message

from prefixscore.engine.loop.request import TokenizedRequest
from prefixscore.engine.requests.answers import TokenLogprobs
from prefixscore.engine.requests.embedding import EmbedInput, ValidatedEmbed
from prefixscore.engine.requests.invalid_input import InvalidInput
from prefixscore.engine.requests.likelihood import ItemLikelihood
from prefixscore.engine.requests.rerank import RerankInput
from prefixscore.engine.requests.score import ScoreInput
from prefixscore.engine.requests.truncation import Truncation
from prefixscore.engine.runtime.token_rows import TokenRows
from prefixscore.service.failures import Failure
from prefixscore.v1 import score_service_pb2 as pb

TRUNCATE = {pb.TRUNCATE_NONE: "none", pb.TRUNCATE_END: "end"}
TRUNCATION_SIDE = {
    pb.TRUNCATION_SIDE_UNSPECIFIED: "right",
    pb.TRUNCATION_SIDE_LEFT: "left",
    pb.TRUNCATION_SIDE_RIGHT: "right",
}
QUERY_TRUNCATION = {
    pb.QUERY_TRUNCATION_UNSPECIFIED: "none",
    pb.QUERY_TRUNCATION_NONE: "none",
    pb.QUERY_TRUNCATION_LEFT: "left",
    pb.QUERY_TRUNCATION_RIGHT: "right",
}

ACTIVATION = {
    pb.ACTIVATION_UNSPECIFIED: "auto",
    pb.ACTIVATION_NONE: "none",
    pb.ACTIVATION_SIGMOID: "sigmoid",
    pb.ACTIVATION_SOFTMAX: "softmax",
}


def parse(cls: type[Message], raw: bytes, field: str = "request") -> Message:
    """Deserialize here, not in gRPC, so that undecodable bytes get INVALID_ARGUMENT naming the field."""
    try:
        return cls.FromString(raw)
    except DecodeError as err:
        raise Failure(
            grpc.StatusCode.INVALID_ARGUMENT, f"{field}: not a valid {cls.DESCRIPTOR.full_name} message ({err})"
        ) from err


def _input(field: str, value: pb.Input) -> str | list[int]:
    kind = value.WhichOneof("kind")
    if kind == "text":
        return value.text
    if kind == "token_ids":
        return list(value.token_ids.ids)
    raise InvalidInput(field, "set either text or token_ids")


def _query(msg: pb.ScoreRequest | pb.StreamOpen) -> str | list[int]:
    if not msg.HasField("query"):
        raise InvalidInput("query", "is required (set query.text or query.token_ids)")
    return _input("query", msg.query)


def items_of(items: Sequence[pb.Input]) -> list[str | list[int]] | TokenRows:
    """Token-id items straight into one array (integers by the message's type: no check per
    token); texts, or a mix that validation refuses, as a list."""
    if items and all(it.WhichOneof("kind") == "token_ids" for it in items):
        return TokenRows.from_lists([it.token_ids.ids for it in items])
    return [_input(f"items[{j}]", it) for j, it in enumerate(items)]


def _truncate(value: int, default: str) -> str:
    return TRUNCATE.get(value, default)


def score_kind(inp: ScoreInput) -> str:
    """The kind a ScoreRequest (or a stream's open) asks for: label scores, or with
    `loglikelihood` the items' own likelihood."""
    return "likelihood" if inp.loglikelihood else "score"


def score_input(msg: pb.ScoreRequest) -> ScoreInput:
    """A ScoreRequest as the score (or likelihood) kind's input."""
    messages = [{"role": m.role, "content": m.content} for m in msg.messages] or None
    return ScoreInput(
        query=None if messages and not msg.HasField("query") else _query(msg),
        items=items_of(msg.items),
        label_token_ids=list(msg.label_token_ids),
        labels=list(msg.labels),
        apply_softmax=msg.apply_softmax,
        item_first=msg.item_first,
        truncate=_truncate(msg.truncate, "none"),
        truncation_side=TRUNCATION_SIDE.get(msg.truncation_side, str(msg.truncation_side)),
        query_truncation=QUERY_TRUNCATION.get(msg.query_truncation, "none"),
        max_query_tokens=msg.max_query_tokens or None,
        check_tokenization=msg.check_tokenization,
        activation=ACTIVATION.get(msg.activation, str(msg.activation)),
        messages=messages,
        loglikelihood=msg.loglikelihood,
        top_logprobs=msg.top_logprobs,
    )


def rerank_input(msg: pb.RerankRequest) -> RerankInput:
    return RerankInput(
        query=msg.query,
        documents=list(msg.documents),
        instruction=msg.instruction or None,
        top_n=msg.top_n or None,
        return_documents=msg.return_documents,
        max_tokens_per_doc=msg.max_tokens_per_doc or None,
        truncate=_truncate(msg.truncate, "end"),
        truncation_side=TRUNCATION_SIDE.get(msg.truncation_side, str(msg.truncation_side)),
        check_tokenization=msg.check_tokenization,
    )


def stream_open_input(msg: pb.StreamOpen) -> ScoreInput:
    """A StreamOpen as the input of its kind's `stream_open` (no items yet)."""
    return ScoreInput(
        query=_query(msg),
        items=[],
        label_token_ids=list(msg.label_token_ids),
        labels=list(msg.labels),
        apply_softmax=msg.apply_softmax,
        item_first=msg.item_first,
        activation=ACTIVATION.get(msg.activation, str(msg.activation)),
        loglikelihood=msg.loglikelihood,
        top_logprobs=msg.top_logprobs,
    )


def embed_input(msg: pb.EmbedRequest | pb.EmbedStreamOpen, batch: Sequence[pb.Input] = ()) -> EmbedInput:
    """An EmbedRequest, or an EmbedStream's open with one `batch` of its inputs, as the input of
    the embedding validation (engine/requests/embedding.py)."""
    return EmbedInput(
        items_of(msg.inputs if isinstance(msg, pb.EmbedRequest) else batch),
        msg.prompt_name if msg.HasField("prompt_name") else None,
        msg.prompt if msg.HasField("prompt") else None,
        msg.dimensions or None,
        msg.normalize if msg.HasField("normalize") else None,
        _truncate(msg.truncate, "none") == "end",
        TRUNCATION_SIDE.get(msg.truncation_side, str(msg.truncation_side)),
    )


def embeddings(vectors: np.ndarray) -> list[pb.Embedding]:
    return [pb.Embedding(values=row) for row in vectors.tolist()]


def embed_response(checked: ValidatedEmbed, vectors: np.ndarray, cached_tokens: int) -> pb.EmbedResponse:
    """One Embedding per input, in order, and the request's usage."""
    return pb.EmbedResponse(
        embeddings=embeddings(vectors),
        usage=pb.Usage(
            prompt_tokens=checked.prompt_tokens,
            cached_tokens=cached_tokens,
            items=len(vectors),
            truncated_items=checked.truncated,
        ),
    )


def usage(req: TokenizedRequest, cached_tokens: int, truncation: Truncation) -> pb.Usage:
    return pb.Usage(
        prompt_tokens=req.prompt_tokens,
        cached_tokens=cached_tokens,
        items=len(req.items),
        truncated_query_tokens=truncation.query_tokens,
        truncated_items=truncation.items,
        truncated_item_tokens=truncation.item_tokens,
    )


def item_scores(req: TokenizedRequest, result: np.ndarray | list[ItemLikelihood]) -> list[pb.ItemScores]:
    """One ItemScores per item: its label scores [labels] (float32 on the wire: no precision
    lost), or a likelihood request's likelihood."""
    if isinstance(req.answer, TokenLogprobs):
        top = req.answer.top_logprobs
        return [pb.ItemScores(likelihood=_likelihood(item, top)) for item in result]  # type: ignore[union-attr]
    return [pb.ItemScores(probabilities=row) for row in result.tolist()]  # type: ignore[union-attr]


def _likelihood(item: ItemLikelihood, top: int) -> pb.ItemLikelihood:
    """One item's likelihood, with the `top` most likely tokens at each position (0: none)."""
    tops = (
        [
            pb.TopLogprobs(token_ids=ids[:top].tolist(), logprobs=logprobs[:top].tolist())
            for ids, logprobs in zip(item.top_ids, item.top_logprobs, strict=True)
        ]
        if top
        else []
    )
    return pb.ItemLikelihood(
        logprob=item.total,
        is_greedy=item.is_greedy,
        token_logprobs=item.logprobs.tolist(),
        greedy=item.greedy.tolist(),
        top_logprobs=tops,
    )
