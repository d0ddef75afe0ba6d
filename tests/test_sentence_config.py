"""model/sentence_config.py against sentence-transformers itself: checkpoints saved by its own API
(a tiny Qwen3 with SmolLM2's tokenizer), read by read_pooling and loaded again by
SentenceTransformer, the reference for every field of the record. No forward pass: only the
configuration is read."""

from __future__ import annotations

import dataclasses
import json
import re
import shutil

import pytest
import sentence_transformers.sentence_transformer.modules as stm
from conftest import make_torch_model
from sentence_transformers import SentenceTransformer

from prefixscore.model.presets import smollm2_tokenizer_dir
from prefixscore.model.sentence_config import Pooling, SentenceConfigError, plain_pooling, read_pooling

PROMPTS = {"query": "Instruct: find the passage\nQuery: ", "passage": "Passage: "}
MAX_SEQ_LENGTH = 48  # below the tiny model's 512 positions, so the limit shows
# the Pooling's legacy switches, one per mode, as older releases saved them
LEGACY_SWITCHES = (
    "pooling_mode_cls_token",
    "pooling_mode_max_tokens",
    "pooling_mode_mean_tokens",
    "pooling_mode_mean_sqrt_len_tokens",
    "pooling_mode_weightedmean_tokens",
    "pooling_mode_lasttoken",
)
LEGACY_TYPES = ("Transformer", "Pooling", "Normalize")  # modules.json's sentence_transformers.models.<name>


@pytest.fixture(scope="module")
def decoder(tmp_path_factory):
    """A plain checkpoint: a tiny Qwen3ForCausalLM and SmolLM2's tokenizer without its chat
    template (with one, sentence-transformers 6 embeds through it: a refusal of its own)."""
    path = tmp_path_factory.mktemp("decoder")
    model = make_torch_model("qwen3", seed=1, vocab_size=49152)
    model.save_pretrained(path)
    for f in smollm2_tokenizer_dir().iterdir():
        if f.name != "chat_template.jinja":
            shutil.copy(f, path)
    return path


@pytest.fixture(scope="module")
def hidden(decoder):
    return json.loads((decoder / "config.json").read_text())["hidden_size"]


@pytest.fixture(scope="module")
def transformer(decoder):
    return stm.Transformer(str(decoder), max_seq_length=MAX_SEQ_LENGTH)


def _save(path, *modules, **kwargs):
    SentenceTransformer(modules=list(modules), **kwargs).save(str(path))
    return path


@pytest.fixture(scope="module")
def base(tmp_path_factory, transformer, hidden):
    """Last-token pooling without the prompt, normalized, with a default prompt and dot similarity."""
    return _save(
        tmp_path_factory.mktemp("base") / "st",
        transformer,
        stm.Pooling(hidden, pooling_mode="lasttoken", include_prompt=False),
        stm.Normalize(),
        prompts=PROMPTS,
        default_prompt_name="query",
        similarity_fn_name="dot",
    )


@pytest.fixture
def ckpt(base, tmp_path):
    """A copy of the base checkpoint to edit."""
    return shutil.copytree(base, tmp_path / "ckpt")


def _edit(path, **changes):
    """Sets keys of a JSON file; None deletes one."""
    raw = {**json.loads(path.read_text()), **changes}
    path.write_text(json.dumps({key: value for key, value in raw.items() if value is not None}))


def _refused(path, hidden, *names):
    """read_pooling refuses the checkpoint with a message naming each of `names`."""
    with pytest.raises(SentenceConfigError) as e:
        read_pooling(path, hidden)
    for name in names:
        assert name in str(e.value)


def _reference(path) -> dict:
    """The record's fields as sentence-transformers reports them, loading the checkpoint."""
    model = SentenceTransformer(str(path))
    (pooling,) = [m for m in model if isinstance(m, stm.Pooling)]
    return dict(
        mode=pooling.pooling_mode,
        include_prompt=pooling.include_prompt,
        normalize=any(isinstance(m, stm.Normalize) for m in model),
        dimension=model.get_embedding_dimension(),
        prompts=model.prompts,
        default_prompt_name=model.default_prompt_name,
        similarity=model.similarity_fn_name,
        max_seq_length=model.max_seq_length,
        renders_messages="message" in model[0].modality_config,
    )


