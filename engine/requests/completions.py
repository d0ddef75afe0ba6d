"""Prompts scored whole, token by token: the work of vLLM's `/v1/completions` as scorers call it.

lm-evaluation-harness (`local-completions`), perplexity filters and judges send prompts with
`echo` and `logprobs` and at most one new token: they want the log-probability of every
prompt token given the tokens before it, and perhaps the greedy next token. That is the
likelihood path (engine/requests/likelihood.py) over whole prompts, planned here as engine requests,
one per context the prompts run over:

- each prompt runs over the longest context whose positions are known without computing it
  again: the longest prompt an earlier request computed that it starts with (`KnownPositions`:
  lm-eval's order puts a question's choices in different requests), or a prefix it shares with
  other prompts of the request (the k-shot header they all start with, a question's choices),
  whose positions the first of them computes, running over a shorter context itself;
- a context is the prefix of its engine request: prefilled once and kept in the prefix cache,
  where its leading whole pages are borrowed from a cached context that starts alike (a
  question's context prefills only the question, not the header again);
- a prompt with no such context runs whole (a sequence of its own).

Either way each position's log-prob is the one a plain forward pass over that prompt gives:
where a prompt's tokens sit in a call does not change them. Validated once, before any device
work: prompt forms, emptiness, the vocabulary, the context, and the options a scorer cannot
honour (more than one new token, several choices, streaming, sampling), each refused by name.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
from collections.abc import Sequence

import numpy as np

from prefixscore.engine.loop.request import TokenizedRequest
from prefixscore.engine.requests.answers import TokenLogprobs
from prefixscore.engine.requests.invalid_input import InvalidInput
from prefixscore.engine.requests.kind import Done
from prefixscore.engine.requests.known_positions import Known, KnownPositions, Positions, common_prefix
from prefixscore.engine.requests.likelihood import (
    ItemLikelihood,
    check_top_logprobs,
    check_vocabulary_head,
    layout,
    read_likelihoods,
)
from prefixscore.engine.requests.validation import RequestTokenizer
from prefixscore.engine.runtime.token_rows import TokenRows
from prefixscore.model.call_inputs import TOP_LOGPROBS

# vLLM's and OpenAI's default for `max_tokens` when a request leaves it out
DEFAULT_MAX_TOKENS = 16
# the fewest tokens a context adds to the next shorter one: fewer save less than a prefix of their
# own costs (its own entry in the prefix cache, and the part of a page it cannot borrow)
MIN_CONTEXT_GAIN = 8


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
    (indices, in order), each its tokens after a context of `shared` tokens they all start with
    (0: whole prompts)."""

    request: TokenizedRequest
    prompts: tuple[int, ...]
    shared: int


@dataclasses.dataclass(frozen=True)
class PromptContext:
    """What one prompt runs over: its first `shared` tokens (0: nothing, it runs whole), whose
    positions come from a kept prompt (`known`) or from another prompt of the request that runs
    over a shorter context (`from_prompt`)."""

    shared: int = 0
    known: Known | None = None
    from_prompt: int | None = None


@dataclasses.dataclass(frozen=True)
class PlannedCompletions:
    prompts: list[np.ndarray]  # each prompt's token ids [n_i] int64
    texts: list[str] | None  # the prompts as sent, when they were texts
    parts: tuple[CompletionPart, ...]
    contexts: tuple[PromptContext, ...]  # per prompt
    max_tokens: int  # 0 or 1
    echo: bool
    logprobs: int | None

    @property
    def prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)

    @property
    def requests(self) -> tuple[TokenizedRequest, ...]:
        return tuple(part.request for part in self.parts)


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

    def positions(self) -> Positions:
        """Positions 1 .. n-1."""
        return Positions(self.logprobs[1:], self.top_ids[1:].astype(np.int32), self.top_logprobs[1:])


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


