"""The published reranker records against their reference code, `--template auto` on checkpoints
shaped like the published ones, instructions, truncation sides and the known-answer check.

Each reference is transcribed from its authors' code (the Qwen3-Reranker model card's
`process_inputs`; mixedbread's `mxbai_rerank_v2.py` `prepare_inputs`, as vLLM's test adapts it;
FlagEmbedding's `get_inputs` of `FlagLLMReranker` on the bge-reranker-v2-gemma model card) and run
on a tokenizer built offline: SmolLM2's byte-level BPE with ChatML's added tokens (the shape of
Qwen's) for the ChatML records, and a SentencePiece-shaped BPE trained here ("▁" for spaces, a BOS
it adds, as Gemma's) for bge-reranker-v2-gemma, whose relevance is also checked against a tiny
random Gemma in transformers (the raw logit of "Yes", squashed by a sigmoid).
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import time
from collections.abc import Iterator

import numpy as np
import pytest
import torch
from conftest import ONE_SHAPE_BUCKETS, make_torch_model
from helpers.service import scrape, server_config, wait_for

from prefixscore import Scorer
from prefixscore.engine.requests.invalid_input import InvalidInput
from prefixscore.engine.requests.rerank import RerankInput, RerankKind
from prefixscore.engine.requests.score import ScoreInput
from prefixscore.engine.requests.template_choice import Checkpoint, recognize
from prefixscore.engine.requests.templates import RECORDS, RerankTemplate
from prefixscore.model import presets
from prefixscore.model.loader import load_model
from prefixscore.service import template_check
from prefixscore.service.process import ServerThread
from prefixscore.telemetry.logs import JsonFormatter

QUERY = "What is the capital of France?"
DOCS = ["Paris is the capital of France.", "Bananas are yellow.", " (leading) space and 中文", "Yes? No."]
INSTRUCTION = "Given a question, find the passage that answers it"


# ---- the references, transcribed from their authors' code ----------------------------------------
# FlagEmbedding's default `prompt` of get_inputs (the BAAI/bge-reranker-v2-gemma model card)
FLAG_PROMPT = (
    "Given a query A and a passage B, determine whether the passage contains an answer to the query by "
    "providing a prediction of either 'Yes' or 'No'."
)
# Qwen3-Reranker's model card, format_instruction's default
QWEN3_DEFAULT_INSTRUCTION = "Given a web search query, retrieve relevant passages that answer the query"


def prepare_for_model(first: list[int], second: list[int], max_length: int | None = None) -> list[int]:
    """transformers 4's tokenizer.prepare_for_model(first, second, truncation="only_second",
    add_special_tokens=False): the two joined, the second cut to max_length (transformers 5,
    installed here, has no prepare_for_model)."""
    if max_length is not None and len(first) + len(second) > max_length:
        second = second[: max(0, max_length - len(first))]
    return first + second


def qwen3_model_card(tok, query: str, doc: str, instruction: str | None = None) -> list[int]:
    """Qwen3-Reranker's model card: format_instruction, then process_inputs."""
    prefix = (
        "<|im_start|>system\nJudge whether the Document meets the requirements based on the Query and the "
        'Instruct provided. Note that the answer can only be "yes" or "no".<|im_end|>\n<|im_start|>user\n'
    )
    suffix = "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
    if instruction is None:
        instruction = QWEN3_DEFAULT_INSTRUCTION
    pair = f"<Instruct>: {instruction}\n<Query>: {query}\n<Document>: {doc}"
    prefix_tokens = tok.encode(prefix, add_special_tokens=False)
    suffix_tokens = tok.encode(suffix, add_special_tokens=False)
    ids = tok([pair], padding=False, truncation="longest_first", return_attention_mask=False, max_length=8192)
    return prefix_tokens + ids["input_ids"][0] + suffix_tokens


# mixedbread-ai/mxbai-rerank, mxbai_rerank/mxbai_rerank_v2.py, class MxbaiRerankV2's attributes as
# published (https://github.com/mixedbread-ai/mxbai-rerank/blob/main/mxbai_rerank/mxbai_rerank_v2.py)
MXBAI_SEP = "\n"
MXBAI_INSTRUCTION_PROMPT = "instruction: {instruction}"
MXBAI_QUERY_PROMPT = "query: {query}"
MXBAI_DOC_PROMPT = "document: {document}"
MXBAI_TASK_PROMPT = "You are a search relevance expert who evaluates how well documents match search queries. For each query-document pair, carefully analyze the semantic relationship between them, then provide your binary relevance judgment (0 for not relevant, 1 for relevant).\nRelevance:"  # noqa: E501
MXBAI_CHAT_TEMPLATE = {
    "prefix": "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n<|im_start|>user\n",  # noqa: E501
    "suffix": "<|im_end|>\n<|im_start|>assistant\n",
}


