"""A follower's side of each call: the call the leader sent over the step channel
(engine/hosts/step_channel.py: its shape and its inputs' leaves) launched on this host's engine as
the leader launched it, so the call's collectives meet. Only a follower runs calls this way
(service/follower.py); the engine itself knows nothing of hosts but its broadcast.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import numpy as np

from prefixscore.engine.runtime.scoring_engine import ScoringEngine
from prefixscore.model.call_inputs import CallShape


class SentCalls:
    """The calls a leader sends, run on this follower's engine (`run`)."""

    def __init__(self, engine: ScoringEngine) -> None:
        self.engine = engine
        # a call's inputs as the step channel carries them: their leaves, in this tree, of these
        # dtypes (the same for every call shape)
        specs = engine.call_specs(engine.buckets.call_shapes()[0])
        self._tree = jax.tree.structure(specs)
        self._dtypes = [spec.dtype for spec in jax.tree.leaves(specs)]

    def run(self, shape: CallShape, arrays: Sequence[np.ndarray]) -> jax.Array:
        """Launch the call the leader sent (its shape and its inputs' leaves), as the leader
        launched it; returns the probabilities (replicated: every host has them)."""
        # the leader's Python scalars travel as int64: the executable takes its own dtypes
        leaves = [a if a.dtype == t else a.astype(t) for a, t in zip(arrays, self._dtypes, strict=True)]
        return self.engine.run(shape, jax.tree.unflatten(self._tree, leaves))
