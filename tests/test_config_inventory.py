"""Never a silently wrong score: every configuration in the inventory (model/config_inventory.py)
that a field computes scores exactly as transformers' eager model does, and every one at a value
its `accepts` rejects is refused, naming the field.

The trials come from the inventory itself, so a field added there is tested here without
another line. Each trial is a tiny checkpoint written by transformers (or a GGUF file written
from one) with the field set to a non-default value. A computed one is scored with a query
longer than any window (trials' windows are 48 tokens) and a short one, items of several
lengths: every sequence inside the served context must match within 1e-5 (float32), every
sequence past it must get the context-length error, and the short ones must fit. A refused one
must fail its load with that field's own refusal: a value the inventory lists as computed
(llama3 RoPE, `hidden_act: gelu`, a GGUF window) can never pass by being refused.
"""

from __future__ import annotations

import dataclasses
import json
import re

import numpy as np
import pytest
import transformers
from conftest import FAMILY_OPTIONS, ONE_SHAPE_BUCKETS, TINY_SHAPES, make_torch_model, torch_label_probs
from gguf import GGMLQuantizationType as Q
from helpers.gguf_files import write_gguf

from prefixscore import Scorer
from prefixscore.engine.requests.validation import InvalidInput
from prefixscore.model.config import UnsupportedModelError
from prefixscore.model.config_inventory import FAMILIES, GGUF_KEYS, Effect, Field, family_fields

TOLERANCE = 1e-5  # float32, against transformers' eager float32 forward pass
# one page size, one item bucket, one prefill bucket: each trial compiles two small executables
BUCKETS = ONE_SHAPE_BUCKETS
RNG = np.random.default_rng(28)
QUERIES = [RNG.integers(0, 320, n).tolist() for n in (20, 60)]  # inside and past a 48-token window
ITEMS = [RNG.integers(0, 320, n).tolist() for n in (1, 5, 13, 27)]
LABELS = [3, 77, 319]


def _field_trials(fields) -> list[tuple[str, object, bool]]:
    """(field name, trial, whether it must be refused) for each trial of `fields`."""
    return [(f.name, t, False) for f in fields for t in f.trials] + [
        (f.name, t, True) for f in fields for t in f.refused
    ]


def _dedupe(trials):
    """(trial, refused, fields it tries) with identical configurations merged: one compile each."""
    merged: dict[str, tuple[object, bool, list[str]]] = {}
    for name, trial, refused in trials:
        config = dataclasses.asdict(trial) if dataclasses.is_dataclass(trial) else trial
        key = json.dumps([config, refused], sort_keys=True)
        merged.setdefault(key, (trial, refused, []))[2].append(name)
    return list(merged.values())


# Fields the config classes read their own way (Qwen2's and Qwen3's windows): tried in every
# family that has them. The others are one Field shared by the families' inventories
# (model/config_inventory.py) and one decoder computes them: each trial in one family, in turn.
PER_FAMILY = {"use_sliding_window", "sliding_window", "max_window_layers", "layer_types"}


def _hf_trials() -> list:
    owners: dict[str, list[str]] = {}  # trial -> the families whose inventory has it
    trials: dict[str, tuple[object, bool, list[str]]] = {}
    for model_type, family in FAMILIES.items():
        for trial, refused, names in _dedupe(_field_trials(family.fields)):
            key = json.dumps([trial, refused, names], sort_keys=True)
            key = f"{model_type}:{key}" if PER_FAMILY & set(names) else key
            owners.setdefault(key, []).append(model_type)
            trials[key] = (trial, refused, names)
    return [
        pytest.param(
            families[i % len(families)],
            *trials[key],
            id=_trial_id(families[i % len(families)], trials[key][2], trials[key][1], i),
        )
        for i, (key, families) in enumerate(owners.items())
    ]


def _trial_id(owner: str, names: list[str], refused: bool, i: int) -> str:
    return f"{owner}-{'+'.join(names)}{'-refused' if refused else ''}-{i}"