def _agrees(path, hidden) -> Pooling:
    """The record read, after checking it field by field against sentence-transformers."""
    record = read_pooling(path, hidden)
    assert isinstance(record, Pooling)
    # without a limit of the checkpoint's own, sentence-transformers truncates at the model's positions
    positions = json.loads((path / "config.json").read_text())["max_position_embeddings"]
    fields = {**vars(record), "prompts": dict(record.prompts)}
    fields["renders_messages"] = fields.pop("chat") is not None
    fields["max_seq_length"] = record.max_seq_length if record.max_seq_length is not None else positions
    assert fields == _reference(path)
    return record


def test_a_saved_checkpoint_reads_as_sentence_transformers_loads_it(base, hidden):
    record = _agrees(base, hidden)
    assert (record.mode, record.include_prompt, record.normalize) == ("lasttoken", False, True)
    assert record.similarity == "dot"
    assert record.prompts == {"document": "", **PROMPTS} and record.default_prompt_name == "query"
    assert (record.dimension, record.max_seq_length) == (hidden, MAX_SEQ_LENGTH)
    with pytest.raises(TypeError):  # frozen, its prompts too
        record.prompts["query"] = ""


@pytest.mark.parametrize(
    ("mode", "include_prompt", "normalize", "kwargs"),
    [
        ("mean", True, False, {}),  # no prompts, the default similarity (cosine)
        ("cls", False, True, dict(prompts=PROMPTS, default_prompt_name="passage", similarity_fn_name="manhattan")),
        ("mean", False, True, dict(prompts={"other": "x"}, similarity_fn_name="euclidean")),
    ],
)
def test_each_mode_reads_as_sentence_transformers_loads_it(
    tmp_path, transformer, hidden, mode, include_prompt, normalize, kwargs
):
    pooling = stm.Pooling(hidden, pooling_mode=mode, include_prompt=include_prompt)
    path = _save(tmp_path / "st", transformer, pooling, *([stm.Normalize()] if normalize else []), **kwargs)
    record = _agrees(path, hidden)
    assert (record.mode, record.include_prompt, record.normalize) == (mode, include_prompt, normalize)


def test_a_tokenizer_without_a_limit_leaves_the_length_to_the_context(ckpt, hidden):
    _edit(ckpt / "tokenizer_config.json", model_max_length=int(1e30))  # transformers' "no limit"
    assert _agrees(ckpt, hidden).max_seq_length is None


@pytest.mark.parametrize(
    ("switched_on", "mode", "include_prompt"),
    [
        ("pooling_mode_lasttoken", "lasttoken", False),
        ("pooling_mode_mean_tokens", "mean", False),
        ("pooling_mode_cls_token", "cls", True),
        (None, "mean", None),  # none on: mean; no include_prompt (the oldest): true
    ],
)
def test_a_checkpoint_saved_by_an_old_release_reads_as_a_new_one(ckpt, base, hidden, switched_on, mode, include_prompt):
    """The legacy spellings of older releases: modules.json's sentence_transformers.models.*, the
    Pooling's switches and word_embedding_dimension, no Normalize config, a sentence_bert_config.json
    holding max_seq_length, no model_type."""
    modules = json.loads((ckpt / "modules.json").read_text())
    for entry, name in zip(modules, LEGACY_TYPES, strict=True):
        entry["type"] = f"sentence_transformers.models.{name}"
    (ckpt / "modules.json").write_text(json.dumps(modules))
    switches = {key: key == switched_on for key in LEGACY_SWITCHES}
    _edit(ckpt / "1_Pooling" / "config.json", embedding_dimension=None, pooling_mode=None, include_prompt=None)
    legacy = {"word_embedding_dimension": hidden, **switches, "include_prompt": include_prompt}
    _edit(ckpt / "1_Pooling" / "config.json", **legacy)
    (ckpt / "2_Normalize" / "config.json").unlink()
    (ckpt / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 40, "do_lower_case": False}))
    versions = {"sentence_transformers": "3.0.1", "transformers": "4.41.2", "pytorch": "2.3.0"}
    _edit(ckpt / "config_sentence_transformers.json", model_type=None, __version__=versions)

    record = _agrees(ckpt, hidden)
    new = read_pooling(base, hidden)
    assert record == dataclasses.replace(new, mode=mode, include_prompt=include_prompt is not False, max_seq_length=40)


