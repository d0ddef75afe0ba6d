"""The client's messages: ScoreService requests built from Python values, responses read back into
typed records. No I/O: the sync and asyncio clients send what these build."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from prefixscore.v1 import score_service_pb2 as pb

Text = str | Sequence[int]  # a text, or its token ids
Metadata = tuple[tuple[str, str], ...] | None  # a call's gRPC metadata (request headers)


@dataclasses.dataclass(frozen=True)
class Usage:
    prompt_tokens: int  # query + all items
    cached_tokens: int  # query tokens served from the server's prefix cache
    items: int


@dataclasses.dataclass(frozen=True)
class Likelihood:
    """An item's own likelihood after its query (natural log, over the whole vocabulary)."""

    logprob: float  # log p(item | query): the sum of token_logprobs
    is_greedy: bool  # greedy decoding after the query would produce the item
    token_logprobs: list[float]  # log p(token i | query, the item's tokens before i)
    greedy: list[bool]  # token i is the argmax at its position
    # with top_logprobs: per item token, the most likely (token id, log-prob) there, most likely first
    top_logprobs: list[list[tuple[int, float]]]


# a stream batch's answer: label scores [items][labels], or a likelihood stream's per item
BatchResult = list[list[float]] | list[Likelihood]


@dataclasses.dataclass(frozen=True)
class ScoreResult:
    scores: list[list[float]]  # [items][labels] ([]: a loglikelihood request)
    usage: Usage
    label_token_ids: list[int]  # the labels scored (resolved by the server when label strings were sent)
    label_names: list[str] = dataclasses.field(default_factory=list)  # a classifier model's columns
    likelihoods: list[Likelihood] = dataclasses.field(default_factory=list)  # a loglikelihood request's, per item


@dataclasses.dataclass(frozen=True)
class RerankedDocument:
    index: int  # the document's index in the request
    relevance_score: float
    document: str


@dataclasses.dataclass(frozen=True)
class RerankResult:
    results: list[RerankedDocument]  # most relevant first
    usage: Usage
    template: str  # the server's reranker template


# a classifier's activation (Score's `activation`)
ACTIVATIONS = {
    "auto": pb.ACTIVATION_UNSPECIFIED,
    "none": pb.ACTIVATION_NONE,
    "sigmoid": pb.ACTIVATION_SIGMOID,
    "softmax": pb.ACTIVATION_SOFTMAX,
}


def _activation(name: str) -> int:
    if name not in ACTIVATIONS:
        raise ValueError(f"activation: {name!r} is not one of {', '.join(ACTIVATIONS)}")
    return ACTIVATIONS[name]


def _input(value: Any, field: str) -> pb.Input:
    if isinstance(value, str):
        return pb.Input(text=value)
    try:
        ids = [int(t) for t in value]
    except TypeError as err:
        raise TypeError(f"{field}: expected a string or a sequence of token ids, got {type(value).__name__}") from err
    return pb.Input(token_ids=pb.TokenIds(ids=ids))


def items_message(items: Sequence[Text]) -> list[pb.Input]:
    """One batch's items (a Score request's or a stream batch's)."""
    if isinstance(items, str):
        raise TypeError("items: expected a list of strings or of token-id lists, got a string")
    return [_input(it, f"items[{j}]") for j, it in enumerate(items)]


def _scoring(
    query: Text,
    label_token_ids: Sequence[int] | None,
    apply_softmax: bool,
    item_first: bool,
    labels: Sequence[str] | None,
    activation: str,
    loglikelihood: bool,
    top_logprobs: int,
) -> dict[str, Any]:
    """The fields a Score request and a stream's open share (the activation checked first)."""
    checked = _activation(activation)
    return {
        "query": _input(query, "query"),
        "label_token_ids": list(label_token_ids or ()),
        "labels": list(labels or ()),
        "apply_softmax": apply_softmax,
        "item_first": item_first,
        "activation": checked,
        "loglikelihood": loglikelihood,
        "top_logprobs": top_logprobs,
    }


def score_request(
    query: Text,
    items: Sequence[Text],
    label_token_ids: Sequence[int] | None = None,
    apply_softmax: bool = False,
    item_first: bool = False,
    labels: Sequence[str] | None = None,
    activation: str = "auto",
    loglikelihood: bool = False,
    top_logprobs: int = 0,
) -> pb.ScoreRequest:
    """Build a ScoreRequest message. activation: a classifier model's auto, none, sigmoid or softmax;
    loglikelihood: each item's own likelihood instead (no labels), with top_logprobs (0-20) per position."""
    fields = _scoring(
        query, label_token_ids, apply_softmax, item_first, labels, activation, loglikelihood, top_logprobs
    )
    return pb.ScoreRequest(items=items_message(items), **fields)


