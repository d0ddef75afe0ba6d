"""Proto messages -> validated token-id requests, and scores -> proto messages.

Every check happens here, before any device work, and reuses
`service/requests.py` (with `Limits.for_engine`, so sequences fit the
compiled buckets), so the gRPC service and the in-process `Scorer` reject the
same inputs with the same messages. On top of those, label strings are resolved
to single token ids.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import grpc
import numpy as np
from google.protobuf.message import DecodeError, Message

from prefixscore.service.requests import InvalidInput, RequestTokenizer, TokenizedRequest, check_labels
from prefixscore.v1 import score_service_pb2 as pb


class RpcFailure(Exception):
    """Ends an RPC with `code` and `message` (and optional trailing metadata)."""

    def __init__(self, code: grpc.StatusCode, message: str, trailers: tuple[tuple[str, str], ...] = ()) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.trailers = trailers


def invalid(err: InvalidInput) -> RpcFailure:
    return RpcFailure(grpc.StatusCode.INVALID_ARGUMENT, str(err))


def parse(cls: type[Message], raw: bytes, field: str = "request") -> Message:
    """Deserialize here, not in gRPC, so that undecodable bytes get INVALID_ARGUMENT naming the field."""
    try:
        return cls.FromString(raw)
    except DecodeError as err:
        raise RpcFailure(
            grpc.StatusCode.INVALID_ARGUMENT, f"{field}: not a valid {cls.DESCRIPTOR.full_name} message ({err})"
        ) from err


def _input(field: str, value: pb.Input) -> str | list[int]:
    kind = value.WhichOneof("kind")
    if kind == "text":
        return value.text
    if kind == "token_ids":
        return list(value.token_ids.ids)
    raise InvalidInput(field, "set either text or token_ids")


@dataclasses.dataclass(frozen=True)
class StreamSpec:
    """A validated StreamOpen. prefix: start tokens + query (empty for item_first)."""

    query: list[int]
    kind: str  # "text" or "ids": every batch's items must be the same
    label_ids: tuple[int, ...]
    apply_softmax: bool
    item_first: bool
    prefix: tuple[int, ...]


class RequestConverter:
    """Validates and tokenizes the service's messages for one model and bucket set."""

    def __init__(self, requests: RequestTokenizer) -> None:
        self.requests = requests
        context = requests.cfg.max_position_embeddings
        self.max_sequence_tokens = min(context, requests.limits.max_sequence_tokens or context)
        self.max_item_tokens = min(self.max_sequence_tokens, requests.limits.max_item_tokens or context)

    # ---- the pieces ------------------------------------------------------------------------------
    def _query(self, msg: pb.ScoreRequest | pb.StreamOpen) -> str | list[int]:
        if not msg.HasField("query"):
            raise InvalidInput("query", "is required (set query.text or query.token_ids)")
        return _input("query", msg.query)

    def _items(self, items: Sequence[pb.Input]) -> list[str | list[int]]:
        limit = self.requests.limits.max_items
        if len(items) > limit:
            # INVALID_ARGUMENT, not RESOURCE_EXHAUSTED: retrying the same request can never succeed
            raise InvalidInput("items", f"{len(items)} items exceed the limit of {limit} per request")
        return [_input(f"items[{j}]", it) for j, it in enumerate(items)]

    def _labels(self, ids: Sequence[int], labels: Sequence[str]) -> tuple[int, ...]:
        limits = self.requests.limits
        if ids and labels:
            raise InvalidInput("labels", "set either label_token_ids or labels, not both")
        if labels:
            tokenizer = self.requests.tokenizer
            if tokenizer is None:
                raise InvalidInput("labels", "the model has no tokenizer; send label_token_ids instead")
            if len(labels) > limits.max_labels:
                raise InvalidInput("labels", f"{len(labels)} labels exceed the limit of {limits.max_labels}")
            resolved = []
            for j, label in enumerate(labels):
                try:
                    resolved.append(tokenizer.token_id(label))
                except ValueError as err:
                    raise InvalidInput(f"labels[{j}]", str(err)) from err
            ids = resolved
        return check_labels(list(ids), self.requests.cfg.vocab_size, limits)

    # ---- messages --------------------------------------------------------------------------------
    def score_request(self, msg: pb.ScoreRequest) -> TokenizedRequest:
        """A ScoreRequest -> a validated TokenizedRequest; raises InvalidInput or RpcFailure."""
        labels = self._labels(msg.label_token_ids, msg.labels)
        query = self._query(msg)
        items = self._items(msg.items)
        return self.requests.request(query, items, labels, msg.apply_softmax, msg.item_first)

    def stream_open(self, msg: pb.StreamOpen) -> StreamSpec:
        """A StreamOpen -> the stream's validated query, labels and options."""
        labels = self._labels(msg.label_token_ids, msg.labels)
        query = self._query(msg)
        ids = self.requests.query_ids(query)
        # no items yet: this checks the query leaves room for one and gives the prefix
        opened = self.requests.assemble(ids, [], labels, bool(msg.apply_softmax), bool(msg.item_first))
        kind = "text" if isinstance(query, str) else "ids"
        return StreamSpec(ids, kind, labels, opened.apply_softmax, opened.item_first, opened.prefix)

    def stream_batch(self, spec: StreamSpec, msg: pb.ItemBatch) -> TokenizedRequest:
        """One ItemBatch of an open stream -> a validated TokenizedRequest over the stream's query."""
        items = self.requests.item_ids(self._items(msg.items), spec.kind)
        return self.requests.assemble(spec.query, items, spec.label_ids, spec.apply_softmax, spec.item_first)


def item_scores(scores: np.ndarray) -> list[pb.ItemScores]:
    """[items, labels] float32 -> one ItemScores per item (float32 on the wire: no precision lost)."""
    return [pb.ItemScores(probabilities=row) for row in scores.tolist()]
