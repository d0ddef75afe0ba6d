"""Several hosts as one replica: groups of real `prefixscore serve` processes on loopback, 4
simulated CPU devices each, one JAX runtime over gloo collectives (engine/hosts/hosts.py).

- Meshes over two hosts (2x4, 8x1, 1x8) and three (3x4) score unary and stream requests
  like one process (an in-process server over one device) in log space, and rerank and
  classify requests (label softmaxes) within 1e-5;
- the prefix cache hits across calls, and steady state compiles nothing on any host;
- a follower SIGKILLed under load: the leader goes NOT_SERVING and exits non-zero within the
  README's 5 s, and every request ends with a status; behind Envoy with a second group, nothing
  is lost; a follower silent (SIGSTOP) or sent a call it never starts: the leader exits within
  `--host-timeout` + 5 s; the leader gone, its followers exit (a silent leader: within
  `--host-timeout` + 5 s, `leader_lost` logged); the leader drained (SIGTERM), they exit 0.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import json
import signal
import socket
import subprocess
import threading
import time
import urllib.request
from collections.abc import Sequence
from pathlib import Path

import grpc
import numpy as np
import pytest
from conftest import TINY_SHAPES, xla_flags
from helpers.service import AS_DEPLOYED, LABELS, SERVE_BUCKETS, scrape, serve_process, server_config, wait_for
from test_prefix_affinity import envoy_in_front

from prefixscore.client import ScoreClient
from prefixscore.service.process import ServerThread

DEVICES = 4  # per host
QUERY = "Is this sentence about rivers?"
ITEMS = ["The Seine flows through Paris.", "Cats sleep a lot.", "The Rhine rises in the Alps."]
DOCS = ["The Loire is the longest river in France.", "Bread is baked in ovens.", "Rivers flow to the sea."]
CLASSIFY = ["The Seine is a river. Answer:", "The Seine is a cat. Answer:"]
CLASSIFY_LABELS = ("yes", "no")
HOST_TIMEOUT = 10.0
# the README's promise: a leader exits within 5 s of noticing a lost follower, and a SIGKILLed
# one is noticed at once (its connection closes); a silent one after `--host-timeout`
EXIT_BOUND_S = 5.0
# a process that decided to exit is reaped within this after (the kernel's teardown, see _killed)
TEARDOWN_S = 60.0
# a log probability (or a label softmax's probability) within this of one process's: float32
# over another sharding differs by about 1e-6; each comparison checks the effects it must see
# (rows reversed, labels swapped, a constant) are far larger
LOG_TOL = 1e-4
PROB_TOL = 1e-5
# the groups that fail a silent or stalling follower: short, so the tests wait little
SHORT_HOST_TIMEOUT = 4.0
SERVE = [
    "--model", "tiny-qwen3", "--host", "127.0.0.1", "--metrics-port", "0",
    *SERVE_BUCKETS, "--drain-seconds", "30",
    "--host-timeout", str(HOST_TIMEOUT), "--template", "qwen3-reranker", "--warmup", "false",
    "--classify-labels", *CLASSIFY_LABELS,
]  # fmt: skip


def _coordinator_port() -> int:
    """A free port whose successor (the step channel) is free too."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        try:
            with socket.socket() as s:
                s.bind(("127.0.0.1", port + 1))
        except OSError:
            continue
        return port
    raise RuntimeError("no two consecutive free ports")