HF_TRIALS = _hf_trials()
# each key's trials on one architecture, the three in turn: GGUF keys are read through the same
# `{arch}.` names for every architecture (model/gguf_loader.py), so a key honoured or refused for
# one is for all; the architectures' own tensors are in tests/test_gguf.py
GGUF_ARCHES = ("llama", "qwen2", "qwen3")
GGUF_TRIALS = [
    pytest.param(GGUF_ARCHES[i % 3], trial, refused, names, id=_trial_id(GGUF_ARCHES[i % 3], names, refused, i))
    for i, (trial, refused, names) in enumerate(_dedupe(_field_trials(GGUF_KEYS)))
]


@pytest.fixture(autouse=True)
def _own_cache(tmp_path, monkeypatch):
    """Converted GGUF weights go to this test's cache, not the user's."""
    monkeypatch.setenv("PREFIXSCORE_CACHE", str(tmp_path / "cache"))


def _scores_exactly(path: str, torch_model) -> None:
    """Load `path` and hold it to transformers."""
    scorer = Scorer.load(path, buckets=BUCKETS)
    context = scorer.cfg.context_length
    assert context >= len(QUERIES[0]) + len(ITEMS[-1]), "the cap refuses even short sequences"
    assert context <= torch_model.config.max_position_embeddings
    for query in QUERIES:
        fits = [item for item in ITEMS if len(query) + len(item) <= context]
        for item in ITEMS:
            if item not in fits:  # past the served context: the precise error, before device work
                with pytest.raises(InvalidInput, match=f"(within|over the limit of) {context}"):
                    scorer.score(query, [item], LABELS)
        for apply_softmax in (False,)[: 1 if fits else 0]:  # each query new: one call shape, one compile
            got = np.array(scorer.score(query, fits, LABELS, apply_softmax=apply_softmax))
            want = torch_label_probs(torch_model, [query + item for item in fits], LABELS, apply_softmax)
            err = np.abs(got - want).max()
            assert err <= TOLERANCE, (len(query), apply_softmax, err)


def _refused_by_accepts(path: str, fields: list[Field], arch: str = "") -> None:
    """Loading `path` fails with one of `fields`' own refusals (Field.refusal: its `accepts`
    rejected the value), not any other error."""
    with pytest.raises(UnsupportedModelError) as refusal:
        Scorer.load(path, buckets=BUCKETS)
    message = str(refusal.value)
    patterns = [re.escape(f.name.replace("{arch}", arch)) + "=.* is not supported: " + re.escape(f.why) for f in fields]
    assert any(re.search(pattern, message) for pattern in patterns), message


@pytest.mark.parametrize("model_type,trial,refused,names", HF_TRIALS)
def test_every_config_field_scores_exactly_or_is_refused(tmp_path, model_type, trial, refused, names):
    inventory = family_fields(model_type)
    torch_model = make_torch_model(model_type, seed=5, **trial)
    torch_model.save_pretrained(tmp_path)
    if refused:
        _refused_by_accepts(str(tmp_path), [inventory[n] for n in names])
    elif all(inventory[n].effect is Effect.INERT for n in names):  # inert: the very config of the base
        base = tmp_path / "base"
        make_torch_model(model_type, seed=5).save_pretrained(base)
        assert Scorer.load(str(tmp_path), buckets=BUCKETS).cfg == Scorer.load(str(base), buckets=BUCKETS).cfg
    else:
        _scores_exactly(str(tmp_path), torch_model)


@pytest.mark.parametrize("arch,trial,refused,names", GGUF_TRIALS)
def test_every_gguf_key_scores_exactly_or_is_refused(tmp_path, arch, trial, refused, names):
    # transformers' Llama has no window: Mistral's decoder is Llama's with one
    oracle = "mistral" if arch == "llama" and "sliding_window" in trial.hf else arch
    torch_model = make_torch_model(oracle, seed=6, **trial.hf)
    path = tmp_path / "trial.gguf"
    write_gguf(torch_model, arch, path, Q.F32, dict(trial.metadata))
    if refused:
        by_name = {f.name: f for f in GGUF_KEYS}
        _refused_by_accepts(str(path), [by_name[n] for n in names], arch)
    else:
        _scores_exactly(str(path), torch_model)


