"""A function over a call's rows in steps of one fixed size, the steps' count read at run time.

The per-token work of the layers (model/decoder.py `per_tile`) and the output head (model/step.py)
both run this way, so that a row's bits never depend on its call: XLA:CPU lays a product or a
reduction out by its operand's shape, and a step has the same shape, and the same code, in every
call.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp


def in_steps(
    fn: Callable[..., Any], step: int, rows: tuple[jax.Array, ...], count: jax.Array, wanted: jax.Array | None = None
) -> Any:
    """fn over `step` rows at a time: the first `count` steps (a traced int32), or the steps that
    `wanted` marks ([ceil(R / step)] bool; count: how many it marks).

    rows: arrays with one leading row axis [R, ...]; fn maps slices [step, ...] to a pytree of
    [step, ...]. Rows of the steps that do not run are zeros. Returns the pytree of [R, ...]."""
    total = rows[0].shape[0]
    # at least two steps' rows: XLA drops a dynamic slice that covers its whole operand, and a
    # one-step call's code would then differ from every other call's
    padded = -(-max(total, 2 * step) // step) * step
    rows = tuple(jnp.pad(a, [(0, padded - total)] + [(0, 0)] * (a.ndim - 1)) for a in rows)
    probe = [jax.ShapeDtypeStruct((step, *a.shape[1:]), a.dtype) for a in rows]
    out = jax.tree.map(lambda s: jnp.zeros((padded, *s.shape[1:]), s.dtype), jax.eval_shape(fn, *probe))
    # a step's offset read from an array of at least two entries in every call: with one read off
    # the loop counter, or out of a one-entry array, the mesh's needles (tests/test_mesh.py) gave a
    # token other bits with its query cached than with it prefilled in the same call
    steps = padded // step
    if wanted is None:
        order = jnp.arange(steps, dtype=jnp.int32)
    else:  # the wanted steps, in order
        wanted = jnp.pad(wanted, (0, steps - wanted.shape[0]))
        order = jnp.nonzero(wanted, size=steps, fill_value=0)[0].astype(jnp.int32)

    def run(i: jax.Array, out: Any) -> Any:
        at = order[i] * step
        got = fn(*(jax.lax.dynamic_slice_in_dim(a, at, step) for a in rows))
        return jax.tree.map(lambda o, g: jax.lax.dynamic_update_slice_in_dim(o, g, at, 0), out, got)

    # a trip count XLA cannot read: it would inline a loop it sees run once, and the step's code
    # would then fuse with the code around it
    out = jax.lax.fori_loop(0, jax.lax.optimization_barrier(count), run, out)
    return jax.tree.map(lambda o: o[:total], out)