def mxbai_v2(tok, query: str, doc: str, instruction: str | None = None) -> list[int]:
    """mixedbread's MxbaiRerankV2.prepare_inputs (no length limit reached) and concat_input_ids."""

    def ids(x: str) -> list[int]:
        return tok(x, return_tensors=None, add_special_tokens=False)["input_ids"]

    instruction_prompt = MXBAI_INSTRUCTION_PROMPT.format(instruction=instruction) if instruction else None
    query_prompt = MXBAI_QUERY_PROMPT.format(query=query)
    if instruction_prompt:
        query_prompt = "".join([instruction_prompt, MXBAI_SEP, query_prompt])
    item = prepare_for_model(ids(query_prompt), ids(MXBAI_SEP) + ids(MXBAI_DOC_PROMPT.format(document=doc)))
    return (
        ids(MXBAI_CHAT_TEMPLATE["prefix"])
        + item
        + ids(MXBAI_SEP)
        + ids(MXBAI_TASK_PROMPT)
        + ids(MXBAI_CHAT_TEMPLATE["suffix"])
    )


def flag_llm_reranker(tok, query: str, doc: str, prompt: str | None = None, max_length: int = 1024) -> list[int]:
    """FlagEmbedding's get_inputs (FlagLLMReranker, the bge-reranker-v2-gemma model card)."""
    if prompt is None:
        prompt = FLAG_PROMPT
    sep = "\n"
    prompt_inputs = tok(prompt, return_tensors=None, add_special_tokens=False)["input_ids"]
    sep_inputs = tok(sep, return_tensors=None, add_special_tokens=False)["input_ids"]
    query_inputs = tok(
        f"A: {query}", return_tensors=None, add_special_tokens=False, max_length=max_length * 3 // 4, truncation=True
    )
    passage_inputs = tok(
        f"B: {doc}", return_tensors=None, add_special_tokens=False, max_length=max_length, truncation=True
    )
    item = prepare_for_model(
        [tok.bos_token_id] + query_inputs["input_ids"], sep_inputs + passage_inputs["input_ids"], max_length
    )
    return item + sep_inputs + prompt_inputs


# ---- helpers ---------------------------------------------------------------------------------------
def bound(scorer: Scorer, name: str) -> RerankKind:
    """The scorer's rerank kind with the record `name` (as `--template name` serves it)."""
    return RerankKind(scorer.requests, RerankTemplate(name, scorer.model.tokenizer))


def prompt_ids(
    rerank: RerankKind, docs: list[str], instruction: str | None = None, query: str = QUERY, **options
) -> list[list[int]]:
    req = rerank.plan(RerankInput(query, docs, instruction, **options)).scored.request
    return [list(req.prefix) + item for item in req.items]


def gemma_shaped_tokenizer():
    """A SentencePiece-shaped BPE as Gemma's: spaces as "▁", no pre-tokenizer, a BOS added in
    front; "Yes" one token. Trained here in under a second (no download)."""
    from tokenizers import Tokenizer, decoders, models, normalizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    # words apart (no merge spans two): the prompts split into many tokens, as a real vocabulary's would
    words = " ".join(["A: B:", QUERY, *DOCS, FLAG_PROMPT]).split()
    corpus = ["Yes", "No"] * 20 + words + [" " + w for w in words]
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.normalizer = normalizers.Replace(" ", "▁")
    tok.decoder = decoders.Replace("▁", " ")
    alphabet = sorted(set("".join(corpus).replace(" ", "▁")) | set("\n▁"))
    tok.train_from_iterator(
        corpus,
        trainers.BpeTrainer(
            vocab_size=300, special_tokens=["<pad>", "<eos>", "<bos>", "<unk>"], initial_alphabet=alphabet
        ),
    )
    bos = tok.token_to_id("<bos>")
    tok.post_processor = processors.TemplateProcessing(
        single="<bos> $A", pair="<bos> $A $B", special_tokens=[("<bos>", bos)]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>", unk_token="<unk>"
    )


