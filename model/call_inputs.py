"""The typed inputs of one device call (model/step.py): what crosses into compiled code.

The engine's planner (engine/runtime/planner.py) fills them on the host as numpy arrays; the
executable ships them as they are. Every shape follows from a `CallShape` (the
executable key) and the buckets: Tp prefill tokens, Ti item tokens and R rows per
device, d devices, S segments (page-table rows) of P pages, L label ids.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax

# label sets per call: rows index into a [LABEL_SETS, labels] table of the call
LABEL_SETS = 16
# what a causal LM's row returns for its labels (ItemRegion.output): each label's probability over
# the whole vocabulary, the softmax over the row's labels, or the labels' raw logits (a reranker
# whose published relevance is a function of one label's logit, engine/requests/templates.py). A token row
# (OUTPUT_TOKEN) reads one token of an item instead and returns the log-probability of its
# `target` (the item's next token) over the whole vocabulary, and the vocabulary's top
# TOP_LOGPROBS there: an item's own likelihood, one row per token (engine/requests/likelihood.py). A hidden
# row (OUTPUT_HIDDEN) returns the final-normed hidden state at its token: what an embedding pools
# (engine/requests/pooling.py), one row per item (its last token) or one per token (a mean)
OUTPUT_FULL, OUTPUT_SOFTMAX, OUTPUT_LOGIT, OUTPUT_TOKEN, OUTPUT_HIDDEN = 0, 1, 2, 3, 4
# the top log-probs a token row returns: the most a request may ask for
TOP_LOGPROBS = 20
# a token row's columns, after the call's label columns: its target's log-prob, the top
# TOP_LOGPROBS log-probs (descending), then their token ids (exact in float32: ids < 2**24)
TOKEN_COLUMNS = 1 + 2 * TOP_LOGPROBS


@dataclasses.dataclass(frozen=True, order=True)
class CallShape:
    """The executable key: every shape of a call's inputs follows from it and the buckets."""

    prefill_tokens: int  # Tp: the prefill region (0: none)
    item_tokens: int  # Ti: the item region, per device
    rows: int  # R: rows per device: one per item, or one per token (R = Tp + Ti) in a call
    # whose rows read every token (a likelihood's items, a mean-pooled embedding's, a prompt's
    # own prefill)
    labels: int  # L: label ids per call (the union of its rows' label sets)
    # TOP_LOGPROBS: the call has token rows (OUTPUT_TOKEN), and each row returns TOKEN_COLUMNS
    # more columns; 0: none
    top_logprobs: int = 0
    # the model's hidden size: the call has hidden rows (OUTPUT_HIDDEN), and each row returns that
    # many more columns, after the token columns; 0: none
    hidden: int = 0

    @staticmethod
    def top_count(outputs: set[int] | frozenset[int]) -> int:
        """How many top log-probs a row returns in a call whose rows read these outputs (its shape's
        `top_logprobs`)."""
        return TOP_LOGPROBS if OUTPUT_TOKEN in outputs else 0

    @staticmethod
    def reads_hidden(output: int) -> bool:
        """Whether a row of this output returns hidden columns (the buckets must have them)."""
        return output == OUTPUT_HIDDEN

    def columns(self, output: int, labels: int | None = None) -> slice:
        """Where a row of this kind finds its own columns in the call's output [R, ...] (a label
        row: its own `labels` first columns, else all the call's)."""
        tokens = TOKEN_COLUMNS if self.top_logprobs else 0
        if output == OUTPUT_TOKEN:
            return slice(self.labels, self.labels + tokens)
        if output == OUTPUT_HIDDEN:
            return slice(self.labels + tokens, self.labels + tokens + self.hidden)
        return slice(0, self.labels if labels is None else labels)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PrefillRegion:
    """Prefill chunks, one stream per data replica (each its own chunks). [d, Tp] int32, the
    groups' count [d]."""

    tokens: Any
    positions: Any
    segment_ids: Any  # the chunk's segment (page-table row)
    item_ids: Any  # one causal item per chunk (padding: a unique id per token)
    write_pages: Any  # the pool page each token's K/V goes to (pool pages: padding, dropped)
    write_offsets: Any  # and the slot within that page
    # short chunks that take their first key steps together (kernels/paged.py SharedSteps;
    # engine/runtime/shared_steps.py): each group's first token (-1 past the last), the groups [d],
    # and per token its group's first token (-1: none) and key steps
    shared_blocks: Any
    shared_count: Any
    shared_block_of: Any
    shared_steps: Any


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class ItemRegion:
    """Items, one stream per device (leading axis: devices)."""

    tokens: Any  # [d, Ti] int32
    positions: Any  # [d, Ti] int32: prefix_len + index within the item
    segment_ids: Any  # [d, Ti] int32
    item_ids: Any  # [d, Ti] int32
    read_at: Any  # [d, R] int32: the stream index (prefill region included) of the token each row reads
    label_set: Any  # [d, R] int32: row of label_sets
    output: Any  # [d, R] int8: OUTPUT_FULL, OUTPUT_SOFTMAX, OUTPUT_LOGIT, OUTPUT_TOKEN or OUTPUT_HIDDEN
    target: Any  # [d, R] int32: a token row's next token, whose log-prob it returns (other rows: 0)
    n_rows: Any  # [d] int32: rows in use
    max_item_len: Any  # [d] int32: the longest item (a hint for the causal part)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PageCopies:
    """Pool slots copied, every layer, before the layer's attention (after its prefill K/V are
    written, so a copy may read a chunk of the same call): a query's leading tokens that another
    query's pages hold (engine/runtime/prefix_cache.py). All [C] int32, the same on every device;
    padding copies to a page out of the pool (dropped)."""

    from_pages: Any
    from_offsets: Any
    to_pages: Any
    to_offsets: Any


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class CallInputs:
    """Everything a device call reads besides the weights and the pool."""

    prefill: PrefillRegion
    items: ItemRegion
    page_table: Any  # [S, P] int32: pool pages of each segment
    prefix_len: Any  # [S] int32
    labels: Any  # [L] int32: the call's label ids
    label_sets: Any  # [LABEL_SETS, L] int32: per set, indices into labels (-1: unused)
    max_chunk_len: Any  # [] int32: the longest prefill chunk
    copies: PageCopies