class Group:
    """`hosts` serve processes forming one replica; host 0 (the leader) serves the API."""

    def __init__(
        self,
        hosts: int,
        *flags: str,
        model: list[str] | None = None,
        follower: Sequence[str] | None = None,
        env: dict[str, str] | None = None,
    ) -> None:
        """`follower`: what python runs for the last host instead of the CLI (a wrapper script)."""
        coordinator = f"127.0.0.1:{_coordinator_port()}"
        env = {"XLA_FLAGS": xla_flags(DEVICES), **(env or {})}
        common = [*SERVE, *(model or []), "--num-hosts", str(hosts), "--coordinator", coordinator, *flags]
        self.hosts: list[tuple[subprocess.Popen, list[dict]]] = []
        for index in range(hosts):
            api = ["--port", "0", "--http-port", "0"] if index == 0 else []
            launcher = follower if follower is not None and index == hosts - 1 else AS_DEPLOYED
            self.hosts.append(serve_process([*common, *api, "--host-index", str(index)], env, launcher))

    @property
    def leader(self) -> subprocess.Popen:
        return self.hosts[0][0]

    def event(self, name: str, host: int = 0) -> dict | None:
        proc, events = self.hosts[host]
        if proc.poll() is not None:  # exited: its last lines may still be on the reader's way
            events.complete()
        return next((e for e in list(events) if e.get("event") == name), None)

    def event_tail(self, count: int, host: int = 0) -> list[dict]:
        proc, events = self.hosts[host]
        if proc.poll() is not None:
            events.complete()
        return list(events)[-count:]

    def wait_ready(self) -> None:
        wait_for(lambda: self.event("ready") or any(p.poll() is not None for p, _ in self.hosts), 600, "ready")
        for index, (proc, events) in enumerate(self.hosts):
            assert proc.poll() is None, f"host {index} exited: {events[-20:]}"

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.event('listening')['port']}"

    @property
    def http(self) -> str:
        return f"http://127.0.0.1:{self.event('listening')['http_port']}"

    def metrics(self, host: int = 0) -> dict[str, float]:
        return scrape(self.event("listening", host)["metrics_port"])

    def stop(self) -> None:
        for proc, _ in self.hosts:
            if proc.poll() is None:
                proc.kill()
                proc.wait(30)


def _post(url: str, body: dict) -> dict:
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as response:
        return json.loads(response.read())


def _answers(target: str, http: str) -> dict[str, np.ndarray]:
    """What one replica answers: unary and stream scores, rerank relevance, classify probs."""
    with ScoreClient(target) as client:
        unary = client.score(QUERY, ITEMS, LABELS).scores
        with client.stream(QUERY, LABELS) as stream:
            streamed = stream.send(ITEMS[:2]) + stream.send(ITEMS[2:])
        ranked = client.rerank(QUERY, DOCS)
    relevance = sorted((r.index, r.relevance_score) for r in ranked.results)
    classified = _post(f"{http}/v1/classify", {"input": CLASSIFY})["data"]
    return {
        "unary": np.asarray(unary),
        "stream": np.asarray(streamed),
        "rerank": np.asarray([score for _, score in relevance]),
        "classify": np.asarray([row["probs"] for row in classified]),
    }


def _ready(started: dict[str, Group]):
    """The groups, once every one is ready; each stopped after the module."""
    try:
        for group in started.values():
            group.wait_ready()
        yield started
    finally:
        for group in started.values():
            group.stop()


@pytest.fixture(scope="module")
def one_process(tiny_scorer) -> dict[str, np.ndarray]:
    """The same requests to one process on one device (an in-process server)."""
    config = server_config(tiny_scorer, http_port=0, template="qwen3-reranker", classify_labels=CLASSIFY_LABELS)
    with ServerThread(config).start() as srv:
        return _answers(srv.target, f"http://127.0.0.1:{srv.server.http_port}")


@pytest.fixture(scope="module")
def groups():
    """Two groups of two hosts, started together: 2x4 (the model axis within each host) and 8x1
    (every device a replica), compiling each shape on first use (warm-up is each host's own
    compile, tests/test_compile.py proves it; here it would only cost the suite time)."""
    started = {"2x4": Group(2, "--tp-size", "4"), "8x1": Group(2, "--dp-size", "8")}
    yield from _ready(started)


def _assert_close_and_telling(got: np.ndarray, want: np.ndarray, tol: float, what: str) -> None:
    """got within tol of want, and want such that this sees a wrong answer: its rows reversed
    (several rows), its labels (last axis) swapped or any constant each differ from it by over
    10 x tol."""
    np.testing.assert_allclose(got, want, rtol=0, atol=tol, err_msg=what)
    assert np.ptp(want) > 20 * tol, f"{what}: a constant would pass ({np.ptp(want)})"
    if len(want) > 1:
        assert np.abs(want[::-1] - want).max() > 10 * tol, f"{what}: reversed rows would pass"
    if want.ndim == 2:
        assert np.abs(want[:, ::-1] - want).max() > 10 * tol, f"{what}: swapped labels would pass"


def _assert_like(got: dict[str, np.ndarray], want: dict[str, np.ndarray]) -> None:
    """Unary and stream scores are full-vocabulary probabilities (about 2e-5): compared as log
    probabilities; rerank relevances and classify probabilities are label softmaxes."""
    for key in ("unary", "stream"):
        _assert_close_and_telling(np.log(got[key]), np.log(want[key]), LOG_TOL, key)
    for key in ("rerank", "classify"):
        _assert_close_and_telling(got[key], want[key], PROB_TOL, key)


