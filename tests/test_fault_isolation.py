"""Issue 64: failure isolation as one rule for all work, held by a property test.

A server over a tiny causal LM that also serves embeddings (sentence-transformers' last-token
configuration saved beside it), faults injected into its real engine:

- a stream open (ScoreStream and EmbedStream) whose prefill fails on the device fails that open
  alone, with INTERNAL and its request id; the other open streams and a unary request on the
  replica are answered, and it stays SERVING;
- the property: seeded rounds of random mixes of work on the real device loop (bench/faults.py,
  which `prefixscore bench --workload faults` runs for many more seeds), with one or more
  faults keyed on requests, on one device and on a 2-device mesh.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading

import grpc
import numpy as np
import pytest
from conftest import ONE_SHAPE_BUCKETS, xla_flags
from grpc_health.v1 import health_pb2, health_pb2_grpc
from helpers.sentence_checkpoints import st_checkpoint
from helpers.service import LABELS, server_config, wait_for

from prefixscore import Scorer
from prefixscore.bench import faults
from prefixscore.service.process import ServerThread
from prefixscore.service.server import SERVICE
from prefixscore.v1 import score_service_pb2 as pb
from prefixscore.v1 import score_service_pb2_grpc as pb_grpc

Code = grpc.StatusCode
# seeds the suite runs on one device; `prefixscore bench --workload faults` runs as many as asked
SEEDS = range(12)
MESH_SEEDS = 4


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> str:
    return st_checkpoint(tmp_path_factory.mktemp("faults"), "lasttoken", True, True)


@pytest.fixture(scope="module")
def scorer(checkpoint):
    return Scorer.load(checkpoint, buckets=ONE_SHAPE_BUCKETS)


@pytest.fixture(scope="module")
def server(scorer):
    with ServerThread(server_config(scorer, template="none")) as srv:
        yield srv


def _prefill_fault(engine, marker: int):
    """engine.launch, failing every call whose prefill region carries `marker`."""
    launch = engine.launch

    def faulty(plan):
        if (np.asarray(plan.inputs.prefill.tokens) == marker).any():
            raise RuntimeError("injected fault: the prefill failed on the device")
        return launch(plan)

    return faulty


def _serving(target: str) -> bool:
    with grpc.insecure_channel(target) as channel:
        health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=SERVICE))
    return health.status == health_pb2.HealthCheckResponse.SERVING


def _held(messages, release: threading.Event):
    yield from messages
    release.wait(60)


@pytest.mark.parametrize("kind", ["ScoreStream", "EmbedStream"])
def test_a_stream_open_whose_prefill_fails_fails_alone(server, scorer, monkeypatch, kind):
    """The issue's report, as a user saw it: a unary request over a query carrying the marked
    token fails alone; then a stream opens over another query carrying it, whose prefill fails
    in every call. That open fails with INTERNAL and its request id; a stream opened before it
    and a unary request are answered, and the replica stays SERVING."""
    engine = server.server.service.worker.engine
    stub = pb_grpc.ScoreServiceStub(grpc.insecure_channel(server.target))
    tokenizer = scorer.model.tokenizer
    if kind == "ScoreStream":
        marker = 30001
        bad_open = pb.ScoreStreamRequest(
            open=pb.StreamOpen(query=pb.Input(token_ids=pb.TokenIds(ids=[1, 3, marker])), label_token_ids=LABELS)
        )
        stream = stub.ScoreStream
    else:
        prompt = "Zebra quartz xylophone: "
        marker = tokenizer.encode_whole_many([prompt])[0][1]  # in the prompt's shared run
        bad_open = pb.EmbedStreamRequest(open=pb.EmbedStreamOpen(prompt=prompt))
        stream = stub.EmbedStream
    release = threading.Event()
    good = stub.ScoreStream(
        _held(
            [
                pb.ScoreStreamRequest(
                    open=pb.StreamOpen(query=pb.Input(token_ids=pb.TokenIds(ids=[1, 4, 5, 6])), label_token_ids=LABELS)
                )
            ],
            release,
        ),
        timeout=120,
    )
    try:
        assert next(good).HasField("opened")
        monkeypatch.setattr(engine, "launch", _prefill_fault(engine, marker))
        with pytest.raises(grpc.RpcError) as unary:
            stub.Score(
                pb.ScoreRequest(
                    query=pb.Input(token_ids=pb.TokenIds(ids=[1, 2, marker])),
                    items=[pb.Input(token_ids=pb.TokenIds(ids=[7, 8]))],
                    label_token_ids=LABELS,
                ),
                timeout=60,
            )
        assert unary.value.code() == Code.INTERNAL
        with pytest.raises(grpc.RpcError) as opened:
            list(stream(iter([bad_open]), timeout=60, metadata=(("x-request-id", "open-that-fails"),)))
        assert opened.value.code() == Code.INTERNAL, opened.value.details()
        assert "request id open-that-fails" in opened.value.details()
        assert _serving(server.target)
        # the stream opened before goes on, and a unary request is answered
        item = pb.Input(token_ids=pb.TokenIds(ids=[9, 10]))
        answer = stub.Score(
            pb.ScoreRequest(query=pb.Input(token_ids=pb.TokenIds(ids=[1, 4])), items=[item], label_token_ids=LABELS),
            timeout=60,
        )
        assert len(answer.scores) == 1
    finally:
        release.set()
    rest = list(good)  # half-closed: its usage
    assert rest[-1].HasField("usage")
    monkeypatch.undo()
    assert _serving(server.target)
    worker = server.server.service.worker
    wait_for(lambda: worker.cache.pinned == 0, 30, "every prefix unpinned")


@pytest.mark.parametrize("seed", SEEDS)
def test_fault_rounds_on_the_device_loop(scorer, seed):
    """A round of random work with faults keyed on requests (bench/faults.py): every request
    that is not a culprit gets its answer alone, every culprit its error, the loop still
    serves, its pins and gauges are back at their baseline, and failed calls stay bounded."""
    verdict = faults.run_round(scorer.engine, seed)
    assert verdict.ok, verdict.report()


def test_fault_rounds_on_a_two_device_mesh(checkpoint, tmp_path):
    """The same rounds on a (data 2) mesh, through `prefixscore bench --workload faults` in a
    process with two CPU devices: it prints every failed seed and exits non-zero on any."""
    out = tmp_path / "faults.json"
    env = {**os.environ, "XLA_FLAGS": xla_flags(2), "JAX_PLATFORMS": "cpu"}
    cmd = [sys.executable, "-m", "prefixscore.cli", "bench", "--workload", "faults", "--model", checkpoint]
    cmd += ["--dp-size", "2", "--max-batch-tokens", "128", "--max-prefill-tokens", "128"]
    cmd += ["--fault-seeds", str(MESH_SEEDS), "--json", str(out)]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    report = json.loads(out.read_text())
    assert report["devices"] == 2 and report["seeds"] == MESH_SEEDS and report["failed"] == []
