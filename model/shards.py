"""The mesh's axes as the per-device code sees them (inside `shard_map`). On the model axis
each device holds 1/size of the attention heads, MLP columns and vocabulary rows
(engine/runtime/mesh.py places them); on the data axis each replica runs its own prefill chunks.

The decoder needs exactly three things from the split, all here: sum the partial outputs
of a row-split projection (the attention's o and the MLP's down projection: one
all-reduce each per layer), look a token up in a vocabulary split by rows, and reduce the
vocabulary head's log-sum-exp across shards (each device's share of the vocabulary, then
one max and one sum of a [rows] vector: the logits are never gathered).

`UNSPLIT` and `ALONE` (the defaults everywhere) are the whole model on one device: no
collective is traced, so one device runs exactly the code it always ran.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class ModelShards:
    """Static (hashable): how the weights this device holds were split on the model axis."""

    axis: str | None = None  # the mesh axis name; None: the whole model here
    size: int = 1  # devices on the axis
    # the real vocabulary: rows of the last shard past it are padding (the vocabulary rounded
    # up to a multiple of size), which the log-sum-exp must not count; 0: no padding
    vocab_size: int = 0

    @property
    def split(self) -> bool:
        return self.axis is not None and self.size > 1

    def sum(self, x: jax.Array) -> jax.Array:
        """The sum over the model axis of each device's partial x (an all-reduce)."""
        return jax.lax.psum(x, self.axis) if self.split else x

    def max(self, x: jax.Array) -> jax.Array:
        return jax.lax.pmax(x, self.axis) if self.split else x

    def first_row(self, local_rows: int) -> jax.Array:
        """The global index of this device's first row of a [vocab / size, ...] shard."""
        return jax.lax.axis_index(self.axis) * local_rows if self.split else jnp.int32(0)

    def real_rows(self, local_rows: int) -> jax.Array | None:
        """Rows of this device's vocabulary shard that are real (not padding); None: all."""
        if not self.split or not self.vocab_size or self.vocab_size == local_rows * self.size:
            return None
        return jnp.clip(self.vocab_size - self.first_row(local_rows), 0, local_rows)

    def take_rows(self, table: jax.Array, ids: jax.Array) -> jax.Array:
        """table[ids] for a table split by rows: each device looks up the ids in its shard
        (zeros for the rest) and the shards are summed, which is exact (one term is nonzero).
        table: [rows / size, width]; ids: [...] int32 -> [..., width]."""
        if not self.split:
            return jnp.take(table, ids, axis=0)
        rows = table.shape[0]
        local = ids - self.first_row(rows)
        mine = (local >= 0) & (local < rows)
        found = jnp.take(table, jnp.clip(local, 0, rows - 1), axis=0)
        return self.sum(jnp.where(mine[..., None], found, jnp.zeros((), table.dtype)))

    def top(self, values: jax.Array, ids: jax.Array) -> tuple[jax.Array, jax.Array]:
        """The k largest of every shard's own k largest values [rows, k] (ids: their global ids
        [rows, k]): each device gathers all shards' and keeps the k largest, lower ids first
        on ties (shards hold ascending id ranges, gathered in order)."""
        if not self.split:
            return values, ids
        k = values.shape[1]
        every_vals = jax.lax.all_gather(values, self.axis, axis=1, tiled=True)  # [rows, size * k]
        every_ids = jax.lax.all_gather(ids, self.axis, axis=1, tiled=True)
        top_vals, pick = jax.lax.top_k(every_vals, k)
        return top_vals, jnp.take_along_axis(every_ids, pick, axis=1)

    def logsumexp(self, local_lse: jax.Array) -> jax.Array:
        """log(sum(exp(.))) over the whole vocabulary from each shard's own: [rows] float32."""
        if not self.split:
            return local_lse
        top = self.max(local_lse)
        return top + jnp.log(self.sum(jnp.exp(local_lse - top)))


UNSPLIT = ModelShards()


@dataclasses.dataclass(frozen=True)
class DataReplicas:
    """Static (hashable): the data axis as the per-device code sees it. Each replica runs its
    own prefill chunks; their K/V is gathered so every replica's pool gets every page."""

    axis: str | None = None  # the mesh axis name; None: one replica
    size: int = 1

    def gather(self, x: jax.Array) -> jax.Array:
        """Every replica's x, concatenated on the leading axis in replica order (an all-gather)."""
        if self.axis is None or self.size == 1:
            return x
        return jax.lax.all_gather(x, self.axis, axis=0, tiled=True)


ALONE = DataReplicas()
