"""Prompts scored whole, token by token: the work of vLLM's `/v1/completions` as scorers call it.

lm-evaluation-harness (`local-completions`), perplexity filters and judges send prompts with
`echo` and `logprobs` and at most one new token: they want the log-probability of every
prompt token given the tokens before it, and perhaps the greedy next token. That is the
likelihood path (engine/likelihood.py) over whole prompts, planned here as one or two
engine requests:

- the prompts' longest common prefix, rounded down to whole pages of the pool (and leaving
  every prompt a token after it), is a shared context: the first prompt runs whole (it gives
  the shared tokens' log-probs), and every other prompt is a continuation over that context,
  which is prefilled once and kept in the prefix cache (a multiple-choice question's
  choices, a k-shot header's questions). The context's own log-probs are kept too
  (`ContextStore`, bounded): a later request over the same context (the next batch of a k-shot
  task) runs every prompt as a continuation;
- without one (or for a single prompt), every prompt runs as a whole sequence.

Either way each position's log-prob is the one a plain forward pass over that prompt gives:
where a prompt's tokens sit in a call does not change them. Validated once, before any device
work: prompt forms, emptiness, the vocabulary, the context, and the options a scorer cannot
honour (more than one new token, several choices, streaming, sampling), each refused by name.
"""

from __future__ import annotations

import collections
import dataclasses
import threading

import numpy as np

from prefixscore.engine.likelihood import ItemLikelihood
from prefixscore.engine.token_rows import TokenRows
from prefixscore.engine.validation import InvalidInput, RequestTokenizer, TokenizedRequest, check_top_logprobs
from prefixscore.model.call_inputs import TOP_LOGPROBS

# vLLM's and OpenAI's default for `max_tokens` when a request leaves it out
DEFAULT_MAX_TOKENS = 16
# host memory a server keeps shared contexts' own log-probs in (ContextStore): 244 bytes a token
# (its float32 log-prob, 20 int64 top ids and 20 float32 log-probs), so about 275,000 context tokens
CONTEXT_STORE_BYTES = 64 << 20


@dataclasses.dataclass
class CompletionsInput:
    """A /v1/completions request as a transport received it (OpenAI's and vLLM's fields)."""

    prompt: object  # a text, texts, token ids, or token-id lists
    echo: bool = False
    logprobs: int | None = None  # None: no logprobs object; 0..TOP_LOGPROBS: that many top tokens
    max_tokens: int | None = DEFAULT_MAX_TOKENS
    add_special_tokens: bool = True  # a text prompt's BOS (vLLM's)
    n: int = 1
    best_of: int | None = None
    stream: bool = False
    temperature: float | None = None
    suffix: str | None = None
    stop: object = None
    logit_bias: object = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    prompt_logprobs: int | None = None


@dataclasses.dataclass(frozen=True)
class CompletionPart:
    """One engine request of a completions request: its items are the prompts at `prompts`
    (indices, in order), each its tokens after the shared context's `shared` (0: whole prompts)."""

    request: TokenizedRequest
    prompts: tuple[int, ...]
    shared: int


@dataclasses.dataclass(frozen=True)
class ContextLogprobs:
    """A shared context's own positions 1 .. n-1 (position 0 has no context)."""

    logprobs: np.ndarray  # [n-1] float32
    top_ids: np.ndarray  # [n-1, TOP_LOGPROBS] int64
    top_logprobs: np.ndarray  # [n-1, TOP_LOGPROBS] float32

    @property
    def nbytes(self) -> int:
        return self.logprobs.nbytes + self.top_ids.nbytes + self.top_logprobs.nbytes