def test_saved_prompts_read_over_the_defaults_a_null_one_empty(ckpt, hidden):
    # as older releases saved them: without the "query" and "document" defaults, nor a similarity
    prompts = {"query": None, "passage": PROMPTS["passage"]}
    model = ckpt / "config_sentence_transformers.json"
    _edit(model, prompts=prompts, default_prompt_name=None, similarity_fn_name=None)
    record = _agrees(ckpt, hidden)
    assert record.prompts == {"query": "", "document": "", "passage": PROMPTS["passage"]}
    assert record.similarity == "cosine"


def test_a_checkpoint_without_config_sentence_transformers_reads_with_the_defaults(ckpt, hidden):
    (ckpt / "config_sentence_transformers.json").unlink()  # as the oldest releases saved none
    record = _agrees(ckpt, hidden)
    assert (record.prompts, record.default_prompt_name, record.similarity) == (
        {"query": "", "document": ""},
        None,
        "cosine",
    )


def test_legacy_switches_beside_pooling_mode_are_read_past_as_sentence_transformers_does(ckpt, hidden):
    _edit(ckpt / "1_Pooling" / "config.json", pooling_mode_max_tokens=True, pooling_mode_mean_tokens=True)
    assert _agrees(ckpt, hidden).mode == "lasttoken"


def test_a_plain_checkpoint_has_no_sentence_configuration(decoder, hidden):
    assert read_pooling(decoder, hidden) is None


@pytest.mark.parametrize(("flag", "mode"), [("last", "lasttoken"), ("mean", "mean")])
def test_plain_pooling_is_normalized_without_prompts(hidden, flag, mode):
    record = plain_pooling(flag, hidden)
    assert (record.mode, record.include_prompt, record.normalize, record.dimension) == (mode, True, True, hidden)
    assert (record.similarity, record.default_prompt_name, record.max_seq_length) == ("cosine", None, None)
    assert record.prompts == {"query": "", "document": ""}  # "no prompts" as sentence-transformers holds it


def test_plain_pooling_refuses_an_unknown_mode(hidden):
    with pytest.raises(SentenceConfigError, match=re.escape("--pooling 'cls' is not supported")):
        plain_pooling("cls", hidden)


# refusals, each naming what it refuses


def test_a_dense_module_is_refused_naming_it_and_its_folder(tmp_path, transformer, hidden):
    pooling = stm.Pooling(hidden, pooling_mode="lasttoken")
    path = _save(tmp_path / "st", transformer, pooling, stm.Dense(hidden, hidden), stm.Normalize())
    _refused(path, hidden, "modules.json: module 2 (sentence_transformers.base.modules.dense.Dense at 2_Dense)")


def test_a_normalize_before_the_pooling_is_refused(tmp_path, transformer, hidden):
    path = _save(tmp_path / "st", transformer, stm.Normalize(), stm.Pooling(hidden, pooling_mode="mean"))
    _refused(path, hidden, "modules.json: module 1 (sentence_transformers.base.modules.normalize.Normalize")


def test_a_transformer_without_a_pooling_is_refused(ckpt, hidden):
    modules = json.loads((ckpt / "modules.json").read_text())
    (ckpt / "modules.json").write_text(json.dumps(modules[:1]))
    _refused(ckpt, hidden, "modules.json has no Pooling")


