"""The ScoreService client written once for the sync and the asyncio client: its channel and
metadata (the bearer token, each call's prefix key) and its calls as steps (steps.py). The client
classes (client/score_client.py) only say how they wait: the channel kind, the sleep, the runner
of steps, and how a stream session opens."""

from __future__ import annotations

import abc
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any, Generic, TypeVar

import grpc

from prefixscore import prefix_key
from prefixscore.client.channel import Affinity, channel_options
from prefixscore.client.messages import (
    EmbedResult,
    Metadata,
    RerankResult,
    ScoreResult,
    Text,
    embed_request,
    embed_result,
    embed_stream_open,
    rerank_request,
    rerank_result,
    score_request,
    score_result,
    stream_open,
)
from prefixscore.client.retry import Retry, unary_steps
from prefixscore.client.steps import Steps
from prefixscore.v1 import score_service_pb2 as pb
from prefixscore.v1 import score_service_pb2_grpc as pb_grpc

# What each call returns: the result itself (ScoreClient) or an awaitable of it (AsyncScoreClient)
ScoreOut = TypeVar("ScoreOut")
RerankOut = TypeVar("RerankOut")
StreamOut = TypeVar("StreamOut")


def auth_metadata(token: str | None) -> Metadata:
    return (("authorization", f"Bearer {token}"),) if token else None


def keyed(metadata: Metadata, key: str | None) -> Metadata:
    """A call's metadata with its prefix key: a router (deploy/envoy) sends every call over one
    query to the replica that caches it (prefix_key.py). None: the client sends none."""
    return (*(metadata or ()), (prefix_key.HEADER, key)) if key is not None else metadata


