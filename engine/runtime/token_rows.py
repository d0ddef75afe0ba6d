"""`TokenRows`: a request's items as one flat array of token ids and their offsets.

Every step after the wire (validation, admission, planning, laying out a device call)
works on a request's items with array operations over this one buffer, so the host's
work per request grows with the number of items it carries, never with a Python step
per token.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from itertools import chain
from typing import overload

import numpy as np


class TokenRows:
    """Ragged token ids: row j is `flat[offsets[j]:offsets[j + 1]]`.

    flat: [tokens] int64 (ids are checked against the vocabulary before they reach int32
    device arrays); offsets: [rows + 1] int64, offsets[0] == 0, non-decreasing.
    Indexing and iteration give plain lists, as the items were sent.
    """

    __slots__ = ("_positions", "flat", "offsets")

    def __init__(self, flat: np.ndarray, offsets: np.ndarray) -> None:
        self.flat = flat
        self.offsets = offsets
        self._positions: np.ndarray | None = None

    @classmethod
    def from_lists(cls, rows: Sequence[Iterable[int]]) -> TokenRows:
        """Rows of ints (lists, tuples, protobuf repeated fields, arrays): one C-level pass over
        the tokens. The caller has checked they are integers (np.fromiter would truncate floats)."""
        lengths = np.fromiter(map(len, rows), np.int64, len(rows))  # type: ignore[arg-type]
        offsets = np.zeros(len(rows) + 1, np.int64)
        np.cumsum(lengths, out=offsets[1:])
        flat = np.fromiter(chain.from_iterable(rows), np.int64, int(offsets[-1]))
        return cls(flat, offsets)

    @classmethod
    def coerce(cls, rows: TokenRows | Sequence[Iterable[int]]) -> TokenRows:
        return rows if isinstance(rows, TokenRows) else cls.from_lists(rows)

    @property
    def lengths(self) -> np.ndarray:
        """[rows] int64: tokens per row."""
        return np.diff(self.offsets)

    @property
    def total(self) -> int:
        """Tokens in all rows."""
        return int(self.offsets[-1])

    def positions(self) -> np.ndarray:
        """[tokens] int32: each token's index within its row (computed once, on first use)."""
        if self._positions is None:
            starts = np.repeat(self.offsets[:-1], self.lengths)
            self._positions = (np.arange(self.total, dtype=np.int64) - starts).astype(np.int32)
        return self._positions

    def with_suffix(self, suffix: Sequence[int]) -> TokenRows:
        """Every row followed by the same ids (a template's suffix after each document)."""
        if not suffix:
            return self
        n, s = len(self), len(suffix)
        offsets = self.offsets + s * np.arange(n + 1, dtype=np.int64)
        flat = np.empty(int(offsets[-1]), np.int64)
        # a token of the new rows is an old one when its index in its row is below the old length
        old = np.repeat(self.lengths, self.lengths + s)
        index = np.arange(len(flat)) - np.repeat(offsets[:-1], self.lengths + s)
        from_old = index < old
        flat[from_old] = self.flat
        flat[~from_old] = np.tile(np.asarray(suffix, np.int64), n)
        return TokenRows(flat, offsets)

    def rows(self, first: int, count: int) -> TokenRows:
        """Rows first .. first + count - 1 as a TokenRows (views of this one's arrays)."""
        offsets = self.offsets[first : first + count + 1]
        return TokenRows(self.flat[offsets[0] : offsets[-1]], offsets - offsets[0])

    def map_rows(self, fn: Callable[[list[int]], Sequence[int]]) -> TokenRows:
        """A new TokenRows of fn(row as list) for every row (truncation, templates: rare paths)."""
        return TokenRows.from_lists([fn(row) for row in self])

    def __len__(self) -> int:
        return len(self.offsets) - 1

    @overload
    def __getitem__(self, j: int) -> list[int]: ...
    @overload
    def __getitem__(self, j: slice) -> list[list[int]]: ...
    def __getitem__(self, j: int | slice) -> list[int] | list[list[int]]:
        if isinstance(j, slice):
            return [self[k] for k in range(*j.indices(len(self)))]
        if not -len(self) <= j < len(self):
            raise IndexError(j)
        j %= len(self)
        return self.flat[self.offsets[j] : self.offsets[j + 1]].tolist()

    def __iter__(self) -> Iterator[list[int]]:
        flat, offsets = self.flat.tolist(), self.offsets.tolist()
        return (flat[offsets[j] : offsets[j + 1]] for j in range(len(self)))

    def tolist(self) -> list[list[int]]:
        return list(self)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, TokenRows):
            return np.array_equal(self.offsets, other.offsets) and np.array_equal(self.flat, other.flat)
        if isinstance(other, (list, tuple)):
            return self.tolist() == [list(row) for row in other]
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"TokenRows({self.tolist()!r})"
