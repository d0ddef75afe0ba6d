"""Embeddings of checkpoints sentence-transformers 6 saves from a chat-template tokenizer (the
`message` modality: every text rendered through the chat template, the prompt as a system
message), against sentence-transformers' own `encode` on checkpoints it writes, on every surface;
and the same checkpoint saved without modality_config (as older releases saved it), encoded as text.
"""

from __future__ import annotations

import base64
import json
from pathlib import Path

import numpy as np
import pytest
from helpers.sentence_checkpoints import QUERY_PROMPT, batch_and_alone, st_checkpoint

from prefixscore import Scorer

TEXTS = [
    "What is the capital of France?",
    "ripe yellow bananas",
    "How do I bake bread at home without a bread machine, using only flour, water and salt?",
    "Berlin is in Germany",
]
ATOL = 1e-5  # on unit vectors of 64 float32 components; a wrong token moves them by 1e-2 and more

# a template that writes each part of a structured message with its type (a string content as it is)
STRUCTURED_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n"
    "{% if m.content is string %}{{ m.content }}{% else %}{% for p in m.content %}[{{ p.type }}] {{ p.text }}"
    "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

CASES = {  # name -> (pooling mode, include_prompt, the chat_template arguments saved)
    # a generation prompt after the user turn, as some embedders are trained
    "last": ("lasttoken", True, {"add_generation_prompt": True}),
    # include_prompt false, which sentence-transformers 6.2 does not apply to a rendered input
    "mean": ("mean", False, {}),
}


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    """case -> (sentence-transformers' model, prefixscore's Scorer, the checkpoint), made once."""
    import sentence_transformers as st
    from conftest import ONE_SHAPE_BUCKETS

    made = {}

    def get(case: str):
        if case not in made:
            mode, include_prompt, chat = CASES[case]
            path = st_checkpoint(tmp_path_factory.mktemp(case), mode, include_prompt, True, chat)
            st_model = st.SentenceTransformer(path, device="cpu")
            made[case] = st_model, Scorer.load(path, buckets=ONE_SHAPE_BUCKETS), path
        return made[case]

    return get


@pytest.fixture(params=list(CASES))
def pair(request, pairs):
    return pairs(request.param)


def _close(got, want) -> None:
    got = np.asarray(got, np.float32)
    assert got.shape == want.shape
    np.testing.assert_allclose(got, want, atol=ATOL, rtol=0)


def test_sentence_transformers_saves_the_message_modality(pair):
    """The checkpoint is what the issue is about: sentence-transformers 6 renders its texts as
    messages (its own preprocess says so), and prefixscore reads it so."""
    st_model, scorer, path = pair
    saved = json.loads((Path(path) / "sentence_bert_config.json").read_text())
    assert "message" in saved["modality_config"]
    assert st_model.preprocess(["hello"])["modality"] == "message"
    assert scorer.model.pooling.chat is not None and scorer.model.pooling.include_prompt


@pytest.mark.parametrize("prompt", [{"prompt_name": "query"}, {"prompt_name": "document"}, {}, {"prompt": "Say: "}])
def test_encode_equals_sentence_transformers(pair, prompt):
    """Each text rendered with its prompt as the system message (none for an empty prompt: the
    template's own default), pooled and normalized as the checkpoint says."""
    st_model, scorer, _ = pair
    want = st_model.encode(TEXTS, convert_to_numpy=True, **prompt)
    _close(scorer.embed(TEXTS, **prompt), want)
    assert np.ptp(want[:, 0]) > 1e-2  # the inputs' embeddings differ: a shared or shifted row would show


def test_a_batch_padded_either_side_equals_each_input_alone(pair):
    st_model, scorer, _ = pair
    alone, padded, batch, each = batch_and_alone(st_model, scorer, TEXTS)
    for got in (*padded, batch, each):
        _close(got, alone)


def test_the_rendered_prompt_is_a_cached_prefix(pairs):
    """The template's start, the system message and the user turn's header are the same tokens at
    the start of every input under a prompt: prefilled once, read from the cache by the next request
    (all but the last, which a text's first may merge into; sentence-transformers' own tokens)."""
    st_model, scorer, _ = pairs("last")
    scorer.embed(["first request"], prompt_name="query")
    scorer.embed(["second request", "and another"], prompt_name="query")
    ids = st_model.preprocess(["second request", "and another"], prompt=QUERY_PROMPT)["input_ids"].tolist()
    common = next(i for i, (a, b) in enumerate(zip(*ids, strict=True)) if a != b)
    assert scorer.last_usage.cached_tokens == common - 1


def test_a_text_over_the_limit_is_cut_keeping_the_templates_tail(pairs):
    """truncate: cut as sentence-transformers cuts a rendered input at its max_seq_length: the
    text's end goes, the template's tail (the turn's end, the generation prompt) stays."""
    st_model, scorer, _ = pairs("last")
    long_text = " ".join(f"word{i}" for i in range(400))
    got = scorer.embed([long_text], prompt_name="query", truncate=True)
    kept = scorer.last_usage.prompt_tokens
    saved, st_model.max_seq_length = st_model.max_seq_length, kept
    try:
        rendered = st_model.preprocess([long_text], prompt=QUERY_PROMPT)["input_ids"][0].tolist()
        want = st_model.encode([long_text], prompt_name="query", convert_to_numpy=True)
    finally:
        st_model.max_seq_length = saved
    assert len(rendered) == kept < len(st_model.tokenizer(long_text)["input_ids"])
    _close(got, want)
    with pytest.raises(ValueError, match=r"^input\[0\]: "):
        scorer.embed([long_text])  # not asked to cut: refused, naming it


