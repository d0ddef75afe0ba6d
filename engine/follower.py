"""A follower host's device loop: run the leader's calls, as sent, in the order sent.

The leader plans (engine/device_loop.py) and sends each call before launching it
(engine/step_channel.py); a follower plans nothing and reads no result: it launches the same
executable on its own devices' shards with the same inputs, so every collective of the call
meets its peers on the other hosts. It keeps one call in flight while the next is already
waiting (as the leader overlaps planning with the device), reports each call started and
finished, and stops when the leader says so. Any failure here ends the process: the group is
restarted together.
"""

from __future__ import annotations

import logging

import jax

from prefixscore.engine.scoring_engine import ScoringEngine
from prefixscore.engine.step_channel import CALL, HEARTBEAT, RESET, STOP, StepFollower

log = logging.getLogger("prefixscore.hosts")


def follow(engine: ScoringEngine, channel: StepFollower) -> int:
    """Run the leader's steps until it says stop; returns the calls run. Raises LeaderLost
    (the leader is gone) or the device's error."""
    in_flight: tuple[int, jax.Array] | None = None  # (seq, probabilities) launched, not yet done

    def finish() -> None:
        nonlocal in_flight
        if in_flight is not None:
            seq, probs = in_flight
            jax.block_until_ready(probs)
            channel.done(seq)
            in_flight = None

    calls = 0
    while True:
        if not channel.waiting():
            finish()  # nothing queued behind it: report it as soon as it is done
        step = channel.receive()
        if step.op == HEARTBEAT:
            continue
        if step.op == STOP:
            finish()
            return calls
        if step.op == RESET:
            finish()
            engine.reset_pool()
            continue
        if step.op != CALL or step.shape is None:
            raise ValueError(f"the leader sent an unknown step: {step.op!r}")
        if not engine.compiled(step.shape):
            channel.compiling(step.seq)
        probs = engine.run_sent(step.shape, step.arrays)
        channel.started(step.seq)
        finish()
        in_flight = (step.seq, probs)
        calls += 1
