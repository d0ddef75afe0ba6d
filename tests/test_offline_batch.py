"""`prefixscore batch` end to end: real subprocesses of the command, in process (`--model`) and
against real servers (`--target`), checked against direct calls to the HTTP API.

One server over the session's tiny-qwen3 (template `none`) answers the direct calls and is a
target; a second one, with its own engine and prefix pool, makes a fleet of two.
"""

from __future__ import annotations

import json
import os
import random
import re
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import numpy as np
import pytest
from conftest import SMALL_BUCKETS
from helpers.service import AS_DEPLOYED, SERVE_BUCKETS, scrape, server_config, wait_for

from prefixscore.service.core import ServerConfig
from prefixscore.service.process import ServerThread

LABELS = [28, 1017]
MISSES = "prefixscore_prefix_cache_misses_total"


@pytest.fixture(scope="module")
def server(tiny_scorer):
    config = server_config(tiny_scorer, http_port=0, template="none")
    with ServerThread(config) as srv:
        yield srv


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=f"http://127.0.0.1:{server.server.http_port}", timeout=120) as client:
        yield client


def batch(*args: str, limit: list[str] = ()) -> subprocess.Popen:
    """`prefixscore batch ARGS` as a subprocess, without torch as deployed; `limit`: a command it
    runs under (prlimit)."""
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "TOKENIZERS_PARALLELISM": "false"}
    return subprocess.Popen(
        [*limit, sys.executable, *AS_DEPLOYED, "batch", *args],
        stderr=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        text=True,
        env=env,
    )


def finished(proc: subprocess.Popen, timeout: float = 300) -> str:
    _, err = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, err[-3000:]
    return err


def prefills(stderr: str) -> int:
    return int(re.search(r"; (\d+) prefills", stderr).group(1))