def test_the_sentence_transformer_class_encodes_as_sentence_transformers(pair):
    from prefixscore import SentenceTransformer

    st_model, scorer, _ = pair
    ours = SentenceTransformer(scorer)
    for kwargs in ({"prompt_name": "query"}, {"truncate_dim": 8, "normalize_embeddings": True}):
        np.testing.assert_allclose(ours.encode(TEXTS, **kwargs), st_model.encode(TEXTS, **kwargs), atol=ATOL, rtol=0)


def test_a_checkpoint_saved_without_modality_config_encodes_text(pairs, tmp_path):
    """As older releases saved it (no modality_config), the same checkpoint embeds its texts as
    text, in sentence-transformers 6.2 and here, though its tokenizer has a chat template."""
    import shutil

    import sentence_transformers as st
    from conftest import ONE_SHAPE_BUCKETS

    _, _, path = pairs("last")
    older = tmp_path / "older"
    shutil.copytree(path, older)
    config = json.loads((older / "sentence_bert_config.json").read_text())
    config.pop("modality_config")
    config.pop("module_output_name")  # saved with modality_config, by the same release
    config.pop("processing_kwargs", None)
    (older / "sentence_bert_config.json").write_text(json.dumps(config))
    st_model = st.SentenceTransformer(str(older), device="cpu")
    assert st_model.preprocess(["hello"])["modality"] == "text"
    scorer = Scorer.load(str(older), buckets=ONE_SHAPE_BUCKETS)
    assert scorer.model.pooling.chat is None
    _close(scorer.embed(TEXTS, prompt_name="query"), st_model.encode(TEXTS, prompt_name="query"))


def test_the_structured_message_format_renders_as_sentence_transformers_renders_it(pairs, tmp_path):
    """format structured (a message's content a list of typed parts), under a template that reads
    such parts (as a multimodal processor's does; SmolLM2's reads strings only): the same
    conversations, the same embeddings."""
    import shutil

    import sentence_transformers as st
    from conftest import ONE_SHAPE_BUCKETS

    _, _, path = pairs("last")
    structured = tmp_path / "structured"
    shutil.copytree(path, structured)
    config = json.loads((structured / "sentence_bert_config.json").read_text())
    config["modality_config"]["message"]["format"] = "structured"
    (structured / "sentence_bert_config.json").write_text(json.dumps(config))
    (structured / "chat_template.jinja").write_text(STRUCTURED_TEMPLATE)
    st_model = st.SentenceTransformer(str(structured), device="cpu")
    assert st_model[0].input_formatter.message_format == "structured"
    scorer = Scorer.load(str(structured), buckets=ONE_SHAPE_BUCKETS)
    assert scorer.model.pooling.chat.format == "structured"
    _close(scorer.embed(TEXTS, prompt_name="query"), st_model.encode(TEXTS, prompt_name="query"))


def test_every_surface_serves_rendered_embeddings(pairs, capsys):
    """HTTP /v1/embeddings and /embed, gRPC Embed and EmbedStream (its pinned prefix the rendered
    prompt's run), `prefixscore embed`, batch lines, and /v1/models naming the modality."""
    import httpx
    from helpers.service import server_config

    from prefixscore import cli
    from prefixscore.client import ScoreClient
    from prefixscore.offline.inprocess import ScorerBackend
    from prefixscore.offline.lines import parse
    from prefixscore.service.process import ServerThread

    st_model, scorer, _ = pairs("last")
    query = st_model.encode(TEXTS, prompt_name="query")
    document = st_model.encode(TEXTS, prompt_name="document")
    with ServerThread(server_config(scorer, http_port=0, template="none")) as srv:
        url = f"http://127.0.0.1:{srv.server.http_port}"
        body = httpx.post(f"{url}/v1/embeddings", json={"input": TEXTS, "prompt_name": "query"}, timeout=120)
        assert body.status_code == 200, body.text
        _close([d["embedding"] for d in body.json()["data"]], query)
        tei = httpx.post(f"{url}/embed", json={"inputs": TEXTS, "prompt_name": "document"}, timeout=120)
        _close(tei.json(), document)
        card = httpx.get(f"{url}/v1/models", timeout=30).json()["data"][0]
        assert card["embedding_modality"] == "message"
        with ScoreClient(srv.target) as client:
            _close(client.embed(TEXTS, prompt_name="query").embeddings, query)
            assert client.model_info().embedding_modality == "message"
            with client.embed_stream(prompt_name="query") as stream:
                head = st_model.preprocess(["0", "1 2 3 4"], prompt=QUERY_PROMPT)["input_ids"].tolist()
                common = next(i for i, (a, b) in enumerate(zip(*head, strict=True)) if a != b)
                assert stream.prefix_tokens == common - 1
                _close(stream.send(TEXTS), query)
        assert cli.main(["embed", "--target", srv.target, "-i", TEXTS[0], "--prompt-name", "document"]) == 0
        _close([json.loads(capsys.readouterr().out)], document[:1])
    lines = [
        parse(1, json.dumps({"custom_id": "q", "url": "/v1/embeddings", "body": {"input": TEXTS}}).encode()),
        parse(
            2,
            json.dumps(
                {
                    "custom_id": "d",
                    "url": "/v1/embeddings",
                    "body": {"input": TEXTS, "prompt_name": "document", "encoding_format": "base64"},
                }
            ).encode(),
        ),  # noqa: E501
    ]
    out = {o["custom_id"]: o["response"]["body"]["data"] for o in ScorerBackend(scorer).answer([lines])}
    _close([d["embedding"] for d in out["q"]], query)
    _close([np.frombuffer(base64.b64decode(d["embedding"]), "<f4") for d in out["d"]], document)