def _neighbours(prompts: list[np.ndarray]) -> tuple[int, list[int]]:
    """The tokens every prompt starts with, and per prompt the most it shares with another one
    (from the prompts in token order: a prompt shares the most with a neighbour there)."""
    order = sorted(range(len(prompts)), key=lambda j: prompts[j].tolist())
    pairs = [common_prefix(prompts[a], prompts[b]) for a, b in itertools.pairwise(order)]
    most = [0] * len(prompts)
    for i, j in enumerate(order):
        most[j] = max(pairs[i - 1] if i else 0, pairs[i] if i < len(pairs) else 0)
    return min(pairs), most


def _kept_contexts(known: Known | None, shared: int) -> list[int]:
    """Contexts whose positions a kept prompt holds, for a prompt sharing `shared` tokens with it:
    that share, and the contexts it and the prompts before it in its line ran over (prefixes an
    earlier request used: likely still in the prefix cache)."""
    if known is None or shared < 2:
        return []
    out, at = [shared], known
    while at is not None:
        if 2 <= at.start <= shared:
            out.append(at.start)
        at = at.parent
    return out


def _contexts(prompts: list[np.ndarray], known: KnownPositions | None, page_tokens: int) -> list[PromptContext]:
    """What each prompt runs over (see the module doc): the longest of its candidate contexts
    whose positions are known or computed by another prompt of the request. Candidates: the
    contexts a kept prompt it starts with holds (`_kept_contexts`), the request's common prefix,
    and the most it shares with another prompt. A context of the request is computed by its first
    prompt, which runs over a shorter one; it is used only when the tokens its other prompts then
    skip pay for its prefill (up to a page more than it adds to the next shorter context). A
    context adding fewer than MIN_CONTEXT_GAIN tokens to the next shorter one is not worth a
    prefix of its own."""
    kept = [known.longest(p, len(p) - 1) if known is not None else (None, 0) for p in prompts]
    common, most = _neighbours(prompts) if len(prompts) > 1 else (0, [0])
    wanted = [{c for c in (min(common, len(p) - 1), min(most[j], len(p) - 1)) if c >= 2} for j, p in enumerate(prompts)]
    sharing = collections.Counter(prompts[j][:c].tobytes() for j in range(len(prompts)) for c in wanted[j])
    options = [sorted(wanted[j] | set(_kept_contexts(*kept[j]))) for j in range(len(prompts))]
    held: dict[bytes, Known] = {}  # a context whose positions a kept prompt holds -> that prompt
    for j, p in enumerate(prompts):
        for c in options[j]:
            if c <= kept[j][1]:
                held.setdefault(p[:c].tobytes(), kept[j][0])  # type: ignore[arg-type]
    candidates: list[list[int]] = []  # per prompt, ascending
    for j, p in enumerate(prompts):
        below, useful = 0, []
        for c in options[j]:
            gain, key = c - below, p[:c].tobytes()
            if gain >= MIN_CONTEXT_GAIN and (key in held or (sharing[key] - 1) * gain >= gain + page_tokens):
                useful.append(c)
                below = c
        candidates.append(useful)
    first_of: dict[bytes, int] = {}  # a context of the request -> the prompt that computes it
    for j, p in enumerate(prompts):
        for c in candidates[j]:
            if p[:c].tobytes() not in held:
                first_of.setdefault(p[:c].tobytes(), j)
    out = []
    for j, p in enumerate(prompts):
        computes = [c for c in candidates[j] if first_of.get(p[:c].tobytes()) == j]
        over = [c for c in candidates[j] if c < min(computes, default=len(p))]
        if not over:
            out.append(PromptContext())
            continue
        key = p[: over[-1]].tobytes()
        if key in held:
            out.append(PromptContext(over[-1], known=held[key]))
        else:
            out.append(PromptContext(over[-1], from_prompt=first_of[key]))
    return out