def test_a_transformer_outside_the_checkpoint_root_is_refused(ckpt, hidden):
    modules = json.loads((ckpt / "modules.json").read_text())
    modules[0]["path"] = "0_Transformer"
    (ckpt / "modules.json").write_text(json.dumps(modules))
    _refused(ckpt, hidden, "module 0 (sentence_transformers.base.modules.transformer.Transformer at 0_Transformer)")


@pytest.mark.parametrize(
    ("change", "named"),
    [
        pytest.param({"kwargs": ["task"]}, "modules.json: module 1 kwargs=['task'] is not supported", id="kwargs"),
        pytest.param({"path": "../1_Pooling"}, "at ../1_Pooling): its path leaves the checkpoint", id="outside"),
        pytest.param({"type": None}, "modules.json: module 1 has no type", id="no-type"),
        pytest.param({"surprise": 1}, "modules.json: module 1 keys ['surprise'] are not in", id="unknown-key"),
    ],
)
def test_a_modules_json_entry_not_computed_is_refused(ckpt, hidden, change, named):
    modules = json.loads((ckpt / "modules.json").read_text())
    modules[1] = {key: value for key, value in {**modules[1], **change}.items() if value is not None}
    (ckpt / "modules.json").write_text(json.dumps(modules))
    _refused(ckpt, hidden, named)


@pytest.mark.parametrize("mode", ["max", "weightedmean", "mean_sqrt_len_tokens", ("mean", "lasttoken")])
def test_a_pooling_mode_not_computed_is_refused(tmp_path, transformer, hidden, mode):
    path = _save(tmp_path / "st", transformer, stm.Pooling(hidden, pooling_mode=mode))
    saved = mode if isinstance(mode, str) else list(mode)  # a combination is saved as a list
    _refused(path, hidden, f"1_Pooling/config.json pooling_mode={saved!r} is not supported")


@pytest.mark.parametrize(
    "switched_on",
    [
        ("pooling_mode_max_tokens",),
        ("pooling_mode_weightedmean_tokens",),
        ("pooling_mode_mean_tokens", "pooling_mode_lasttoken"),
        ("pooling_mode_cls_token", "pooling_mode_mean_tokens"),
    ],
)
def test_a_legacy_pooling_mode_not_computed_is_refused(ckpt, hidden, switched_on):
    legacy = {"word_embedding_dimension": hidden, **{key: key in switched_on for key in LEGACY_SWITCHES}}
    (ckpt / "1_Pooling" / "config.json").write_text(json.dumps(legacy))
    _refused(ckpt, hidden, "1_Pooling/config.json", *(f"{key}=True" for key in switched_on))


@pytest.mark.parametrize(
    "name",
    [
        "1_Pooling/config.json",
        "config_sentence_transformers.json",
        "sentence_bert_config.json",
        "2_Normalize/config.json",
    ],
)
def test_a_key_not_in_the_inventory_is_refused_naming_the_file_and_key(ckpt, hidden, name):
    _edit(ckpt / name, surprise=1)
    _refused(ckpt, hidden, f"{name} keys ['surprise'] are not in prefixscore's inventory")


def test_lowercasing_is_refused_and_its_absence_read_past(ckpt, base, hidden):
    _edit(ckpt / "sentence_bert_config.json", do_lower_case=False)
    assert read_pooling(ckpt, hidden) == read_pooling(base, hidden)
    _edit(ckpt / "sentence_bert_config.json", do_lower_case=True)
    _refused(ckpt, hidden, "sentence_bert_config.json do_lower_case=True is not supported")


def test_a_default_prompt_naming_no_prompt_is_refused_as_sentence_transformers_refuses_it(ckpt, hidden):
    _edit(ckpt / "config_sentence_transformers.json", default_prompt_name="missing")
    _refused(ckpt, hidden, "config_sentence_transformers.json default_prompt_name='missing' is not supported")
    with pytest.raises(ValueError, match="'missing' not found"):
        SentenceTransformer(str(ckpt))


