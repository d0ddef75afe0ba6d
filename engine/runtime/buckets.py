"""Shape buckets: every device call is padded to one of these, so each shape compiles once.

One kind of device call (model/step.py) serves everything: a prefill region of
`prefill` tokens (0: none) for chunks of new queries, and an item region of
`tokens` tokens per device for items of any number of queries. Executables are
keyed by (prefill tokens, item tokens, labels) only: query lengths, item lengths,
item counts and the number of queries in a call are runtime values.

The page table of a call has `segments` rows of `max_pages` pages (the longest
prefix the context allows), whatever the call's queries: a prefix's length never
shapes an executable.
"""

from __future__ import annotations

import bisect
import dataclasses
import math

from prefixscore.model.call_inputs import CallShape


def geometric(lo: int, hi: int, ratio: int, cap: int | None = None) -> tuple[int, ...]:
    """lo, ratio*lo, ... up to the first value >= hi; with `cap`, values above it become cap."""
    out = [lo]
    while out[-1] < hi:
        out.append(out[-1] * ratio)
    if cap is not None:
        out = sorted({min(x, cap) for x in out})
    return tuple(out)


def steps(lo: int, hi: int) -> tuple[int, ...]:
    """Powers of two from lo to hi, with the midpoints 1.5 x 2^k from 3072 on (capped at hi):
    a call rounds its tokens up by at most a third past 2048, a half below."""
    out = set(geometric(lo, hi, 2, cap=hi))
    out |= {p * 3 // 2 for p in out if p >= 2048 and p * 3 // 2 < hi}
    return tuple(sorted(out))


def ceil_div(n: int, d: int) -> int:
    """n / d rounded up (non-negative n, positive d): pages of n tokens, and the like."""
    return -(-n // d)


def round_up(n: int, multiple: int) -> int:
    """The smallest multiple of `multiple` that is >= n."""
    return ceil_div(n, multiple) * multiple


@dataclasses.dataclass(frozen=True)
class Buckets:
    """Padded sizes for every axis of a device call.

    context: the longest sequence served (query + item, or an item_first sequence).
    tokens: item-region lengths per device (derived when empty: 256, then steps() from 1024 to
      max_batch_tokens, then x4 to the context).
    prefill: prefill-region lengths, 0 first (derived: steps() from 1024, or max_prefill_tokens
      when smaller, to max_prefill_tokens).
    max_batch_tokens: the item region a call fills before another starts (bounds activation
      memory); longer items and sequences run alone in a larger bucket.
    prefill_chunk: a prefill chunk's longest run (its causal part is one item).
    page_tokens: tokens per page of the prefix pool; segments: page-table rows per call.
    labels: label ids per call (the union of its rows' label sets).
    tokens_per_row: an item region of T tokens returns T // tokens_per_row rows.
    head_rows: rows per step of the output head (a runtime loop; one size in every call: model/step.py
      head_rows_loop). 64: bench-cpu's full-vocabulary head over 409 rows took 594 ms in steps of
      32, 429 in steps of 64 and 405 in one of 256, and 44, 65 and 203 ms for a call of 10 rows.
    hidden: the hidden state's columns every call returns (CallShape.hidden): the model's hidden
      size for an engine that serves embeddings, so the shapes warm-up compiles are the ones
      embedding requests run (every call carries them; their rows cost a norm); 0: none.
    token_rows: every call shape also in its token-rows form (a row per item token) among the
      shapes warm-up compiles: an engine whose embeddings pool every token (mean, cls), so that
      its embedding requests find their shapes compiled.
    top_logprobs: TOP_LOGPROBS: every call shape also in its token-logprob form (a row per item
      token with the vocabulary's top log-probs: likelihood, completions) among the shapes warm-up
      compiles: an engine with a vocabulary head, so that those requests find their shapes
      compiled; 0: they compile on first use.
    token_logprobs_wait: a warm-up stage's buckets before its token-logprob forms are compiled:
      calls with such rows wait for the stage that compiles them (engine/runtime/warmup.py).
    """

    context: int
    tokens: tuple[int, ...] = ()
    prefill: tuple[int, ...] = ()
    labels: tuple[int, ...] = (256,)
    max_batch_tokens: int = 8192
    prefill_chunk: int = 512
    max_prefill_tokens: int = 4096
    page_tokens: int = 128
    segments: int = 64
    tokens_per_row: int = 4
    head_rows: int = 64
    hidden: int = 0
    token_rows: bool = False
    top_logprobs: int = 0
    token_logprobs_wait: bool = False

    def __post_init__(self) -> None:
        # a chunk never exceeds the region that holds it
        object.__setattr__(self, "prefill_chunk", min(self.prefill_chunk, self.max_prefill_tokens))
        if not self.tokens:
            short = (256, *steps(1024, self.max_batch_tokens))
            long = geometric(self.max_batch_tokens, self.context, 4, cap=round_up(self.context, 256))
            object.__setattr__(self, "tokens", tuple(sorted({t for t in (*short, *long) if t > 0})))
        if not self.prefill:
            lo = min(1024, self.max_prefill_tokens)
            object.__setattr__(self, "prefill", (0, *steps(lo, self.max_prefill_tokens)))
        if self.prefill[0] != 0 or self.prefill[-1] < self.prefill_chunk:
            raise ValueError(f"prefill buckets {self.prefill} must start at 0 and hold a chunk")

    @classmethod
    def for_context(cls, context: int, max_batch_tokens: int = 8192) -> Buckets:
        """Defaults for a model with this context: few buckets, so warm-up is a few dozen compilations."""
        return cls(context=context, max_batch_tokens=max_batch_tokens)

    @staticmethod
    def fit(sizes: tuple[int, ...], n: int, axis: str) -> int:
        """The smallest bucket >= n."""
        i = bisect.bisect_left(sizes, n)
        if i == len(sizes):
            raise ValueError(f"{axis} size {n} exceeds the largest bucket {sizes[-1]}")
        return sizes[i]

    def token_tile(self, most: int) -> int:
        """The most tokens, at most `most`, of a tile that divides every call's tokens (any sum of a
        prefill and an item size): every call's per-token work then runs in tiles of one shape
        (decoder.per_tile), so a token's bits never depend on the call's size."""
        common = math.gcd(*self.prefill, *self.tokens)
        return max(d for d in range(1, min(common, most) + 1) if common % d == 0)

    @property
    def max_labels(self) -> int:
        return self.labels[-1]

    @property
    def copy_slots(self) -> int:
        """Pool slots a call can copy (PageCopies): a query copies at most a page less one token
        (the rest of what it shares is whole pages it borrows), so a call holds 16 queries' at
        least: a completions request's prompts (each a choice over its question) plan together."""
        return 16 * self.page_tokens

    @property
    def max_pages(self) -> int:
        """Pages of the longest prefix: a page-table row."""
        return ceil_div(self.context, self.page_tokens)

    def rows(self, tokens: int, token_rows: bool = False) -> int:
        """Item rows an item region of `tokens` tokens returns: one per token in a call with
        token rows (an item's likelihood reads every token of it)."""
        return tokens if token_rows else max(1, tokens // self.tokens_per_row)

    def shape(
        self, prefill_tokens: int, item_tokens: int, labels: int, top_logprobs: int = 0, token_rows: bool | None = None
    ) -> CallShape:
        """The call shape of these buckets (its rows follow from the item tokens, and whether the
        call reads every item token: by default when it has token rows; such a call has a row
        for every token of its prefill region too, which a prefill chunk's own rows take)."""
        per_token = top_logprobs > 0 if token_rows is None else token_rows
        rows = self.rows(item_tokens, per_token) + (prefill_tokens if per_token else 0)
        return CallShape(prefill_tokens, item_tokens, rows, labels, top_logprobs, self.hidden)

    def call_shapes(self) -> list[CallShape]:
        """Every shape a call can have: a prefill region only beside item regions up to
        max_batch_tokens (longer ones hold one long item alone)."""
        out = []
        for tp in self.prefill:
            for ti in self.tokens:
                if tp and ti > self.max_batch_tokens:
                    continue
                out += [self.shape(tp, ti, lb) for lb in self.labels]
                if self.token_rows:
                    out += [self.shape(tp, ti, lb, token_rows=True) for lb in self.labels]
                if self.top_logprobs:
                    out += [self.shape(tp, ti, lb, self.top_logprobs) for lb in self.labels]
        return out