class ContextStore:
    """Shared contexts' own log-probs, kept for the next request over the same context (the next
    batch of a k-shot task): least recently used first out past `max_bytes`. Any thread."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.bytes = 0
        self._kept: collections.OrderedDict[tuple[int, ...], ContextLogprobs] = collections.OrderedDict()
        self._lock = threading.Lock()

    def get(self, context: tuple[int, ...]) -> ContextLogprobs | None:
        with self._lock:
            rows = self._kept.get(context)
            if rows is not None:
                self._kept.move_to_end(context)
            return rows

    def keep(self, context: tuple[int, ...], rows: ContextLogprobs) -> None:
        if rows.nbytes > self.max_bytes:
            return
        with self._lock:
            old = self._kept.pop(context, None)
            self.bytes += rows.nbytes - (old.nbytes if old is not None else 0)
            self._kept[context] = rows
            while self.bytes > self.max_bytes:
                _, dropped = self._kept.popitem(last=False)
                self.bytes -= dropped.nbytes


@dataclasses.dataclass(frozen=True)
class PlannedCompletions:
    prompts: list[np.ndarray]  # each prompt's token ids [n_i] int64
    texts: list[str] | None  # the prompts as sent, when they were texts
    parts: tuple[CompletionPart, ...]
    max_tokens: int  # 0 or 1
    echo: bool
    logprobs: int | None
    context: tuple[int, ...] = ()  # the shared context (none: every prompt runs whole)
    context_rows: ContextLogprobs | None = None  # its own log-probs, when known before the request

    @property
    def prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)


@dataclasses.dataclass(frozen=True)
class PromptLogprobs:
    """Every position of one prompt (natural log, float32 from the device). Position 0 has no
    context: its log-prob is NaN and its top lists are unused."""

    tokens: np.ndarray  # [n] int64
    logprobs: np.ndarray  # [n] float32: log p(token i | tokens before i)
    top_ids: np.ndarray  # [n, TOP_LOGPROBS] int64: the most likely tokens at each position, descending
    top_logprobs: np.ndarray  # [n, TOP_LOGPROBS] float32
    next_top_ids: np.ndarray  # [TOP_LOGPROBS] int64: after the whole prompt (the first is the greedy token)
    next_top_logprobs: np.ndarray  # [TOP_LOGPROBS] float32


def _options(inp: CompletionsInput) -> int:
    """The request's max_tokens (0 or 1) once the options a scorer cannot honour are refused."""
    if inp.max_tokens is None or isinstance(inp.max_tokens, bool) or not isinstance(inp.max_tokens, int):
        raise InvalidInput("max_tokens", f"{inp.max_tokens!r} is not an integer")
    if not 0 <= inp.max_tokens <= 1:
        why = "this server scores prompts: it returns at most one new token (the greedy next one); set 0 or 1"
        default = " (left out, it is 16)" if inp.max_tokens == DEFAULT_MAX_TOKENS else ""
        raise InvalidInput("max_tokens", f"{inp.max_tokens}{default}: {why}")
    if inp.max_tokens == 0 and not inp.echo:
        raise InvalidInput("max_tokens", "0 without echo returns nothing: set echo or ask for one token")
    refused = {
        "n": inp.n not in (None, 1),
        "best_of": inp.best_of not in (None, 1),
        "stream": bool(inp.stream),
        "suffix": bool(inp.suffix),
        "stop": bool(inp.stop),
        "logit_bias": bool(inp.logit_bias),
        "presence_penalty": inp.presence_penalty not in (None, 0),
        "frequency_penalty": inp.frequency_penalty not in (None, 0),
        "repetition_penalty": inp.repetition_penalty not in (None, 1),
        "prompt_logprobs": inp.prompt_logprobs is not None,
        "temperature": inp.max_tokens == 1 and inp.temperature not in (None, 0),
    }
    for field, sent in refused.items():
        if sent:
            why = "use echo with logprobs" if field == "prompt_logprobs" else "this server scores, it does not sample"
            raise InvalidInput(field, f"not supported: {why} (one choice, the greedy next token, no stream)")
    if inp.logprobs is not None:
        check_top_logprobs("logprobs", inp.logprobs)
    return inp.max_tokens


def _prompt_rows(requests: RequestTokenizer, inp: CompletionsInput) -> tuple[TokenRows, list[str] | None]:
    """The prompts' token ids (a text as vLLM encodes a prompt), and their texts when sent as text."""
    raw = inp.prompt
    if isinstance(raw, str) or (isinstance(raw, list) and raw and all(isinstance(t, int) for t in raw)):
        raw = [raw]
    if not isinstance(raw, list) or not raw:
        raise InvalidInput("prompt", "must be a string, a list of strings, token ids or a list of token-id lists")
    if all(isinstance(p, str) for p in raw):
        if len(raw) > requests.limits.max_items:
            raise InvalidInput("prompt", f"{len(raw)} prompts exceed the limit of {requests.limits.max_items}")
        lists = []
        for j, text in enumerate(raw):
            field = "prompt" if len(raw) == 1 else f"prompt[{j}]"
            if not text:
                raise InvalidInput(field, "the prompt is empty")
            try:
                lists.append(requests.prompt_ids(text, inp.add_special_tokens))
            except InvalidInput as err:
                raise InvalidInput(field, err.message, err.too_large) from err
        rows = TokenRows.from_lists(lists)
        empty = np.flatnonzero(rows.lengths == 0)
        if empty.size:
            raise InvalidInput(f"prompt[{int(empty[0])}]", "the prompt has no tokens")
        return rows, list(raw)
    try:
        return requests.item_ids(raw, "ids", field="prompt"), None
    except InvalidInput as err:  # one prompt is `prompt`, not `prompt[0]`
        field = "prompt" if len(raw) == 1 and err.field == "prompt[0]" else err.field
        raise InvalidInput(field, err.message, err.too_large) from err