def test_a_pooling_width_other_than_the_hidden_size_is_refused(tmp_path, transformer, hidden):
    path = _save(tmp_path / "st", transformer, stm.Pooling(hidden + 8, pooling_mode="mean"))
    _refused(path, hidden, f"1_Pooling/config.json embedding_dimension={hidden + 8} is not supported")
    legacy = {"word_embedding_dimension": hidden + 8, "pooling_mode_mean_tokens": True}
    (path / "1_Pooling" / "config.json").write_text(json.dumps(legacy))
    _refused(path, hidden, f"1_Pooling/config.json word_embedding_dimension={hidden + 8} is not supported")


@pytest.fixture
def chat_ckpt(tmp_path, decoder, hidden):
    """With a chat template, sentence-transformers 6 saves a 'message' modality and embeds every
    text through the template, its prompt as a system message (mean pooling without the prompt,
    which it does not apply to a rendered input)."""
    chat = shutil.copytree(decoder, tmp_path / "chat")
    shutil.copy(smollm2_tokenizer_dir() / "chat_template.jinja", chat)
    transformer = stm.Transformer(str(chat), processing_kwargs={"chat_template": {"add_generation_prompt": True}})
    pooling = stm.Pooling(hidden, pooling_mode="mean", include_prompt=False)
    path = _save(tmp_path / "st", transformer, pooling)
    assert SentenceTransformer(str(path))[0].modality_config["message"]["format"] == "flat"
    return path


def test_a_chat_template_backbone_renders_its_texts(chat_ckpt, hidden):
    pooling = read_pooling(chat_ckpt, hidden)
    assert pooling.chat is not None and pooling.chat.format == "flat" and pooling.chat.restore_suffix
    assert dict(pooling.chat.template_kwargs) == {"add_generation_prompt": True}
    assert pooling.mode == "mean" and pooling.include_prompt  # as sentence-transformers 6.2 pools a message


@pytest.mark.parametrize(
    "change, named",
    [
        (
            {
                "modality_config": {
                    "message": {"method": "forward", "method_output_name": "last_hidden_state", "format": "auto"}
                }
            },
            "modality_config=",
        ),  # noqa: E501
        (
            {"modality_config": {"image": {"method": "forward", "method_output_name": "last_hidden_state"}}},
            "modality_config=",
        ),  # noqa: E501
        ({"processing_kwargs": {"text": {"max_length": 16}}}, "processing_kwargs="),
        ({"processing_kwargs": {"chat_template": {"max_length": 16}}}, "['max_length']"),
        ({"processing_kwargs": {"chat_template": {"restore_suffix": "yes"}}}, "processing_kwargs="),
    ],
)
def test_a_message_modality_not_computed_is_refused(chat_ckpt, hidden, change, named):
    _edit(chat_ckpt / "sentence_bert_config.json", **change)
    _refused(chat_ckpt, hidden, "sentence_bert_config.json", named)


def test_a_template_that_reads_the_task_or_no_template_is_refused(chat_ckpt, hidden):
    template = chat_ckpt / "chat_template.jinja"
    template.write_text("{% if task == 'query' %}Q: {% endif %}" + template.read_text())
    _refused(chat_ckpt, hidden, "`task` variable")
    template.unlink()
    _refused(chat_ckpt, hidden, "the tokenizer has none")


def test_a_truncated_embedding_is_refused(tmp_path, transformer, hidden):
    pooling = stm.Pooling(hidden, pooling_mode="lasttoken")
    path = _save(tmp_path / "st", transformer, pooling, stm.Normalize(), truncate_dim=32)
    _refused(path, hidden, "config_sentence_transformers.json truncate_dim=32 is not supported")


def test_a_similarity_sentence_transformers_would_replace_is_refused(ckpt, hidden):
    # sentence-transformers reads an unsupported name as cosine: a silent change, refused here
    _edit(ckpt / "config_sentence_transformers.json", similarity_fn_name="maxsim")
    _refused(ckpt, hidden, "config_sentence_transformers.json similarity_fn_name='maxsim' is not supported")