def stream_open(
    query: Text,
    label_token_ids: Sequence[int] | None = None,
    apply_softmax: bool = False,
    item_first: bool = False,
    labels: Sequence[str] | None = None,
    activation: str = "auto",
    loglikelihood: bool = False,
    top_logprobs: int = 0,
) -> pb.ScoreStreamRequest:
    """Build the opening message of a ScoreStream (the options as in score_request)."""
    fields = _scoring(
        query, label_token_ids, apply_softmax, item_first, labels, activation, loglikelihood, top_logprobs
    )
    return pb.ScoreStreamRequest(open=pb.StreamOpen(**fields))


def rerank_request(
    query: str, documents: Sequence[str], instruction: str | None = None, top_n: int = 0, max_tokens_per_doc: int = 0
) -> pb.RerankRequest:
    """Build a RerankRequest message (documents are echoed back)."""
    if isinstance(documents, str):
        raise TypeError("documents: expected a list of strings, got a string")
    return pb.RerankRequest(
        query=query,
        documents=list(documents),
        instruction=instruction or "",
        top_n=top_n,
        return_documents=True,
        max_tokens_per_doc=max_tokens_per_doc,
    )


@dataclasses.dataclass(frozen=True)
class EmbedResult:
    embeddings: list[list[float]]  # [inputs][dimensions], in request order
    usage: Usage  # prompt_tokens: every input whole; cached_tokens: its prompt's, from the prefix cache


def embed_request(
    inputs: Sequence[Text],
    prompt_name: str | None = None,
    prompt: str | None = None,
    dimensions: int = 0,
    normalize: bool | None = None,
    truncate: bool = False,
) -> pb.EmbedRequest:
    """Build an EmbedRequest: texts (after the prompt, tokenized by the server) or token ids."""
    if isinstance(inputs, str):
        raise TypeError("inputs: expected a list of texts or token-id lists, got a string")
    return pb.EmbedRequest(
        inputs=[_input(value, f"inputs[{j}]") for j, value in enumerate(inputs)],
        prompt_name=prompt_name,
        prompt=prompt,
        dimensions=dimensions,
        normalize=normalize,
        truncate=pb.TRUNCATE_END if truncate else pb.TRUNCATE_NONE,
    )


def embed_stream_open(
    prompt_name: str | None = None,
    prompt: str | None = None,
    dimensions: int = 0,
    normalize: bool | None = None,
    truncate: bool = False,
) -> pb.EmbedStreamRequest:
    """Build the opening message of an EmbedStream (the options as in embed_request)."""
    return pb.EmbedStreamRequest(
        open=pb.EmbedStreamOpen(
            prompt_name=prompt_name,
            prompt=prompt,
            dimensions=dimensions,
            normalize=normalize,
            truncate=pb.TRUNCATE_END if truncate else pb.TRUNCATE_NONE,
        )
    )


def embed_result(response: pb.EmbedResponse) -> EmbedResult:
    return EmbedResult(vectors(response.embeddings), usage(response.usage))


def vectors(msgs: Sequence[pb.Embedding]) -> list[list[float]]:
    """Embeddings [inputs][dimensions]."""
    return [list(e.values) for e in msgs]


def usage(msg: pb.Usage) -> Usage:
    return Usage(msg.prompt_tokens, msg.cached_tokens, msg.items)


def scores(msgs: Sequence[pb.ItemScores]) -> list[list[float]]:
    """Probabilities [items][labels]."""
    return [list(m.probabilities) for m in msgs]


def likelihoods(msgs: Sequence[pb.ItemScores]) -> list[Likelihood]:
    """A loglikelihood request's items."""
    out = []
    for m in msgs:
        x = m.likelihood
        tops = [list(zip(t.token_ids, t.logprobs, strict=True)) for t in x.top_logprobs]
        out.append(Likelihood(x.logprob, x.is_greedy, list(x.token_logprobs), list(x.greedy), tops))
    return out


def is_likelihood(msgs: Sequence[pb.ItemScores]) -> bool:
    """Whether the items carry likelihoods (a loglikelihood request's) rather than label scores."""
    return bool(msgs) and msgs[0].HasField("likelihood")


def batch_results(msgs: Sequence[pb.ItemScores]) -> BatchResult:
    """A stream batch's answer: its label scores, or a likelihood stream's likelihoods."""
    return likelihoods(msgs) if is_likelihood(msgs) else scores(msgs)


def score_result(response: pb.ScoreResponse) -> ScoreResult:
    if is_likelihood(response.scores):
        return ScoreResult([], usage(response.usage), [], [], likelihoods(response.scores))
    return ScoreResult(
        scores(response.scores), usage(response.usage), list(response.label_token_ids), list(response.label_names)
    )


def rerank_result(response: pb.RerankResponse) -> RerankResult:
    results = [RerankedDocument(r.index, r.relevance_score, r.document) for r in response.results]
    return RerankResult(results, usage(response.usage), response.template)
