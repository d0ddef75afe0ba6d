"""The step channel: how each planned call reaches every host before it launches.

One TCP connection per follower to the leader (the coordinator's host, its port + 1). The
leader sends each call's shape and its input arrays (a few KB: token ids, positions, the page
table) as one frame, to every follower, before launching the call itself; a follower launches
the same executable with the same inputs, in the order received (service/follower.py), so the
collectives of every call meet. Arrays travel as raw bytes under a JSON header (dtype, shape):
nothing is unpickled, and the header is all a peer can make a host parse.

Both ends watch the other, so nothing waits forever in a collective:
- a follower sends a heartbeat every `timeout / 4`, STARTED when it has launched a call and
  DONE when the call's outputs are ready, each for consecutive calls, and COMPILING before it
  compiles a call's shape (no warm-up: the first calls of a shape); the leader sends a
  heartbeat when it has sent nothing for `timeout / 4`;
- the leader declares the group lost when a follower closes its connection (it exited), sends
  nothing for `timeout`, has not started a call `timeout` after it was sent and the call ahead
  of it started (unless compiling it: then while it beats), leaves a started call unfinished for `timeout`, or starts or
  finishes calls out of order (it skipped one); a follower declares the leader lost when its
  connection closes or it sends nothing for `timeout`.
What a lost group does (health NOT_SERVING, in-flight requests UNAVAILABLE, exit) is the
service's business (service/group_watch.py, service/follower.py).
"""

from __future__ import annotations

import collections
import dataclasses
import json
import logging
import select
import socket
import struct
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from prefixscore.engine.hosts.hosts import JOIN_TIMEOUT_S, HostGroup
from prefixscore.model.call_inputs import CallShape

log = logging.getLogger("prefixscore.hosts")

_FRAME = struct.Struct("!II")  # header bytes, payload bytes
MAX_HEADER_BYTES = 1 << 20  # a header past this is not one the leader wrote
# leader -> follower
CALL, RESET, STOP, HEARTBEAT = "call", "reset", "stop", "heartbeat"
# follower -> leader (and HEARTBEAT)
HELLO, READY, COMPILING, STARTED, DONE = "hello", "ready", "compiling", "started", "done"


class GroupLost(RuntimeError):
    """A host of the group is gone or stuck: the group cannot run another call."""


@dataclasses.dataclass(frozen=True)
class Step:
    """One message from the leader: a call (its shape and input arrays), a pool reset or stop."""

    op: str
    seq: int = 0  # calls are numbered from 1, in launch order
    shape: CallShape | None = None
    arrays: tuple[np.ndarray, ...] = ()


def encode(header: dict[str, Any], arrays: Sequence[np.ndarray] = ()) -> bytes:
    """One frame: the header (JSON, with each array's dtype and shape) and the arrays' bytes."""
    arrays = [np.asarray(a) for a in arrays]  # (tobytes() writes C order whatever the strides)
    head = json.dumps({**header, "arrays": [[a.dtype.str, list(a.shape)] for a in arrays]}).encode()
    payload = b"".join(a.tobytes() for a in arrays)
    return _FRAME.pack(len(head), len(payload)) + head + payload


def _read_exactly(sock: socket.socket, n: int) -> bytearray:
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        k = sock.recv_into(view[got:])
        if not k:
            raise ConnectionError("the connection closed")
        got += k
    return buf


def read_frame(sock: socket.socket) -> tuple[dict[str, Any], list[np.ndarray]]:
    """One frame off the socket: its header and arrays (views of one buffer, read-only)."""
    head_len, payload_len = _FRAME.unpack(_read_exactly(sock, _FRAME.size))
    if head_len > MAX_HEADER_BYTES:
        raise ConnectionError(f"a frame header of {head_len} bytes: not a step channel peer")
    header = json.loads(_read_exactly(sock, head_len))
    payload = bytes(_read_exactly(sock, payload_len))
    arrays, at = [], 0
    for dtype, shape in header.pop("arrays", []):
        array = np.frombuffer(payload, np.dtype(dtype), int(np.prod(shape, dtype=np.int64)), at).reshape(shape)
        at += array.nbytes
        arrays.append(array)
    if at != payload_len:
        raise ConnectionError("a frame's arrays do not fill its payload")
    return header, arrays


def _tuned(sock: socket.socket) -> socket.socket:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # a call's frame goes out at once
    return sock


