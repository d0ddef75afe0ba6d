"""Who else runs each call: the engine tells its broadcast before it launches a call or resets
its pool, whatever the number of hosts.

One host: nobody (`ALONE`). The leader of a group of hosts: every follower, over the step
channel (engine/hosts/step_channel.py `StepLeader`), so each launches the same executable with the
same inputs in the same order and the collectives of every call meet.
"""

from __future__ import annotations

from typing import Any, Protocol

from prefixscore.model.call_inputs import CallShape


class CallBroadcast(Protocol):
    """What the engine tells the other hosts, before doing it itself."""

    def call(self, shape: CallShape, inputs: Any) -> None:
        """A call of `shape` over `inputs` (its pytree of arrays) is about to launch."""

    def reset(self) -> None:
        """The pool is about to be replaced by a new, zeroed one."""


class _Alone:
    """One host: no other host runs the calls."""

    def call(self, shape: CallShape, inputs: Any) -> None:
        pass

    def reset(self) -> None:
        pass


ALONE: CallBroadcast = _Alone()
