"""Bad input is rejected with a ValueError naming the field, before any device work."""

from __future__ import annotations

import pytest

from prefixscore.engine.runtime.scoring_engine import ScoringEngine

LABELS = [1, 2]


@pytest.fixture
def no_device(tiny_scorer, monkeypatch):
    """Fail the test if validation lets anything reach the device."""

    def boom(*_a, **_k):
        raise AssertionError("device work started for an invalid request")

    for name in ("launch", "score_packed"):
        monkeypatch.setattr(ScoringEngine, name, boom)
    return tiny_scorer


@pytest.mark.parametrize(
    "kwargs,field",
    [
        (dict(query="q", items=["a"], label_token_ids=[49152]), "label_token_ids"),
        (dict(query="q", items=["a"], label_token_ids=[-1]), "label_token_ids"),
        (dict(query="q", items=["a"], label_token_ids=[]), "label_token_ids"),
        (dict(query="q", items=["a"], label_token_ids=list(range(300))), "label_token_ids"),
        (dict(query="", items=["a"], label_token_ids=LABELS), "query"),
        (dict(query="", items=[], label_token_ids=LABELS), "query"),
        (dict(query=[], items=[[1]], label_token_ids=LABELS), "query"),
        (dict(query="q", items=["a", [1, 2]], label_token_ids=LABELS), "items"),
        (dict(query="q", items=[[1, 2]], label_token_ids=LABELS), "items"),
        (dict(query=[1, 2], items=["text"], label_token_ids=LABELS), "items"),
        (dict(query=[1, 99999], items=[[1]], label_token_ids=LABELS), "query"),
        (dict(query=[1, 2], items=[[1], [3, -4]], label_token_ids=LABELS), r"items\[1\]"),
        (dict(query=[1, 2], items=[[1], []], label_token_ids=LABELS), r"items\[1\]"),
        (dict(query=[1, 2], items=[[1], [1.5]], label_token_ids=LABELS), r"items\[1\]"),
        (dict(query="q", items=["a", ""], label_token_ids=LABELS), r"items\[1\]"),
        (dict(query=[1] * 8192, items=[[1]], label_token_ids=LABELS), "query"),
        (dict(query=[1] * 500, items=[[1] * 20], label_token_ids=LABELS), r"items\[0\]"),
        (dict(query=[1] * 10, items=[[1] * 600], label_token_ids=LABELS), r"items\[0\]"),
        (dict(query=[1] * 400, items=[[1] * 10, [1] * 120], label_token_ids=LABELS), r"items\[1\]"),
        (dict(query=3, items=[[1]], label_token_ids=LABELS), "query"),
        (dict(query="q", items="abc", label_token_ids=LABELS), "items"),
    ],
)
def test_bad_input_names_the_field(no_device, kwargs, field):
    with pytest.raises(ValueError, match=rf"^{field}"):
        no_device.score(**kwargs)


def test_empty_items_return_empty(no_device):
    assert no_device.score("a query", [], LABELS) == []
    assert no_device.score([1, 2, 3], [], LABELS) == []


def test_unknown_mode_and_model():
    from prefixscore import Scorer

    with pytest.raises(ValueError, match="not a preset"):
        Scorer.load("no-such-model")
    with pytest.raises(FileNotFoundError, match="GGUF"):
        Scorer.load("/nonexistent/model.gguf")
    with pytest.raises(ValueError, match="dtype"):
        Scorer.load("tiny-qwen3", dtype="float8")


def test_hub_id_offline_fails_clearly(monkeypatch):
    from prefixscore import Scorer

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(FileNotFoundError, match="hub id"):
        Scorer.load("someorg/somemodel")
