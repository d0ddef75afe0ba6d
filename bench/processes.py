"""Server processes for the benches: `prefixscore serve` started in a process of its own and
waited on until SERVING, stopped with a drain; free loopback ports; waiting until a target has
compiled its call shapes (`prefixscore bench --serve-process` and --target, cluster.py's replicas)."""

from __future__ import annotations

import argparse
import socket
import subprocess
import sys
import tempfile
import time
from typing import Any

from prefixscore.engine import options


class ServedProcess:
    """`prefixscore serve` in a process of its own, on free ports, until closed: its threads
    are the server's alone, so their CPU time per request is the host cost."""

    def __init__(self, args: argparse.Namespace, timeout_s: float = 1800.0) -> None:
        port, http_port, metrics_port = free_ports(3)
        self.target, self.http_target = f"127.0.0.1:{port}", f"127.0.0.1:{http_port}"
        self.metrics_target = f"127.0.0.1:{metrics_port}"
        cmd = [sys.executable, "-c", "from prefixscore.cli import main; main()", "serve"]
        cmd += ["--host", "127.0.0.1", "--port", str(port)]
        cmd += ["--http-port", str(http_port), "--metrics-port", str(metrics_port), "--log-level", "warning"]
        # the bench's engine options, each as its serve flag (--serve-arg may override one)
        for option in options.OPTIONS:
            value = getattr(args, option.name)
            if value is not None:
                cmd += [option.flag_name, str(value)]
        self._log = tempfile.TemporaryFile()
        self.proc = subprocess.Popen([*cmd, *args.serve_arg], stdout=self._log, stderr=subprocess.STDOUT)
        try:
            self._wait_serving(timeout_s)
        except BaseException:
            self.close()
            raise

    def _wait_serving(self, timeout_s: float) -> None:
        import grpc
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        deadline = time.monotonic() + timeout_s
        with grpc.insecure_channel(self.target) as channel:
            health = health_pb2_grpc.HealthStub(channel)
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"the served process exited {self.proc.returncode}:\n{self._tail()}")
                try:
                    status = health.Check(health_pb2.HealthCheckRequest(), timeout=2).status
                    if status == health_pb2.HealthCheckResponse.SERVING:
                        return
                except grpc.RpcError:
                    pass
                time.sleep(0.5)
        raise RuntimeError(f"the served process was not SERVING after {timeout_s:.0f} s:\n{self._tail()}")

    def _tail(self, chars: int = 4000) -> str:
        self._log.seek(0)
        return self._log.read().decode(errors="replace")[-chars:]

    def close(self) -> None:
        stop_process(self.proc)
        self._log.close()


def stop_process(proc: subprocess.Popen, grace_s: float = 60.0) -> None:
    """SIGTERM (a server drains and exits), SIGKILL if it has not after `grace_s`."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def warmed_up(client: Any, timeout_s: float = 1800.0) -> Any:
    """The target's GetModelInfo once its background warm-up is done: measuring while shapes
    still compile beside the traffic would count the compiler's CPU and waits."""
    deadline = time.monotonic() + timeout_s
    while True:
        info = client.model_info()
        if info.call_shapes_ready >= info.call_shapes:
            return info
        if time.monotonic() > deadline:
            raise RuntimeError(
                f"the target compiled {info.call_shapes_ready} of {info.call_shapes} shapes in {timeout_s:.0f} s"
            )
        time.sleep(0.5)


def free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    try:
        for sock in socks:
            sock.bind(("127.0.0.1", 0))
        return [sock.getsockname()[1] for sock in socks]
    finally:
        for sock in socks:
            sock.close()