class _Peer:
    """A socket written by several threads (a lock per frame) and when it last spoke."""

    def __init__(self, sock: socket.socket, name: str) -> None:
        self.sock, self.name = _tuned(sock), name
        self.lock = threading.Lock()
        self.heard = time.monotonic()
        self.said = time.monotonic()

    def send(self, frame: bytes) -> None:
        with self.lock:
            self.sock.sendall(frame)
            self.said = time.monotonic()

    def close(self) -> None:
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()


@dataclasses.dataclass
class _Follower:
    peer: _Peer
    index: int
    ready: dict[str, Any] | None = None  # what it reported when ready
    started: int = 0  # the last call it launched
    compiling: int = 0  # the call whose shape it said it compiles (its start may take long)
    done: int = 0  # the last call whose outputs it had
    started_at: collections.deque = dataclasses.field(default_factory=collections.deque)  # (seq, when)
    last_started_at: float = 0.0  # when it launched its last call (a call starts after the one ahead)


class StepLeader:
    """The leader's end: accepts the followers, sends them every call before it launches, and
    watches them (see the module doc). `on_lost(reason)` callbacks run once, on a channel thread,
    when the group is lost."""

    def __init__(self, group: HostGroup) -> None:
        self.group = group
        self.timeout = group.timeout_s
        host, port = group.step_address
        family = socket.AF_INET6 if socket.has_dualstack_ipv6() else socket.AF_INET
        self._server = socket.create_server(
            ("", port), family=family, dualstack_ipv6=family == socket.AF_INET6, backlog=group.hosts
        )
        self._followers: dict[int, _Follower] = {}
        self._cv = threading.Condition()
        self._seq = 0
        self._sent: collections.deque[tuple[int, float]] = collections.deque()  # (seq, when) not started by all
        self.lost: str | None = None
        self._on_lost: list[Callable[[str], None]] = []
        self._stopping = False
        # the cost of sending calls: count, bytes of one follower's copy, seconds serializing and sending
        self.sent = {"calls": 0, "bytes": 0, "seconds": 0.0}
        self.on_sent: Callable[[float, int], None] | None = None
        threading.Thread(target=self._accept, name="prefixscore-steps-accept", daemon=True).start()
        threading.Thread(target=self._watch, name="prefixscore-steps-watch", daemon=True).start()

    # ---- the device thread -----------------------------------------------------------------
    def call(self, shape: CallShape, inputs: Any) -> None:
        """Send one call (its shape, its inputs' leaves) to every follower, before the leader
        launches it. Raises GroupLost."""
        started = time.perf_counter()
        arrays = jax.tree.leaves(inputs)
        with self._cv:
            self._seq += 1
            seq = self._seq
            self._sent.append((seq, time.monotonic()))
        frame = encode({"op": CALL, "seq": seq, "shape": dataclasses.astuple(shape)}, arrays)
        self._send_all(frame)
        seconds = time.perf_counter() - started
        self.sent["calls"] += 1
        self.sent["bytes"] += len(frame)
        self.sent["seconds"] += seconds
        if self.on_sent is not None:
            self.on_sent(seconds, len(frame))

    def reset(self) -> None:
        """Every follower makes a new, zeroed pool, as the leader does after a failed call."""
        self._send_all(encode({"op": RESET}))

    def _send_all(self, frame: bytes) -> None:
        if self.lost is not None:
            raise GroupLost(self.lost)
        for follower in self._all():
            try:
                follower.peer.send(frame)
            except OSError as err:
                self._lose(f"host {follower.index}: sending a call failed ({err})")
                raise GroupLost(self.lost or "") from err

    # ---- life ---------------------------------------------------------------------------------
    def watch(self, on_lost: Callable[[str], None]) -> None:
        """Call on_lost(reason) once the group is lost (at once if it already is)."""
        with self._cv:
            if self.lost is None:
                self._on_lost.append(on_lost)
                return
        on_lost(self.lost)

    def wait_ready(self, on_ready: Callable[[int, dict[str, Any]], None] | None = None) -> list[dict[str, Any]]:
        """Block until every follower has joined and reported ready (loaded, compiled, kernels
        checked): what each reported, by host index. Raises GroupLost."""
        with self._cv:
            while self.lost is None and self.ready_hosts < self.group.hosts - 1:
                self._cv.wait(0.5)
            if self.lost is not None:
                raise GroupLost(self.lost)
            return [self._followers[i].ready or {} for i in sorted(self._followers)]

    @property
    def ready_hosts(self) -> int:
        """Followers that reported ready."""
        return sum(f.ready is not None for f in self._followers.values())

    def stop(self, timeout: float = 5.0) -> None:
        """Tell every follower to exit, and wait (up to timeout) for them to close."""
        self._stopping = True
        for follower in self._all():
            try:
                follower.peer.send(encode({"op": STOP}))
            except OSError:
                continue
        deadline = time.monotonic() + timeout
        for follower in self._all():
            follower.peer.sock.settimeout(max(0.0, deadline - time.monotonic()))
        with self._cv:
            while self._followers and time.monotonic() < deadline:
                self._cv.wait(0.1)
        self._server.close()

    def _all(self) -> list[_Follower]:
        with self._cv:
            return list(self._followers.values())

    def _lose(self, reason: str) -> None:
        with self._cv:
            if self.lost is not None or self._stopping:
                return
            self.lost = reason
            callbacks, self._on_lost = self._on_lost, []
            self._cv.notify_all()
        log.critical("host group lost: %s", reason)
        for callback in callbacks:
            try:
                callback(reason)
            except Exception:
                log.exception("a group-lost callback failed")

    # ---- channel threads ------------------------------------------------------------------------
    def _accept(self) -> None:
        """Take each follower's connection once (its hello names its index), then stop listening."""
        self._server.settimeout(1.0)
        deadline = time.monotonic() + JOIN_TIMEOUT_S
        while len(self._followers) < self.group.hosts - 1 and self.lost is None:
            if time.monotonic() > deadline:
                missing = sorted(set(range(1, self.group.hosts)) - set(self._followers))
                self._lose(f"host(s) {missing} never joined the step channel in {JOIN_TIMEOUT_S} s")
                return
            try:
                sock, address = self._server.accept()
            except TimeoutError:
                continue
            except OSError:
                return  # closed by stop()
            try:
                sock.settimeout(self.timeout)
                header, _ = read_frame(sock)
                index = int(header.get("index", -1))
                if header.get("op") != HELLO or not 0 < index < self.group.hosts or index in self._followers:
                    raise ConnectionError(f"not an expected follower's hello: {header}")
                sock.settimeout(None)
            except (OSError, ValueError) as err:
                log.warning("step channel: refused a connection from %s: %s", address, err)
                sock.close()
                continue
            follower = _Follower(_Peer(sock, f"host {index}"), index)
            with self._cv:
                self._followers[index] = follower
                self._cv.notify_all()
            log.info("step channel: host %d joined from %s", index, address[0])
            reader = threading.Thread(target=self._read, args=(follower,), name=f"prefixscore-steps-{index}")
            reader.daemon = True
            reader.start()
        self._server.close()

    def _read(self, follower: _Follower) -> None:
        """A follower's messages: heartbeats, ready, and the calls it started and finished."""
        while True:
            try:
                header, _ = read_frame(follower.peer.sock)
            except (OSError, ValueError) as err:
                with self._cv:
                    self._followers.pop(follower.index, None)
                    self._cv.notify_all()
                self._lose(f"host {follower.index} closed the step channel ({err}): it exited or its network failed")
                return
            follower.peer.heard = time.monotonic()
            op, seq = header.get("op"), int(header.get("seq", 0))
            if op == READY:
                with self._cv:
                    follower.ready = header
                    self._cv.notify_all()
            elif op == COMPILING:
                follower.compiling = seq
            elif op == STARTED:
                if seq != follower.started + 1:
                    after = follower.started
                    self._lose(f"host {follower.index} launched call {seq} after call {after}: it skipped one")
                    return
                follower.started = seq
                follower.last_started_at = follower.peer.heard
                follower.started_at.append((seq, follower.peer.heard))
            elif op == DONE:
                if seq != follower.done + 1 or seq > follower.started:
                    self._lose(f"host {follower.index} finished call {seq} after call {follower.done}: out of order")
                    return
                follower.done = seq
                follower.started_at.popleft()

    def _watch(self) -> None:
        """Every timeout / 8: a follower silent, with a call sent and not started (unless it
        compiles it) or started and not finished, for `timeout` loses the group; a follower not
        written to for timeout / 4 gets a heartbeat."""
        beat = encode({"op": HEARTBEAT})
        while self.lost is None and not self._stopping:
            time.sleep(min(0.25, self.timeout / 8))
            now = time.monotonic()
            followers = self._all()
            with self._cv:  # calls every follower started leave the clock
                while self._sent and followers and all(f.started >= self._sent[0][0] for f in followers):
                    self._sent.popleft()
                sent = list(self._sent)
            for follower in followers:
                waiting = next(((seq, at) for seq, at in sent if seq > follower.started), None)
                # its clock runs from its sending or the start of the call ahead of it, whichever
                # is later: a follower compiling that one (it said so) cannot start this one yet
                since = max(waiting[1], follower.last_started_at) if waiting else now
                if waiting and waiting[0] != follower.compiling and now - since > self.timeout:
                    self._lose(f"host {follower.index} has not started call {waiting[0]} in {self.timeout:g} s")
                    return
                if now - follower.peer.heard > self.timeout:
                    self._lose(f"host {follower.index} sent nothing for {now - follower.peer.heard:.1f} s")
                    return
                if follower.started_at and now - follower.started_at[0][1] > self.timeout:
                    seq = follower.started_at[0][0]
                    self._lose(f"host {follower.index} has not finished call {seq} in {self.timeout:g} s")
                    return
                if now - follower.peer.said > self.timeout / 4:
                    try:
                        follower.peer.send(beat)
                    except OSError:
                        pass  # its reader sees the connection end