@pytest.mark.parametrize("model_type", FAMILIES)
def test_the_inventory_covers_transformers_config_class(model_type):
    """Every field of the installed transformers' class is classified, and each computed field
    without a trial of its own is set to a non-default value by the tests' tiny checkpoint."""
    cls = getattr(transformers, FAMILIES[model_type].config_class)
    inventory = family_fields(model_type)
    class_fields = {f.name for f in dataclasses.fields(cls)}
    assert class_fields <= inventory.keys(), sorted(class_fields - inventory.keys())
    default, tiny = cls(), cls(**{**TINY_SHAPES, **FAMILY_OPTIONS[model_type]})
    for field in inventory.values():
        if field.effect is Effect.COMPUTED and not field.trials:
            if field.name in class_fields and field.name not in ("architectures", "rope_parameters"):
                assert getattr(tiny, field.name) != getattr(default, field.name), field.name


def test_a_field_missing_from_the_inventory_refuses_the_load(tmp_path, monkeypatch):
    """A transformers field nobody has classified (as after an upgrade) is refused, named."""
    make_torch_model("llama", seed=5).save_pretrained(tmp_path)
    fields = tuple(f for f in FAMILIES["llama"].fields if f.name != "mlp_bias")
    monkeypatch.setitem(FAMILIES, "llama", dataclasses.replace(FAMILIES["llama"], fields=fields))
    with pytest.raises(UnsupportedModelError, match="mlp_bias.*inventory"):
        Scorer.load(str(tmp_path), buckets=BUCKETS)


@pytest.mark.parametrize(
    "key,value",
    [("quantization_config", {"quant_method": "fp8"}), ("auto_map", {"AutoModelForCausalLM": "modeling.Custom"})],
)
def test_keys_outside_transformers_class_that_change_the_model_are_refused(tmp_path, key, value):
    make_torch_model("qwen3", seed=5).save_pretrained(tmp_path)
    raw = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**raw, key: value}))
    with pytest.raises(UnsupportedModelError, match=f"config.json {key}="):
        Scorer.load(str(tmp_path), buckets=BUCKETS)


def test_an_unknown_gguf_key_refuses_the_load(tmp_path):
    path = tmp_path / "odd.gguf"
    write_gguf(make_torch_model("llama", seed=6), "llama", path, Q.F32, {"{arch}.attention.temperature": 0.5})
    with pytest.raises(UnsupportedModelError, match="llama.attention.temperature"):
        Scorer.load(str(path), buckets=BUCKETS)


def test_a_checkpoint_tensor_the_config_does_not_use_refuses_the_load(tmp_path):
    """A Llama checkpoint with attention biases whose config.json says attention_bias=false: the
    biases would be read past, so the load names them."""
    make_torch_model("llama", seed=5, attention_bias=True).save_pretrained(tmp_path)
    raw = json.loads((tmp_path / "config.json").read_text())
    raw["attention_bias"] = False
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(UnsupportedModelError, match="o_proj.bias"):
        Scorer.load(str(tmp_path), buckets=BUCKETS)


def test_a_window_is_computed_and_reported(tmp_path):
    """Mistral v0.1's shape: a window under the positions is computed, so the whole context is
    served; gRPC and HTTP report the window beside it, and a query longer than the window
    scores as transformers does over both."""
    import httpx
    from helpers.service import server_config

    from prefixscore.client import ScoreClient
    from prefixscore.service.process import ServerThread

    torch_model = make_torch_model("mistral", seed=5, sliding_window=48)
    torch_model.save_pretrained(tmp_path)
    scorer = Scorer.load(str(tmp_path), buckets=BUCKETS)
    cfg = scorer.cfg
    assert (cfg.sliding_window, cfg.max_position_embeddings, cfg.context_length) == (48, 512, 512)
    long_query = QUERIES[1] + QUERIES[1]  # 120 tokens: every item sees past the window's start
    want = torch_label_probs(torch_model, [long_query + item for item in ITEMS], LABELS, False)
    with ServerThread(server_config(scorer, http_port=0)) as srv, ScoreClient(srv.target) as client:
        info = client.model_info(timeout=30)
        assert (info.context_length, info.sliding_window, info.max_position_embeddings) == (512, 48, 512)
        got = np.array(client.score(long_query, ITEMS, LABELS).scores)
        assert np.abs(got - want).max() <= TOLERANCE
        with httpx.Client(base_url=f"http://127.0.0.1:{srv.server.http_port}", timeout=60) as http:
            card = http.get("/v1/models").json()["data"][0]
            assert (card["max_model_len"], card["sliding_window"], card["max_position_embeddings"]) == (512, 48, 512)
