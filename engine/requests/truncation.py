"""Options and cuts shared by the kinds that truncate what is too long (engine/requests/score.py,
rerank.py): a query cut from one side, items (documents) cut to the room left after their prefix,
and what was cut, reported in the response's usage."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from prefixscore.engine.requests.invalid_input import InvalidInput
from prefixscore.engine.runtime.token_rows import TokenRows

TRUNCATE = ("none", "end")
QUERY_TRUNCATION = ("none", "left", "right")
# the side an item (a document) loses tokens from when it is cut (vLLM's and LiteLLM's truncation_side)
TRUNCATION_SIDES = ("right", "left")


@dataclasses.dataclass(frozen=True)
class Truncation:
    """What truncation removed: reported in the response's usage."""

    query_tokens: int = 0
    items: tuple[int, ...] = ()  # indices of the items (documents) that were cut
    item_tokens: int = 0


def choice(field: str, value: object, allowed: Sequence[str]) -> str:
    if value not in allowed:
        raise InvalidInput(field, f"{value!r} is not one of {', '.join(allowed)}")
    return str(value)


def count(field: str, value: object) -> int | None:
    """An optional non-negative integer option (0 and None mean unset)."""
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise InvalidInput(field, f"must be a non-negative integer, got {value!r}")
    return value or None


def cut_query(query: list[int], how: str, keep: int | None, budget: int) -> tuple[list[int], int]:
    """The query cut as asked ("left"/"right": tokens dropped from that side), to at most `keep`
    tokens and `budget` (room for a one-token item after the start tokens); and how many went."""
    if how == "none":
        if keep is not None:
            raise InvalidInput("max_query_tokens", "only applies with query_truncation left or right")
        return query, 0
    budget = min(keep or 1 << 62, budget)
    if len(query) <= budget:
        return query, 0
    kept = query[len(query) - budget :] if how == "left" else query[:budget]
    return kept, len(query) - budget


def cut_items(
    items: TokenRows, room: int, side: str = "right", lead: Sequence[int] = ()
) -> tuple[TokenRows, Truncation]:
    """Items longer than `room` cut to it: their end dropped (side "right"), or their start
    (side "left"), keeping the ids an item shares with `lead` at its start (a template's
    document marker, such as "B: ", which belongs to the prompt rather than to the document;
    its last token may have merged with the document's first)."""
    lengths = items.lengths
    cut = np.flatnonzero(lengths > room)
    if not cut.size:
        return items, Truncation()
    dropped = int((lengths[cut] - room).sum())
    lead = list(lead)

    def left(row: list[int]) -> list[int]:
        if len(row) <= room:
            return row
        keep = 0
        while keep < min(len(lead), room - 1) and row[keep] == lead[keep]:
            keep += 1
        return row[:keep] + row[len(row) - (room - keep) :]

    cut_row = left if side == "left" else (lambda row: row[:room])
    return items.map_rows(cut_row), Truncation(items=tuple(cut.tolist()), item_tokens=dropped)
