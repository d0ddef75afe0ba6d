"""Compile discipline: warm-up compiles every bucket, and steady-state traffic of varied
sizes compiles nothing; the persistent compilation cache makes a restart compile nothing."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import textwrap

import jax.numpy as jnp
import numpy as np
import pytest
from conftest import SMALL_QWEN3

from prefixscore.engine.loop.request import TokenizedRequest
from prefixscore.engine.requests.answers import Pooled, TokenLogprobs, label_scores
from prefixscore.engine.requests.pooling import PoolRows
from prefixscore.engine.runtime.buckets import Buckets
from prefixscore.engine.runtime.scoring_engine import ScoringEngine
from prefixscore.engine.scorer import EngineRunner
from prefixscore.model.call_inputs import TOP_LOGPROBS
from prefixscore.model.sentence_config import LAST, MEAN
from prefixscore.model.weights import random_params
from prefixscore.telemetry.compiles import CompileCounter

CFG = dataclasses.replace(SMALL_QWEN3, name="compile-test")
# every form of call a kind uses: label rows, token log-probs (likelihood, completions) and hidden
# rows, one per item (a last-token embedding) or per token (a mean)
BUCKETS = Buckets(
    context=512,
    max_batch_tokens=256,
    prefill_chunk=128,
    max_prefill_tokens=256,
    hidden=CFG.hidden_size,
    token_rows=True,
    top_logprobs=TOP_LOGPROBS,
)


@pytest.fixture(scope="module")
def engine() -> ScoringEngine:
    eng = ScoringEngine(CFG, random_params(CFG, 0, jnp.float32), "float32", BUCKETS)
    stats = eng.warmup()
    assert stats["executables"] == len(eng.executable_keys())
    return eng


def test_default_buckets_are_few() -> None:
    """Warm-up of the default buckets stays a few dozen executables, even at a 128k context:
    no executable depends on a query's length."""
    for context in (8192, 40960, 131072):
        b = Buckets.for_context(context)
        assert len(b.call_shapes()) <= 40, context
        # a model with a vocabulary head: each shape in its token-logprob form too
        with_tokens = dataclasses.replace(b, top_logprobs=TOP_LOGPROBS).call_shapes()
        assert len(with_tokens) == 2 * len(b.call_shapes()) and len(set(with_tokens)) == len(with_tokens)
        assert b.tokens[-1] >= context and b.max_pages * b.page_tokens >= context


def test_steady_state_traffic_compiles_nothing(engine: ScoringEngine) -> None:
    """Every mix: several requests at once with new and cached queries (short and chunked),
    item counts and lengths, label sets and counts, softmax both ways, item_first, and every kind
    of rows (label scores, token log-probs, hidden rows per item and per token) alone and
    together: zero compilations."""
    rng = np.random.default_rng(1)
    runner = EngineRunner(engine)
    before, slots = CompileCounter.obtained(), len(engine._slots)
    hot = rng.integers(0, CFG.vocab_size, 300).tolist()
    for step in range(6):
        reqs = []
        for r in range(int(rng.integers(1, 5))):
            query = hot if r == 0 and step % 2 else rng.integers(0, CFG.vocab_size, int(rng.integers(1, 400))).tolist()
            items = [
                rng.integers(0, CFG.vocab_size, int(rng.integers(1, 100))).tolist()
                for _ in range(int(rng.integers(1, 30)))
            ]
            labels = tuple(rng.integers(0, CFG.vocab_size, int(rng.integers(1, 6))).tolist())
            reqs.append(TokenizedRequest(tuple(query), items, labels, label_scores(bool((step + r) % 2)), False))
        first = [it + hot[:50] for it in reqs[0].items[:4]]
        reqs.append(TokenizedRequest((), first, (3, 7), label_scores(True), True))  # item_first: whole sequences
        # the other kinds of rows, in some steps alone (a call of their own) and in others beside the rest
        items = reqs[0].items[: int(rng.integers(1, 8))]
        skip = np.zeros(len(items), np.int64)
        others = [
            TokenizedRequest(tuple(hot[:-1]), [[hot[-1], *it] for it in items], (), TokenLogprobs(5), False),
            TokenizedRequest((), items, (), TokenLogprobs(), True),
            TokenizedRequest(tuple(hot[:30]), items, (), Pooled(PoolRows(LAST, skip, CFG.hidden_size)), False),
            TokenizedRequest((), items, (), Pooled(PoolRows(MEAN, skip, CFG.hidden_size)), True),
        ]
        reqs = others if step % 3 == 0 else [*reqs, *others]
        for unit in runner.run_requests(reqs):
            assert np.isfinite(unit.reply.answer).all()
    assert CompileCounter.obtained() == before, "steady-state traffic compiled"
    assert len(engine._slots) == slots


def test_a_replica_shares_the_executables_and_has_a_pool_of_its_own(engine: ScoringEngine) -> None:
    """engine.replica(): its traffic obtains no executable (none traced, none loaded from the
    persistent cache) and scores exactly as the engine; a query the engine holds is new to it."""
    rng = np.random.default_rng(2)
    query = tuple(rng.integers(0, CFG.vocab_size, 200).tolist())
    items = [rng.integers(0, CFG.vocab_size, n).tolist() for n in (3, 40, 9)]
    request = TokenizedRequest(query, items, (3, 7, 11), label_scores(False), False)
    want, _ = EngineRunner(engine).score_requests([request])
    _, cached_again = EngineRunner(engine).score_requests([request])
    assert cached_again == [len(query)]  # the engine holds the query
    twin = engine.replica()
    before = CompileCounter.obtained()
    got, cached = EngineRunner(twin).score_requests([request])
    assert CompileCounter.obtained() == before, "the replica obtained an executable"
    assert cached == [0] and twin.pool_pages == engine.pool_pages  # its own pool, of the same size
    np.testing.assert_array_equal(got[0], want[0])


def test_persistent_cache_makes_restart_compile_nothing(tmp_path) -> None:
    """Two processes warm up with the default cache (under the user's cache directory, nothing
    configured): the second compiles nothing."""
    script = textwrap.dedent(
        f"""
        import json, jax.numpy as jnp
        from prefixscore.engine.runtime.buckets import Buckets
        from prefixscore.model.config import ModelConfig
        from prefixscore.engine.runtime.scoring_engine import ScoringEngine
        from prefixscore.model.weights import random_params
        cfg = ModelConfig(**{CFG.__dict__!r})
        params = random_params(cfg, 0, jnp.float32)
        buckets = Buckets(context=256, max_batch_tokens=256, prefill_chunk=128, max_prefill_tokens=128)
        eng = ScoringEngine(cfg, params, "float32", buckets)
        print(json.dumps(eng.warmup()))
        """
    )
    env = {k: v for k, v in os.environ.items() if k != "PREFIXSCORE_COMPILE_CACHE_DIR"}
    env["XDG_CACHE_HOME"] = str(tmp_path)
    runs = [
        json.loads(
            subprocess.run(
                [sys.executable, "-c", script], env=env, check=True, capture_output=True, text=True, timeout=600
            ).stdout.splitlines()[-1]
        )
        for _ in range(2)
    ]
    assert runs[0]["compilations"] == runs[0]["executables"] == 2
    assert runs[1]["compilations"] == 0
    assert any((tmp_path / "prefixscore" / "jax").iterdir())