class ClientCore(abc.ABC, Generic[ScoreOut, RerankOut, StreamOut]):
    """The calls of both clients (see `ScoreClient` for the arguments). A subclass names its
    channel constructors (grpc's or grpc.aio's), `_sleep`, `_run` (steps.run_blocking or
    steps.run_awaiting) and `_open_stream`."""

    _insecure_channel: Callable[..., Any]
    _secure_channel: Callable[..., Any]
    _sleep: Callable[[float], Any]
    _run: Callable[[Steps[Any]], Any]

    def __init__(
        self,
        target: str,
        options: Sequence[tuple[str, Any]] = (),
        credentials: grpc.ChannelCredentials | None = None,
        token: str | None = None,
        affinity: Affinity = None,
        send_prefix_key: bool = True,
        retry: Retry | None = None,
    ) -> None:
        self.target = target
        self._send_key = send_prefix_key
        self._retry = retry
        opts = channel_options(options, affinity, retry)
        if credentials is None:
            self._channel = self._insecure_channel(target, options=opts)
        else:
            self._channel = self._secure_channel(target, credentials, options=opts)
        self._metadata = auth_metadata(token)
        self._stub = pb_grpc.ScoreServiceStub(self._channel)

    def score(
        self,
        query: Text,
        items: Sequence[Text],
        label_token_ids: Sequence[int] | None = None,
        apply_softmax: bool = False,
        item_first: bool = False,
        labels: Sequence[str] | None = None,
        timeout: float | None = None,
        activation: str = "auto",
    ) -> ScoreOut:
        """Probabilities [items][labels] of each label as the next token after query + item."""

        def steps() -> Steps[ScoreResult]:
            request = score_request(query, items, label_token_ids, apply_softmax, item_first, labels, activation)
            metadata = self._call_metadata(partial(prefix_key.for_score, query))
            return score_result((yield from self._unary_steps(self._stub.Score, request, timeout, metadata)))

        return self._run(steps())

    def loglikelihood(
        self, query: Text, items: Sequence[Text], top_logprobs: int = 0, timeout: float | None = None
    ) -> ScoreOut:
        """Each item's own likelihood after `query` (ScoreResult.likelihoods): log p(item | query),
        whether greedy decoding gives it, and per token its log-prob and, with top_logprobs (up
        to 20), the most likely tokens there. A text query gets the model's start tokens."""

        def steps() -> Steps[ScoreResult]:
            request = score_request(query, items, loglikelihood=True, top_logprobs=top_logprobs)
            metadata = self._call_metadata(partial(prefix_key.for_score, query))
            return score_result((yield from self._unary_steps(self._stub.Score, request, timeout, metadata)))

        return self._run(steps())

    def stream(
        self,
        query: Text,
        label_token_ids: Sequence[int] | None = None,
        apply_softmax: bool = False,
        item_first: bool = False,
        labels: Sequence[str] | None = None,
        timeout: float | None = None,
        activation: str = "auto",
        loglikelihood: bool = False,
        top_logprobs: int = 0,
    ) -> StreamOut:
        """Open a ScoreStream session over `query` (returns once the server has its KV on the device).
        loglikelihood: every batch's items are scored by their own likelihood (as `loglikelihood`)."""

        def steps() -> Steps[Any]:
            opening = stream_open(
                query, label_token_ids, apply_softmax, item_first, labels, activation, loglikelihood, top_logprobs
            )
            metadata = self._call_metadata(partial(prefix_key.for_score, query))
            return (yield partial(self._open_stream, opening, timeout, metadata))

        return self._run(steps())

    def rerank(
        self,
        query: str,
        documents: Sequence[str],
        instruction: str | None = None,
        top_n: int = 0,
        max_tokens_per_doc: int = 0,
        timeout: float | None = None,
    ) -> RerankOut:
        """Documents sorted by the server template's relevance to `query` (top_n: only the first N)."""

        def steps() -> Steps[RerankResult]:
            request = rerank_request(query, documents, instruction, top_n, max_tokens_per_doc)
            metadata = self._call_metadata(partial(prefix_key.for_rerank, query, instruction))
            return rerank_result((yield from self._unary_steps(self._stub.Rerank, request, timeout, metadata)))

        return self._run(steps())

    def embed(
        self,
        inputs: Sequence[Text],
        prompt_name: str | None = None,
        prompt: str | None = None,
        dimensions: int = 0,
        normalize: bool | None = None,
        truncate: bool = False,
        timeout: float | None = None,
    ) -> Any:
        """Each input's embedding (`EmbedResult`; awaitable from the asyncio client), pooled as the
        served checkpoint says: texts after `prompt_name`'s prompt (unset: the model's default) or
        `prompt`, or token ids as given; `dimensions` (0: all) kept, then normalized."""

        def steps() -> Steps[EmbedResult]:
            request = embed_request(inputs, prompt_name, prompt, dimensions, normalize, truncate)
            return embed_result((yield from self._unary_steps(self._stub.Embed, request, timeout, self._metadata)))

        return self._run(steps())

    def embed_stream(
        self,
        prompt_name: str | None = None,
        prompt: str | None = None,
        dimensions: int = 0,
        normalize: bool | None = None,
        truncate: bool = False,
        timeout: float | None = None,
    ) -> StreamOut:
        """Open an EmbedStream session: the prompt (as in `embed`) prefilled once and pinned while
        it is open; each batch sent (`send`, or `submit` then `result`) gives its inputs'
        embeddings [inputs][dimensions], as `embed` does. Failover as a ScoreStream's."""

        def steps() -> Steps[Any]:
            opening = embed_stream_open(prompt_name, prompt, dimensions, normalize, truncate)
            metadata = self._call_metadata(partial(prefix_key.for_embed, prompt_name))
            return (yield partial(self._open_stream, opening, timeout, metadata))

        return self._run(steps())

    @abc.abstractmethod
    def _open_stream(
        self, opening: pb.ScoreStreamRequest | pb.EmbedStreamRequest, timeout: float | None, metadata: Metadata
    ) -> Any:
        """A session over a new stream, returned once the server acknowledged its open."""

    def _unary(self, method: Callable[..., Any], request: Any, timeout: float | None, metadata: Metadata) -> Any:
        """One unary call with the client's retry (`retry.unary_steps`), performed."""
        return self._run(self._unary_steps(method, request, timeout, metadata))

    def _unary_steps(
        self, method: Callable[..., Any], request: Any, timeout: float | None, metadata: Metadata
    ) -> Steps[Any]:
        return unary_steps(method, request, timeout, metadata, self._retry, self._sleep)

    def _call_metadata(self, key: Callable[[], str]) -> Metadata:
        """This client's metadata, with the call's prefix key unless it sends none (then `key` is
        not computed)."""
        return keyed(self._metadata, key() if self._send_key else None)
