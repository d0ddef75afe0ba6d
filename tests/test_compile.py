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

from prefixscore.model.buckets import Buckets
from prefixscore.model.engine import CompileCounter, ScoringEngine, split_streams
from prefixscore.model.weights import random_params

CFG = dataclasses.replace(SMALL_QWEN3, name="compile-test")
BUCKETS = Buckets(prefix=(128, 512), item=(16, 128), batch=(1, 64), max_batch_tokens=256)


@pytest.fixture(scope="module")
def engine() -> ScoringEngine:
    eng = ScoringEngine(CFG, random_params(CFG, 0, jnp.float32), "float32", BUCKETS)
    stats = eng.warmup()
    assert stats["executables"] == len(eng.executable_keys())
    return eng


def test_default_buckets_are_few() -> None:
    """Warm-up of the default buckets stays a few dozen executables, even at a 40k context."""
    for context in (8192, 40960, 131072):
        b = Buckets.for_context(context)
        assert len(b.prefix) + len(b.item_calls()) * len(b.labels) <= 45, context
        assert b.prefix[-1] >= context and b.tokens[-1] >= context
    assert len(Buckets.for_context(8192).item_calls()) + len(Buckets.for_context(8192).prefix) <= 20


def test_bucket_pairs_cover_every_servable_call() -> None:
    """item_calls() prunes only (stream, prefix) pairs no request within the context can need."""
    b = Buckets.for_context(40960)
    pairs = set(b.item_calls())
    for item_len in (1, 8192, 8193, 20000, 32768, 32769, 40000):
        for prefix_len in (0, 1, 512, 2048, 8000, 40960 - item_len):
            if prefix_len < 0 or prefix_len + item_len > 40960:
                continue
            stream = Buckets.fit(b.tokens, item_len, "tokens")
            assert (stream, Buckets.fit(b.prefix, max(prefix_len, 1), "prefix")) in pairs, (item_len, prefix_len)


def test_split_streams_is_greedy_and_bounded() -> None:
    assert split_streams([3, 3, 3], 2, 6, 10) == [[0, 1], [2]]
    assert split_streams([3, 3, 3], 1, 6, 10) is None
    assert split_streams([7], 4, 6, 10) is None
    assert split_streams([1] * 5, 3, 100, 2) == [[0, 1], [2, 3], [4]]


def test_plan_covers_each_item_once_with_little_padding(engine: ScoringEngine) -> None:
    rng = np.random.default_rng(0)
    lengths = rng.integers(1, 128, 300).tolist()
    plans = engine.plan(lengths)
    seen = sorted(i for p in plans for i in p.indices)
    assert seen == list(range(300))
    device = sum(p.device_tokens for p in plans)
    assert 1 - sum(lengths) / device < 0.15  # packed streams: padding only at stream ends


def test_steady_state_traffic_compiles_nothing(engine: ScoringEngine) -> None:
    """Queries, item counts, item lengths, label counts, softmax and item_first all vary: zero compilations."""
    rng = np.random.default_rng(1)
    before, slots = CompileCounter.count(), len(engine._slots)
    for step in range(12):
        query = rng.integers(0, CFG.vocab_size, int(rng.integers(1, 512))).tolist()
        n_items = int(rng.integers(1, 40))
        items = [rng.integers(0, CFG.vocab_size, int(rng.integers(1, 128))).tolist() for _ in range(n_items)]
        labels = rng.integers(0, CFG.vocab_size, int(rng.integers(1, 6))).tolist()
        softmax = bool(step % 2)
        probs = engine.score_items(engine.prefill(query), items, labels, softmax)
        assert probs.shape == (n_items, len(labels)) and np.isfinite(probs).all()
        sequences = [it + query[:100] for it in items[:5]]  # item_first: whole sequences, no prefix
        assert engine.score_sequences(sequences, labels, softmax).shape == (len(sequences), len(labels))
    assert CompileCounter.count() == before, "steady-state traffic compiled"
    assert len(engine._slots) == slots


def test_persistent_cache_makes_restart_compile_nothing(tmp_path) -> None:
    """Two processes warm up against one cache directory: the second compiles nothing."""
    script = textwrap.dedent(
        f"""
        import json, jax.numpy as jnp
        from prefixscore.model.buckets import Buckets
        from prefixscore.model.config import ModelConfig
        from prefixscore.model.engine import ScoringEngine
        from prefixscore.model.weights import random_params
        cfg = ModelConfig(**{CFG.__dict__!r})
        params = random_params(cfg, 0, jnp.float32)
        buckets = Buckets(prefix=(128,), item=(16,), batch=(1,), max_batch_tokens=256)
        eng = ScoringEngine(cfg, params, "float32", buckets)
        print(json.dumps(eng.warmup()))
        """
    )
    env = {**os.environ, "PREFIXSCORE_COMPILE_CACHE_DIR": str(tmp_path / "xla")}
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
    assert any((tmp_path / "xla").iterdir())
