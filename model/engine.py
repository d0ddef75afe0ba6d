"""The scoring engine: owns the parameters on the device and turns token-id work into
bucketed device calls. It validates nothing (callers do, before device work) and
keeps no per-request state; the prefix KV is handed in and out as `PrefixKV`.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from prefixscore.kernels import dispatch
from prefixscore.model import forward
from prefixscore.model.buckets import Buckets
from prefixscore.model.config import ModelConfig
from prefixscore.model.decoder import Params

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


@dataclasses.dataclass(frozen=True)
class PrefixKV:
    """A query's KV cache on the device. keys, values: [layers, bucket, kv_heads, hd]."""

    keys: jax.Array
    values: jax.Array
    length: int  # real tokens; the rest of the bucket is padding

    @property
    def nbytes(self) -> int:
        return int(self.keys.nbytes + self.values.nbytes)


@dataclasses.dataclass(frozen=True)
class BatchShape:
    """One planned device batch: which items (indices into the caller's list) and the padded shape."""

    indices: tuple[int, ...]
    batch: int  # padded batch size
    length: int  # padded item (or sequence) length
    tokens: int  # real tokens; batch * length - tokens is padding


class CompileCounter:
    """Counts XLA backend compilations process-wide (jax.monitoring), to prove steady state compiles nothing."""

    _lock = threading.Lock()
    _count = 0
    _seconds = 0.0
    _installed = False

    @classmethod
    def install(cls) -> None:
        with cls._lock:
            if cls._installed:
                return
            cls._installed = True

        def on_event(event: str, duration: float, **_: object) -> None:
            if event == "/jax/core/compile/backend_compile_duration":
                with cls._lock:
                    cls._count += 1
                    cls._seconds += duration

        jax.monitoring.register_event_duration_secs_listener(on_event)

    @classmethod
    def count(cls) -> int:
        return cls._count

    @classmethod
    def seconds(cls) -> float:
        return cls._seconds


