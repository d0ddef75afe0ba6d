"""`KnownPositions`: prompts whose every position's log-prob was computed, kept so that a later
prompt starting with the same tokens takes those positions instead of computing them again.

lm-evaluation-harness sends a k-shot task's prompts longest first, so a question's choices land
in different requests of /v1/completions. The first choice of a question computes the question's
positions; a sibling in a later request finds them here (its longest common prefix with a kept
prompt) and runs only its own tokens over that context, whose pages the prefix cache holds.

A kept prompt stores only the positions past the kept prompt it was computed over (its parent):
a k-shot header's positions are stored once, not once per question. Found through chained hashes
of whole blocks (the prefix cache's `block_keys`, over blocks of KEY_TOKENS tokens); the match is
then extended token by token and checked against the tokens, so a hash collision costs nothing
but the check. Bounded in bytes, least recently used first out; a
prompt that goes takes the prompts kept over it along. Any thread.
"""

from __future__ import annotations

import collections
import dataclasses
import threading

import numpy as np

from prefixscore.engine.runtime.prefix_cache import block_keys

# host memory for kept prompts by default: 168 bytes a position (its token, its log-prob, 20 top
# ids and 20 top log-probs, 4 bytes each), about 400,000 positions
KNOWN_POSITIONS_BYTES = 64 << 20
# kept prompts one page key leads to (the most recent): siblings that share a page
CANDIDATES_PER_KEY = 4
# tokens a page key covers: a new prompt must share at least this many with a kept one to find it
# (a lookup hashes a prompt once, a key per page, and checks them longest first)
KEY_TOKENS = 16


@dataclasses.dataclass(frozen=True)
class Positions:
    """Log-probs of consecutive positions of one sequence (natural log, float32 from the device)."""

    logprobs: np.ndarray  # [m] float32: log p(token | tokens before it)
    top_ids: np.ndarray  # [m, TOP_LOGPROBS] int32 or int64: the most likely tokens there, descending
    top_logprobs: np.ndarray  # [m, TOP_LOGPROBS] float32

    def head(self, m: int) -> Positions:
        return Positions(self.logprobs[:m], self.top_ids[:m], self.top_logprobs[:m])

    @staticmethod
    def join(parts: list[Positions]) -> Positions:
        return Positions(
            np.concatenate([p.logprobs for p in parts]),
            np.concatenate([p.top_ids for p in parts]),
            np.concatenate([p.top_logprobs for p in parts]),
        )


@dataclasses.dataclass(eq=False, repr=False)
class Known:
    """A kept prompt: positions 1 .. n-1 of `tokens`, those before `start` held by `parent`."""

    tokens: np.ndarray  # [n] int32
    start: int  # its own positions are start .. n-1 (1: no parent)
    own: Positions  # [n - start]
    parent: Known | None  # its tokens[:start] equal ours
    keys: list[int] = dataclasses.field(default_factory=list)  # the page keys that lead to it
    children: list[Known] = dataclasses.field(default_factory=list)

    @property
    def nbytes(self) -> int:
        return self.tokens.nbytes + self.own.logprobs.nbytes + self.own.top_ids.nbytes + self.own.top_logprobs.nbytes


def common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    """How many leading tokens a and b share."""
    n = min(len(a), len(b))
    differ = np.flatnonzero(a[:n] != b[:n])
    return int(differ[0]) if differ.size else n


class KnownPositions:
    """Kept prompts (see module doc), found by the leading tokens they share with a new prompt."""

    def __init__(self, max_bytes: int = KNOWN_POSITIONS_BYTES, page_tokens: int = KEY_TOKENS) -> None:
        self.max_bytes = max_bytes
        self.page_tokens = page_tokens
        self.bytes = 0
        self._recent: collections.OrderedDict[int, Known] = collections.OrderedDict()  # id -> kept, oldest first
        self._by_key: dict[int, list[Known]] = {}
        self._lock = threading.Lock()

    def longest(self, prompt: np.ndarray, most: int) -> tuple[Known | None, int]:
        """The kept prompt sharing the most leading tokens with `prompt` (at least a whole page),
        and how many (at most `most`); (None, 0) when none shares a page."""
        pt = self.page_tokens
        keys = block_keys(tuple(prompt[: min(most, len(prompt))].tolist()), pt)
        with self._lock:
            for k in range(len(keys) - 1, -1, -1):
                best: tuple[Known | None, int] = (None, 0)
                for known in self._by_key.get(keys[k], ()):
                    shared = common_prefix(known.tokens, prompt)
                    if shared >= (k + 1) * pt and shared > best[1]:  # else a hash collision
                        best = (known, min(shared, most))
                if best[0] is not None:
                    self._touch(best[0])
                    return best
        return None, 0

    def positions(self, known: Known, length: int) -> Positions:
        """Positions 1 .. length-1 of a kept prompt (length <= its tokens)."""
        parts, end, at = [], length, known
        while at is not None and end > 1:
            if end > at.start:
                parts.append(at.own.head(end - at.start))
                end = at.start
            at = at.parent
        return Positions.join(parts[::-1])

    def keep(self, tokens: np.ndarray, own: Positions, parent: Known | None, start: int) -> Known | None:
        """Keep a prompt: `own` are its positions start .. n-1, those before held by `parent` (None:
        start is 1). None when it alone is over the bound (nothing is dropped for it)."""
        known = Known(np.asarray(tokens, np.int32), start, own, parent)
        if known.nbytes > self.max_bytes:
            return None
        pt = self.page_tokens
        with self._lock:
            if parent is not None:
                if not self._holds(parent):  # dropped meanwhile
                    return None
                parent.children.append(known)
                self._touch(parent)
            # the pages past the parent's share lead here; those before lead to the parent's line
            keys = block_keys(tuple(known.tokens.tolist()), pt)
            first = start // pt if parent is not None else 0
            for key in keys[first:]:
                line = self._by_key.setdefault(key, [])
                line.insert(0, known)
                del line[CANDIDATES_PER_KEY:]
                known.keys.append(key)
            self._recent[id(known)] = known
            self.bytes += known.nbytes
            while self.bytes > self.max_bytes:
                self._drop(next(iter(self._recent.values())))
        return known if self._holds(known) else None

    def _holds(self, known: Known) -> bool:
        return self._recent.get(id(known)) is known

    def _touch(self, known: Known) -> None:
        """Most recent: it and the prompts it was computed over."""
        at: Known | None = known
        while at is not None and self._holds(at):
            self._recent.move_to_end(id(at))
            at = at.parent

    def _drop(self, known: Known) -> None:
        """Forget a kept prompt and every prompt kept over it."""
        for child in list(known.children):
            self._drop(child)
        if self._recent.pop(id(known), None) is None:
            return
        self.bytes -= known.nbytes
        for key in known.keys:
            line = self._by_key.get(key, [])
            if known in line:
                line.remove(known)
            if not line:
                self._by_key.pop(key, None)
        if known.parent is not None and known in known.parent.children:
            known.parent.children.remove(known)