def checkpoint(path, family: str, tokenizer, name_or_path: str = "", **overrides):
    """A tiny random checkpoint of `family` with `tokenizer`, saved in `path` (its name matters)."""
    make_torch_model(family, **overrides).save_pretrained(path)
    tokenizer.save_pretrained(path)
    if name_or_path:  # as published configs carry it
        config = json.loads((path / "config.json").read_text())
        (path / "config.json").write_text(json.dumps({**config, "_name_or_path": name_or_path}))
    return path


@pytest.fixture(scope="module")
def bge(tmp_path_factory):
    """A tiny random Gemma named as the published reranker, loaded in process (`auto`)."""
    hf = gemma_shaped_tokenizer()
    path = checkpoint(tmp_path_factory.mktemp("bge") / "bge-reranker-v2-gemma", "gemma", hf, seed=5)
    torch_model = make_torch_model("gemma", seed=5)
    return hf, torch_model, Scorer.load(str(path), buckets=ONE_SHAPE_BUCKETS)


# ---- the records against their references ----------------------------------------------------------
@pytest.mark.parametrize("instruction", [None, INSTRUCTION])
def test_qwen3_record_renders_the_model_cards_token_ids(tiny_scorer, instruction):
    tok = tiny_scorer.model.tokenizer.hf
    ours = prompt_ids(bound(tiny_scorer, "qwen3-reranker"), DOCS, instruction)
    assert ours == [qwen3_model_card(tok, QUERY, d, instruction) for d in DOCS]
    # compute_logits: log_softmax over [no, yes] of the last logits, exp of yes's: our label softmax
    assert RerankTemplate("qwen3-reranker", tiny_scorer.model.tokenizer).label_ids == (
        tok.convert_tokens_to_ids("yes"),
        tok.convert_tokens_to_ids("no"),
    )


@pytest.mark.parametrize(
    "instruction, query",
    [
        (None, QUERY),
        (INSTRUCTION, QUERY),
        # trailing spaces: tokenized with the "\n" after them they would be one whitespace token; the
        # reference tokenizes the query and the separator apart
        (None, "capital of France?  "),
    ],
)
def test_mxbai_record_renders_mixedbreads_token_ids(tiny_scorer, instruction, query):
    tok = tiny_scorer.model.tokenizer.hf
    ours = prompt_ids(bound(tiny_scorer, "mxbai-rerank-v2"), DOCS, instruction, query)
    assert ours == [mxbai_v2(tok, query, d, instruction) for d in DOCS]


def test_mxbai_relevance_is_the_sigmoid_of_the_difference_of_the_label_logits(tiny_scorer):
    """_compute_scores: sigmoid(logit("1") - logit("0")) at the last token. The reference: each
    label's full-vocabulary probability at the reference's last token (log p1 - log p0 = l1 - l0)."""
    tok = tiny_scorer.model.tokenizer.hf
    one, zero = (tok("1", add_special_tokens=False)["input_ids"][0], tok("0", add_special_tokens=False)["input_ids"][0])
    req = bound(tiny_scorer, "mxbai-rerank-v2").plan(RerankInput(QUERY, DOCS)).scored.request
    got = RerankTemplate.relevance(tiny_scorer.score_requests([req])[0])
    for j, doc in enumerate(DOCS):
        ids = mxbai_v2(tok, QUERY, doc)
        p1, p0 = tiny_scorer.score(ids[:-1], [ids[-1:]], [one, zero])[0]
        np.testing.assert_allclose(got[j], 1 / (1 + np.exp(-(np.log(p1) - np.log(p0)))), rtol=1e-5)


def test_bge_gemma_record_is_flagembeddings_prompt_and_relevance(bge):
    """Recognized from the checkpoint; the token ids of FlagEmbedding's get_inputs (its `prompt`
    argument is the instruction); relevance = sigmoid of the "Yes" logit at the last token, as
    FlagLLMReranker.compute_score(normalize=True), against transformers' forward pass."""
    hf, torch_model, scorer = bge
    assert scorer.template_choice.template == "bge-reranker-v2-gemma"
    assert "recognized" in scorer.template_choice.reason and "GemmaForCausalLM" in scorer.template_choice.reason
    for prompt in (None, "Does passage B answer query A? Yes or No."):
        want = [flag_llm_reranker(hf, QUERY, d, prompt) for d in DOCS]
        assert prompt_ids(scorer.kinds["rerank"], DOCS, prompt) == want
    yes_loc = hf("Yes", add_special_tokens=False)["input_ids"][0]
    docs = DOCS[:3]  # their items fit one device call: one executable compiled
    got = {r.index: r.relevance_score for r in scorer.rerank(QUERY, docs)}
    with torch.no_grad():
        logits = [torch_model(torch.tensor([flag_llm_reranker(hf, QUERY, d)])).logits[0, -1, yes_loc] for d in docs]
    want = torch.stack(logits).float().sigmoid().numpy()
    np.testing.assert_allclose([got[j] for j in range(len(docs))], want, atol=1e-5)
    assert np.ptp(want) > 1e-3  # the documents' scores differ: a constant would not pass by luck


