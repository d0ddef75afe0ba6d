"""Shape buckets: every device call is padded to one of these, so each compiles once."""

from __future__ import annotations

import bisect
import dataclasses


def powers_of_two(lo: int, hi: int) -> tuple[int, ...]:
    """lo, 2*lo, ... up to the first value >= hi."""
    out = [lo]
    while out[-1] < hi:
        out.append(out[-1] * 2)
    return tuple(out)


@dataclasses.dataclass(frozen=True)
class Buckets:
    """Padded sizes for every axis of a device call.

    prefix: query lengths (and full-sequence lengths for item_first/sequential);
    item: item lengths; batch: items per device batch; labels: label-id slots.
    max_batch_tokens bounds batch * item_len, which bounds activation memory.
    """

    prefix: tuple[int, ...]
    item: tuple[int, ...]
    batch: tuple[int, ...]
    labels: tuple[int, ...] = (4, 16, 64, 256)
    max_batch_tokens: int = 8192

    @classmethod
    def for_context(cls, context: int, max_batch: int = 512, max_batch_tokens: int = 8192) -> Buckets:
        return cls(
            prefix=powers_of_two(64, context),
            item=powers_of_two(8, context),
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