def test_a_group_reports_its_hosts_and_its_mesh(groups):
    group = groups["2x4"]
    loaded = group.event("model_loaded")
    assert (loaded["tp_size"], loaded["dp_size"], len(loaded["devices"])) == (4, 2, 8)
    assert loaded["hosts"] == 2 and loaded["model_axis_hosts"] == 1  # each host one row of the model axis
    assert group.event("hosts_ready")["hosts"] == 2
    metrics = group.metrics()
    assert metrics["prefixscore_hosts{state=group}"] == metrics["prefixscore_hosts{state=ready}"] == 2
    follower = group.metrics(1)
    assert follower["prefixscore_host_ready"] == 1
    assert follower["prefixscore_host_info{host_index=1,hosts=2}"] == 1
    with urllib.request.urlopen(f"http://127.0.0.1:{group.event('listening', 1)['metrics_port']}/ready") as ready:
        assert ready.status == 200
    loaded_8x1 = groups["8x1"].event("model_loaded")
    assert (loaded_8x1["tp_size"], loaded_8x1["dp_size"], loaded_8x1["model_axis_hosts"]) == (1, 8, 1)


@pytest.mark.parametrize("mesh", ["2x4", "8x1"])
def test_meshes_over_two_hosts_answer_like_one_process(groups, one_process, mesh):
    group = groups[mesh]
    _assert_like(_answers(group.target, group.http), one_process)
    sent = group.metrics()
    assert sent["prefixscore_step_send_seconds_count"] > 0 and sent["prefixscore_step_send_bytes_total"] > 0
    assert group.metrics(1)["prefixscore_host_calls_total"] == sent["prefixscore_step_send_seconds_count"]


def test_the_prefix_cache_hits_across_calls_and_steady_state_compiles_nothing_on_any_host(groups):
    """Traffic of every kind twice (new queries, cache hits, streams, long items): the first
    round compiles the shapes it needs on every host (the group runs without warm-up here), the
    second compiles nothing on any host."""
    group = groups["2x4"]
    query = list(range(3000, 3200))  # two pages: a prefill, then hits

    def traffic(client: ScoreClient, round: int) -> None:
        for n in range(3):
            client.score(query, [[7, 8, 9], list(range(10 + n, 300 + n))], LABELS)
            client.score(list(range(4000 + 300 * n + round, 4200 + 300 * n)), [[5, 6]] * (n + 1), LABELS)
            with client.stream(query, LABELS) as stream:
                stream.send([[1, 2, 3]] * 4)

    with ScoreClient(group.target) as client:
        first = client.score(query, [[7, 8, 9]], LABELS)
        traffic(client, 0)
        before = [group.metrics(h) for h in (0, 1)]
        traffic(client, 1)
        again = client.score(query, [[7, 8, 9]], LABELS)
    after = [group.metrics(h) for h in (0, 1)]
    assert first.usage.cached_tokens == 0 and again.usage.cached_tokens >= 128
    _assert_close_and_telling(np.log(again.scores), np.log(first.scores), LOG_TOL, "cache hit")
    assert after[0]["prefixscore_prefix_cache_hits_total"] > before[0]["prefixscore_prefix_cache_hits_total"]
    for host in (0, 1):
        assert after[host]["prefixscore_compilations_total"] == before[host]["prefixscore_compilations_total"], host
    assert after[1]["prefixscore_host_calls_total"] > before[1]["prefixscore_host_calls_total"]


def _exit_clock(proc: subprocess.Popen) -> concurrent.futures.Future[float]:
    """When `proc` exits (time.monotonic()), seen by a thread of its own from now on: a test
    busy elsewhere meanwhile (awaiting its requests) still measures the exit itself."""
    exited: concurrent.futures.Future[float] = concurrent.futures.Future()

    def wait() -> None:
        proc.wait()
        exited.set_result(time.monotonic())

    threading.Thread(target=wait, daemon=True).start()
    return exited


def _killed(proc: subprocess.Popen) -> _Gone:
    """SIGKILL `proc`; when it is gone. A killed process's sockets close only once the kernel has
    torn it down: its peers can notice the loss only from then (in one loaded run its leader saw
    both of its connections reset at one instant, 20 s after the signal), so the bounds on their
    exits count from its exit, not from the signal."""
    exited = _exit_clock(proc)
    proc.send_signal(signal.SIGKILL)
    return _Gone(time.monotonic(), exited)


