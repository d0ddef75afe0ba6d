"""Shape buckets: every device call is padded to one of these, so each shape compiles once.

The engine compiles two kinds of device call (model/engine.py):

- prefill, one per `prefix` bucket: the query runs in chunks of `prefill_chunk`
  tokens (or one chunk of a shorter bucket) into a KV buffer of the bucket's length; the chunk loop runs only as
  many chunks as the query has, so a coarse bucket costs memory, not time;
- items, one per (`tokens`, `prefix`, `labels`) combination: items (or whole
  sequences) packed back to back, unpadded, into a stream of `tokens` tokens per
  device, over a prefix KV of a `prefix` bucket. Item length and item count are
  runtime values, not shapes, so they add no compilations.

`item` and `batch` are the grouping the service's batcher uses (items of one
length bucket, up to `batch_capacity` of them per device call); the engine does
not compile per item length or batch size.
"""

from __future__ import annotations

import bisect
import dataclasses


def powers_of_two(lo: int, hi: int) -> tuple[int, ...]:
    """lo, 2*lo, ... up to the first value >= hi."""
    return geometric(lo, hi, 2)


def geometric(lo: int, hi: int, ratio: int, cap: int | None = None) -> tuple[int, ...]:
    """lo, ratio*lo, ... up to the first value >= hi; with `cap`, values above it become cap."""
    out = [lo]
    while out[-1] < hi:
        out.append(out[-1] * ratio)
    if cap is not None:
        out = sorted({min(x, cap) for x in out})
    return tuple(out)


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


@dataclasses.dataclass(frozen=True)
class Buckets:
    """Padded sizes for every axis of a device call.

    prefix: prefix KV lengths (multiples of prefill_chunk, or shorter); prefix[-1] is the longest
      query, and the longest item_first sequence.
    item, batch: the service batcher's grouping (item lengths; items per batch);
      item[-1] is the longest item.
    labels: label-id slots. max_batch_tokens: the packed stream length the engine
      fills before starting another device call (bounds activation memory).
    tokens: packed stream lengths per device (derived when empty: 256, then powers of 2
      from 1024 to max_batch_tokens, then x4 to the longest item or sequence).
    tokens_per_row: a stream of T tokens returns T // tokens_per_row item rows.
    head_rows: rows per step of the vocabulary projection (a runtime loop).
    """

    prefix: tuple[int, ...]
    item: tuple[int, ...]
    batch: tuple[int, ...]
    labels: tuple[int, ...] = (256,)
    max_batch_tokens: int = 8192
    tokens: tuple[int, ...] = ()
    prefill_chunk: int = 1024
    tokens_per_row: int = 4
    head_rows: int = 256

    def __post_init__(self) -> None:
        # a prefix bucket is one prefill chunk, or holds whole chunks
        chunk = self.prefill_chunk
        prefix = {p if p <= chunk else _round_up(p, chunk) for p in self.prefix}
        object.__setattr__(self, "prefix", tuple(sorted(prefix)))
        if not self.tokens:
            longest = max(self.item[-1], self.prefix[-1])
            # small requests: 256; then x2 steps, so a request's last, partial call wastes little
            short = (256, *geometric(1024, self.max_batch_tokens, 2, cap=self.max_batch_tokens))
            long = geometric(self.max_batch_tokens, longest, 4, cap=_round_up(longest, 256))
            object.__setattr__(self, "tokens", tuple(sorted({*short, *long})))

    @classmethod
    def for_context(cls, context: int, max_batch: int = 512, max_batch_tokens: int = 8192) -> Buckets:
        """Defaults for a model with this context: few buckets, so warm-up is a few dozen compilations."""
        return cls(
            prefix=geometric(512, context, 4, cap=context),
            item=geometric(8, context, 2, cap=context),
            batch=powers_of_two(1, max_batch),
            max_batch_tokens=max_batch_tokens,
        )

    @staticmethod
    def fit(sizes: tuple[int, ...], n: int, axis: str) -> int:
        """The smallest bucket >= n."""
        i = bisect.bisect_left(sizes, n)
        if i == len(sizes):
            raise ValueError(f"{axis} size {n} exceeds the largest bucket {sizes[-1]}")
        return sizes[i]

    def batch_capacity(self, item_len_bucket: int) -> int:
        """Most items of this padded length in one device batch (a batch bucket)."""
        fits = max(1, self.max_batch_tokens // item_len_bucket)
        return max([b for b in self.batch if b <= fits] or [self.batch[0]])

    @property
    def max_labels(self) -> int:
        return self.labels[-1]

    def chunk(self, prefix_bucket: int) -> int:
        """Prefill chunk length for a prefix bucket (the bucket itself when it is shorter)."""
        return min(self.prefill_chunk, prefix_bucket)

    def rows(self, tokens: int) -> int:
        """Item rows a packed stream of `tokens` tokens returns."""
        return max(1, tokens // self.tokens_per_row)

    def stream_for(self, tokens: int, items: int) -> int:
        """The smallest stream bucket holding `tokens` tokens in at most rows() items."""
        for t in self.tokens:
            if t >= tokens and self.rows(t) >= items:
                return t
        raise ValueError(
            f"a device batch of {items} items, {tokens} tokens exceeds the largest stream {self.tokens[-1]}"
        )

    def item_calls(self) -> list[tuple[int, int]]:
        """Every (stream, prefix) bucket pair an items call can need.

        A stream longer than max_batch_tokens only ever holds one item longer than the
        stream bucket below it, so its prefix is at most prefix[-1] minus that length.
        """
        pairs = []
        for i, t in enumerate(self.tokens):
            longest_prefix = self.prefix[-1]
            if t > self.max_batch_tokens and i > 0:
                longest_prefix = max(self.prefix[-1] - self.tokens[i - 1], 1)
            top = bisect.bisect_left(self.prefix, longest_prefix)
            pairs += [(t, p) for p in self.prefix[: top + 1]]
        return pairs
