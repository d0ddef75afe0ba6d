"""`prefixscore serve` whose follower receives a call and never starts it (for tests/test_hosts.py):
once the file named by $PREFIXSCORE_TEST_STALL_FILE exists, the next call the leader sends is
received and then held forever, while the step channel's heartbeat (its own thread) goes on, as
a follower whose device thread hangs before launching would behave. Run as a script:
`python stalling_follower.py serve ARGS`."""

from __future__ import annotations

import os
import sys
import threading

from cli_as_deployed import cli  # as deployed: without torch (first, before anything imports it)

from prefixscore.engine.hosts.step_channel import CALL, Step, StepFollower

TRIGGER = os.environ["PREFIXSCORE_TEST_STALL_FILE"]
received = StepFollower.receive


def receive_then_stall(self: StepFollower) -> Step:
    step = received(self)
    if step.op == CALL and os.path.exists(TRIGGER):
        threading.Event().wait()  # never started, never reported
    return step


StepFollower.receive = receive_then_stall  # type: ignore[method-assign]

if __name__ == "__main__":
    sys.exit(cli.main(sys.argv[1:]))
