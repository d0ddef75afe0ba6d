"""One device call carrying several requests gives each exactly the scores it gets alone, for
every attention implementation (the Pallas kernels interpreted on CPU).

The mix: a new query long enough to prefill in three chunks (its items ride in the call
that carries its chunks), a short new query with another label set and softmax, a query
already cached from an earlier call, and an item_first request (whole sequences over no
prefix); items of many lengths. Alone: each request on a fresh runner (its own calls).
The model slides a 64-token window (shorter than two of the queries) with Gemma 2's soft caps
and a query scale, so every family's window, cap and scale ride in mixed calls too.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest
from conftest import SMALL_QWEN3

from prefixscore.engine.loop import batcher
from prefixscore.engine.loop.request import TokenizedRequest
from prefixscore.engine.requests.answers import label_scores
from prefixscore.engine.runtime.buckets import Buckets
from prefixscore.engine.runtime.scoring_engine import ScoringEngine
from prefixscore.engine.scorer import EngineRunner
from prefixscore.model.weights import random_params

# head_dim 64 and 128-token pages: shapes every kernel family tiles (none falls back to XLA)
CFG = dataclasses.replace(
    SMALL_QWEN3,
    name="mixed-test",
    head_dim=64,
    num_layers=1,
    sliding_window=64,
    attn_scale=0.1,
    attn_softcap=20.0,
    final_softcap=15.0,
)
BUCKETS = Buckets(context=1024, max_batch_tokens=512, prefill_chunk=128, max_prefill_tokens=512)


def requests(rng: np.random.Generator) -> tuple[TokenizedRequest, list[TokenizedRequest]]:
    """(the request cached beforehand, the mix)."""
    tokens = lambda n: rng.integers(0, CFG.vocab_size, n).tolist()  # noqa: E731
    items = lambda *lengths: [tokens(n) for n in lengths]  # noqa: E731
    cached = TokenizedRequest(tuple(tokens(150)), items(4, 33), (5, 9), label_scores(False), False)
    mix = [
        TokenizedRequest(tuple(tokens(300)), items(20, 1, 7, 40, 20), (3, 17, 400), label_scores(False), False),
        TokenizedRequest(tuple(tokens(40)), items(12, 3, 65), (8, 2), label_scores(True), False),
        dataclasses.replace(cached, items=items(9, 2, 25), answer=label_scores(True)),
        TokenizedRequest((), [tokens(30) + tokens(20), tokens(5)], (3, 17, 400), label_scores(False), True),
    ]
    return cached, mix


# the served families; the reference kernel is checked against brute force on a call that mixes
# a prefill chunk, items of three queries and whole sequences (tests/test_kernels.py, selfcheck.case)
@pytest.mark.parametrize("impl", ["xla", "pallas_tpu", "pallas_gpu"])
def test_a_mixed_call_scores_each_request_as_alone(impl: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # plan the whole mix into one call even where fewer requests would pad less (batcher's trim)
    monkeypatch.setattr(batcher, "PADDING_GOAL", 1.0)
    engine = ScoringEngine(CFG, random_params(CFG, 0, jnp.float32), "float32", BUCKETS, impl)
    cached, mix = requests(np.random.default_rng(0))
    runner = EngineRunner(engine)
    runner.score_requests([cached])
    plans = []
    next_call = runner.batcher.next_call

    def watched(**kwargs):
        call = next_call(**kwargs)
        if call is not None:
            plans.append(call.plan)
        return call

    runner.batcher.next_call = watched
    mixed, hits = runner.score_requests(mix)
    assert len(plans) == 1, "the mix fits one call and must ride in one"
    assert plans[0].chunks == 4 and plans[0].items == sum(len(r.items) for r in mix)
    assert hits == [0, 0, len(cached.prefix), 0]
    for req, got in zip(mix, mixed, strict=True):
        alone, _ = EngineRunner(engine).score_requests([req])
        np.testing.assert_allclose(got, alone[0], atol=1e-6, rtol=0)
        assert got.shape == (len(req.items), len(req.label_ids))


def test_the_gpu_head_scores_like_the_cpu_head(monkeypatch: pytest.MonkeyPatch) -> None:
    """GPU calls run the output head over every row slot with no runtime loop or branch
    (step.score_call's static_head); compiled here for CPU, it must give the same scores as
    the row loop CPUs run, for the whole mix (softmax and full-vocabulary rows, item_first)."""
    from prefixscore.engine.runtime import scoring_engine as engine_module

    params = random_params(CFG, 0, jnp.float32)
    cached, mix = requests(np.random.default_rng(1))

    def scores() -> list[np.ndarray]:
        runner = EngineRunner(ScoringEngine(CFG, params, "float32", BUCKETS, "xla"))
        runner.score_requests([cached])
        return runner.score_requests(mix)[0]

    looped = scores()
    monkeypatch.setattr(engine_module, "GPU_PLATFORMS", ("cpu",))
    static = scores()
    for want, got in zip(looped, static, strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("total", [20, 64, 512])
def test_the_head_row_steps_cover_every_row_once(total: int) -> None:
    """head_rows_loop: steps of one size (rows padded to a whole step when a call has fewer); every
    row below n_rows gets its own value whatever n_rows is (each step's boundaries)."""
    import jax

    from prefixscore.model.step import head_rows_loop

    rows = jnp.arange(total, dtype=jnp.float32)[:, None] + 1.0
    loop = jax.jit(lambda n: head_rows_loop(lambda x: jnp.concatenate([x, 2 * x], axis=1), (rows,), n, 32))
    edges = {0, 1, total - 1, total} | {z + d for z in range(32, total + 1, 32) for d in (-1, 0, 1)}
    for n in sorted(e for e in edges if 0 <= e <= total):
        out = np.asarray(loop(jnp.int32(n)))
        assert out.shape == (total, 2)
        want = np.arange(n, dtype=np.float32) + 1.0
        np.testing.assert_array_equal(out[:n, 0], want, err_msg=f"n_rows={n}")
        np.testing.assert_array_equal(out[:n, 1], 2 * want, err_msg=f"n_rows={n}")


def test_the_cpu_token_tiles_compute_the_whole_mlp() -> None:
    """decoder.per_tile (the CPU engine's per-token work, in tiles of one size) over the MLP against
    the whole product, for token counts it tiles and ones it leaves whole."""
    import jax

    from prefixscore.model import decoder

    params = random_params(CFG, 1, jnp.float32)
    first_mlp = jax.tree.map(lambda a: a[0], params.layers.mlp)
    rng = np.random.default_rng(2)
    for tokens in (3 * 128, 200, 128):
        y = jnp.asarray(rng.normal(size=(1, tokens, CFG.hidden_size)), jnp.float32)
        got = jax.jit(lambda y: decoder.per_tile(lambda t: decoder.mlp(first_mlp, t), 128, y))(y)
        np.testing.assert_allclose(np.asarray(got), np.asarray(decoder.mlp(first_mlp, y)), atol=1e-6, rtol=1e-5)


def test_a_cpu_tile_is_set_by_the_width_of_a_models_layers() -> None:
    """scoring_engine.cpu_token_tile: the smallest power of two (64 to 1,024 tokens) whose tokens take
    CPU_TILE_MACS multiply-adds through a layer's projections, whatever the layer count; a narrow
    model's tile is large (bench-cpu: 256), a wide one's small (SmolLM2-135M's layer: 64), and the
    engine's tile is the largest of that dividing every bucket."""
    from prefixscore.engine.runtime import scoring_engine as se
    from prefixscore.model import flops
    from prefixscore.model.presets import RANDOM_PRESETS

    narrow = RANDOM_PRESETS["bench-cpu"][0]
    smollm2 = dataclasses.replace(narrow, hidden_size=576, intermediate_size=1536, num_heads=9, num_kv_heads=3)
    assert (se.cpu_token_tile(narrow), se.cpu_token_tile(smollm2), se.cpu_token_tile(CFG)) == (256, 64, 1024)
    for cfg in (narrow, smollm2, CFG, RANDOM_PRESETS["qwen3-0.6b-random"][0]):
        tile = se.cpu_token_tile(cfg)
        assert se.cpu_token_tile(dataclasses.replace(cfg, num_layers=3 * cfg.num_layers)) == tile
        per_token = flops.linear_per_token(cfg) // (2 * cfg.num_layers)
        assert tile * per_token >= se.CPU_TILE_MACS or tile == se.CPU_TILE_MOST, cfg.name
        assert tile // 2 * per_token < se.CPU_TILE_MACS or tile == se.CPU_TILE_FEWEST, cfg.name
    assert BUCKETS.token_tile(se.cpu_token_tile(smollm2)) == 64
    assert BUCKETS.token_tile(se.cpu_token_tile(CFG)) == 256  # the buckets' largest common divisor


def test_the_cpu_token_tiles_skip_tiles_of_padding_alone() -> None:
    """decoder.per_tile with `live` (the tokens a call reads): a tile with no live token is not
    computed (its outputs are zeros), and every tile that runs, whole, gives the bits it gives with
    every tile running, wherever the live tiles sit (first, between, last)."""
    import jax

    from prefixscore.model import decoder

    params = random_params(CFG, 1, jnp.float32)
    first_mlp = jax.tree.map(lambda a: a[0], params.layers.mlp)
    rng = np.random.default_rng(3)
    tile, tiles = 64, 6
    y = jnp.asarray(rng.normal(size=(1, tile * tiles, CFG.hidden_size)), jnp.float32)
    run = jax.jit(lambda y, live: decoder.per_tile(lambda t: decoder.mlp(first_mlp, t), tile, y, live=live))
    every = np.asarray(run(y, jnp.ones((1, tile * tiles), bool)))
    for live_tokens in ([0], [5, 70, 300], [tile * tiles - 1], list(range(tile, 2 * tile))):
        live = np.zeros((1, tile * tiles), bool)
        live[0, live_tokens] = True
        got = np.asarray(run(y, jnp.asarray(live)))
        runs = live.reshape(tiles, tile).any(axis=1)
        for i in range(tiles):
            rows = slice(i * tile, (i + 1) * tile)
            want = every[0, rows] if runs[i] else np.zeros_like(every[0, rows])
            np.testing.assert_array_equal(got[0, rows], want, err_msg=f"tile {i}, live {live_tokens}")


def test_the_last_layer_runs_past_its_attention_at_the_read_rows_only() -> None:
    """decoder.run_layers with ReadRows (the CPU engine): the rows' final states, moved to the
    front of the stream, are the states a run over every token gives at those tokens (however the
    rows are ordered), and in the last layer the tiles past the rows' are not computed: they hold
    what the layers before gave them (its o projection and MLP ran over the rows' tile alone)."""
    import jax

    from prefixscore.model import decoder
    from prefixscore.model.packed_baseline import packed_attention

    cfg = dataclasses.replace(CFG, num_layers=2)  # a layer before the last one
    params = random_params(cfg, 1, jnp.float32)
    rng = np.random.default_rng(4)
    tile, tokens = 64, 256
    x = jnp.asarray(rng.normal(size=(1, tokens, cfg.hidden_size)), jnp.float32)
    positions = jnp.arange(tokens, dtype=jnp.int32)
    segments = jnp.zeros(tokens, jnp.int32)  # one causal sequence

    def attend(q, k, v, layer, state):
        return packed_attention(q, k, v, segments), state

    def run(read, params=params, cfg=cfg):
        return decoder.run_layers(params, cfg, x, positions, attend, None, tile, read=read)[0]

    every = np.asarray(jax.jit(lambda: run(None))())
    wanted = [200, 7, 63, 255]
    at = jnp.asarray(wanted + [0] * 4, jnp.int32)  # padded to 8 rows, 4 in use
    got = np.asarray(jax.jit(lambda: run(decoder.ReadRows(at, jnp.int32(len(wanted)))))())
    np.testing.assert_allclose(got[0, : len(wanted)], every[0, wanted], atol=2e-5, rtol=1e-5)
    all_but_last = jax.tree.map(lambda a: a[:-1], params.layers)
    before_last = jax.jit(
        lambda: run(
            None,
            dataclasses.replace(params, layers=all_but_last),
            dataclasses.replace(cfg, num_layers=1),
        )
    )()
    np.testing.assert_allclose(got[0, tile:], np.asarray(before_last)[0, tile:], atol=1e-6, rtol=1e-6)
    assert np.abs(every[0, tile:] - got[0, tile:]).max() > 1e-2  # the last layer moves every token