def plan(requests: RequestTokenizer, inp: CompletionsInput, known: KnownPositions | None = None) -> PlannedCompletions:
    """Validate a completions request and plan its engine requests (see the module doc). `known`:
    prompts whose positions earlier requests computed."""
    max_tokens = _options(inp)
    check_vocabulary_head(requests)
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
    contexts = _contexts(prompts, known, requests.limits.page_tokens)
    by_context: dict[bytes, list[int]] = collections.defaultdict(list)
    for j, c in enumerate(contexts):
        by_context[prompts[j][: c.shared].tobytes()].append(j)
    parts = []
    for js in by_context.values():
        shared = contexts[js[0]].shared
        rest = TokenRows.from_lists([prompts[j][shared:] for j in js])
        if shared == 0:  # whole sequences: no prefix, a row per token of each prompt
            request = TokenizedRequest((), rest, (), TokenLogprobs(top), True)
        else:
            request = layout(requests, prompts[js[0]][:shared].tolist(), rest, top)
        parts.append(CompletionPart(request, tuple(js), shared))
    return PlannedCompletions(prompts, texts, tuple(parts), tuple(contexts), max_tokens, bool(inp.echo), inp.logprobs)


def prompt_logprobs(
    planned: PlannedCompletions, results: list[list[ItemLikelihood]], known: KnownPositions | None = None
) -> list[PromptLogprobs]:
    """Each prompt's positions from its part's likelihoods (`results`: per part, per item): those
    of its context (kept, or another prompt's), then its own. `known`: where to keep them for
    later requests (each over the kept prompt its context came from, which holds the rest)."""
    own: dict[int, ItemLikelihood] = {}
    for part, items in zip(planned.parts, results, strict=True):
        own.update(zip(part.prompts, items, strict=True))
    out: list[PromptLogprobs | None] = [None] * len(planned.prompts)
    kept: dict[int, Known | None] = {}
    # a context's positions come from a prompt over a shorter context: those go first
    for j in sorted(range(len(planned.prompts)), key=lambda j: planned.contexts[j].shared):
        context, item = planned.contexts[j], own[j]
        mine = Positions(item.logprobs, item.top_ids, item.top_logprobs)
        parent = None
        if context.known is not None:
            assert known is not None
            head = known.positions(context.known, context.shared)
            parent = context.known
        elif context.from_prompt is not None:
            source = out[context.from_prompt]
            assert source is not None
            head = source.positions().head(context.shared - 1)
            parent = kept.get(context.from_prompt)
        whole = Positions.join([head, mine]) if context.shared else mine
        out[j] = PromptLogprobs(
            tokens=planned.prompts[j],
            logprobs=np.concatenate([[np.nan], whole.logprobs]).astype(np.float32),
            top_ids=np.concatenate([np.zeros((1, TOP_LOGPROBS), np.int64), whole.top_ids]).astype(np.int64),
            top_logprobs=np.concatenate([np.full((1, TOP_LOGPROBS), np.nan, np.float32), whole.top_logprobs]),
            next_top_ids=item.next_top_ids,
            next_top_logprobs=item.next_top_logprobs,
        )
        if known is not None:
            if parent is not None:
                start = context.shared
                stored = Positions(mine.logprobs, mine.top_ids.astype(np.int32), mine.top_logprobs)
            else:
                start, stored = 1, out[j].positions()
            kept[j] = known.keep(planned.prompts[j], stored, parent, start)
    assert all(p is not None for p in out)
    return out  # type: ignore[return-value]


class CompletionsKind:
    """/v1/completions (see the module doc). It keeps the positions of the prompts it computed
    (`known`) for later requests. Result: a PromptLogprobs per prompt."""

    name = "completions"
    input_type = CompletionsInput

    def __init__(self, requests: RequestTokenizer, known: KnownPositions | None = None) -> None:
        self.requests = requests
        self.known = KnownPositions() if known is None else known

    def plan(self, inp: CompletionsInput) -> PlannedCompletions:
        return plan(self.requests, inp, self.known)

    def answer(self, planned: PlannedCompletions, done: Sequence[Done]) -> list[PromptLogprobs]:
        results = [read_likelihoods(part.request, d.answer) for part, d in zip(planned.parts, done, strict=True)]
        return prompt_logprobs(planned, results, self.known)
