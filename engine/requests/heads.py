"""What a request asks of the model's output head (model/head.py), and a classifier's activations.

A causal LM's head is its vocabulary: a request names label tokens and gets their next-token
probabilities (the device computes them). A sequence classifier's head is its `score`
projection: a request names no labels, the device returns the raw logits of every label, and
the activation the request asked for is applied here, on the host, when the scores are read
back (engine/loop/batcher.py take_results): one compiled head serves every activation.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import numpy as np

from prefixscore.choices import HEAD_ACTIVATIONS
from prefixscore.engine.requests.invalid_input import InvalidInput
from prefixscore.model.head import OutputHead

# a classifier request's `activation`: "auto" (the default) is the head's own (a sigmoid for a
# one-label head or a multi-label problem_type, else a softmax over the labels); "none" returns
# raw logits
ACTIVATIONS = HEAD_ACTIVATIONS

# a causal LM's label tokens from a request's label_token_ids and label strings, checked
LabelTokens = Callable[[Sequence[int], Sequence[str]], tuple[int, ...]]


@dataclasses.dataclass(frozen=True)
class RequestHead:
    """What one request scores: the head's rows (label token ids, or a classifier's label rows),
    whether the device takes their softmax, and the activation the host applies ("": none, the
    device's probabilities are the scores)."""

    label_ids: tuple[int, ...]
    apply_softmax: bool
    activation: str
    raw_logits: bool = False  # a causal LM's label logits as they are (the activation then applies)


def check_head(head: OutputHead, field: str) -> None:
    """A request that reads a head (scores, a rerank, a classification, a likelihood) needs one:
    a base model has none and serves embeddings only."""
    if not head.rows:
        raise InvalidInput(
            field,
            "the model is a base model (a *Model checkpoint: hidden states, no output head); it serves "
            "embeddings only (/v1/embeddings)",
        )


def for_request(
    head: OutputHead,
    ids: Sequence[int],
    labels: Sequence[str],
    activation: object,
    apply_softmax: bool,
    label_tokens: LabelTokens,
) -> RequestHead:
    """A score request's head. A causal LM: its label tokens (`ids` or `labels`, resolved by
    `label_tokens`), no activation. A classifier: every label of its head, in order, and the
    activation resolved; label tokens sent to it are refused, naming the field."""
    check_head(head, "label_token_ids")
    if activation in (None, ""):
        activation = "auto"
    if activation not in ACTIVATIONS:
        raise InvalidInput("activation", f"{activation!r} is not one of {', '.join(ACTIVATIONS)}")
    if not head.own_rows:
        if activation != "auto":
            why = "applies to classifier models; this model's head is its vocabulary (use apply_softmax)"
            raise InvalidInput("activation", why)
        return RequestHead(label_tokens(ids, labels), bool(apply_softmax), "")
    for field, sent in (("label_token_ids", ids), ("labels", labels)):
        if sent:
            raise InvalidInput(
                field,
                f"the model is a sequence classifier with {head.rows} label(s) {list(head.label_names)}: "
                "it scores its own labels, send no label tokens",
            )
    if apply_softmax and activation not in ("auto", "softmax"):
        raise InvalidInput("apply_softmax", f"contradicts activation {activation!r}; set one of them")
    resolved = "softmax" if apply_softmax else (head.auto_activation if activation == "auto" else str(activation))
    return RequestHead(head.own_labels, False, resolved)


def for_rerank(head: OutputHead, template_label_ids: tuple[int, ...], reads_logit: bool = False) -> RequestHead:
    """A rerank request's head. A causal LM: what the template's relevance formula reads
    (engine/requests/templates.py): the softmax over its labels (p(yes) / (p(yes) + p(no))), or with
    `reads_logit` the first label's raw logit and its sigmoid. A one-label classifier (a reranker
    converted to one score row): the sigmoid of its logit."""
    check_head(head, "documents")
    if not head.own_rows:
        if reads_logit:
            return RequestHead(template_label_ids[:1], False, "sigmoid", raw_logits=True)
        return RequestHead(template_label_ids, True, "")
    if head.rows != 1:
        raise InvalidInput("documents", f"rerank needs a one-label classifier; this one has {head.rows}")
    return RequestHead(head.own_labels, False, "sigmoid")


def for_classify(
    head: OutputHead, labels: Sequence[str], activation: object, label_tokens: LabelTokens
) -> tuple[RequestHead, tuple[str, ...]]:
    """A classify request's head and its columns' names: a classifier's own labels, or (a causal
    LM) the softmax over the label strings the server was started with."""
    check_head(head, "input")
    if head.own_rows:
        return for_request(head, (), (), activation, False, label_tokens), head.label_names
    if not labels:
        raise InvalidInput(
            "input", "the model is a causal LM and the server has no classify labels (serve --classify-labels)"
        )
    return for_request(head, (), labels, activation, True, label_tokens), tuple(labels)


def activate(logits: np.ndarray, activation: str) -> np.ndarray:
    """[rows, labels] raw logits -> the activation's outputs ("" and "none": as they are), float32."""
    if activation in ("", "none"):
        return logits
    x = logits.astype(np.float64)
    if activation == "sigmoid":
        return (1.0 / (1.0 + np.exp(-x))).astype(np.float32)
    e = np.exp(x - x.max(axis=-1, keepdims=True))
    return (e / e.sum(axis=-1, keepdims=True)).astype(np.float32)
