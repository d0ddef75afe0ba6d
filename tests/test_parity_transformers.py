"""The shared-prefix fast path equals a plain transformers forward pass of `query + item`."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import ONE_SHAPE_BUCKETS, torch_label_probs

from prefixscore import Scorer

# one item bucket, one prefill bucket: two executables per model, the two every test here needs
# (queries' items beside their prefill; item_first sequences, no prefill). Its 128-token item region
# holds the six items of a query (73 tokens) in one call and splits the item_first sequences (343
# tokens) over three; its 16-token pages put the 45-token query on three pages.
BUCKETS = ONE_SHAPE_BUCKETS

RNG = np.random.default_rng(1234)
QUERY = RNG.integers(0, 320, 45).tolist()
# different lengths in one call
ITEMS = [RNG.integers(0, 320, n).tolist() for n in (1, 3, 9, 20, 33, 7)]
LABELS = [5, 17, 319, 42]
TOLERANCE = {"float32": 1e-5, "bfloat16": 2e-2}


# every family in both dtypes: a user's bfloat16 model rounds where its family's options act
# (Gemma's embeddings scaled after rounding and its (1 + w) norms, soft caps, windows, biases)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3_text"])
def test_matches_transformers(hf_checkpoints, family, dtype):
    path, torch_model = hf_checkpoints[family]
    scorer = Scorer.load(str(path), dtype=dtype, buckets=BUCKETS)
    # Mistral runs Llama's decoder
    assert scorer.cfg.family == {"mistral": "llama", "gemma3_text": "gemma3"}.get(family, family)
    for apply_softmax in (False, True):
        for item_first in (False, True):
            got = np.array(scorer.score(QUERY, ITEMS, LABELS, apply_softmax=apply_softmax, item_first=item_first))
            seqs = [it + QUERY if item_first else QUERY + it for it in ITEMS]
            want = torch_label_probs(torch_model, seqs, LABELS, apply_softmax)
            assert got.shape == (len(ITEMS), len(LABELS))
            err = np.abs(got - want).max()
            assert err <= TOLERANCE[dtype], (family, dtype, apply_softmax, item_first, err)
            if apply_softmax:
                np.testing.assert_allclose(got.sum(-1), 1.0, atol=1e-5)


def test_per_layer_sliding_windows_match_transformers(tmp_path):
    """Per-layer windows from the config equal transformers' sliding attention: a Qwen2 whose
    second layer slides (`layer_types`) with a window shorter than the query and than some of
    its sequences, the first attending fully."""
    import torch
    from conftest import make_torch_model

    window = 16
    plain = make_torch_model("qwen2")
    sliding = make_torch_model(
        "qwen2", use_sliding_window=True, sliding_window=window, layer_types=["full_attention", "sliding_attention"]
    )
    for (name, a), b in zip(plain.state_dict().items(), sliding.state_dict().values(), strict=True):
        assert torch.equal(a, b), name  # the same weights: only the window differs
    sliding.save_pretrained(tmp_path)
    scorer = Scorer.load(str(tmp_path), dtype="float32", buckets=BUCKETS)
    assert scorer.cfg.layer_windows == (None, window)
    for item_first in (False, True):  # items over the cached query; whole sequences over no prefix
        seqs = [it + QUERY if item_first else QUERY + it for it in ITEMS]
        got = np.array(scorer.score(QUERY, ITEMS, LABELS, apply_softmax=True, item_first=item_first))
        want = torch_label_probs(sliding, seqs, LABELS, apply_softmax=True)
        assert np.abs(got - want).max() <= TOLERANCE["float32"], item_first
        # the window moves the scores: a scorer that ignored it would fail above
        moved = np.abs(want - torch_label_probs(plain, seqs, LABELS, apply_softmax=True)).max()
        assert moved > 100 * TOLERANCE["float32"], moved


def test_sharded_safetensors_load_identically(tmp_path):
    """A checkpoint saved in many shards (model.safetensors.index.json) scores as the single file."""
    from conftest import make_torch_model

    model = make_torch_model("llama", seed=3)
    single, sharded = tmp_path / "single", tmp_path / "sharded"
    model.save_pretrained(single)
    model.save_pretrained(sharded, max_shard_size="50KB")
    assert (sharded / "model.safetensors.index.json").is_file()
    a = Scorer.load(str(single), buckets=BUCKETS).score(QUERY, ITEMS[:3], LABELS)
    b = Scorer.load(str(sharded), buckets=BUCKETS).score(QUERY, ITEMS[:3], LABELS)
    np.testing.assert_array_equal(np.array(a), np.array(b))
    want = torch_label_probs(model, [QUERY + it for it in ITEMS[:3]], LABELS, False)
    assert np.abs(np.array(a) - want).max() <= 1e-4