def _shared_prefix(rows: TokenRows, page_tokens: int) -> int:
    """The prompts' longest common prefix in whole pages, leaving every prompt a token after it."""
    shared = int(rows.lengths.min()) - 1
    first = rows.flat[: rows.offsets[1]]
    for j in range(1, len(rows)):
        lo = int(rows.offsets[j])
        differ = np.flatnonzero(rows.flat[lo : lo + shared] != first[:shared])
        shared = int(differ[0]) if differ.size else shared
    return shared // page_tokens * page_tokens


def plan(requests: RequestTokenizer, inp: CompletionsInput, known: ContextStore | None = None) -> PlannedCompletions:
    """Validate a completions request and plan its engine requests (see the module doc). `known`:
    shared contexts whose own log-probs an earlier request computed."""
    max_tokens = _options(inp)
    requests.check_vocabulary_head()
    rows, texts = _prompt_rows(requests, inp)
    # a prompt may run whole (a row per token in the item region): within an item's limit too
    limit = min(requests.max_sequence_tokens, requests.max_item_tokens)
    over = np.flatnonzero(rows.lengths + max_tokens > limit)
    if over.size:
        j = int(over[0])
        field = "prompt" if len(rows) == 1 else f"prompt[{j}]"
        asked = f" + {max_tokens} new token" if max_tokens else ""
        raise InvalidInput(field, f"{int(rows.lengths[j])} tokens{asked}, over the model's limit of {limit}")
    requests.check_request_tokens(rows.total)
    top = TOP_LOGPROBS if inp.logprobs is None else inp.logprobs
    prompts = [rows.flat[rows.offsets[j] : rows.offsets[j + 1]] for j in range(len(rows))]
    shared = _shared_prefix(rows, requests.limits.page_tokens) if len(rows) > 1 else 0
    if shared < 2:  # whole sequences: no prefix, a row per token of each prompt
        whole = TokenizedRequest((), rows, (), False, True, per_token=True, top_logprobs=top)
        parts = (CompletionPart(whole, tuple(range(len(rows))), 0),)
        return PlannedCompletions(prompts, texts, parts, max_tokens, bool(inp.echo), inp.logprobs)
    context = tuple(int(t) for t in prompts[0][:shared])
    rows_known = known.get(context) if known is not None else None
    # the first prompt runs whole unless the context's own log-probs are known: its rows give them
    first_over = 0 if rows_known is not None else 1
    rest = TokenRows.from_lists([p[shared:] for p in prompts[first_over:]])
    over_context = CompletionPart(
        requests.likelihood(list(context), rest, top), tuple(range(first_over, len(rows))), shared
    )
    parts = (over_context,)
    if rows_known is None:
        first = TokenizedRequest(
            (), TokenRows.from_lists([prompts[0]]), (), False, True, per_token=True, top_logprobs=top
        )
        parts = (CompletionPart(first, (0,), 0), over_context)
    return PlannedCompletions(prompts, texts, parts, max_tokens, bool(inp.echo), inp.logprobs, context, rows_known)


def context_logprobs(planned: PlannedCompletions, results: list[list[ItemLikelihood]]) -> ContextLogprobs:
    """The shared context's own positions 1 .. shared-1: known, or from the first prompt run whole
    (`results`: per part, per item; that part comes first)."""
    if planned.context_rows is not None:
        return planned.context_rows
    s = len(planned.context) - 1
    first = results[0][0]
    return ContextLogprobs(first.logprobs[:s], first.top_ids[:s], first.top_logprobs[:s])


def prompt_logprobs(planned: PlannedCompletions, results: list[list[ItemLikelihood]]) -> list[PromptLogprobs]:
    """Each prompt's positions from its parts' likelihoods (`results`: per part, per item). A
    prompt over the shared context takes the context's positions from `context_logprobs`."""
    out: list[PromptLogprobs | None] = [None] * len(planned.prompts)
    head = context_logprobs(planned, results) if planned.context else None
    for part, items in zip(planned.parts, results, strict=True):
        for i, item in zip(part.prompts, items, strict=True):
            if part.shared == 0:  # a whole sequence: its rows are positions 1 .. n-1
                head_lp, head_ids, head_top = item.logprobs, item.top_ids, item.top_logprobs
            else:  # positions 1 .. shared-1 are the context's; shared .. n-1 its own
                assert head is not None
                head_lp = np.concatenate([head.logprobs, item.logprobs])
                head_ids = np.concatenate([head.top_ids, item.top_ids])
                head_top = np.concatenate([head.top_logprobs, item.top_logprobs])
            out[i] = PromptLogprobs(
                tokens=planned.prompts[i],
                logprobs=np.concatenate([[np.nan], head_lp]).astype(np.float32),
                top_ids=np.concatenate([np.zeros((1, TOP_LOGPROBS), np.int64), head_ids]),
                top_logprobs=np.concatenate([np.full((1, TOP_LOGPROBS), np.nan, np.float32), head_top]),
                next_top_ids=item.next_top_ids,
                next_top_logprobs=item.next_top_logprobs,
            )
    assert all(p is not None for p in out)
    return out  # type: ignore[return-value]
