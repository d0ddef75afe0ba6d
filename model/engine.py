"""The scoring engine: owns the parameters on the devices and turns token-id work into
bucketed device calls. It validates nothing (callers do, before device work) and
keeps no per-request state; the prefix KV is handed in and out as `PrefixKV`.

Device calls (see model/buckets.py and model/ragged.py):
- prefill: one executable per prefix bucket;
- items: items packed back to back into one stream of T tokens per device, one
  executable per (T, prefix bucket, label bucket). Whole sequences (item_first,
  the sequential baseline) are items over an empty prefix and use the same ones.

Executables are compiled ahead of time (`warmup`, or on first use) and kept in
a table, so steady-state traffic never compiles. With several devices the
weights and the prefix KV are replicated, the query prefill is split along the
sequence (each device runs a slice of every chunk) and each device scores its own
stream of items (`shard_map` over a one-axis mesh, "data").
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import os
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from prefixscore.kernels import dispatch, selfcheck
from prefixscore.model import compile_cache, forward, ragged
from prefixscore.model.buckets import Buckets
from prefixscore.model.config import ModelConfig
from prefixscore.model.decoder import Params

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}
AXIS = "data"
# the last, partial device call of a request may be up to this share padding before it
# is split into a full smaller call plus a smaller remainder
MAX_TAIL_PADDING = 0.25
# a prefill chunk is split across devices only into slices at least this long (shorter
# ones leave the matrix units idle and pay a collective per layer for little work)
MIN_PREFILL_SLICE = 64


@dataclasses.dataclass(frozen=True)
class PrefixKV:
    """A query's KV cache on the device(s). keys, values: [layers, bucket, kv_heads, hd]."""

    keys: jax.Array
    values: jax.Array
    length: int  # real tokens; the rest of the bucket is padding

    @property
    def nbytes(self) -> int:
        return int(self.keys.nbytes + self.values.nbytes)


@dataclasses.dataclass(frozen=True)
class BatchShape:
    """One planned device call: which items (indices into the caller's list) and its padded shape.

    For packed streams, batch is the row slots the call returns (>= len(indices)) and
    batch * length is the device tokens (all devices), so batch * length - tokens is padding.
    """

    indices: tuple[int, ...]
    batch: int  # rows returned (padded batch size)
    length: int  # device tokens per row slot (padded item length for padded batches)
    tokens: int  # real tokens

    @property
    def device_tokens(self) -> int:
        return self.batch * self.length


class CompileCounter:
    """Counts XLA compilations process-wide (jax.monitoring), to prove steady state compiles nothing.

    An executable loaded from the persistent compilation cache is not a compilation:
    jax times cache loads under the same event, so cache hits are subtracted.
    seconds() is the time spent obtaining executables either way.
    """

    _lock = threading.Lock()
    _events = 0
    _hits = 0
    _seconds = 0.0
    _installed = False

    @classmethod
    def install(cls) -> None:
        with cls._lock:
            if cls._installed:
                return
            cls._installed = True

        def on_duration(event: str, duration: float, **_: object) -> None:
            if event == "/jax/core/compile/backend_compile_duration":
                with cls._lock:
                    cls._events += 1
                    cls._seconds += duration

        def on_event(event: str, **_: object) -> None:
            if event == "/jax/compilation_cache/cache_hits":
                with cls._lock:
                    cls._hits += 1

        jax.monitoring.register_event_duration_secs_listener(on_duration)
        jax.monitoring.register_event_listener(on_event)

    @classmethod
    def count(cls) -> int:
        with cls._lock:
            return cls._events - cls._hits

    @classmethod
    def cache_hits(cls) -> int:
        return cls._hits

    @classmethod
    def seconds(cls) -> float:
        return cls._seconds


