"""The leader's group of hosts, as the service sees it (docs/design.md, "Several hosts").

The engine only tells its broadcast each call (engine/runtime/call_broadcast.py); everything else
about the group is here, on the leader:
- **waiting**: the leader is ready only once every follower is loaded, compiled and checked;
- **watch and loss**: a host gone or stuck (the step channel, engine/hosts/step_channel.py, decides)
  means no call can complete: every request held fails UNAVAILABLE at once (the device thread
  may wait in a collective forever), new ones are refused, and the service fails, so the
  process exits non-zero (service/process.py) and the group is restarted together;
- **stop**: once the leader has drained, its followers are told to exit.
A group of one has nothing to wait for, watch or stop.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from prefixscore.engine.hosts.step_channel import StepLeader
from prefixscore.engine.loop.device_loop import WorkerFailed
from prefixscore.telemetry.logs import event
from prefixscore.telemetry.metrics import ServiceMetrics

log = logging.getLogger("prefixscore.server")


class GroupWatch:
    """See the module doc. `fail(error)`: from a step channel thread, once the group is lost:
    fail every request held and refuse new ones with `error`, and stop the process non-zero."""

    def __init__(self, metrics: ServiceMetrics, fail: Callable[[WorkerFailed], None]) -> None:
        self.metrics = metrics
        self._fail = fail
        self._steps: StepLeader | None = None
        self.lost: str | None = None  # why the group can run no more calls

    def wait_ready(self, steps: StepLeader | None) -> None:
        """On the device thread, at start: watch the group of `steps` (None: a group of one) and
        wait until every follower is ready. Raises GroupLost."""
        hosts = 1 if steps is None else steps.group.hosts
        self.metrics.hosts.labels("group").set(hosts)
        if steps is None:
            self.metrics.hosts.labels("ready").set(1)
            return
        self._steps = steps
        steps.on_sent = lambda seconds, size: (
            self.metrics.step_send_seconds.observe(seconds),
            self.metrics.step_send_bytes.inc(size),
        )
        steps.watch(self._lose)
        event(log, "waiting_for_hosts", hosts=hosts, timeout_s=steps.timeout)
        reports = steps.wait_ready()
        self.metrics.hosts.labels("ready").set(hosts)
        event(log, "hosts_ready", hosts=hosts, followers=reports)

    def _lose(self, reason: str) -> None:
        self.lost = reason
        self._fail(WorkerFailed(f"a host of this replica's group was lost ({reason}); retry on another replica"))

    def stop(self) -> None:
        """After draining: the followers exit with the leader (a lost group's are gone already)."""
        if self._steps is not None and self.lost is None:
            self._steps.stop()