@dataclasses.dataclass(frozen=True)
class _Gone:
    signalled: float  # time.monotonic() when the signal was sent
    exited: concurrent.futures.Future[float]  # when the process was reaped

    def result(self) -> float:
        """When it exited (within a minute of the signal)."""
        return self.exited.result(60)

    def __str__(self) -> str:
        return f"the killed process was reaped {self.result() - self.signalled:.1f} s after its signal"


# JAX's fatal line when its client sees the coordination service (on the leader) gone
JAX_LOST_SERVICE = "Terminating process because the JAX distributed service detected fatal errors"


def _left_for_the_leader(group: Group, host: int) -> bool:
    """Why a follower exited once its leader was killed: the step channel saw the connection close
    (`leader_lost`), or JAX's client saw its coordination service go with the leader first and
    ended the process itself (its fatal line, read raw). A follower that failed for another
    reason (`follower_failed`, a traceback) has neither."""
    if group.event("leader_lost", host):
        return True
    return any(e.get("event") == "raw" and JAX_LOST_SERVICE in e["line"] for e in group.hosts[host][1])


def _exited_within(
    exited: concurrent.futures.Future[float], since: float, bound: float, group: Group, host: int = 0, why: object = ""
) -> float:
    """Seconds from `since` (time.monotonic()) to host `host`'s decision to exit, at most `bound`:
    its last line (`exit`, written just before it ends), or its reap where it wrote none (a host
    that JAX's client ended). The process must then be gone, but its reap is not the bound's: the
    kernel frees a large process's memory before it is reaped, which took up to 20 s on a loaded
    machine (see _killed). A miss shows `why` and that host's last lines, timed from `since`."""
    reaped = exited.result(bound + TEARDOWN_S)
    tail = group.event_tail(40, host)
    timeline = _timeline(tail, since)
    last = next((e for e in reversed(tail) if e.get("event") == "exit"), None)
    decided = _monotonic(last["ts"]) if last is not None else reaped
    took = decided - since
    assert took <= bound, f"took {took:.1f} s, bound {bound} s ({why}); host {host}'s lines, s from then: {timeline}"
    return took


def _monotonic(ts: float) -> float:
    """A log line's wall-clock `ts` on this machine's time.monotonic() clock."""
    return ts - time.time() + time.monotonic()


def _timeline(events: list[dict], since: float) -> list[str]:
    """Log lines as `+seconds event` from `since` (time.monotonic()), short enough that a failure's
    message shows all of them: where a slow exit spent its time."""
    lines = []
    for e in events:
        what = e.get("event", "?") if e.get("event") != "raw" else "raw: " + e.get("line", "")[:120].strip()
        at = f"{_monotonic(e['ts']) - since:+.2f}" if isinstance(e.get("ts"), (int, float)) else "?"
        lines.append(f"{at} {str(what)[:160]}")
    return lines


def test_behind_envoy_a_group_losing_a_host_loses_no_request(groups, tmp_path):
    """Envoy in front of two groups' leaders; one group's follower SIGKILLed under load: its
    leader answers what it held UNAVAILABLE and exits, Envoy retries those on the other group,
    and every request is answered."""
    victim, other = groups["8x1"], groups["2x4"]
    ports = [int(g.target.rsplit(":", 1)[1]) for g in (victim, other)]
    http_ports = [int(g.http.rsplit(":", 1)[1]) for g in (victim, other)]
    with envoy_in_front([], tmp_path, ports, http_ports=http_ports) as front:
        with ScoreClient(f"127.0.0.1:{front['grpc']}") as client:
            queries = [list(range(9000 + 41 * q, 9000 + 41 * q + 32)) for q in range(24)]
            with concurrent.futures.ThreadPoolExecutor(12) as pool:
                calls = [pool.submit(client.score, q, [[7, 8, 9]] * 16, LABELS, timeout=120) for q in queries * 3]
                wait_for(lambda: sum(c.done() for c in calls) >= 6, 120, "traffic through Envoy")
                assert victim.leader.poll() is None, "the group failed before its follower was killed"
                exited = _exit_clock(victim.leader)
                gone = _killed(victim.hosts[1][0])
                for call in calls:
                    assert len(call.result(120).scores) == 16
    _exited_within(exited, gone.result(), EXIT_BOUND_S, victim, why=gone)
    assert victim.leader.returncode != 0
    assert victim.event("worker_failed") is not None