def split_streams(lengths: Sequence[int], streams: int, tokens: int, rows: int) -> list[list[int]] | None:
    """Cut items, in order, into at most `streams` runs of <= `tokens` tokens and <= `rows` items.

    Greedy filling is optimal for contiguous runs (it never needs more runs than any
    other cut), so plan() and dispatch_items() agree on whether a call fits.
    Returns the item indices per run, or None when they do not fit.
    """
    out: list[list[int]] = [[]]
    used = 0
    for i, n in enumerate(lengths):
        if n > tokens:
            return None
        if used + n > tokens or len(out[-1]) >= rows:
            if len(out) == streams:
                return None
            out.append([])
            used = 0
        out[-1].append(i)
        used += n
    return out


@dataclasses.dataclass
class _Slot:
    lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)
    exe: Any = None


class ScoringEngine:
    """Token ids in, label probabilities out; every device call is one precompiled bucket."""

    def __init__(
        self,
        cfg: ModelConfig,
        params: Params,
        dtype: str = "float32",
        buckets: Buckets | None = None,
        attn_impl: str | None = None,
        *,
        devices: int | Sequence[jax.Device] | None = None,
        compile_cache_dir: str | None = None,
    ) -> None:
        CompileCounter.install()
        self.compile_cache_dir = compile_cache.enable(compile_cache_dir)
        self.cfg = cfg
        self.dtype = dtype
        self.buckets = buckets or Buckets.for_context(cfg.max_position_embeddings)
        self.attn_impl = dispatch.resolve(attn_impl)
        self._impl = dispatch.get(self.attn_impl)
        if devices is None:
            devices = jax.local_devices()
        elif isinstance(devices, int):
            devices = jax.local_devices()[:devices]
        self.devices = list(devices)
        self.mesh = Mesh(np.array(self.devices), (AXIS,))
        self._replicated = NamedSharding(self.mesh, P())
        self._split = NamedSharding(self.mesh, P(AXIS))
        self.params = jax.device_put(params, self._replicated)
        self._slots: dict[tuple, _Slot] = {}
        self._lock = threading.Lock()
        self._empty: PrefixKV | None = None
        # device tokens launched and the real ones among them (padding share = 1 - real / device)
        self.stats = {"calls": 0, "device_tokens": 0, "tokens": 0, "items": 0}

    @property
    def n_devices(self) -> int:
        return len(self.devices)

    # ---- executables ----------------------------------------------------------
    def _executable(self, key: tuple) -> Any:
        """The compiled executable for a bucket key, compiling it on first use (once, thread-safe)."""
        with self._lock:
            slot = self._slots.setdefault(key, _Slot())
        with slot.lock:
            if slot.exe is None:
                slot.exe = self._compile(key)
        return slot.exe

    def _spec(self, shape: tuple[int, ...], dtype: Any, sharding: NamedSharding) -> jax.ShapeDtypeStruct:
        return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)

    def _kv_spec(self, bucket: int) -> jax.ShapeDtypeStruct:
        c = self.cfg
        return self._spec((c.num_layers, bucket, c.num_kv_heads, c.head_dim), DTYPES[self.dtype], self._replicated)

    def _compile(self, key: tuple) -> Any:
        return self._traced(key).lower().compile()

    def lower_for(self, key: tuple, platform: str) -> jax.stages.Lowered:
        """A bucket's device call lowered for `platform` ("cuda", "tpu") with that platform's
        kernels, on any machine: proves the kernels lower for real hardware without it."""
        with dispatch.lowering_for(platform):
            return self._traced(key).lower(lowering_platforms=(platform,))

    def _traced(self, key: tuple) -> jax.stages.Traced:
        params = jax.tree.map(lambda a: self._spec(a.shape, a.dtype, self._replicated), self.params)
        rep, split = P(), P(AXIS)
        if key[0] == "prefill":
            (_, bucket) = key
            fn = functools.partial(self._prefill_fn, bucket=bucket)
            mapped = jax.shard_map(fn, mesh=self.mesh, in_specs=(rep, rep), out_specs=(rep, rep), check_vma=False)
            args = (params, self._spec((bucket + 1,), jnp.int32, self._replicated))
        else:
            (_, tokens, bucket, labels) = key
            rows, d = self.buckets.rows(tokens), self.n_devices
            fn = self._items_fn
            mapped = jax.shard_map(
                fn, mesh=self.mesh, in_specs=(rep, rep, rep, split, split, rep, rep), out_specs=rep, check_vma=False
            )
            args = (
                params,
                self._kv_spec(bucket),
                self._kv_spec(bucket),
                self._spec((d, 3, tokens), jnp.int32, self._split),
                self._spec((d, rows + 2), jnp.int32, self._split),
                self._spec((labels,), jnp.int32, self._replicated),
                self._spec((3 + d * rows,), jnp.int32, self._replicated),
            )
        return jax.jit(mapped).trace(*args)

    def _prefill_fn(self, params: Params, packed: jax.Array, *, bucket: int) -> tuple[jax.Array, jax.Array]:
        """packed: [bucket + 1] int32 = token ids then the real length."""
        chunk = self.buckets.chunk(bucket)
        split = self._prefill_split(chunk)
        return ragged.prefill(
            params,
            self.cfg,
            packed[:bucket],
            packed[bucket],
            chunk=chunk,
            impl=self._impl,
            axis=AXIS if split > 1 else None,
            devices=split,
        )

    def _prefill_split(self, chunk: int) -> int:
        """Devices a prefill chunk is split across (sequence parallel): all of them when the
        chunk divides into slices of at least MIN_PREFILL_SLICE tokens, else 1 (replicated)."""
        d = self.n_devices
        return d if d > 1 and chunk % d == 0 and chunk // d >= MIN_PREFILL_SLICE else 1

    def _items_fn(self, params, prefix_k, prefix_v, stream, rows, label_ids, meta) -> jax.Array:
        """Per device: stream [1, 3, T]; rows [1, R + 2] = read_at, n_items, max_item_len;
        meta [3 + devices * R] = prefix_len, apply_softmax, n_labels, then the output row of
        each of the call's items. Returns [devices * R, labels], rows in the caller's order."""
        r = rows.shape[1] - 2
        out = ragged.score_stream(
            params,
            self.cfg,
            prefix_k,
            prefix_v,
            meta[0],
            stream[0],
            rows[0, :r],
            rows[0, r],
            rows[0, r + 1],
            label_ids,
            meta[2],
            meta[1] != 0,
            impl=self._impl,
            head_rows=self.buckets.head_rows,
        )
        out = jax.lax.all_gather(out, AXIS, tiled=True)  # [devices * R, labels]
        return jnp.take(out, meta[3:], axis=0)

    def executable_keys(self) -> list[tuple]:
        """Every executable the engine can be asked for with its buckets."""
        keys: list[tuple] = [("prefill", p) for p in self.buckets.prefix]
        keys += [("items", t, p, lb) for t, p in self.buckets.item_calls() for lb in self.buckets.labels]
        return keys

    def warmup(
        self, workers: int | None = None, progress: Callable[[int, int], None] | None = None
    ) -> dict[str, float]:
        """Compile every bucket combination up front (in parallel: XLA compiles without the GIL).

        Returns {"executables", "compilations", "seconds"}; with a warm persistent
        compilation cache, compilations is 0.
        """
        keys = self.executable_keys()
        count, started = CompileCounter.count(), time.perf_counter()
        workers = workers or min(4, os.cpu_count() or 1)
        with concurrent.futures.ThreadPoolExecutor(workers) as pool:
            for done, _ in enumerate(pool.map(self._executable, keys), 1):
                if progress:
                    progress(done, len(keys))
        return {
            "executables": len(keys),
            "compilations": CompileCounter.count() - count,
            "seconds": time.perf_counter() - started,
        }

    def check_attention(self) -> dict[str, float]:
        """The attention implementation against the reference at this model's head shapes and
        dtype, on this process's device (kernels/selfcheck.py). Returns max errors per call;
        raises selfcheck.KernelCheckFailed past the tolerance."""
        c = self.cfg
        return selfcheck.verify(self.attn_impl, self._impl, c.num_heads, c.num_kv_heads, c.head_dim, self.dtype)

    # ---- labels -------------------------------------------------------------
    def _labels(self, label_ids: Sequence[int]) -> np.ndarray:
        """Label ids padded to a bucket [L] int32 (the count travels separately)."""
        n = Buckets.fit(self.buckets.labels, len(label_ids), "label_token_ids")
        ids = np.zeros(n, np.int32)
        ids[: len(label_ids)] = label_ids
        return ids

    # ---- prefix ----------------------------------------------------------------
    def prefill(self, query_ids: Sequence[int]) -> PrefixKV:
        """Run the query once; its KV stays on the device(s) in the returned PrefixKV."""
        n = len(query_ids)
        s = Buckets.fit(self.buckets.prefix, n, "query length")
        packed = np.zeros(s + 1, np.int32)
        packed[:n] = query_ids
        packed[s] = n
        keys, values = self._executable(("prefill", s))(self.params, jax.device_put(packed, self._replicated))
        return PrefixKV(keys, values, n)

    def _empty_prefix(self) -> PrefixKV:
        """A zero-length prefix: whole sequences are items over it."""
        if self._empty is None:
            zeros = jax.device_put(
                np.zeros(self._kv_spec(self.buckets.prefix[0]).shape, DTYPES[self.dtype]), self._replicated
            )
            self._empty = PrefixKV(zeros, zeros, 0)
        return self._empty

    # ---- items over a prefix ------------------------------------------------
    def _stream_for(self, lengths: Sequence[int]) -> tuple[int, list[list[int]]]:
        """The smallest stream bucket whose device streams hold these items, and the cut."""
        longest = max(lengths, default=1)
        for t in self.buckets.tokens:
            if t >= longest:
                cut = split_streams(lengths, self.n_devices, t, self.buckets.rows(t))
                if cut is not None:
                    return t, cut
        raise ValueError(f"{len(lengths)} items of {sum(lengths)} tokens do not fit one device call")

    def _shape(self, indices: Sequence[int], tokens: int, real: int) -> BatchShape:
        rows = self.buckets.rows(tokens)
        return BatchShape(tuple(indices), self.n_devices * rows, tokens // rows, real)

    def plan(self, lengths: Sequence[int], sequence: bool = False) -> list[BatchShape]:
        """Group items (by index) into device calls, longest first.

        Items are packed back to back (no padding between them) into one stream per
        device; full calls use the max_batch_tokens stream, and the remainder the
        smallest stream that holds it, unless that would be mostly padding, in which
        case a smaller full call goes first. `sequence` is accepted for compatibility:
        whole sequences pack the same way (over an empty prefix).
        """
        del sequence
        b, d = self.buckets, self.n_devices
        order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
        plans: list[BatchShape] = []
        pos = 0
        while pos < len(order):
            rest = [lengths[i] for i in order[pos:]]
            full = max(
                Buckets.fit(b.tokens, min(b.max_batch_tokens, b.tokens[-1]), "tokens"),
                Buckets.fit(b.tokens, rest[0], "item length"),
            )
            cut = split_streams(rest, d, full, b.rows(full))
            if cut is None:
                take, tokens = self._fill(rest, full), full
            else:
                tokens, _ = self._stream_for(rest)
                waste = 1 - sum(rest) / (d * tokens)
                smaller = [t for t in b.tokens if rest[0] <= t < tokens]
                if waste > MAX_TAIL_PADDING and smaller:
                    take, tokens = self._fill(rest, smaller[-1]), smaller[-1]
                else:
                    take = len(rest)
            idx = order[pos : pos + take]
            plans.append(self._shape(idx, tokens, sum(lengths[i] for i in idx)))
            pos += take
        return plans

    def _fill(self, lengths: list[int], tokens: int) -> int:
        """How many of `lengths` (in order) fill one call of `tokens`-token streams."""
        lo, hi = 1, len(lengths)
        while lo < hi:  # the largest prefix that fits (fitting is monotone in the prefix)
            mid = (lo + hi + 1) // 2
            if split_streams(lengths[:mid], self.n_devices, tokens, self.buckets.rows(tokens)) is None:
                hi = mid - 1
            else:
                lo = mid
        return lo

    def dispatch_items(
        self,
        prefix: PrefixKV,
        items: Sequence[Sequence[int]],
        shape: BatchShape,
        label_ids: Sequence[int],
        apply_softmax: bool,
    ) -> jax.Array:
        """Launch one device call (asynchronously) -> probabilities [rows >= len(items), label_bucket] on device,
        row i for items[i]. The call's stream bucket follows from the items themselves, so any
        BatchShape (the service batcher's padded ones too) is served by the precompiled executables."""
        del shape
        lengths = [len(it) for it in items]
        tokens, cut = self._stream_for(lengths)
        d, rows = self.n_devices, self.buckets.rows(tokens)
        stream = np.zeros((d, 3, tokens), np.int32)
        stream[:, 2] = -1
        row_info = np.zeros((d, rows + 2), np.int32)
        meta = np.zeros(3 + d * rows, np.int32)
        meta[:3] = prefix.length, int(apply_softmax), len(label_ids)
        for dev, run in enumerate(cut):
            at = 0
            for r, i in enumerate(run):
                n = lengths[i]
                stream[dev, 0, at : at + n] = items[i]
                stream[dev, 1, at : at + n] = prefix.length + np.arange(n)
                stream[dev, 2, at : at + n] = r
                row_info[dev, r] = at + n - 1
                meta[3 + i] = dev * rows + r
                at += n
            row_info[dev, rows] = len(run)
            row_info[dev, rows + 1] = max((lengths[i] for i in run), default=1)
        labels = self._labels(label_ids)
        exe = self._executable(("items", tokens, prefix.keys.shape[1], len(labels)))
        self.stats["calls"] += 1
        self.stats["device_tokens"] += d * tokens
        self.stats["tokens"] += sum(lengths)
        self.stats["items"] += len(items)
        return exe(
            self.params,
            prefix.keys,
            prefix.values,
            jax.device_put(stream, self._split),
            jax.device_put(row_info, self._split),
            jax.device_put(labels, self._replicated),
            jax.device_put(meta, self._replicated),
        )

    def score_items(
        self, prefix: PrefixKV, items: Sequence[Sequence[int]], label_ids: Sequence[int], apply_softmax: bool
    ) -> np.ndarray:
        """All items over one prefix -> probabilities [len(items), len(label_ids)] float32."""
        plans = self.plan([len(it) for it in items])
        # launch every call before reading any back, so host packing overlaps device work
        launched = [
            (p, self.dispatch_items(prefix, [items[i] for i in p.indices], p, label_ids, apply_softmax)) for p in plans
        ]
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
        """Plain causal forward of each whole sequence -> [len(sequences), len(label_ids)]:
        the sequences are items over an empty prefix (positions from 0)."""
        return self.score_items(self._empty_prefix(), sequences, label_ids, apply_softmax)

    # ---- packed baseline ------------------------------------------------------------
    def score_packed(
        self, query_ids: Sequence[int], items: Sequence[Sequence[int]], label_ids: Sequence[int], apply_softmax: bool
    ) -> np.ndarray:
        """Query and all items in one sequence under a block-diagonal mask (the seeds' `packed`).

        A baseline: compiled on first use per length (multiples of forward.PACKED_ALIGN), not warmed up."""
        total = len(query_ids) + sum(len(it) for it in items)
        s = -(-total // forward.PACKED_ALIGN) * forward.PACKED_ALIGN
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
        ids = self._labels(label_ids)
        valid = np.arange(len(ids)) < len(label_ids)
        probs = forward.score_packed(
            self.params,
            self.cfg,
            jnp.asarray(tokens),
            jnp.asarray(positions),
            jnp.asarray(segments),
            jnp.asarray(read_at),
            jnp.asarray(ids),
            jnp.asarray(valid),
            apply_softmax=apply_softmax,
        )
        return np.asarray(probs)[:, : len(label_ids)]
