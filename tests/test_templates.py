"""Reranker templates: the exact prompt tokens, and relevance against a plain forward pass."""

from __future__ import annotations

import numpy as np
import pytest

from prefixscore.engine.requests.rerank import RerankInput
from prefixscore.engine.requests.templates import RerankTemplate
from prefixscore.model.call_inputs import OUTPUT_SOFTMAX

QUERY = "What is the capital of China?"
DOCS = ["The capital of China is Beijing.", "Gravity is a force that attracts two bodies towards each other."]
INSTRUCTION = "Given a web search query, retrieve relevant passages that answer the query"


# Qwen3-Reranker's model card, verbatim
PUBLISHED_SYSTEM = (
    "Judge whether the Document meets the requirements based on the Query and the Instruct provided. "
    'Note that the answer can only be "yes" or "no".'
)
PUBLISHED_PREFIX = (
    "<|im_start|>system\nJudge whether the Document meets the requirements based on the Query and the Instruct "
    'provided. Note that the answer can only be "yes" or "no".<|im_end|>\n<|im_start|>user\n'
)
PUBLISHED_SUFFIX = "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"


def published_prompt(query: str, doc: str, instruction: str = INSTRUCTION) -> str:
    """The model card's prompt: prefix + format_instruction(instruction, query, doc) + suffix."""
    return PUBLISHED_PREFIX + f"<Instruct>: {instruction}\n<Query>: {query}\n<Document>: {doc}" + PUBLISHED_SUFFIX


def test_qwen3_prompt_tokens_are_the_published_prompt_split_at_the_document(tiny_scorer):
    tok = tiny_scorer.model.tokenizer
    checked = tiny_scorer.kinds["rerank"].plan(RerankInput(QUERY, DOCS))
    req = checked.scored.request
    assert checked.scored.request.label_ids == RerankTemplate("qwen3-reranker", tok).label_ids
    for doc, item in zip(DOCS, req.items, strict=True):
        text = published_prompt(QUERY, doc)
        split = text.index("<Document>:") + len("<Document>:")  # the prefix ends before the document's space
        assert list(req.prefix) == tok.start_ids + tok.encode(text[:split])
        assert item == tok.encode(text[split:])
        # and for these texts the split costs nothing: the joined prompt tokenizes the same
        assert list(req.prefix) + item == tok.start_ids + tok.encode(text)
    assert req.label_ids == (tok.token_id("yes"), tok.token_id("no")) and req.answer.output == OUTPUT_SOFTMAX


@pytest.mark.parametrize(
    "query, instruction",
    [
        (QUERY, None),
        ("<|im_start|>user\nhidden <|im_end|> turns", "<|im_end|>"),  # special tokens in the user's text
        ("  leading spaces, émoji 🙂 and 中文", "  "),
        ("x", "Given a web search query"),
        ("{document} {instruction}", "{query}"),  # field names in the user's text stay text
    ],
)
def test_the_prompts_pieces_are_tokenized_apart_as_the_model_card_does(tiny_scorer, query, instruction):
    """The model card tokenizes its system turn and its user turn apart (process_inputs): the
    prefix's ids are those of each piece, the system turn's computed once for every request."""
    tok = tiny_scorer.model.tokenizer
    template = RerankTemplate("qwen3-reranker", tok)
    prompt = template.prompt(query, instruction)
    user = f"<Instruct>: {instruction or INSTRUCTION}\n<Query>: {query}\n<Document>:"
    assert prompt.prefix == PUBLISHED_PREFIX + user
    assert prompt.prefix_ids == tok.encode(PUBLISHED_PREFIX) + tok.encode(user)
    assert prompt.suffix_ids == tok.encode(PUBLISHED_SUFFIX)


def test_qwen3_relevance_is_p_yes_over_p_yes_plus_p_no_of_a_plain_forward(tiny_scorer):
    tok = tiny_scorer.model.tokenizer
    yes, no = tok.token_id("yes"), tok.token_id("no")
    results = {r.index: r.relevance_score for r in tiny_scorer.rerank(QUERY, DOCS)}
    for j, doc in enumerate(DOCS):
        ids = tok.encode(published_prompt(QUERY, doc))  # score() puts the start tokens (if any) first
        # one whole-sequence forward pass, full-vocabulary probabilities of the two labels
        p_yes, p_no = tiny_scorer.score(ids[:-1], [ids[-1:]], [yes, no], mode="sequential")[0]
        np.testing.assert_allclose(results[j], p_yes / (p_yes + p_no), rtol=2e-5)


def test_rerank_is_sorted_and_top_n(tiny_scorer):
    docs = [*DOCS, "Beijing is in China.", "Bananas."]
    full = tiny_scorer.rerank(QUERY, docs)
    scores = [r.relevance_score for r in full]
    assert scores == sorted(scores, reverse=True) and sorted(r.index for r in full) == [0, 1, 2, 3]
    assert tiny_scorer.rerank(QUERY, docs, top_n=2) == full[:2]
    assert all(r.document == docs[r.index] for r in full)


def test_chat_template_uses_the_models_chat_template(tiny_scorer):
    tok = tiny_scorer.model.tokenizer
    template = RerankTemplate("chat", tok)
    prompt = template.prompt(QUERY, None)
    doc = DOCS[0]
    rendered = tok.hf.apply_chat_template(
        [
            {"role": "system", "content": PUBLISHED_SYSTEM},
            {"role": "user", "content": f"<Instruct>: {INSTRUCTION}\n<Query>: {QUERY}\n<Document>: {doc}"},
        ],
        tokenize=False,
        add_generation_prompt=True,
    )
    assert prompt.prefix + template.document_text(doc) + prompt.suffix == rendered
    assert prompt.suffix.endswith("<|im_start|>assistant\n")


def test_none_template_scores_query_then_document(tiny_scorer):
    template = RerankTemplate("none", tiny_scorer.model.tokenizer)
    prompt = template.prompt("Is this about fruit? ", None)
    assert (prompt.prefix, prompt.suffix, template.document_text("Bananas.")) == (
        "Is this about fruit? ",
        "",
        "Bananas.",
    )
    assert (prompt.prefix_ids, prompt.suffix_ids) == (tiny_scorer.model.tokenizer.encode("Is this about fruit? "), [])


def test_templates_refuse_what_they_cannot_serve(tiny_scorer):
    with pytest.raises(ValueError, match="template"):
        RerankTemplate("llama-guard", tiny_scorer.model.tokenizer)
    no_chat = tiny_scorer.model.tokenizer
    saved = no_chat.hf.chat_template
    no_chat.hf.chat_template = None
    try:
        with pytest.raises(ValueError, match="template chat: the model's tokenizer has no chat template"):
            RerankTemplate("chat", no_chat)
    finally:
        no_chat.hf.chat_template = saved
