"""Proto messages <-> the transport-neutral inputs of `engine/requests/validation.py`.

This module only moves fields: every check is the one validation pass in
engine/requests/validation.py, which HTTP and the in-process `Scorer` share (its `InvalidInput`
becomes INVALID_ARGUMENT in service/server.py: a size limit too, retrying cannot help).
"""

from __future__ import annotations

from collections.abc import Sequence

import grpc
import numpy as np
from google.protobuf.message import DecodeError, Message

from prefixscore.engine.loop.work_unit import Reply
from prefixscore.engine.requests.answers import TokenLogprobs
from prefixscore.engine.requests.embedding import EmbedInput, ValidatedEmbed
from prefixscore.engine.requests.likelihood import ItemLikelihood, read_likelihoods
from prefixscore.engine.requests.validation import (
    InvalidInput,
    RerankInput,
    ScoreInput,
    StreamSpec,
    TokenizedRequest,
    Truncation,
    Validated,
    ValidatedRerank,
    Validator,
)
from prefixscore.engine.runtime.token_rows import TokenRows
from prefixscore.service.core import Failure
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


def _items(items: Sequence[pb.Input]) -> list[str | list[int]] | TokenRows:
    """Token-id items straight into one array (integers by the message's type: no check per
    token); texts, or a mix that validation refuses, as a list."""
    if items and all(it.WhichOneof("kind") == "token_ids" for it in items):
        return TokenRows.from_lists([it.token_ids.ids for it in items])
    return [_input(f"items[{j}]", it) for j, it in enumerate(items)]


def _truncate(value: int, default: str) -> str:
    return TRUNCATE.get(value, default)


class RequestConverter:
    """Turns the service's messages into validated requests, through the core's one validator."""

    def __init__(self, validator: Validator) -> None:
        self.validator = validator

    def score_request(self, msg: pb.ScoreRequest) -> Validated:
        """A ScoreRequest -> a validated request; raises InvalidInput."""
        messages = [{"role": m.role, "content": m.content} for m in msg.messages] or None
        return self.validator.score(
            ScoreInput(
                query=None if messages and not msg.HasField("query") else _query(msg),
                items=_items(msg.items),
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
        )

    def rerank_request(self, msg: pb.RerankRequest) -> ValidatedRerank:
        return self.validator.rerank(
            RerankInput(
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
        )

    def stream_open(self, msg: pb.StreamOpen) -> StreamSpec:
        """A StreamOpen -> the stream's validated query, labels and options."""
        return self.validator.stream_open(
            ScoreInput(
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
        )

    def stream_batch(self, spec: StreamSpec, msg: pb.ItemBatch) -> TokenizedRequest:
        """One ItemBatch of an open stream -> a validated TokenizedRequest over the stream's query."""
        return self.validator.stream_batch(spec, _items(msg.items))


def embed_input(msg: pb.EmbedRequest | pb.EmbedStreamOpen, batch: Sequence[pb.Input] = ()) -> EmbedInput:
    """An EmbedRequest, or an EmbedStream's open with one `batch` of its inputs, as the input of
    the embedding validation (engine/requests/embedding.py)."""
    return EmbedInput(
        _items(msg.inputs if isinstance(msg, pb.EmbedRequest) else batch),
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


def item_scores(req: TokenizedRequest, reply: Reply) -> list[pb.ItemScores]:
    """One ItemScores per item: its label scores [labels] (float32 on the wire: no precision
    lost), or a likelihood request's likelihood."""
    if isinstance(req.answer, TokenLogprobs):
        return [
            pb.ItemScores(likelihood=_likelihood(item, req.answer.top_logprobs))
            for item in read_likelihoods(req, reply.answer)
        ]
    return [pb.ItemScores(probabilities=row) for row in reply.answer.tolist()]


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