class LeaderLost(GroupLost):
    """The leader closed the step channel, told this host to stop, or went silent."""


class StepFollower:
    """A follower's end: connects to the leader, receives its steps in order, reports what it
    launched and finished, and beats while alive (see the module doc)."""

    def __init__(self, group: HostGroup) -> None:
        self.group = group
        self.timeout = group.timeout_s
        address = group.step_address
        deadline = time.monotonic() + JOIN_TIMEOUT_S
        while True:  # the leader listens once it has joined JAX's runtime: retry until then
            try:
                sock = socket.create_connection(address, timeout=self.timeout)
                break
            except OSError as err:
                if time.monotonic() > deadline:
                    raise LeaderLost(f"the leader's step channel at {address} did not answer: {err}") from err
                time.sleep(0.2)
        sock.settimeout(None)
        self._peer = _Peer(sock, "leader")
        self._peer.send(encode({"op": HELLO, "index": group.index}))
        self._closed = threading.Event()
        threading.Thread(target=self._beat, name="prefixscore-steps-beat", daemon=True).start()

    def receive(self) -> Step:
        """The next message (a heartbeat too: the caller may act between them). Raises
        LeaderLost when the leader closes the channel or sends nothing for `timeout`."""
        readable, _, _ = select.select([self._peer.sock], [], [], self.timeout)
        if not readable:
            raise LeaderLost(f"the leader sent nothing for {self.timeout:g} s")
        try:
            header, arrays = read_frame(self._peer.sock)
        except (OSError, ValueError) as err:
            raise LeaderLost(f"the leader closed the step channel ({err})") from err
        op = header.get("op")
        shape = CallShape(*header["shape"]) if op == CALL else None
        return Step(op, int(header.get("seq", 0)), shape, tuple(arrays))

    def waiting(self) -> bool:
        """Whether a step has arrived and not been received yet."""
        readable, _, _ = select.select([self._peer.sock], [], [], 0)
        return bool(readable)

    def compiling(self, seq: int) -> None:
        """Say this host compiles call `seq`'s shape first (it starts late, not never)."""
        self._peer.send(encode({"op": COMPILING, "seq": seq}))

    def started(self, seq: int) -> None:
        self._peer.send(encode({"op": STARTED, "seq": seq}))

    def done(self, seq: int) -> None:
        self._peer.send(encode({"op": DONE, "seq": seq}))

    def ready(self, **report: Any) -> None:
        """Tell the leader this host is loaded, compiled and checked (with what it reports)."""
        self._peer.send(encode({"op": READY, **report}))

    def close(self) -> None:
        self._closed.set()
        self._peer.close()

    def _beat(self) -> None:
        beat = encode({"op": HEARTBEAT})
        while not self._closed.wait(self.timeout / 4):
            try:
                self._peer.send(beat)
            except OSError:
                return  # receive() sees the connection end
