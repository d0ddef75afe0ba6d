"""The output head a model scores with at each item's last token, chosen once from its config.

A causal LM's head is its vocabulary: a request names label tokens and the device returns their
next-token probabilities (a softmax over the labels, or each label's share of the whole
vocabulary: its log-sum-exp). A sequence classifier's head is its `score` projection
[num_labels, hidden] (*ForSequenceClassification: no vocabulary head at all): a request names no
labels, the device returns every label's raw logit, and the host applies the request's activation
(engine/requests/heads.py).

`output_head(cfg)` is the one place that reads which head a config has; the weights, the step,
the reference decoder, the FLOP count, validation and the transports ask the record it returns.
"""

from __future__ import annotations

import dataclasses

from prefixscore.model.config import ModelConfig

# the `head` the API reports (/v1/models, GetModelInfo)
CAUSAL_LM = "causal_lm"
SEQUENCE_CLASSIFICATION = "sequence_classification"
BASE_MODEL = "base_model"  # no head: hidden states only (embeddings)


@dataclasses.dataclass(frozen=True)
class OutputHead:
    """What a model's output head is, for every layer that asks."""

    kind: str  # CAUSAL_LM | SEQUENCE_CLASSIFICATION | BASE_MODEL
    # the Weights field of its own projection [rows, hidden], read from the checkpoint tensor
    # "<weight>.weight"; None: the projection is the embedding (a causal LM's tied head)
    weight: str | None
    rows: int  # the projection's rows: the vocabulary, or one per label (0: a base model has none)
    hidden: int
    # why the checkpoint must hold `weight` (the message when it is missing)
    weight_needed_because: str = ""
    # True: every request scores all of its rows and gets their raw logits (a classifier: the
    # host applies the activation); False: a request names label tokens (vocabulary rows) and
    # the device returns their probabilities
    own_rows: bool = False
    label_names: tuple[str, ...] = ()  # a classifier's, one per row in order (id2label): its scores' columns
    # what a request's activation "auto" means: a sigmoid for one label or a multi-label
    # problem_type, else a softmax; "": no activation (a causal LM's probabilities)
    auto_activation: str = ""
    # a classifier reads the last token that is not this one (transformers), so no sequence may
    # end in it; None: the head reads the last token, whatever it is
    pad_token_id: int | None = None

    @property
    def tied(self) -> bool:
        """The projection is the embedding (no tensor of its own)."""
        return self.weight is None

    @property
    def tensor(self) -> str | None:
        """The checkpoint tensor of its projection (None: tied to the embedding)."""
        return None if self.weight is None else f"{self.weight}.weight"

    @property
    def shape(self) -> tuple[int, int]:
        """Its projection's shape [rows, hidden]."""
        return (self.rows, self.hidden)

    @property
    def own_labels(self) -> tuple[int, ...]:
        """The rows every request scores, in order (a classifier's every label); (): a request names them."""
        return tuple(range(self.rows)) if self.own_rows else ()

    def projected_rows(self, apply_softmax: bool, n_labels: int) -> int:
        """Rows of the projection one item's last token multiplies: only the request's labels, unless
        a causal LM's probabilities need the whole vocabulary's log-sum-exp (no apply_softmax)."""
        return n_labels if apply_softmax or self.own_rows else self.rows

    def label_token_ids(self, label_ids: tuple[int, ...]) -> tuple[int, ...]:
        """The label token ids a response reports: a causal LM's; none for a classifier (its rows
        are labels, reported by name)."""
        return () if self.own_rows else label_ids


def output_head(cfg: ModelConfig) -> OutputHead:
    """The head `cfg` scores with: its `score` rows when it is a classifier (num_labels), none for
    a base model, else its vocabulary (lm_head, or the embedding when tied)."""
    if cfg.base_model:
        return OutputHead(kind=BASE_MODEL, weight=None, rows=0, hidden=cfg.hidden_size, own_rows=True)
    if cfg.num_labels:
        return OutputHead(
            kind=SEQUENCE_CLASSIFICATION,
            weight="score",
            rows=cfg.num_labels,
            hidden=cfg.hidden_size,
            weight_needed_because="(a *ForSequenceClassification checkpoint)",
            own_rows=True,
            label_names=cfg.label_names,
            auto_activation="sigmoid" if cfg.num_labels == 1 or cfg.multi_label else "softmax",
            pad_token_id=cfg.pad_token_id,
        )
    return OutputHead(
        kind=CAUSAL_LM,
        weight=None if cfg.tie_word_embeddings else "lm_head",
        rows=cfg.vocab_size,
        hidden=cfg.hidden_size,
        weight_needed_because="and tie_word_embeddings is false",
    )
