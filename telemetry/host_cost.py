"""This process's CPU time per thread kind, as the OS counts it (`/proc/self/task/*/stat`).

The server exports it as `prefixscore_thread_cpu_seconds_total{kind}`, and the bench
reads that before and after a timed run, so a request's host cost is measured, not
estimated: CPU seconds per request of

- `python`: the interpreter's threads (event loop, device loop, executors, gRPC's
  poller), known by their native ids (`threading.enumerate()`). Not by name: CPython
  does not name its threads for the OS, and neither does XLA name all of its own, so
  both kinds carry the process's name;
- `xla`: the threads XLA runs device calls on (on CPU the call's compute itself; on an
  accelerator its host side): its named pools (`tf_XLAEigen`, `llvm-worker-*`) and the
  native threads without a name of their own, which on CPU execute the calls;
- `grpc`: gRPC's C core (`grpc_global_tim`, `event_engine`, `lifeguard`, executors);
- `other`: any other named thread, and the threads that have ended (the process's total
  from /proc/self/stat less what the live threads account for), so the sum is the
  process's CPU time and every kind only grows.

Only Linux has /proc: elsewhere nothing is exported.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

from prometheus_client.core import CounterMetricFamily

KINDS = ("python", "xla", "grpc", "other")
# thread names (comm, 15 characters at most) of XLA's CPU client and compiler, and of gRPC's core
XLA_MARKS = ("xla", "eigen", "tf_", "llvm-worker", "pjrt", "tsl")
GRPC_MARKS = ("grpc", "event_engine", "lifeguard", "resolver", "executor", "default-execu")


def kind_of(tid: int, comm: str, python_tids: set[int], main_comm: str) -> str:
    if tid in python_tids:
        return "python"
    name = comm.lower()
    if comm == main_comm or any(mark in name for mark in XLA_MARKS):
        return "xla"  # an unnamed native thread: on CPU, XLA's execution threads
    if any(mark in name for mark in GRPC_MARKS):
        return "grpc"
    return "other"


@dataclasses.dataclass(frozen=True)
class Snapshot:
    """CPU seconds (user + system) per thread id, with each thread's name."""

    seconds: dict[int, float]
    names: dict[int, str]
    main_comm: str


def snapshot(pid: int) -> Snapshot | None:
    """Every thread's CPU time now; None where /proc is not there (not Linux) or pid is gone."""
    tasks = Path(f"/proc/{pid}/task")
    try:
        main_comm = (tasks / str(pid) / "comm").read_text().strip()
        tids = [int(t) for t in os.listdir(tasks)]
    except OSError:
        return None
    hz = os.sysconf("SC_CLK_TCK")
    seconds, names = {}, {}
    for tid in tids:
        try:
            stat = (tasks / str(tid) / "stat").read_text()
            comm = (tasks / str(tid) / "comm").read_text().strip()
        except OSError:  # the thread ended meanwhile
            continue
        # fields after "(comm)": state is the 3rd field of the line, utime and stime the 14th and 15th
        fields = stat[stat.rfind(")") + 2 :].split()
        seconds[tid] = (int(fields[11]) + int(fields[12])) / hz
        names[tid] = comm
    return Snapshot(seconds, names, main_comm)


def python_thread_ids() -> set[int]:
    """Native ids of this interpreter's threads."""
    return {t.native_id for t in threading.enumerate() if t.native_id is not None}


def _process_seconds(pid: int) -> float | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat[stat.rfind(")") + 2 :].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def seconds_by_kind(pid: int | None = None, python_tids: set[int] | None = None) -> dict[str, float] | None:
    """CPU seconds so far by thread kind (and `total`) of a process (this one by default)."""
    pid = pid or os.getpid()
    snap = snapshot(pid)
    total = _process_seconds(pid)
    if snap is None or total is None:
        return None
    python_tids = python_thread_ids() if python_tids is None else python_tids
    out = {kind: 0.0 for kind in KINDS}
    for tid, spent in snap.seconds.items():
        out[kind_of(tid, snap.names[tid], python_tids, snap.main_comm)] += spent
    out["other"] += max(0.0, total - sum(out.values()))  # threads that have ended
    return {**out, "total": max(total, sum(out.values()))}


def interpreter_thread_ids(pid: int) -> set[int]:
    """Native ids of another process's Python threads, from `py-spy dump` (it reads the
    interpreter's thread states): for a server that does not export its own figures."""
    spy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    try:
        out = subprocess.run([spy, "dump", "--pid", str(pid), "--json"], capture_output=True, text=True, timeout=60)
    except OSError as err:
        raise RuntimeError(f"--target-pid needs py-spy to tell Python threads from native ones: {err}") from err
    if out.returncode != 0:
        raise RuntimeError(f"py-spy dump --pid {pid} failed: {out.stderr.strip()[-500:]}")
    return {int(t["os_thread_id"]) for t in json.loads(out.stdout)}


class ThreadCpuCollector:
    """`prefixscore_thread_cpu_seconds_total{kind}`, read from /proc at each scrape."""

    def collect(self) -> Iterator[CounterMetricFamily]:
        family = CounterMetricFamily(
            "prefixscore_thread_cpu_seconds",
            "CPU seconds of this process's threads by kind (python, xla, grpc, other), as the OS counts them.",
            labels=["kind"],
        )
        seconds = seconds_by_kind()
        if seconds is not None:
            for kind in KINDS:
                family.add_metric([kind], seconds[kind])
        yield family


def per_request(before: dict[str, float], after: dict[str, float], requests: int) -> dict[str, float]:
    """Milliseconds of CPU per request by kind and in total, between two readings."""
    kinds = (*KINDS, "total")
    return {k: 1000 * (after.get(k, 0.0) - before.get(k, 0.0)) / max(1, requests) for k in kinds}
