"""8-bit checkpoints as people publish them, loaded and held to transformers.

- compressed-tensors (written by the `compressed_tensors` package as llm-compressor does:
  tests/helpers/compressed_checkpoints.py): every scheme served W8A16 scores within 1e-5 of
  transformers running the same checkpoint dequantized (causal LM and classifier), its 8-bit
  values kept on the device; fp8 W8A8 (dynamic per token, and static with the stored
  input_scale) within 1e-4 of transformers' own fake-quantized forward of the checkpoint, whose
  fp8 arithmetic is the one documented in model/quant.py; int8 W8A8 within 1e-4 of transformers'
  dequantized forward with each projection's input fake-quantized per token as int8 kernels do
  (max |x| / 127, round half to even).
- Probabilities here are about 1/320: every comparison is of log-probabilities.
- Every quantization_config key is inventoried: an uncomputed value refuses the load naming it.
- The ignore list is held to the tensors.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import transformers
from conftest import SMALL_BUCKETS, make_torch_model, torch_label_probs
from helpers.compressed_checkpoints import (
    dequantized_oracle,
    fake_quant_oracle,
    int8_per_token_oracle,
    write_compressed,
)

from prefixscore import Scorer
from prefixscore.model.config import UnsupportedModelError
from prefixscore.model.quant import QuantizedMatrix

QUERY = list(range(3, 40))
ITEMS = [[7, 8, 9], [100], [250, 251, 252, 253, 254, 255, 256, 257, 258, 259]]
LABELS = [1, 2, 300]
# on log-probabilities: W8A16 (and dequantized) against transformers on the same weights, float32
# rounding; W8A8 against its fake-quantized forward (float32 products summed in another order
# may round an activation near a tie the other way)
W8A16_TOLERANCE = 1e-5
W8A8_TOLERANCE = 1e-4

# scheme -> (stored values, the activations `auto` serves)
SCHEMES = {
    "int8-w8a8": ("int8", "dynamic"),
    "fp8-w8a8": ("fp8", "dynamic"),
    "fp8-tensor-static": ("fp8", "static"),
    "int8-w8a16": ("int8", "none"),
    "fp8-w8a16": ("fp8", "none"),
}


@pytest.fixture(scope="module")
def causal_lm():
    return make_torch_model("qwen3", seed=7)


@pytest.fixture(scope="module")
def checkpoints(causal_lm, tmp_path_factory):
    """Each scheme's checkpoint of the same tiny Qwen3 (written once for the module)."""
    root = tmp_path_factory.mktemp("compressed")
    return {scheme: write_compressed(causal_lm, root / scheme, scheme) for scheme in SCHEMES}


@pytest.fixture(scope="module")
def served(checkpoints):
    """(scheme, activations) -> its Scorer, loaded once for the module."""
    cache = {}

    def load(scheme: str, activations: str) -> Scorer:
        if (scheme, activations) not in cache:
            cache[scheme, activations] = Scorer.load(
                str(checkpoints[scheme]), buckets=SMALL_BUCKETS, activations=activations
            )
        return cache[scheme, activations]

    return load


def _sequences() -> list[list[int]]:
    return [QUERY + item for item in ITEMS]


@pytest.mark.parametrize("scheme", SCHEMES)
def test_w8a16_matches_transformers_dequantized(checkpoints, served, scheme):
    """Served W8A16, each scheme's projections stay 8-bit on the device and score as transformers'
    dequantized load of the checkpoint; `auto` reports the checkpoint's own activation scheme."""
    path = checkpoints[scheme]
    scorer = served(scheme, "none")
    kind, published = SCHEMES[scheme]
    wq = scorer.model.params.layers.attn.wq
    assert isinstance(wq, QuantizedMatrix) and wq.kind == kind and wq.per_channel
    assert scorer.model.quantization["weights"] == kind and scorer.model.quantization["activations"] == "none"
    got = np.array(scorer.score(QUERY, ITEMS, LABELS))
    want = torch_label_probs(dequantized_oracle(path, transformers.Qwen3ForCausalLM), _sequences(), LABELS, False)
    np.testing.assert_allclose(np.log(got), np.log(want), rtol=0, atol=W8A16_TOLERANCE)
    assert served(scheme, "auto").model.quantization["activations"] == published


def test_quantize_none_serves_a_w8a8_checkpoint_dequantized(checkpoints, causal_lm):
    """--quantize none: every projection in the served dtype (and so no 8-bit activations either)."""
    path = checkpoints["int8-w8a8"]
    scorer = Scorer.load(str(path), buckets=SMALL_BUCKETS, quantize="none")
    assert scorer.model.quantization == {"weights": "none"}
    assert not isinstance(scorer.model.params.layers.attn.wq, QuantizedMatrix)
    got = np.array(scorer.score(QUERY, ITEMS, LABELS))
    want = torch_label_probs(dequantized_oracle(path, transformers.Qwen3ForCausalLM), _sequences(), LABELS, False)
    np.testing.assert_allclose(np.log(got), np.log(want), rtol=0, atol=W8A16_TOLERANCE)


@pytest.mark.parametrize("scheme", ["fp8-w8a8", "fp8-tensor-static"])
def test_fp8_w8a8_matches_transformers_fake_quantized(checkpoints, served, scheme):
    """fp8 activations as the checkpoint specifies (per token: max |x| / 448; static: its
    input_scale), clipped to +-448 and rounded to e4m3: transformers' compressed-tensors forward
    computes the same products in float32."""
    path = checkpoints[scheme]
    got = np.array(served(scheme, "auto").score(QUERY, ITEMS, LABELS))
    want = torch_label_probs(fake_quant_oracle(path, transformers.Qwen3ForCausalLM), _sequences(), LABELS, False)
    np.testing.assert_allclose(np.log(got), np.log(want), rtol=0, atol=W8A8_TOLERANCE)
    dequantized = torch_label_probs(
        dequantized_oracle(path, transformers.Qwen3ForCausalLM), _sequences(), LABELS, False
    )
    assert np.abs(np.log(got) - np.log(dequantized)).max() > W8A8_TOLERANCE  # the activations really are 8-bit