def test_a_follower_killed_under_load_fails_the_group_fast(groups):
    """SIGKILL a follower while requests run: the leader reports NOT_SERVING, answers every
    request with a status (scores or UNAVAILABLE; none hangs) and exits non-zero in the bound."""
    group = groups["2x4"]
    channel = grpc.insecure_channel(group.target)
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    health = health_pb2_grpc.HealthStub(channel)
    with ScoreClient(group.target) as client:
        queries = [list(range(5000 + 37 * q, 5000 + 37 * q + 64)) for q in range(48)]
        with concurrent.futures.ThreadPoolExecutor(16) as pool:
            calls = [pool.submit(client.score, q, [[7, 8, 9]] * 32, LABELS, timeout=120) for q in queries]
            wait_for(lambda: sum(c.done() for c in calls) >= 4, 120, "requests under way")
            assert group.leader.poll() is None, "the group failed before its follower was killed"
            exited = _exit_clock(group.leader)
            gone = _killed(group.hosts[1][0])
            statuses = []
            for call in calls:
                try:
                    call.result(EXIT_BOUND_S + 60)
                    statuses.append("OK")
                except grpc.RpcError as err:
                    statuses.append(err.code().name)
        try:
            serving = health.Check(health_pb2.HealthCheckRequest(), timeout=5).status
        except grpc.RpcError:
            serving = None  # already gone
    channel.close()
    took = _exited_within(exited, gone.result(), EXIT_BOUND_S, group, why=gone)
    assert group.leader.returncode != 0
    assert serving != health_pb2.HealthCheckResponse.SERVING
    assert "UNAVAILABLE" in statuses and set(statuses) <= {"OK", "UNAVAILABLE"}, collections.Counter(statuses)
    lost = group.event("worker_failed")
    assert "host 1" in lost["error"], lost
    print(f"leader exited {took:.2f} s after its follower was gone ({gone}); statuses {statuses}")


def _eight_head_checkpoint(directory: Path) -> Path:
    """A tiny Qwen3 checkpoint written by transformers with 8 query heads: tp 8 splits it."""
    import torch
    import transformers

    shapes = {**TINY_SHAPES, "num_attention_heads": 8}
    config = transformers.Qwen3Config(**shapes, head_dim=16, tie_word_embeddings=True)
    torch.manual_seed(0)
    transformers.Qwen3ForCausalLM(config).save_pretrained(directory)
    return directory


def test_one_model_axis_over_two_hosts_scores_like_transformers_and_stops_with_its_leader(tmp_path):
    """1x8: the model axis spans both hosts (its all-reduces cross them). Scores equal the
    transformers forward of query + item; SIGTERM drains the leader, which stops its follower:
    both exit 0."""
    import torch
    import transformers

    path = _eight_head_checkpoint(tmp_path / "qwen3-8-heads")
    group = Group(2, "--tp-size", "8", model=["--model", str(path)])
    try:
        group.wait_ready()
        loaded = group.event("model_loaded")
        assert (loaded["tp_size"], loaded["dp_size"], loaded["model_axis_hosts"]) == (8, 1, 2)
        query, items, labels = list(range(5, 45)), [[7, 8, 9], list(range(100, 130))], [11, 12]
        with ScoreClient(group.target) as client:
            got = np.asarray(client.score(query, items, labels).scores)
        oracle = transformers.AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32).eval()
        want = []
        for item in items:
            with torch.no_grad():
                logits = oracle(torch.tensor([query + item])).logits[0, -1]
            want.append(torch.log_softmax(logits.double(), -1)[labels].numpy())
        _assert_close_and_telling(np.log(got), np.asarray(want), LOG_TOL, "1x8 against transformers")
        group.leader.send_signal(signal.SIGTERM)
        assert group.leader.wait(60) == 0
        assert group.hosts[1][0].wait(30) == 0
        assert group.event("stopped", 1)["calls"] >= 1
    finally:
        group.stop()


def test_three_hosts_answer_like_one_process_and_exit_when_the_leader_is_gone(one_process):
    """12 devices over 3 hosts (3x4); the leader SIGKILLed, both followers exit non-zero."""
    group = Group(3, "--tp-size", "4")
    try:
        group.wait_ready()
        assert (group.event("model_loaded")["dp_size"], group.event("hosts_ready")["hosts"]) == (3, 3)
        _assert_like(_answers(group.target, group.http), one_process)
        followers = [(proc, _exit_clock(proc)) for proc, _ in group.hosts[1:]]
        gone = _killed(group.leader)
        for host, (proc, exited) in enumerate(followers, 1):
            _exited_within(exited, gone.result(), HOST_TIMEOUT + EXIT_BOUND_S, group, host, why=gone)
            assert proc.returncode != 0
        for host in (1, 2):
            assert _left_for_the_leader(group, host), group.hosts[host][1][-10:]
    finally:
        group.stop()


