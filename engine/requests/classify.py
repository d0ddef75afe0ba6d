"""The classify kind (vLLM's and SGLang's `/v1/classify`): each input scored whole, by a
classifier's head or (a causal LM) the softmax over the configured label tokens. The inputs'
longest common token prefix, rounded down to whole pages of the pool (and leaving every input
at least one token), is the shared prefix, prefilled once; the rest of each input is its item.
Inputs may be conversations, rendered by the chat template (engine/requests/chat.py)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from prefixscore.engine.loop.request import TokenizedRequest
from prefixscore.engine.requests import chat, heads
from prefixscore.engine.requests.answers import for_head
from prefixscore.engine.requests.invalid_input import InvalidInput
from prefixscore.engine.requests.kind import Done
from prefixscore.engine.requests.validation import RequestTokenizer, plain_ints
from prefixscore.engine.runtime.token_rows import TokenRows


@dataclasses.dataclass
class ClassifyInput:
    """A classify request (vLLM's and SGLang's /v1/classify fields) as a transport received it."""

    input: object  # a text, texts, token ids, or token-id lists (None: `messages` instead)
    truncate_prompt_tokens: int | None = None  # keep each input's last n tokens (-1: as many as fit)
    activation: str = "auto"  # a classifier's logits (engine/requests/heads.py)
    labels: Sequence[str] = ()  # a causal LM: the label strings the server was started with
    # instead of `input`: a conversation (a list of {"role", "content"} messages), or several
    # (a list of them: one result each), rendered whole by the model's chat template
    messages: object = None


@dataclasses.dataclass(frozen=True)
class ValidatedClassify:
    """Inputs as one prefix (their longest common run of tokens, in whole pool pages) and one
    item each (the rest of every input)."""

    request: TokenizedRequest
    label_names: tuple[str, ...]
    prompt_tokens: int  # every input whole, start tokens included, as a forward pass of each sees it
    truncated_inputs: tuple[int, ...] = ()  # indices of the inputs truncate_prompt_tokens cut

    @property
    def requests(self) -> tuple[TokenizedRequest, ...]:
        return (self.request,)


def _shared_prefix(inputs: list[list[int]], start: int, page: int) -> int:
    """The inputs' longest common prefix, rounded down (with the start tokens) to whole pages and
    leaving every input a token."""
    shared = min(len(ids) for ids in inputs) - 1
    head = np.asarray(inputs[0])
    for ids in inputs[1:]:  # one array comparison per input
        differ = np.flatnonzero(np.asarray(ids[:shared]) != head[:shared])
        shared = int(differ[0]) if differ.size else shared
    return max(0, (start + shared) // page * page - start)


class ClassifyKind:
    """Classification (see the module doc). Result: [inputs, labels] float32."""

    name = "classify"
    input_type = ClassifyInput

    def __init__(self, requests: RequestTokenizer) -> None:
        self.requests = requests

    def plan(self, inp: ClassifyInput) -> ValidatedClassify:
        requests = self.requests
        asked, names = heads.for_classify(requests.head, inp.labels, inp.activation, requests.label_ids)
        if (inp.input is None) == (inp.messages is None):
            raise InvalidInput("input", "set either input or messages")
        raw = inp.input if inp.messages is None else chat.conversations(requests.tokenizer, inp.messages)
        if isinstance(raw, str) or (isinstance(raw, list) and raw and plain_ints(raw)):
            raw = [raw]
        if not isinstance(raw, list) or not raw:
            raise InvalidInput("input", "must be a string, a list of strings, token ids or a list of token-id lists")
        keep = inp.truncate_prompt_tokens
        if keep is not None and (not isinstance(keep, int) or isinstance(keep, bool) or keep < -1 or keep == 0):
            raise InvalidInput("truncate_prompt_tokens", f"must be a positive integer or -1, got {keep!r}")
        rows = requests.item_ids(raw, field="input", truncating=keep is not None)
        start = list(requests.start_ids)
        inputs = [list(r) for r in rows]
        cut: list[int] = []
        limit = requests.max_sequence_tokens
        if keep is not None:  # vLLM's: the last `keep` tokens of each input (-1: all that fit)
            budget = limit - len(start) if keep == -1 else keep
            for j, ids in enumerate(inputs):
                if len(ids) > budget:
                    inputs[j], cut = ids[len(ids) - budget :], [*cut, j]
        for j, ids in enumerate(inputs):
            if len(start) + len(ids) > limit:
                raise InvalidInput(f"input[{j}]", f"{len(start) + len(ids)} tokens, over the limit of {limit}")
        shared = _shared_prefix(inputs, len(start), requests.limits.page_tokens)
        prompt_tokens = sum(len(start) + len(ids) for ids in inputs)
        items = TokenRows.from_lists([ids[shared:] for ids in inputs])
        try:  # without a shared prefix the inputs are whole sequences (start + input)
            req = requests.assemble(inputs[0][:shared], items, asked.label_ids, for_head(asked), not shared)
        except InvalidInput as err:
            raise InvalidInput(err.field.replace("items", "input", 1), err.message, err.too_large) from err
        return ValidatedClassify(req, names, prompt_tokens, tuple(cut))

    def answer(self, plan: ValidatedClassify, done: Sequence[Done]) -> np.ndarray:
        (scores,) = done
        return scores.answer
