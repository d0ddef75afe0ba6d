"""Start-up: serving early from the first warm-up stage while the rest compiles in the
background, the stages themselves, and a restart from the persistent compilation cache."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import threading
import time

import grpc
import jax
import numpy as np
import pytest
from conftest import SMALL_BUCKETS
from helpers.service import LABELS, scrape, server_config, wait_for

from prefixscore.client import ScoreClient
from prefixscore.engine.runtime import compile_cache
from prefixscore.engine.runtime.buckets import Buckets
from prefixscore.engine.runtime.scoring_engine import ScoringEngine
from prefixscore.engine.scorer import EngineRunner
from prefixscore.model.call_inputs import TOP_LOGPROBS, CallShape
from prefixscore.service.process import ServerThread
from prefixscore.telemetry.compiles import CompileCounter

QUERY = list(range(100, 160))  # 60 token ids
SHORT = [list(range(200 + k, 230 + k)) for k in range(6)]  # 30 tokens each: the first stage's bucket
LONG = [list(range(300, 600))]  # 300 tokens: past the first stage's 256-token item bucket


def _engine(scorer, buckets: Buckets, cache: str = "off") -> ScoringEngine:
    m = scorer.model
    return ScoringEngine(m.cfg, m.params, m.dtype, buckets, compile_cache_dir=cache)


@pytest.mark.parametrize(
    "buckets",
    [
        SMALL_BUCKETS,
        Buckets.for_context(8192),
        Buckets.for_context(40960),
        Buckets(context=4096, labels=(8, 256)),
        dataclasses.replace(Buckets.for_context(8192), top_logprobs=TOP_LOGPROBS),
    ],
    ids=["small", "8k", "40k", "labels", "token-logprobs"],
)
def test_warmup_stages_compile_every_shape_once_and_plan_only_compiled_ones(tiny_scorer, buckets) -> None:
    """Every shape in exactly one stage; the first holds the smallest item bucket with and
    without a prefill region that holds a chunk; after each stage, every shape its buckets can
    plan is compiled (a grid), and the last stage plans in the full buckets. Token-logprob forms
    come second, in the first stage's sizes: the first stage's buckets hold such calls back."""
    stages = ScoringEngine.warmup_stages(dataclasses.make_dataclass("E", [("buckets", Buckets)])(buckets))
    every = [s for stage in stages for s in stage.shapes]
    assert sorted(every) == sorted(buckets.call_shapes()) and len(set(every)) == len(every)
    first = stages[0].buckets
    assert first.tokens == (buckets.tokens[0],) and first.prefill[0] == 0
    assert first.prefill[-1] == Buckets.fit(buckets.prefill[1:], buckets.prefill_chunk, "prefill")
    assert first.prefill_chunk == buckets.prefill_chunk
    compiled: set[CallShape] = set()
    for stage in stages:
        compiled |= set(stage.shapes)
        assert set(stage.buckets.call_shapes()) == compiled
    assert stages[-1].buckets.call_shapes() == buckets.call_shapes()
    assert stages[-1].buckets.max_batch_tokens == buckets.max_batch_tokens
    assert stages[-1].buckets == buckets
    if buckets.top_logprobs:
        assert first.token_logprobs_wait and not any(s.top_logprobs for s in stages[0].shapes)
        second = stages[1]
        assert second.buckets == dataclasses.replace(first, top_logprobs=TOP_LOGPROBS, token_logprobs_wait=False)
        assert {s.top_logprobs for s in second.shapes} == {TOP_LOGPROBS}
        assert len(second.shapes) == len(stages[0].shapes)
        assert not any(stage.buckets.token_logprobs_wait for stage in stages[1:])
    else:
        assert not any(stage.buckets.token_logprobs_wait for stage in stages)


def test_serves_early_and_each_request_waits_only_for_the_shape_it_needs(tiny_scorer) -> None:
    """SERVING once the first stage is compiled; a request that fits it is answered (exactly as
    the in-process scorer answers) while the rest is held back; a request with a longer item
    waits for its own stage, holding up no one; once every stage is in, traffic compiles nothing."""
    engine = _engine(tiny_scorer, SMALL_BUCKETS)
    stages = engine.warmup_stages()
    assert [len(s.shapes) for s in stages] == [2, 1]
    first = set(stages[0].shapes)
    gate = threading.Event()
    compile_shape = engine._executable

    def gated(shape):  # the later stage's compile waits for the test; a launch never comes here
        if shape not in first:
            assert gate.wait(300), "the later stage was never released"
        return compile_shape(shape)

    engine._executable = gated
    reference_short = np.array(tiny_scorer.score(QUERY, SHORT, LABELS))
    reference_long = np.array(tiny_scorer.score(QUERY, LONG, LABELS))
    config = server_config(tiny_scorer, engine=engine, warmup=True)
    with ServerThread(config) as srv, ScoreClient(srv.target) as client:
        info = client.model_info()
        assert (info.call_shapes_ready, info.call_shapes) == (2, 3)
        metrics = scrape(srv.server.metrics_port)
        assert metrics["prefixscore_call_shapes{state=compiled}"] == 2
        assert metrics["prefixscore_call_shapes{state=all}"] == 3
        short = client.score(QUERY, SHORT, LABELS)
        np.testing.assert_allclose(short.scores, reference_short, rtol=1e-5, atol=1e-6)
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            waiting = pool.submit(client.score, QUERY, LONG, LABELS, timeout=300)
            time.sleep(1.0)
            assert not waiting.done(), "a request whose item fits no compiled shape was answered"
            again = client.score(QUERY, SHORT[:3], LABELS)  # not held up behind the waiting one
            np.testing.assert_allclose(again.scores, reference_short[:3], rtol=1e-5, atol=1e-6)
            assert engine.shapes_ready == 2
            gate.set()
            np.testing.assert_allclose(waiting.result(300).scores, reference_long, rtol=1e-5, atol=1e-6)
        wait_for(lambda: client.model_info().call_shapes_ready == 3, 300, "the background stages")
        assert engine.serving == SMALL_BUCKETS
        assert scrape(srv.server.metrics_port)["prefixscore_call_shapes{state=compiled}"] == 3
        before = CompileCounter.obtained()
        for items in (SHORT, LONG, SHORT[:1] + LONG):
            client.score(QUERY, items, LABELS)
        assert CompileCounter.obtained() == before, "traffic compiled after warm-up ended"


def test_token_logprobs_wait_for_their_stage_and_then_nothing_compiles(tiny_scorer) -> None:
    """Buckets with token-logprob forms: SERVING after the label shapes alone; a likelihood request
    waits for the stage that compiles its shapes while scores are answered; once every stage is
    in, neither kind, alone or together, compiles anything."""
    buckets = dataclasses.replace(SMALL_BUCKETS, top_logprobs=TOP_LOGPROBS)
    engine = _engine(tiny_scorer, buckets)
    stages = engine.warmup_stages()
    assert [len(s.shapes) for s in stages] == [2, 2, 2]
    first = set(stages[0].shapes)
    gate = threading.Event()
    compile_shape = engine._executable

    def gated(shape):  # the later stages' compiles wait for the test
        if shape not in first:
            assert gate.wait(300), "the later stages were never released"
        return compile_shape(shape)

    engine._executable = gated
    want = [item.total for item in tiny_scorer.loglikelihood_tokens(QUERY, SHORT)]
    with ServerThread(server_config(tiny_scorer, engine=engine, warmup=True)) as srv, ScoreClient(srv.target) as client:
        assert client.model_info().call_shapes_ready == 2
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            waiting = pool.submit(client.loglikelihood, QUERY, SHORT, timeout=300)
            time.sleep(1.0)
            assert not waiting.done(), "a likelihood was answered before its shapes were compiled"
            client.score(QUERY, SHORT[:3], LABELS)  # not held up behind it
            assert engine.shapes_ready == 2
            gate.set()
            got = [item.logprob for item in waiting.result(300).likelihoods]
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
        wait_for(lambda: client.model_info().call_shapes_ready == 6, 300, "the background stages")
        assert engine.serving == buckets
        before = CompileCounter.obtained()
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            together = [
                pool.submit(client.score, QUERY, SHORT + LONG, LABELS),
                pool.submit(client.loglikelihood, QUERY, LONG),
            ]
            [f.result(300) for f in together]
        client.loglikelihood(QUERY, SHORT[:2])
        assert CompileCounter.obtained() == before, "traffic compiled after warm-up ended"


def test_a_restart_with_a_warm_cache_serves_at_once_and_compiles_nothing(tiny_scorer, tmp_path) -> None:
    """Two servers, one after the other, on one compile cache: the second loads every stage
    from it (0 compilations in its early stage and in the background) and answers the same."""
    answers = []
    previous = jax.config.jax_compilation_cache_dir  # the engines point jax's one cache at tmp_path
    try:
        for run in range(2):
            engine = _engine(tiny_scorer, SMALL_BUCKETS, cache=str(tmp_path))
            before = CompileCounter.count()
            # no template: its known-answer check runs after the warm-up, in the background, and
            # may still be running as the server stops; what is counted is the engine's stages
            with ServerThread(server_config(tiny_scorer, engine=engine, warmup=True, template="none")) as srv:
                with ScoreClient(srv.target) as client:
                    wait_for(lambda: client.model_info().call_shapes_ready == 3, 300, "the background stages")
                    answers.append(client.score(QUERY, SHORT + LONG, LABELS).scores)
            compiled = CompileCounter.count() - before
            assert compiled > 0 if run == 0 else compiled == 0, (run, compiled)
    finally:
        compile_cache.enable(previous or compile_cache.default_dir())
    np.testing.assert_allclose(answers[1], answers[0], rtol=1e-6, atol=1e-7)


def test_serve_early_off_compiles_everything_before_serving(tiny_scorer) -> None:
    engine = _engine(tiny_scorer, SMALL_BUCKETS)
    with ServerThread(server_config(tiny_scorer, engine=engine, warmup=True, serve_early=False)) as srv:
        assert engine.shapes_ready == 3 and srv.server.service.call_shapes == 3


def test_stopping_during_the_background_warmup_fails_waiting_work_at_once(tiny_scorer) -> None:
    """Work waiting for a stage that will not come (the server stops) fails instead of keeping
    the device loop, and the stop, waiting; the engine, once its server is gone, scores that work
    in process (a stopped warm-up must not leave it waiting for the stage either)."""
    engine = _engine(tiny_scorer, SMALL_BUCKETS)
    first = set(engine.warmup_stages()[0].shapes)
    gate = threading.Event()
    compile_shape = engine._executable

    def gated(shape):
        if shape not in first:
            gate.wait(300)
        return compile_shape(shape)

    engine._executable = gated
    srv = ServerThread(server_config(tiny_scorer, engine=engine, warmup=True)).start()
    try:
        with ScoreClient(srv.target) as client, concurrent.futures.ThreadPoolExecutor(1) as pool:
            waiting = pool.submit(client.score, QUERY, LONG, LABELS, timeout=300)
            wait_for(lambda: srv.server.service.worker.depth == 1, 30, "the long request queued")
            started = time.monotonic()
            srv.stop()
            assert time.monotonic() - started < 10
            with pytest.raises(grpc.RpcError):
                waiting.result(30)
            assert srv.server.service.worker.depth == 0
    finally:
        gate.set()
    # the engine outlives its server (as a Scorer's does in process): the stopped warm-up leaves it
    # planning in every bucket, compiling on first use, so the long item is scored, not held forever
    wait_for(lambda: not srv.server.service.compiling_in_background, 300, "the stopped warm-up's last compile")
    assert engine.serving == SMALL_BUCKETS
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        later = pool.submit(EngineRunner(engine).score_requests, [tiny_scorer.tokenize(QUERY, LONG, LABELS)])
        (scores,), _ = later.result(300)
    np.testing.assert_allclose(scores, tiny_scorer.score(QUERY, LONG, LABELS), rtol=1e-5, atol=1e-6)