@pytest.fixture(scope="module")
def stall_file(tmp_path_factory) -> Path:
    """Once this file exists, the "stalling" group's follower holds the next call it receives."""
    return tmp_path_factory.mktemp("stall") / "stall-now"


@pytest.fixture(scope="module")
def failing_groups(stall_file):
    """Three 8x1 groups to fail, started together, with a short `--host-timeout`: one whose
    follower goes silent, one whose follower holds a call (tests/helpers/stalling_follower.py),
    one whose leader goes silent. Their tests come last: the other groups' processes are gone by then."""
    short = ("--dp-size", "8", "--host-timeout", str(SHORT_HOST_TIMEOUT))
    stalling = [str(Path(__file__).parent / "helpers" / "stalling_follower.py")]
    started = {
        "silent": Group(2, *short),
        "stalling": Group(2, *short, follower=stalling, env={"PREFIXSCORE_TEST_STALL_FILE": str(stall_file)}),
        "silent leader": Group(2, *short),
    }
    yield from _ready(started)


def _score_fails_unavailable(group: Group) -> None:
    """A request to a group about to fail ends UNAVAILABLE (not by its deadline, far past the bound)."""
    with ScoreClient(group.target) as client, pytest.raises(grpc.RpcError) as failed:
        client.score(QUERY, ITEMS, LABELS, timeout=60)
    assert failed.value.code() == grpc.StatusCode.UNAVAILABLE, failed.value


def test_a_silent_follower_fails_the_group_within_the_host_timeout(failing_groups):
    """A follower alive but answering nothing (SIGSTOP): no heartbeat for `--host-timeout`
    loses the group; the request held is answered UNAVAILABLE and the leader exits non-zero
    within `--host-timeout` + 5 s."""
    group = failing_groups["silent"]
    exited = _exit_clock(group.leader)
    group.hosts[1][0].send_signal(signal.SIGSTOP)
    stopped = time.monotonic()
    _score_fails_unavailable(group)
    _exited_within(exited, stopped, SHORT_HOST_TIMEOUT + EXIT_BOUND_S, group)
    assert group.leader.returncode != 0
    lost = group.event("worker_failed")["error"]
    assert "host 1 sent nothing for" in lost, lost


def test_a_call_sent_and_never_started_fails_the_group(failing_groups, stall_file):
    """A follower that receives a call and never starts it while its heartbeat goes on: the
    leader loses the group `--host-timeout` after sending it, answers the request UNAVAILABLE
    and exits non-zero within `--host-timeout` + 5 s."""
    group = failing_groups["stalling"]
    # twice: the first call prefills the query, the second reads it from the pool; each compiles
    # its shape on the leader before it is sent, so the next (the second's shape) is sent at once
    with ScoreClient(group.target) as client:
        for _ in range(2):
            assert len(client.score(QUERY, ITEMS, LABELS).scores) == len(ITEMS)
    exited = _exit_clock(group.leader)
    stall_file.touch()
    sent = time.monotonic()
    _score_fails_unavailable(group)
    _exited_within(exited, sent, SHORT_HOST_TIMEOUT + EXIT_BOUND_S, group)
    assert group.leader.returncode != 0
    lost = group.event("worker_failed")["error"]
    assert "host 1 has not started call" in lost, lost


def test_a_silent_leader_ends_its_follower_within_the_host_timeout(failing_groups):
    """A leader alive but sending nothing (SIGSTOP): its follower hears nothing for
    `--host-timeout`, logs `leader_lost` and exits non-zero within `--host-timeout` + 5 s. JAX's
    own heartbeat (3 x `--host-timeout`) comes later and the leader's TCP connections stay open,
    so here the step channel alone ends the follower (a SIGKILLed leader races JAX's client)."""
    group = failing_groups["silent leader"]
    follower = group.hosts[1][0]
    exited = _exit_clock(follower)
    group.leader.send_signal(signal.SIGSTOP)
    stopped = time.monotonic()
    _exited_within(exited, stopped, SHORT_HOST_TIMEOUT + EXIT_BOUND_S, group, 1)
    assert follower.returncode != 0
    lost = group.event("leader_lost", 1)
    assert lost is not None and "the leader sent nothing for" in lost["error"], group.hosts[1][1][-10:]