# ---- recognition -------------------------------------------------------------------------------------
SMOLLM2 = None  # SmolLM2's tokenizer (ChatML added tokens, like Qwen's), loaded once


def chatml_tokenizer():
    global SMOLLM2
    if SMOLLM2 is None:
        from prefixscore.model.tokenizer import load_tokenizer

        SMOLLM2 = load_tokenizer(presets.smollm2_tokenizer_dir()).hf
    return SMOLLM2


@pytest.mark.parametrize(
    "directory, family, tokenizer, name_or_path, overrides, chosen, why",
    [
        ("Qwen3-Reranker-0.6B", "qwen3", "chatml", "", {}, "qwen3-reranker", "recognized"),
        # vLLM's conversion to one score row, found by config.json's _name_or_path
        (
            "model",
            "qwen3",
            "chatml",
            "tomaarsen/Qwen3-Reranker-0.6B-seq-cls",
            dict(classifier=True, num_labels=1),
            "qwen3-reranker",
            "a one-logit classifier",
        ),
        ("mxbai-rerank-base-v2", "qwen2", "chatml", "", {}, "mxbai-rerank-v2", "recognized"),
        ("mxbai-rerank-large-v2", "qwen2", "chatml", "", {}, "mxbai-rerank-v2", "Qwen2ForCausalLM"),
        ("bge-reranker-v2-gemma", "gemma", "gemma", "", {}, "bge-reranker-v2-gemma", "recognized"),
        # the name with another checkpoint: nothing is guessed
        ("bge-reranker-v2-gemma", "qwen3", "chatml", "", {}, None, "its decoder is qwen3"),
        ("Qwen3-Reranker-4B", "qwen3", "gemma", "", {}, None, "lacks the added tokens"),
        ("Qwen3-Reranker-8B", "qwen3", "chatml", "", dict(classifier=True, num_labels=2), None, "classifier of 2"),
        ("my-qwen3-chat", "qwen3", "chatml", "", {}, None, "no published reranker is recognized"),
    ],
)
def test_auto_recognizes_each_published_reranker_from_a_checkpoint_shaped_like_it(
    tmp_path, directory, family, tokenizer, name_or_path, overrides, chosen, why
):
    tok = chatml_tokenizer() if tokenizer == "chatml" else gemma_shaped_tokenizer()
    path = checkpoint(tmp_path / directory, family, tok, name_or_path, **overrides)
    choice = recognize(Checkpoint.of(load_model(str(path))))
    assert choice.template == chosen and why in choice.reason, choice


def test_a_preset_is_recognized_as_nothing_and_its_rerank_is_refused_naming_the_flag(tiny_scorer):
    """tiny-qwen3 (random, SmolLM2's tokenizer) under `auto`: rerank refused before any device
    work, naming --template; score serves as ever."""
    scorer = Scorer(tiny_scorer.model, tiny_scorer.engine)
    assert scorer.template is None and scorer.template_choice.template is None
    with pytest.raises(InvalidInput, match="^template: the server has no reranker template: .*--template NAME") as err:
        scorer.rerank(QUERY, DOCS)
    assert err.value.precondition
    assert len(scorer.score(QUERY, DOCS, [17, 18])) == len(DOCS)


# ---- instructions ----------------------------------------------------------------------------------
# where each reference writes the instruction and its default when none is given (None: the
# prompt takes none): Qwen3's format_instruction in the user turn (the prefix), FlagEmbedding's
# `prompt` after the passage (the suffix), mixedbread's instruction_prompt before the query, with
# no default; `chat` is Qwen3-Reranker's user turn in the model's chat template; `none` takes none
INSTRUCTION_PLACES: dict[str, tuple[str, str | None] | None] = {
    "qwen3-reranker": ("prefix", QWEN3_DEFAULT_INSTRUCTION),
    "bge-reranker-v2-gemma": ("suffix", FLAG_PROMPT),
    "mxbai-rerank-v2": ("prefix", None),
    "chat": ("prefix", QWEN3_DEFAULT_INSTRUCTION),
    "none": None,
}


