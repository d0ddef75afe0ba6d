"""Several hosts as one replica: JAX's multi-controller runtime, one process per host.

Every host runs `prefixscore serve` with the same model and flags and its own index; the
processes join one JAX runtime (`jax.distributed.initialize`), so `jax.devices()` lists every
host's devices and one (data, model) mesh spans them (engine/runtime/mesh.py keeps the model axis
within a host where the sizes allow). Host 0, the leader, plans every call and sends it to the
others before it launches (engine/hosts/step_channel.py); each follower launches the same
executable with the same inputs in the same order (service/follower.py), so the collectives of
every call meet.

Joining: `--num-hosts N --host-index I --coordinator HOST:PORT` on every host (JAX's
coordination service listens on the leader's PORT, the step channel on PORT + 1); on a
multi-host TPU slice with none of them, JAX's own detection from the TPU runtime's
environment (`TPU_WORKER_HOSTNAMES`, `TPU_WORKER_ID`), the leader being the first hostname.
On CPUs the processes' collectives run over gloo (TCP), which is how several processes on one
machine form one mesh (the tests).
"""

from __future__ import annotations

import dataclasses
import logging
import os

import jax

log = logging.getLogger("prefixscore.hosts")

# JAX's coordinator port on a TPU slice it detects (jax._src.clusters.cloud_tpu_cluster; 8476 is
# the TPU runtime's own); the step channel listens on the next port
STEP_PORT_OFFSET = 1
TPU_COORDINATOR_PORT = 8482
# how long a host waits for the others to join (JAX's coordination service, the step channel)
JOIN_TIMEOUT_S = 300


class HostGroupError(ValueError):
    """A host group the flags describe wrongly (raised before any device work)."""


@dataclasses.dataclass(frozen=True)
class HostGroup:
    """This process's place in a group of hosts serving one model (hosts 1: a group of one)."""

    hosts: int = 1
    index: int = 0  # 0: the leader (plans, serves the API); others follow
    coordinator: str | None = None  # "HOST:PORT" of the leader's JAX coordination service
    # a follower silent this long (no heartbeat, or a call unfinished) fails the group
    timeout_s: float = 10.0
    detected: bool = False  # from the TPU runtime's environment, not from flags

    def __post_init__(self) -> None:
        if self.hosts < 1:
            raise HostGroupError(f"num-hosts must be at least 1 (got {self.hosts})")
        if not 0 <= self.index < self.hosts:
            raise HostGroupError(f"host-index must be in [0, {self.hosts}) for {self.hosts} host(s) (got {self.index})")
        if self.hosts > 1 and not self.detected:
            host, _, port = (self.coordinator or "").rpartition(":")
            if not host or not port.isdigit():
                raise HostGroupError(
                    f"coordinator must be HOST:PORT, the leader's address, with num-hosts {self.hosts} "
                    f"(got {self.coordinator!r})"
                )
        if self.timeout_s <= 0:
            raise HostGroupError(f"host-timeout must be positive (got {self.timeout_s})")

    @property
    def several(self) -> bool:
        return self.hosts > 1

    @property
    def leader(self) -> bool:
        return self.index == 0

    @property
    def step_address(self) -> tuple[str, int]:
        """Where the leader's step channel listens: the coordinator's host, its port + 1."""
        host, _, port = (self.coordinator or "").rpartition(":")
        return host.strip("[]"), int(port) + STEP_PORT_OFFSET

    @classmethod
    def from_flags(cls, hosts: int | None, index: int | None, coordinator: str | None, timeout_s: float) -> HostGroup:
        """The group the flags name; none of them on a multi-host TPU slice: the slice's (JAX's
        detection, from TPU_WORKER_HOSTNAMES and TPU_WORKER_ID); else a group of one."""
        if hosts is None and index is None and coordinator is None:
            names = [n for n in os.environ.get("TPU_WORKER_HOSTNAMES", "").split(",") if n]
            if len(names) > 1:
                index = int(os.environ.get("TPU_WORKER_ID", "0"))
                return cls(len(names), index, f"{names[0]}:{TPU_COORDINATOR_PORT}", timeout_s, detected=True)
        return cls(hosts or 1, index or 0, coordinator, timeout_s)


def join(group: HostGroup) -> None:
    """Join the group's JAX runtime (before any device is touched; once: a second call is a
    no-op); a group of one: nothing.
    Returns once every host has joined. JAX's own client ends a process whose peers are gone: at
    once when the leader, which runs JAX's coordination service, dies (racing the step channel,
    engine/hosts/step_channel.py, which logs `leader_lost`), or after its heartbeat timeout."""
    if not group.several or jax.distributed.is_initialized():
        return
    # CPU processes exchange their collectives over gloo (TCP); accelerators use their own links
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    # JAX's preemption service takes SIGTERM for its own sync points; the server drains on it
    jax.config.update("jax_enable_preemption_service", False)
    heartbeat = max(10, int(3 * group.timeout_s))
    if group.detected:
        jax.distributed.initialize(initialization_timeout=JOIN_TIMEOUT_S, heartbeat_timeout_seconds=heartbeat)
    else:
        jax.distributed.initialize(
            group.coordinator,
            group.hosts,
            group.index,
            initialization_timeout=JOIN_TIMEOUT_S,
            heartbeat_timeout_seconds=heartbeat,
        )
    if (jax.process_count(), jax.process_index()) != (group.hosts, group.index):
        raise HostGroupError(
            f"JAX's runtime has {jax.process_count()} process(es) and this is {jax.process_index()}, "
            f"but the group is {group.hosts} host(s) and this is host {group.index}"
        )
    log.info(
        "joined host group: host %d of %d, %d devices here, %d in all",
        group.index,
        group.hosts,
        jax.local_device_count(),
        jax.device_count(),
    )
