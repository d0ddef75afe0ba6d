"""`prefixscore serve --tp-size` as a real subprocess on 4 simulated CPU devices: the mesh
it chose is logged, reported (GetModelInfo, /v1/models, a gauge), and it scores unary calls
and streams like one device; a tp-size the model cannot take fails start-up naming the
valid sizes."""

from __future__ import annotations

import json
import subprocess
import urllib.request

import numpy as np
import pytest
from conftest import xla_flags
from helpers.compare import log_gap
from helpers.service import LABELS, SERVE_BUCKETS, scrape, serve_process, wait_for

from prefixscore.client import ScoreClient

DEVICES = 4
QUERY = "Is this sentence about rivers?"
ITEMS = ["The Seine flows through Paris.", "Cats sleep a lot.", "The Rhine rises in the Alps."]
SERVE = [
    "--model", "tiny-qwen3", "--host", "127.0.0.1", "--port", "0", "--metrics-port", "0",
    "--http-port", "0", "--template", "none", "--warmup", "false", *SERVE_BUCKETS,
]  # fmt: skip


def _start(*flags: str) -> tuple[subprocess.Popen, list[dict]]:
    return serve_process([*SERVE, *flags], {"XLA_FLAGS": xla_flags(DEVICES)})


def _event(events: list[dict], name: str) -> dict | None:
    return next((e for e in list(events) if e.get("event") == name), None)


@pytest.fixture(scope="module")
def served():
    proc, events = _start("--tp-size", "2")
    try:
        wait_for(lambda: _event(events, "ready") or proc.poll() is not None, 300, "ready")
        assert proc.poll() is None, f"serve exited: {events}"
        yield _event(events, "listening"), events
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)


def test_the_mesh_is_logged_and_reported(served):
    listening, events = served
    loaded = _event(events, "model_loaded")
    assert loaded["tp_size"] == 2 and loaded["dp_size"] == 2 and len(loaded["devices"]) == DEVICES
    assert loaded["kv_heads_per_device"] >= 1 and loaded["peak_host_memory_bytes"] > 0
    with ScoreClient(f"127.0.0.1:{listening['port']}") as client:
        info = client.model_info()
    assert (info.tp_size, info.dp_size) == (2, 2)
    with urllib.request.urlopen(f"http://127.0.0.1:{listening['http_port']}/v1/models") as response:
        card = json.loads(response.read())["data"][0]
    assert (card["tp_size"], card["dp_size"]) == (2, 2)
    metrics = scrape(listening["metrics_port"])
    assert metrics["prefixscore_mesh_devices{axis=model}"] == 2
    assert metrics["prefixscore_mesh_devices{axis=data}"] == 2


# in log space: the probabilities are full-vocabulary ones near 2e-5, and an absolute 1e-5 passed
# another query's scores, the items reversed and a constant 1/V alike. Measured on 2x2 against one
# device: 9.9e-7 apart; those three wrong answers are 4.0e-2, 1.2e-1 and 3.0e-1 away
LOG_TOLERANCE = 1e-5


def test_unary_and_stream_score_like_one_device(served, tiny_scorer):
    listening, _ = served
    want = np.asarray(tiny_scorer.score(QUERY, ITEMS, LABELS))
    with ScoreClient(f"127.0.0.1:{listening['port']}") as client:
        got = client.score(QUERY, ITEMS, LABELS).scores
        with client.stream(QUERY, LABELS) as stream:
            first, second = stream.send(ITEMS[:2]), stream.send(ITEMS[2:])
    wrong = {
        "another query": tiny_scorer.score("Is this sentence about cats?", ITEMS, LABELS),
        "the items reversed": want[::-1],
        "1/V": np.full_like(want, 1 / tiny_scorer.cfg.vocab_size),
    }
    assert log_gap(got, want) <= LOG_TOLERANCE
    assert log_gap(first + second, want) <= LOG_TOLERANCE
    assert min(log_gap(w, want) for w in wrong.values()) > 1000 * LOG_TOLERANCE  # the check sees them


def test_a_tp_size_the_model_cannot_take_fails_startup_naming_the_valid_ones():
    proc, events = _start("--tp-size", "3")
    assert proc.wait(120) != 0
    wait_for(lambda: _event(events, "startup_failed"), 10, "startup_failed")
    error = _event(events, "startup_failed")["error"]
    assert "tp-size 3" in error and "valid tp-sizes on 4 device(s): [1, 2, 4]" in error, error
