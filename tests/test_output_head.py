"""The output head chosen once from the config (model/head.py): what each kind of head says to
the layers that ask it, and the request rules built on it (engine/requests/heads.py). End to end, the
heads are tested against transformers in test_heads.py; these are the record's own answers."""

from __future__ import annotations

import dataclasses

import pytest

from prefixscore.engine.requests import heads
from prefixscore.engine.requests.validation import InvalidInput
from prefixscore.model.head import CAUSAL_LM, SEQUENCE_CLASSIFICATION, output_head
from prefixscore.model.presets import RANDOM_PRESETS

BASE = RANDOM_PRESETS["tiny-qwen3"][0]  # tied embeddings


def _classifier(n: int, multi_label: bool = False):
    names = tuple(f"label{i}" for i in range(n))
    return dataclasses.replace(BASE, num_labels=n, label_names=names, multi_label=multi_label, pad_token_id=3)


def _no_label_tokens(ids, labels):
    raise AssertionError("a classifier's rows are its own: no label tokens are resolved")


def test_a_causal_lm_head_is_its_vocabulary() -> None:
    tied, untied = output_head(BASE), output_head(dataclasses.replace(BASE, tie_word_embeddings=False))
    assert (tied.kind, tied.weight, tied.tensor, tied.tied) == (CAUSAL_LM, None, None, True)
    vocabulary = (BASE.vocab_size, BASE.hidden_size)
    assert (untied.weight, untied.tensor, untied.shape) == ("lm_head", "lm_head.weight", vocabulary)
    assert (tied.own_labels, tied.label_names, tied.auto_activation, tied.pad_token_id) == ((), (), "", None)
    # the whole vocabulary's log-sum-exp without apply_softmax, the label rows with it
    assert (tied.projected_rows(False, 2), tied.projected_rows(True, 2)) == (BASE.vocab_size, 2)
    assert tied.label_token_ids((17, 219)) == (17, 219)


@pytest.mark.parametrize(
    ("n", "multi_label", "auto"), [(1, False, "sigmoid"), (3, False, "softmax"), (2, True, "sigmoid")]
)
def test_a_classifier_head_scores_its_own_rows(n: int, multi_label: bool, auto: str) -> None:
    head = output_head(_classifier(n, multi_label))
    assert (head.kind, head.weight, head.tensor, head.shape) == (
        SEQUENCE_CLASSIFICATION,
        "score",
        "score.weight",
        (n, BASE.hidden_size),
    )
    assert (head.own_labels, head.label_names, head.auto_activation, head.pad_token_id) == (
        tuple(range(n)),
        tuple(f"label{i}" for i in range(n)),
        auto,
        3,
    )
    # the request's label rows only, with or without apply_softmax: never the vocabulary
    assert (head.projected_rows(False, n), head.projected_rows(True, n), head.projected_rows(False, 1)) == (n, n, 1)
    assert head.label_token_ids(tuple(range(n))) == ()  # its rows are reported by name


def test_request_rules_follow_the_head() -> None:
    causal, classifier = output_head(BASE), output_head(_classifier(3))
    asked = heads.for_request(causal, (), ["yes"], None, True, lambda ids, labels: (17,))
    assert asked == heads.RequestHead((17,), True, "")
    with pytest.raises(InvalidInput, match="applies to classifier models"):
        heads.for_request(causal, (17,), (), "sigmoid", False, lambda ids, labels: (17,))
    assert heads.for_request(classifier, (), (), "auto", False, _no_label_tokens) == heads.RequestHead(
        (0, 1, 2), False, "softmax"
    )
    with pytest.raises(InvalidInput, match="send no label tokens") as refused:
        heads.for_request(classifier, (), ["yes"], "auto", False, _no_label_tokens)
    assert refused.value.field == "labels"
    assert heads.for_rerank(causal, (17, 219)) == heads.RequestHead((17, 219), True, "")
    assert heads.for_rerank(output_head(_classifier(1)), (17, 219)) == heads.RequestHead((0,), False, "sigmoid")
    with pytest.raises(InvalidInput, match="one-label classifier"):
        heads.for_rerank(classifier, (17, 219))
    assert heads.for_classify(classifier, (), "none", _no_label_tokens)[1] == ("label0", "label1", "label2")
    with pytest.raises(InvalidInput, match="no classify labels"):
        heads.for_classify(causal, (), "auto", lambda ids, labels: ())
