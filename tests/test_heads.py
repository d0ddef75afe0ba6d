"""Classifier heads: a *ForSequenceClassification checkpoint scores its `score` projection at each
item's last token, exactly as transformers' model does on `query + item` (batch of one: the last
token), with the activation the request asks for; and a causal LM converted to a one-logit
classifier (score row W[yes] - W[no], vLLM's recipe for Qwen3-Reranker) gives exactly the causal
path's relevance p(yes) / (p(yes) + p(no))."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import transformers
from conftest import ONE_SHAPE_BUCKETS, make_torch_model, torch_label_probs

from prefixscore import Scorer
from prefixscore.engine.requests.validation import InvalidInput
from prefixscore.model.config import UnsupportedModelError
from prefixscore.model.config_inventory import CLASSIFIERS, FAMILIES, Effect, family_fields
from prefixscore.model.weights import weight_axes
from prefixscore.telemetry.compiles import CompileCounter

TOLERANCE = 1e-5  # float32 against transformers' eager float32
# one item bucket, one prefill bucket: two small executables per model
BUCKETS = ONE_SHAPE_BUCKETS
RNG = np.random.default_rng(41)
QUERY = RNG.integers(0, 320, 37).tolist()
ITEMS = [RNG.integers(0, 320, n).tolist() for n in (1, 4, 11, 26)]
# each family's classifier: label counts 1, 2, 3; named labels; a multi-label problem type
HEADS = {
    "llama": dict(id2label={0: "negative", 1: "neutral", 2: "positive"}),
    "mistral": dict(num_labels=2, problem_type="multi_label_classification"),
    "qwen2": dict(num_labels=2),
    "qwen3": dict(id2label={0: "relevant"}),
    # sliding windows, soft-capped vocabulary logits (a classifier's are not), GELU, 1 + weight norms
    "gemma3_text": dict(num_labels=1),
}


def _sigmoid(x: np.ndarray) -> np.ndarray:
    return 1 / (1 + np.exp(-x))


def _softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def torch_logits(model, sequences) -> np.ndarray:
    """transformers' *ForSequenceClassification on each whole sequence: [n, num_labels] float64."""
    with torch.no_grad():
        return np.array([model(torch.tensor([list(s)])).logits[0].double().numpy() for s in sequences])


@pytest.mark.parametrize("family", HEADS)
def test_classifier_matches_transformers_with_every_activation(tmp_path, family):
    """Raw logits, sigmoid, softmax and the default (sigmoid for one label or a multi-label
    problem type, softmax otherwise) equal transformers' logits so transformed; the vocabulary
    head is gone; after the first call no activation or item count compiles anything."""
    model = make_torch_model(family, seed=2, classifier=True, **HEADS[family])
    model.save_pretrained(tmp_path)
    assert "lm_head.weight" not in model.state_dict()
    scorer = Scorer.load(str(tmp_path), buckets=BUCKETS)
    cfg = scorer.cfg
    n = model.config.num_labels
    assert (cfg.num_labels, cfg.label_names) == (n, tuple(model.config.id2label[i] for i in range(n)))
    assert scorer.model.params.lm_head is None and scorer.model.params.score.shape == (n, cfg.hidden_size)
    default = _sigmoid if n == 1 or family == "mistral" else _softmax
    activations = {"none": lambda x: x, "sigmoid": _sigmoid, "softmax": _softmax, "auto": default}
    after_first_call = None
    for k, (activation, items) in enumerate((a, i) for a in activations for i in (ITEMS, ITEMS[2:3])):
        query = [*QUERY, k]  # a new query each time: every call prefills and scores, one call shape
        got = np.array(scorer.score(query, items, activation=activation))
        want = activations[activation](torch_logits(model, [query + it for it in items]))
        assert got.shape == (len(items), n)
        np.testing.assert_allclose(got, want, atol=TOLERANCE, rtol=TOLERANCE)
        if k == 0:
            after_first_call = CompileCounter.obtained()
    assert CompileCounter.obtained() == after_first_call, "a classifier request compiled in steady state"