class ScoringEngine:
    """Token ids in, label probabilities out; every device call padded to a bucket."""

    def __init__(
        self,
        cfg: ModelConfig,
        params: Params,
        dtype: str = "float32",
        buckets: Buckets | None = None,
        attn_impl: str | None = None,
    ) -> None:
        CompileCounter.install()
        self.cfg = cfg
        self.params = params
        self.dtype = dtype
        self.buckets = buckets or Buckets.for_context(cfg.max_position_embeddings)
        self.attn_impl = dispatch.resolve(attn_impl)

    # ---- labels -------------------------------------------------------------
    def _labels(self, label_ids: Sequence[int]) -> tuple[jax.Array, jax.Array]:
        """Pad label ids to a bucket: ids [L] int32 and a validity mask [L]."""
        n = Buckets.fit(self.buckets.labels, len(label_ids), "label_token_ids")
        ids = np.zeros(n, np.int32)
        ids[: len(label_ids)] = label_ids
        return jnp.asarray(ids), jnp.asarray(np.arange(n) < len(label_ids))

    # ---- prefix ----------------------------------------------------------------
    def prefill(self, query_ids: Sequence[int]) -> PrefixKV:
        """Run the query once; its KV stays on the device in the returned PrefixKV."""
        n = len(query_ids)
        s = Buckets.fit(self.buckets.prefix, n, "query length")
        tokens = np.zeros(s, np.int32)
        tokens[:n] = query_ids
        keys, values = forward.prefill(self.params, self.cfg, jnp.asarray(tokens), attn_impl=self.attn_impl)
        return PrefixKV(keys, values, n)

    # ---- items over a prefix ------------------------------------------------
    def plan(self, lengths: Sequence[int], sequence: bool = False) -> list[BatchShape]:
        """Group items (by index) into bucketed device batches, longest first.

        Items of one length bucket share batches; each batch holds at most the
        bucket's capacity (max_batch_tokens / length) and is padded to a batch bucket.
        `sequence=True` buckets whole sequences by the prefix buckets (item_first, sequential).
        """
        sizes = self.buckets.prefix if sequence else self.buckets.item
        by_bucket: dict[int, list[int]] = {}
        for i, n in enumerate(lengths):
            by_bucket.setdefault(Buckets.fit(sizes, n, "sequence length"), []).append(i)
        plans = []
        for length in sorted(by_bucket, reverse=True):
            idx = by_bucket[length]
            cap = self.buckets.batch_capacity(length)
            for start in range(0, len(idx), cap):
                chunk = tuple(idx[start : start + cap])
                plans.append(
                    BatchShape(
                        indices=chunk,
                        batch=Buckets.fit(self.buckets.batch, len(chunk), "batch"),
                        length=length,
                        tokens=sum(lengths[i] for i in chunk),
                    )
                )
        return plans

    @staticmethod
    def _pad(rows: Sequence[Sequence[int]], batch: int, length: int) -> tuple[jax.Array, jax.Array]:
        """rows -> tokens [batch, length] int32 and lengths [batch] (padding rows get length 1)."""
        tokens = np.zeros((batch, length), np.int32)
        lens = np.ones(batch, np.int32)
        for r, row in enumerate(rows):
            tokens[r, : len(row)] = row
            lens[r] = len(row)
        return jnp.asarray(tokens), jnp.asarray(lens)

    def dispatch_items(
        self,
        prefix: PrefixKV,
        items: Sequence[Sequence[int]],
        shape: BatchShape,
        label_ids: Sequence[int],
        apply_softmax: bool,
    ) -> jax.Array:
        """Launch one device batch (asynchronously); returns [batch, label_bucket] probabilities on device."""
        tokens, lens = self._pad(items, shape.batch, shape.length)
        ids, valid = self._labels(label_ids)
        return forward.score_items(
            self.params, self.cfg, prefix.keys, prefix.values, jnp.int32(prefix.length),
            tokens, lens, ids, valid, apply_softmax=apply_softmax, attn_impl=self.attn_impl,
        )

    def score_items(
        self, prefix: PrefixKV, items: Sequence[Sequence[int]], label_ids: Sequence[int], apply_softmax: bool
    ) -> np.ndarray:
        """All items over one prefix -> probabilities [len(items), len(label_ids)] float32."""
        plans = self.plan([len(it) for it in items])
        # launch every batch before reading any back, so host padding overlaps device work
        launched = [(p, self.dispatch_items(prefix, [items[i] for i in p.indices], p, label_ids, apply_softmax)) for p in plans]
        return self._collect(launched, len(items), len(label_ids))

    @staticmethod
    def _collect(launched: list[tuple[BatchShape, jax.Array]], n: int, n_labels: int) -> np.ndarray:
        out = np.zeros((n, n_labels), np.float32)
        for plan, probs in launched:
            out[list(plan.indices)] = np.asarray(probs)[: len(plan.indices), :n_labels]
        return out

    # ---- whole sequences (item_first, sequential baseline) ----------------------
    def score_sequences(
        self, sequences: Sequence[Sequence[int]], label_ids: Sequence[int], apply_softmax: bool
    ) -> np.ndarray:
        """Plain causal forward of each whole sequence -> [len(sequences), len(label_ids)]."""
        plans = self.plan([len(s) for s in sequences], sequence=True)
        ids, valid = self._labels(label_ids)
        launched = []
        for p in plans:
            tokens, lens = self._pad([sequences[i] for i in p.indices], p.batch, p.length)
            probs = forward.score_sequences(
                self.params, self.cfg, tokens, lens, ids, valid, apply_softmax=apply_softmax, attn_impl=self.attn_impl
            )
            launched.append((p, probs))
        return self._collect(launched, len(sequences), len(label_ids))

    # ---- packed baseline ------------------------------------------------------------
    def score_packed(
        self, query_ids: Sequence[int], items: Sequence[Sequence[int]], label_ids: Sequence[int], apply_softmax: bool
    ) -> np.ndarray:
        """Query and all items in one sequence under a dense block-diagonal mask (the seeds' `packed`)."""
        total = len(query_ids) + sum(len(it) for it in items)
        s = Buckets.fit(self.buckets.prefix, total, "packed length")
        tokens = np.zeros(s, np.int32)
        positions = np.zeros(s, np.int32)
        segments = np.full(s, -1, np.int32)
        q = len(query_ids)
        tokens[:q], positions[:q], segments[:q] = query_ids, np.arange(q), 0
        read_at = np.zeros(len(items), np.int32)
        at = q
        for i, item in enumerate(items):
            n = len(item)
            tokens[at : at + n] = item
            positions[at : at + n] = q + np.arange(n)
            segments[at : at + n] = i + 1
            read_at[i] = at + n - 1
            at += n
        ids, valid = self._labels(label_ids)
        probs = forward.score_packed(
            self.params, self.cfg, jnp.asarray(tokens), jnp.asarray(positions), jnp.asarray(segments),
            jnp.asarray(read_at), ids, valid, apply_softmax=apply_softmax,
        )
        return np.asarray(probs)[:, : len(label_ids)]