def test_instructions_follow_the_record(tiny_scorer):
    """Where each record writes an instruction (and its default); a prompt without one refuses
    it, naming the field, before any device work."""
    tok = tiny_scorer.model.tokenizer
    assert set(RECORDS) == set(INSTRUCTION_PLACES)  # a new record states its reference's place here
    for name, place in INSTRUCTION_PLACES.items():
        template = RerankTemplate(name, tok)
        if place is None:
            with pytest.raises(InvalidInput, match=f"^instruction: the {name} template's prompt takes no"):
                bound(tiny_scorer, name).plan(RerankInput(QUERY, DOCS, "an instruction"))
            continue
        where, default_instruction = place
        other = "prefix" if where == "suffix" else "suffix"
        given = template.prompt(QUERY, "INSTR")
        default = template.prompt(QUERY, None)
        assert "INSTR" in getattr(given, where) and "INSTR" not in getattr(given, other)
        if default_instruction:
            assert default_instruction in getattr(default, where)
        else:  # mxbai: no instruction line at all without one (instruction_prompt + sep)
            assert getattr(default, where) == getattr(given, where).replace(
                MXBAI_INSTRUCTION_PROMPT.format(instruction="INSTR") + MXBAI_SEP, ""
            )


# ---- truncation sides --------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["qwen3-reranker", "bge-reranker-v2-gemma"])
def test_rerank_cuts_a_document_from_the_side_asked(tiny_scorer, name):
    """right: the document's first tokens stay; left: its last, after the record's document
    marker ("B: " stays a bge document's opening)."""
    rerank = bound(tiny_scorer, name)
    tok = tiny_scorer.model.tokenizer
    doc = "one two three four five six seven eight nine ten"
    whole = tok.encode(rerank.template.document_text(doc))
    suffix = rerank.template.prompt(QUERY, None).suffix_ids
    right = rerank.plan(RerankInput(QUERY, [doc], max_tokens_per_doc=4)).scored
    left = rerank.plan(RerankInput(QUERY, [doc], max_tokens_per_doc=4, truncation_side="left")).scored
    assert list(right.request.items[0]) == whole[:4] + suffix
    lead = rerank.template.lead_ids
    kept = 0
    while kept < len(lead) and whole[kept] == lead[kept]:
        kept += 1
    assert list(left.request.items[0]) == whole[:kept] + whole[len(whole) - (4 - kept) :] + suffix
    assert (name == "bge-reranker-v2-gemma") == (kept > 0)
    assert right.truncation == left.truncation and left.truncation.items == (0,)
    with pytest.raises(InvalidInput, match="^truncation_side: 'middle' is not one of right, left"):
        rerank.plan(RerankInput(QUERY, [doc], truncation_side="middle"))


def test_score_cuts_an_item_from_the_side_asked(tiny_scorer):
    score = tiny_scorer.kinds["score"]
    item = list(range(1, 601))  # over the 512-token context
    room = tiny_scorer.requests.max_sequence_tokens - 3
    right = score.plan(ScoreInput([7, 8, 9], [item], [5], truncate="end")).request
    left = score.plan(ScoreInput([7, 8, 9], [item], [5], truncate="end", truncation_side="left")).request
    assert list(right.items[0]) == item[:room] and list(left.items[0]) == item[-room:]


# ---- the known-answer check at start -------------------------------------------------------------------
CHECK_GAUGE = "prefixscore_template_check_passed{template=qwen3-reranker}"


def model_relevance(scorer: Scorer) -> list[tuple[str, str, str, float, float]]:
    """Each built-in triple with this model's relevance of its two documents, reranked in process
    (apart from any server): (query, first, second, relevance of first, relevance of second)."""
    out = []
    for query, first, second in template_check.TRIPLES:
        relevance = {r.index: r.relevance_score for r in scorer.rerank(query, [first, second])}
        out.append((query, first, second, relevance[0], relevance[1]))
    return out