def test_causal_lm_converted_to_a_one_logit_classifier_gives_the_template_relevance(tmp_path):
    """vLLM's Qwen3-Reranker conversion: score = W[yes] - W[no] from the causal LM's vocabulary
    head. sigmoid(h . (W[yes] - W[no])) = p(yes) / (p(yes) + p(no)): the classifier path with
    sigmoid equals the causal path's label softmax over (yes, no), item for item."""
    yes, no = 17, 219
    causal = make_torch_model("qwen3", seed=4)
    causal.save_pretrained(tmp_path / "causal")
    config = transformers.Qwen3Config.from_dict(
        {**causal.config.to_dict(), "architectures": ["Qwen3ForSequenceClassification"], "num_labels": 1}
    )
    classifier = transformers.Qwen3ForSequenceClassification(config).eval()
    classifier.model.load_state_dict(causal.model.state_dict())
    with torch.no_grad():
        w = causal.get_output_embeddings().weight
        classifier.score.weight.copy_(w[[yes]] - w[[no]])
    classifier.save_pretrained(tmp_path / "classifier")

    relevance = np.array(
        Scorer.load(str(tmp_path / "causal"), buckets=BUCKETS).score(QUERY, ITEMS, [yes, no], apply_softmax=True)
    )[:, 0]
    got = np.array(Scorer.load(str(tmp_path / "classifier"), buckets=BUCKETS).score(QUERY, ITEMS))[:, 0]
    np.testing.assert_allclose(got, relevance, atol=TOLERANCE)
    want = torch_label_probs(causal, [QUERY + it for it in ITEMS], [yes, no], apply_softmax=True)[:, 0]
    np.testing.assert_allclose(got, want, atol=TOLERANCE)
    assert np.ptp(got) > 0.05  # the items' relevance differs: a constant would not pass by luck


def test_label_tokens_sent_to_a_classifier_and_activation_to_a_causal_lm_are_refused(tiny_scorer, tmp_path):
    """A precise error naming the field, before any device work."""
    make_torch_model("qwen3", seed=2, classifier=True, num_labels=2, pad_token_id=300).save_pretrained(tmp_path)
    scorer = Scorer.load(str(tmp_path), buckets=BUCKETS)
    # transformers reads the last token that is not the pad token: a sequence ending in it is refused
    with pytest.raises(InvalidInput, match="^items\\[1\\]: the sequence ends in the pad token 300"):
        scorer.score(QUERY, [[1, 2], [1, 300]])
    with pytest.raises(InvalidInput, match="^items\\[0\\]: the sequence ends in the pad token 300"):
        scorer.score([*QUERY, 300], [[1, 2]], item_first=True)
    with pytest.raises(InvalidInput, match="^label_token_ids: the model is a sequence classifier with 2 label"):
        scorer.score(QUERY, ITEMS, [3, 4])
    with pytest.raises(InvalidInput, match="^activation: 'tanh' is not one of auto, none, sigmoid, softmax"):
        scorer.score(QUERY, ITEMS, activation="tanh")
    with pytest.raises(InvalidInput, match="^apply_softmax: contradicts activation 'sigmoid'"):
        scorer.score(QUERY, ITEMS, apply_softmax=True, activation="sigmoid")
    with pytest.raises(InvalidInput, match="^activation: applies to classifier models"):
        tiny_scorer.score(QUERY, ITEMS, [3, 4], activation="sigmoid")


def test_the_score_head_is_replicated_under_tensor_parallelism():
    """Its logical axes map to no mesh axis: every device of a model axis holds it whole (a
    classifier needs no vocabulary shards)."""
    from jax.sharding import PartitionSpec as P

    from prefixscore.engine.runtime.mesh import Layout

    assert Layout.spec(weight_axes()["score"]) == P(None, None)


def test_the_inventory_computes_label_fields_for_classifiers_only():
    """id2label, label2id, num_labels and problem_type: computed for a *ForSequenceClassification,
    inert for its causal LM; every classifier architecture exists in transformers and names a
    family the loader serves."""
    for architecture, model_type in CLASSIFIERS.items():
        assert hasattr(transformers, architecture) and model_type in FAMILIES
        causal, classifier = family_fields(model_type), family_fields(model_type, classifier=True)
        for name in ("id2label", "label2id", "problem_type"):
            assert causal[name].effect is Effect.INERT and classifier[name].effect is not Effect.INERT
        assert "num_labels" not in causal and classifier["num_labels"].effect is Effect.COMPUTED


def test_a_classifier_checkpoint_with_a_vocabulary_head_is_refused_naming_it(tmp_path):
    """A tensor the head does not read (an lm_head beside the score) refuses the load."""
    from safetensors.torch import save_file

    model = make_torch_model("llama", seed=2, classifier=True, num_labels=2)
    model.save_pretrained(tmp_path)
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    save_file({**state, "lm_head.weight": state["model.embed_tokens.weight"].clone()}, tmp_path / "model.safetensors")
    with pytest.raises(UnsupportedModelError, match="lm_head.weight"):
        Scorer.load(str(tmp_path), buckets=BUCKETS)