def request_lines(n: int, queries: int, seed: int, topic: str = "query") -> list[dict]:
    """`n` lines, half score and half rerank, over `queries` score and `queries` rerank queries,
    shuffled (a query's lines are spread over the whole file); `topic` names the queries, so a test
    can use queries no other test cached."""
    lines = []
    for i in range(n):
        k = (i // 2) % queries
        if i % 2:
            body = {"query": f"Rerank {topic} {k}:", "documents": [f" doc {i % 5}", " other"], "top_n": 1 + i % 2}
            lines.append({"custom_id": f"r{i}", "method": "POST", "url": "/v1/rerank", "body": body})
        else:
            body = {"query": f"Score {topic} {k}:", "items": [f" item {i % 7}"], "label_token_ids": LABELS}
            lines.append({"custom_id": f"s{i}", "method": "POST", "url": "/v1/score", "body": body})
    random.Random(seed).shuffle(lines)
    return lines


def write(path: Path, lines: list[dict], extra: list[str] = ()) -> None:
    with path.open("w") as f:
        for line in lines:
            f.write(json.dumps(line) + "\n")
        for raw in extra:
            f.write(raw + "\n")


def answers(path: Path) -> dict[str, dict]:
    """custom_id -> output line; fails on a custom_id answered twice or a partial line."""
    out: dict[str, dict] = {}
    for raw in path.read_text().splitlines():
        line = json.loads(raw)
        assert line["custom_id"] not in out, f"{line['custom_id']} answered twice"
        assert set(line) == {"id", "custom_id", "response", "error"}
        assert set(line["response"]) == {"status_code", "request_id", "body"}
        out[line["custom_id"]] = line
    return out


def assert_like_http(http: httpx.Client, line: dict, answer: dict) -> None:
    """The batch's body has the scores the HTTP API gives for the line's body (in process the
    engine's call shapes differ from the server's: float32 rounding apart)."""
    direct = http.post(line["url"], json=line["body"])
    assert direct.status_code == 200 == answer["response"]["status_code"], direct.text
    got, want = answer["response"]["body"], direct.json()
    if line["url"] == "/v1/score":
        np.testing.assert_allclose(got["scores"], want["scores"], rtol=1e-5, atol=1e-7)
        assert got["usage"]["prompt_tokens"] == want["usage"]["prompt_tokens"]
    else:
        assert [r["index"] for r in got["results"]] == [r["index"] for r in want["results"]]
        relevance = [[r["relevance_score"] for r in body["results"]] for body in (got, want)]
        np.testing.assert_allclose(*relevance, rtol=1e-5)
        assert [r["document"] for r in got["results"]] == [r["document"] for r in want["results"]]


MALFORMED = [
    "this is not JSON",
    json.dumps({"method": "POST", "url": "/v1/score", "body": {}}),  # no custom_id
    json.dumps({"custom_id": "bad-url", "method": "POST", "url": "/v1/chat/completions", "body": {}}),
    json.dumps(
        {
            "custom_id": "bad-body",
            "method": "POST",
            "url": "/v1/score",
            "body": {"query": "q", "items": [""], "label_token_ids": LABELS},
        }
    ),
]


def test_killed_and_resumed_answers_every_line_once_like_the_http_api(tmp_path, server, http):
    """6,000 shuffled lines: sent to the server until the output has lines, SIGKILL, a partial
    last line left as a crash mid-write would, then --resume in process (a resumed run may use
    another backend: the output is the same format). Every custom_id once, the malformed lines
    each with an error line of their own, a sample equal to direct HTTP calls, and the resumed
    run prefills each query it still had lines of exactly once."""
    lines = request_lines(6_000, queries=24, seed=1)
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    write(src, lines[:3_000], MALFORMED)  # the malformed lines in the middle of the file
    with src.open("a") as f:
        for line in lines[3_000:]:
            f.write(json.dumps(line) + "\n")
    common = [str(src), "-o", str(out), "--window-lines", "1024"]
    first = batch(*common, "--target", f"127.0.0.1:{server.server.http_port}")
    wait_for(lambda: out.exists() and out.stat().st_size > 90_000, timeout=120, what="output lines")
    first.send_signal(signal.SIGKILL)
    first.wait()
    written = out.read_bytes()
    complete = written[: written.rfind(b"\n") + 1]  # the kill may itself have cut a line short
    assert 0 < complete.count(b"\n") < 6_000
    # a crash in the middle of a write: the last whole line cut short
    keep = complete[: complete.rstrip(b"\n").rfind(b"\n") + 1]
    cut_id = json.loads(complete[len(keep) :])["custom_id"]
    out.write_bytes(keep + complete[len(keep) : len(keep) + 40])

    # the test servers' buckets: shapes other tests may have compiled
    args = [*common, "--model", "tiny-qwen3", "--template", "none", *SERVE_BUCKETS]
    refused = batch(*args)
    refused.communicate(timeout=120)
    assert refused.returncode == 2  # an output with lines is not overwritten without --resume

    err = finished(batch(*args, "--resume"))
    got = answers(out)
    assert set(got) == {line["custom_id"] for line in lines} | {"line:3001", "line:3002", "bad-url", "bad-body"}
    assert cut_id in got
    for custom_id in ("line:3001", "line:3002", "bad-url"):
        assert got[custom_id]["response"]["status_code"] == 400 and isinstance(got[custom_id]["error"], str)
    bad = got["bad-body"]
    assert bad["response"]["body"] is None and bad["error"]["param"] == "items[0]"
    assert http.post("/v1/score", json=json.loads(MALFORMED[3])["body"]).json() == bad["error"]
    ok = [line for line in lines if got[line["custom_id"]]["error"] is None]
    assert len(ok) == 6_000
    for line in random.Random(2).sample(lines, 30):
        assert_like_http(http, line, got[line["custom_id"]])
    # one prefill per query the resumed run still had lines of (the process started cold)
    answered_before = {json.loads(raw)["custom_id"] for raw in keep.splitlines()}
    left = {line["body"]["query"] for line in lines if line["custom_id"] not in answered_before}
    assert prefills(err) == len(left)


@pytest.fixture(scope="module")
def second_server():
    """A replica with its own engine and prefix pool (the first one shares the session's)."""
    config = ServerConfig(
        model="tiny-qwen3",
        buckets=SMALL_BUCKETS,
        host="127.0.0.1",
        port=0,
        metrics_port=0,
        http_port=0,
        template="none",
        warmup=False,
    )
    with ServerThread(config) as srv:
        yield srv


def test_a_fleet_of_two_prefills_each_query_once_where_its_key_sends_it(tmp_path, server, second_server, http):
    lines = request_lines(600, queries=12, seed=3, topic="fleet")
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    write(src, lines)
    servers = [server, second_server]
    before = [scrape(s.server.metrics_port)[MISSES] for s in servers]
    targets = [f"127.0.0.1:{s.server.http_port}" for s in servers]
    finished(batch(str(src), "-o", str(out), "--target", targets[0], "--target", targets[1], "--window-lines", "256"))
    misses = [scrape(s.server.metrics_port)[MISSES] - b for s, b in zip(servers, before, strict=True)]
    assert sum(misses) == 24  # 12 score and 12 rerank queries, each prefilled once, on one replica
    assert min(misses) > 0  # both replicas took queries
    got = answers(out)
    assert len(got) == 600 and all(a["error"] is None for a in got.values())
    for line in lines[:10]:
        assert_like_http(http, line, got[line["custom_id"]])


def test_memory_stays_flat_on_a_file_larger_than_the_memory_limit(tmp_path, server):
    """The input (330 MiB: long padding on every line) is larger than the process may allocate
    (RLIMIT_DATA 300 MiB, set by prlimit: a little above what the command needs; a fork with
    a preexec_fn from this threaded process could deadlock); streamed, it runs through."""
    src, out = tmp_path / "big.jsonl", tmp_path / "out.jsonl"
    pad = "x" * (1 << 20)
    with src.open("w") as f:
        for i in range(330):
            body = {"query": f"Padded query {i % 4}:", "items": [" a"], "label_token_ids": LABELS}
            f.write(json.dumps({"custom_id": f"p{i}", "method": "POST", "url": "/v1/score", "note": pad, "body": body}))
            f.write("\n")
    limit = 300 << 20
    assert src.stat().st_size > limit

    target = f"127.0.0.1:{server.server.http_port}"
    finished(batch(str(src), "-o", str(out), "--target", target, limit=["prlimit", f"--data={limit}", "--"]))
    got = answers(out)
    assert len(got) == 330 and all(a["error"] is None for a in got.values())
