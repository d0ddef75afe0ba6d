"""The rerank kind (Cohere/Jina/vLLM `/v1/rerank`, gRPC Rerank): documents scored by the reranker
template's prompt (engine/requests/templates.py), the prefix everything up to the document and
each item a document and the prompt's suffix, documents cut to fit as asked; the result is the
documents ranked by relevance."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from prefixscore.engine.loop.request import TokenizedRequest
from prefixscore.engine.requests import heads
from prefixscore.engine.requests.answers import for_head
from prefixscore.engine.requests.invalid_input import InvalidInput
from prefixscore.engine.requests.kind import Done
from prefixscore.engine.requests.score import Validated
from prefixscore.engine.requests.templates import Ranked, RerankTemplate, ranked
from prefixscore.engine.requests.truncation import TRUNCATE, TRUNCATION_SIDES, Truncation, choice, count, cut_items
from prefixscore.engine.requests.validation import RequestTokenizer


@dataclasses.dataclass
class RerankInput:
    """A rerank request (Cohere/Jina/vLLM fields) as a transport received it."""

    query: object
    documents: object  # texts
    instruction: str | None = None
    top_n: int | None = None
    return_documents: bool = True
    max_tokens_per_doc: int | None = None
    truncate: str = "end"  # documents: Cohere's default is to cut long ones
    truncation_side: str = "right"  # the side a cut document loses tokens from: "right" (its end) or "left"
    check_tokenization: bool = False


@dataclasses.dataclass(frozen=True)
class ValidatedRerank:
    scored: Validated
    documents: list[str]
    top_n: int | None

    @property
    def requests(self) -> tuple[TokenizedRequest, ...]:
        return self.scored.requests

    @property
    def prompt_tokens(self) -> int:
        return self.scored.prompt_tokens


class RerankKind:
    """Rerank (see the module doc). `template`: the model's reranker prompt (None: no rerank;
    `no_template` says why, for a model with a tokenizer). Result: the documents ranked, highest
    relevance first (the `top_n` first when given)."""

    name = "rerank"
    input_type = RerankInput

    def __init__(self, requests: RequestTokenizer, template: RerankTemplate | None, no_template: str = "") -> None:
        self.requests = requests
        self.template = template
        self.no_template = no_template

    def plan(self, inp: RerankInput) -> ValidatedRerank:
        """A rerank request -> the template's prompt in token ids (prefix = everything up to the
        document; item = document + suffix), documents cut to fit as asked."""
        template, requests = self.template, self.requests
        if template is None and self.no_template:
            raise InvalidInput("template", self.no_template, precondition=True)
        if template is None:
            raise InvalidInput("documents", "the model has no tokenizer, so it has no reranker template")
        if not isinstance(inp.query, str):
            raise InvalidInput("query", "must be text")
        if not isinstance(inp.documents, (list, tuple)) or not all(isinstance(d, str) for d in inp.documents):
            raise InvalidInput("documents", "must be a list of strings")
        for j, doc in enumerate(inp.documents):
            if not doc:
                raise InvalidInput(f"documents[{j}]", "the document is empty")
        if inp.instruction and not template.record.takes_instruction:
            raise InvalidInput(
                "instruction", f"the {template.name} template's prompt takes no instruction; put it in the query"
            )
        truncate = choice("truncate", inp.truncate, TRUNCATE)
        side = choice("truncation_side", inp.truncation_side, TRUNCATION_SIDES)
        per_doc = count("max_tokens_per_doc", inp.max_tokens_per_doc)
        top_n = count("top_n", inp.top_n)
        if not inp.query:
            raise InvalidInput("query", "the query is empty")
        if len(inp.query) > requests.limits.max_text_chars:
            limit = requests.limits.max_text_chars
            raise InvalidInput("query", f"text of {len(inp.query)} characters exceeds the limit of {limit}")
        prompt = template.prompt(inp.query, inp.instruction)
        prefix, suffix = prompt.prefix_ids, prompt.suffix_ids
        texts = [template.document_text(d) for d in inp.documents]
        cutting = truncate == "end" or per_doc is not None
        docs = requests.item_ids(texts, "text", field="documents", truncating=cutting)
        joined = None
        if inp.check_tokenization and docs:
            pairs = [(prompt.prefix, t + prompt.suffix) for t in texts]
            joined = requests.joined_differs(pairs, [prefix + d + suffix for d in docs])
        start = len(requests.start_ids)
        room = requests.room(start + len(prefix)) - len(suffix)
        if room < 1:
            raise InvalidInput("query", f"the prompt is {start + len(prefix)} tokens and leaves no room for a document")
        report = Truncation()
        if per_doc is not None and per_doc < room:
            room, truncate = per_doc, "end"  # an explicit per-document budget always cuts
        if truncate == "end":
            docs, report = cut_items(docs, room, side, template.lead_ids)
        else:  # name the document, not the assembled item
            over = np.flatnonzero(docs.lengths > room)
            if over.size:
                j = int(over[0])
                raise InvalidInput(
                    f"documents[{j}]", f"{docs.lengths[j]} tokens, over the {room} that fit (truncate none)"
                )
        asked = heads.for_rerank(requests.head, template.label_ids, template.reads_logit)
        req = requests.assemble(prefix, docs.with_suffix(suffix), asked.label_ids, for_head(asked), False)
        return ValidatedRerank(Validated(req, report, joined), list(inp.documents), top_n)

    def answer(self, plan: ValidatedRerank, done: Sequence[Done]) -> list[Ranked]:
        (scores,) = done
        return ranked(scores.answer, plan.top_n)
