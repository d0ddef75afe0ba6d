"""The device loop's unit of input: a validated request in token ids, and what its kind declares
to the loop about its rows (`Answer`). The kinds themselves (engine/requests/answers.py and the
validation that builds requests) sit above the loop; the loop knows only this record.
"""

from __future__ import annotations

import dataclasses
from typing import Protocol

import numpy as np

from prefixscore.engine.runtime.token_rows import TokenRows
from prefixscore.model.call_inputs import OUTPUT_FULL


class Answer(Protocol):
    """A request kind's rows and answer (see the module doc)."""

    @property
    def output(self) -> int: ...

    @property
    def each_token(self) -> bool: ...

    @property
    def lead(self) -> int: ...

    def buffer(self, items: TokenRows, labels: int) -> np.ndarray: ...

    def fill(self, answer: np.ndarray, items: TokenRows, first: int, count: int, rows: np.ndarray) -> None: ...


@dataclasses.dataclass(frozen=True)
class PrefillOnly:
    """No rows: a unit that only prefills its query (a stream open's, a retried query's)."""

    output = OUTPUT_FULL
    each_token = False
    lead = 0

    def buffer(self, items: TokenRows, labels: int) -> np.ndarray:
        return np.zeros((len(items), labels), np.float32)

    def fill(self, answer: np.ndarray, items: TokenRows, first: int, count: int, rows: np.ndarray) -> None:
        raise AssertionError("a prefill-only unit has no rows to fill")


@dataclasses.dataclass(frozen=True)
class TokenizedRequest:
    """A validated request in token ids. prefix: start tokens + query (empty for item_first).
    `answer`: its kind's rows on the device and how they become its answer (engine/requests/answers.py):
    all the device loop knows of the kind."""

    prefix: tuple[int, ...]
    items: TokenRows  # for item_first: whole sequences (start + item + query); lists are converted
    label_ids: tuple[int, ...]
    answer: Answer
    item_first: bool
    # the tokens whose answers it needs, each once, when its kind counts them (None: its prompt
    # tokens, less what the prefix cache holds of its prefix): completions' requests overlap (a
    # page's items share rows, a context's positions are other requests' rows), so that kind
    # counts each position once over the whole plan
    requested: int | None = None
    # rows of its own prefix, from this position to its end (None: none): each prefix token's row
    # reads it and targets the next prefix token (the last, none: the top next tokens), computed by
    # the prefix's own prefill as it runs (a prompt scored whole, engine/requests/completions.py).
    # Its prefix is then prefilled from this position at the latest, even when it is cached
    # (engine/runtime/prefix_cache.py: a fresh entry), so every row it reads is computed for it
    prefix_rows: int | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "items", TokenRows.coerce(self.items))

    @property
    def prompt_tokens(self) -> int:
        """The query once and every item (tokens every item repeats from the query counted once)."""
        return len(self.prefix) + self.items.total - self.answer.lead * max(0, len(self.items) - 1)

    @property
    def needs_device(self) -> bool:
        """Whether it has device work: items, or rows of its own prefix."""
        return bool(len(self.items)) or self.prefix_rows is not None

    @property
    def prefill_only(self) -> bool:
        """Only its prefix's prefill, and no rows come back (a stream open's, a retried query's)."""
        return not len(self.items) and self.prefix_rows is None

    @property
    def answers_due(self) -> int:
        """What must come back before it is answered: its items, or its prefix's rows."""
        return len(self.items) + (len(self.prefix) - self.prefix_rows if self.prefix_rows is not None else 0)

    def requested_tokens(self, held: int) -> int:
        """The tokens it needs computed, each once, when `held` of its prefix's tokens need no
        prefill (the prefix cache holds them, or a stream's open asked for them)."""
        return self.prompt_tokens - held if self.requested is None else self.requested
