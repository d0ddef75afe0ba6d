"""A follower host: `prefixscore serve --host-index I` with I > 0.

It serves no API. It joins the group's JAX runtime, connects to the leader's step channel,
loads its own shards of the weights, compiles every call shape and checks its attention
kernels (as the leader does), reports ready to the leader, and then runs each call the leader
sends until the leader says stop (`follow`). Its metrics port answers /metrics, /health
(alive) and /ready (loaded, compiled, checked) for the orchestrator.

Running the leader's calls: the leader plans (engine/loop/device_loop.py) and sends each call
before launching it (engine/hosts/step_channel.py); a follower plans nothing and reads no result:
it launches the same executable on its own devices' shards with the same inputs
(engine/hosts/follower_steps.py), in the order sent, so every collective of the call meets its
peers on the other hosts. It keeps one call in flight while the next is already waiting (as the
leader overlaps planning with the device), and reports each call started and finished.

It exits with the leader: 0 when the leader stopped it, non-zero when the leader is gone or
silent, or on any failure here (which the leader sees as its step channel closing). SIGTERM
does not stop it on its own: a leader draining its requests still needs every host for their
calls, and tells the followers to stop when it is done.
"""

from __future__ import annotations

import logging
import signal
import threading
import time

import jax

from prefixscore.engine.build import build_engine
from prefixscore.engine.hosts.follower_steps import SentCalls
from prefixscore.engine.hosts.hosts import HostGroup, join
from prefixscore.engine.hosts.step_channel import CALL, HEARTBEAT, RESET, STOP, LeaderLost, StepFollower
from prefixscore.engine.runtime.scoring_engine import ScoringEngine
from prefixscore.service.config import ServerConfig
from prefixscore.telemetry.compiles import CompileCounter
from prefixscore.telemetry.logs import event
from prefixscore.telemetry.metrics import FollowerMetrics, serve_metrics

log = logging.getLogger("prefixscore.server")


def follow(engine: ScoringEngine, channel: StepFollower) -> int:
    """Run the leader's steps until it says stop; returns the calls run. Raises LeaderLost
    (the leader is gone) or the device's error."""
    sent = SentCalls(engine)
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
            # the call ahead is reported done before a compile that may outlast --host-timeout
            finish()
            channel.compiling(step.seq)
        probs = sent.run(step.shape, step.arrays)
        channel.started(step.seq)
        finish()
        in_flight = (step.seq, probs)
        calls += 1


class FollowerHost:
    """One follower process; see the module doc. `run()` returns the exit code."""

    def __init__(self, config: ServerConfig, group: HostGroup) -> None:
        self.config = config
        self.group = group
        self.engine: ScoringEngine | None = None
        self.ready = False
        self.metrics = FollowerMetrics(self._stats)
        self.metrics.host.info({"host_index": str(group.index), "hosts": str(group.hosts)})
        self.metrics_port: int | None = None

    def _stats(self) -> dict[str, float]:
        stats: dict[str, float] = {"compilations": CompileCounter.count()}
        engine = self.engine
        if engine is not None:
            stats["calls"] = engine.stats["calls"]
            stats["weight_bytes"] = engine.weight_bytes_per_device
            in_use = [(d.memory_stats() or {}).get("bytes_in_use") for d in engine.layout.local_devices]
            if all(b is not None for b in in_use):
                stats["device_bytes_in_use"] = max(in_use)  # type: ignore[type-var]
        return stats

    def probe(self, path: str) -> str | None:
        """/health passes while the process runs; /ready once it is loaded, compiled and checked."""
        if path == "/ready" and not self.ready:
            return "loading"
        return None

    def run(self) -> int:
        cfg, group = self.config, self.group
        CompileCounter.install()
        if cfg.metrics_port is not None:
            server = serve_metrics(cfg.metrics_host or cfg.host, cfg.metrics_port, self.metrics.registry, self.probe)
            self.metrics_port = server.server_port
        event(log, "listening", metrics_port=self.metrics_port, host_index=group.index, hosts=group.hosts)
        # SIGTERM: keep running the leader's calls until it stops this host (see the module doc)
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, lambda *_: event(log, "sigterm", waiting_for="the leader's stop"))
        try:
            join(group)
            channel = StepFollower(group)
            started = time.monotonic()
            built = build_engine(cfg.engine_spec())
            engine = self.engine = built.engine
            event(
                log,
                "model_loaded",
                host_index=group.index,
                devices=[f"{d.platform}:{d.id}" for d in engine.layout.local_devices],
                weight_bytes_per_device=engine.weight_bytes_per_device,
                seconds=round(built.load_seconds, 3),
            )
            report = engine.warmup() if cfg.warmup else {"executables": 0, "compilations": 0}
            checked = engine.check_attention()
            self.ready = True
            self.metrics.ready.set(1)
            channel.ready(
                host=group.index,
                executables=report["executables"],
                compilations=report["compilations"],
                attention_max_abs_error=checked,
                seconds=round(time.monotonic() - started, 3),
            )
            event(log, "ready", host_index=group.index, **report)
            calls = follow(engine, channel)
        except LeaderLost as err:
            event(log, "leader_lost", level=logging.CRITICAL, error=str(err))
            return 1
        except Exception as err:
            log.exception("the follower failed")
            event(log, "follower_failed", level=logging.CRITICAL, error=f"{type(err).__name__}: {err}")
            return 1
        channel.close()
        event(log, "stopped", host_index=group.index, calls=calls)
        return 0