def test_int8_w8a8_matches_transformers_fake_quantized_per_token(checkpoints, served):
    """The int8 W8A8 checkpoint served as published (dynamic per-token int8 activations):
    transformers' dequantized forward with each projection's input fake-quantized per token
    (max |x| / 127, round half to even, clipped to +-127) computes the same products in float32."""
    path = checkpoints["int8-w8a8"]
    scorer = served("int8-w8a8", "auto")
    assert scorer.model.quantization["activations"] == "dynamic"
    got = np.log(np.array(scorer.score(QUERY, ITEMS, LABELS)))
    oracle = int8_per_token_oracle(path, transformers.Qwen3ForCausalLM)
    want = np.log(torch_label_probs(oracle, _sequences(), LABELS, False))
    np.testing.assert_allclose(got, want, rtol=0, atol=W8A8_TOLERANCE)
    dequantized = torch_label_probs(
        dequantized_oracle(path, transformers.Qwen3ForCausalLM), _sequences(), LABELS, False
    )
    assert np.abs(got - np.log(dequantized)).max() > 10 * W8A8_TOLERANCE  # the activations really are 8-bit


def test_classifier_score_head_stays_full_precision(tmp_path):
    """A quantized classifier (its `score` head ignored, as llm-compressor writes it): projections
    8-bit, the score rows in the served dtype, logits as transformers' dequantized load."""
    model = make_torch_model("qwen3", seed=4, classifier=True, num_labels=3, pad_token_id=0)
    path = write_compressed(model, tmp_path / "clf", "int8-w8a16")
    scorer = Scorer.load(str(path), buckets=SMALL_BUCKETS)
    assert isinstance(scorer.model.params.layers.mlp.w_down, QuantizedMatrix)
    assert scorer.model.params.score.dtype == np.float32
    got = np.array(scorer.score(QUERY, ITEMS, activation="none"))
    oracle = dequantized_oracle(path, transformers.Qwen3ForSequenceClassification)
    with torch.no_grad():
        want = np.array([oracle(torch.tensor([s])).logits[0].double().numpy() for s in _sequences()])
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)


def _edited(src, tmp_path, edit) -> str:
    """A copy of checkpoint `src` with its config.json's quantization_config edited in place."""
    dst = tmp_path / "edited"
    dst.mkdir()
    for f in src.iterdir():
        (dst / f.name).symlink_to(f)
    config = json.loads((src / "config.json").read_text())
    edit(config["quantization_config"])
    (dst / "config.json").unlink()
    (dst / "config.json").write_text(json.dumps(config))
    return str(dst)


def _group(q):
    return q["config_groups"]["group_0"]


REFUSED = {
    "quantization_config.config_groups.*.weights.num_bits": lambda q: _group(q)["weights"].update(num_bits=4),
    "quantization_config.config_groups.*.weights.strategy": lambda q: _group(q)["weights"].update(strategy="group"),
    "quantization_config.config_groups.*.weights.group_size": lambda q: _group(q)["weights"].update(group_size=128),
    "quantization_config.config_groups.*.weights.symmetric": lambda q: _group(q)["weights"].update(symmetric=False),
    "quantization_config.config_groups.*.weights.actorder": lambda q: _group(q)["weights"].update(actorder="weight"),
    "quantization_config.config_groups.*.input_activations.type": lambda q: _group(q)["input_activations"].update(
        type="float"
    ),
    "quantization_config.kv_cache_scheme": lambda q: q.update(kv_cache_scheme={"num_bits": 8, "type": "float"}),
    "quantization_config.format": lambda q: q.update(format="nvfp4-pack-quantized"),
    "quantization_config.sparsity_config": lambda q: q.update(sparsity_config={"format": "sparse-24-bitmask"}),
    "quantization_config.transform_config": lambda q: q.update(transform_config={"config_groups": {"r": {}}}),
    "quantization_config.config_groups": lambda q: q["config_groups"].update(group_1=_group(q)),
    "quantization_config.surprise": lambda q: q.update(surprise=1),
}


@pytest.mark.parametrize("key", REFUSED)
def test_uncomputed_schemes_refuse_naming_the_key(checkpoints, tmp_path, key):
    path = _edited(checkpoints["int8-w8a8"], tmp_path, REFUSED[key])
    with pytest.raises(UnsupportedModelError, match=key.replace("*", r"\*").replace(".", r"\.")):
        Scorer.load(path, buckets=SMALL_BUCKETS)


def test_quant_method_other_than_compressed_tensors_is_refused(checkpoints, tmp_path):
    path = _edited(checkpoints["int8-w8a8"], tmp_path, lambda q: q.update(quant_method="gptq"))
    with pytest.raises(UnsupportedModelError, match="quantization_config"):
        Scorer.load(path, buckets=SMALL_BUCKETS)


def test_ignore_list_is_held_to_the_tensors(checkpoints, tmp_path):
    """A projection the ignore list names must be full precision, and lm_head unnamed while
    quantized layers exist is read as it is: a config contradicting its tensors is refused."""
    path = _edited(checkpoints["int8-w8a8"], tmp_path, lambda q: q.update(ignore=["lm_head", "re:.*down_proj$"]))
    with pytest.raises(ValueError, match="down_proj is 8-bit but quantization_config's ignore list"):
        Scorer.load(path, buckets=SMALL_BUCKETS)