@contextlib.contextmanager
def service_log() -> Iterator[list[dict]]:
    """The service logger's events as the JSON lines an operator reads (telemetry/logs.py)."""
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(JsonFormatter())
    logger = logging.getLogger("prefixscore.service")
    level = logger.level
    logger.setLevel(logging.INFO)  # a pass is said at info, under the suite's usual level
    logger.addHandler(handler)
    events: list[dict] = []
    try:
        yield events
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
        events.extend(json.loads(line) for line in stream.getvalue().splitlines())


def test_the_known_answer_check_fails_where_the_model_ranks_a_triple_wrong(tiny_scorer, monkeypatch):
    """The failure path: triples where this random model ranks the last one's documents the wrong
    way round (its "relevant" document is the one the model scores lower, computed in process), the
    first two the right way. The check must fail: gauge 0 and a `template_check` warning carrying
    each triple's (relevant, irrelevant) relevance, the model's own."""
    measured = model_relevance(tiny_scorer)
    triples, want = [], []
    for j, (query, first, second, r_first, r_second) in enumerate(measured):
        right = (r_first > r_second) == (j < len(measured) - 1)  # the last triple wrong
        triples.append((query, first, second) if right else (query, second, first))
        want.append((r_first, r_second) if right else (r_second, r_first))
    assert [a > b for a, b in want] == [True] * (len(want) - 1) + [False]
    monkeypatch.setattr(template_check, "TRIPLES", tuple(triples))
    with service_log() as events, ServerThread(server_config(tiny_scorer, warmup=True)) as srv:
        wait_for(lambda: CHECK_GAUGE in scrape(srv.server.metrics_port), what="the template check")
        assert scrape(srv.server.metrics_port)[CHECK_GAUGE] == 0.0
    (line,) = [e for e in events if e["event"] == "template_check"]
    assert (line["level"], line["template"], line["passed"]) == ("warning", "qwen3-reranker", False), line
    # the log rounds to 4 places; the scores are the ones reranked in process (one device path)
    np.testing.assert_allclose(line["relevance"], want, rtol=0, atol=1e-4)


def test_the_known_answer_check_sets_its_gauge_and_the_model_description_says_why(tiny_scorer, monkeypatch):
    """After the warm-up the built-in triples are reranked once through the server's own path; the
    gauge says the relevant document won each. A random model wins by chance, so the triples here
    are the built-in ones each ordered as this model ranks its two documents (computed apart, in
    process): the check must pass. GetModelInfo and /v1/models report the template and why (here:
    named). The engine is the session's: its warm-up compiles only the shapes no test used yet."""
    import httpx

    from prefixscore.client import ScoreClient

    ordered = [
        (query, first, second) if r_first > r_second else (query, second, first)
        for query, first, second, r_first, r_second in model_relevance(tiny_scorer)
    ]
    monkeypatch.setattr(template_check, "TRIPLES", tuple(ordered))
    with service_log() as events, ServerThread(server_config(tiny_scorer, warmup=True, http_port=0)) as srv:
        wait_for(lambda: CHECK_GAUGE in scrape(srv.server.metrics_port), what="the template check")
        assert scrape(srv.server.metrics_port)[CHECK_GAUGE] == 1.0
        card = httpx.get(f"http://127.0.0.1:{srv.server.http_port}/v1/models", timeout=30).json()["data"][0]
        with ScoreClient(srv.target) as client:
            info = client.model_info()
    assert card["template"] == info.template == "qwen3-reranker"
    assert card["template_reason"] == info.template_reason == "named by --template"
    (line,) = [e for e in events if e["event"] == "template_check"]
    assert (line["level"], line["passed"]) == ("info", True) and all(a > b for a, b in line["relevance"]), line
    # without a warm-up (as every other test server) the check does not run: no sample at all, also
    # once a rerank queued after where the check would be has come back
    with ServerThread(server_config(tiny_scorer)) as srv, ScoreClient(srv.target) as client:
        query, first, second = template_check.TRIPLES[0]
        client.rerank(query, [first, second])
        time.sleep(0.5)  # the check's verdict would be set on the server's loop as its calls return
        assert not [k for k in scrape(srv.server.metrics_port) if k.startswith("prefixscore_template_check")]


def test_the_checks_verdict_needs_every_triple():
    assert template_check.verdict([[0.9, 0.1], [0.6, 0.4]]).passed
    assert not template_check.verdict([[0.9, 0.1], [0.4, 0.6]]).passed
    assert not template_check.verdict([[0.5, 0.5]]).passed  # a tie is no win
