"""Prompts scored whole, token by token: the work of vLLM's `/v1/completions` as scorers call it.

lm-evaluation-harness (`local-completions`), perplexity filters and judges send prompts with
`echo` and `logprobs` and at most one new token: they want the log-probability of every
prompt token given the tokens before it, and perhaps the greedy next token. That is the
likelihood path (engine/requests/likelihood.py) over whole prompts, planned here as engine requests.

Every position of a prompt comes from its own prefill: the prompt is the query of an engine
request whose rows are its own tokens' (`TokenizedRequest.prefix_rows`): row j reads token j and
gives the log-prob of token j + 1, the last row the top next tokens. A token's hidden state, as
its K/V, depends only on the tokens up to it, and the prefill computes it the same bits however
the prompt was chunked, whatever shares its call, over pages borrowed or copied from another
query or its own (docs/design.md "The same answer whatever the call"): a position's log-prob is
the same bits whether the prompt came alone or among others, in any order, over positions kept
from an earlier request or not.

Each position is computed once:
- the positions an earlier prompt computed (`KnownPositions`: the longest kept prompt this one
  starts with) are taken as they are;
- within a request, the prompts are planned in the order of their tokens, and a prompt takes the
  positions it shares with the prompt before it (the one it shares the most with among those
  before it) from that one;
- a prompt's own rows start at its first position not taken (the row before it: its token's
  log-prob is this prompt's), and its prefill starts there at the latest: the prefix cache lends
  it the tokens before (a sibling's, written or being written: a question is prefilled once for
  all its choices), and a prompt cached whole gets a fresh entry, so every row it reads is
  computed for it.

Each position's log-prob is the one a plain forward pass over that prompt gives. Validated
once, before any device work: prompt forms, emptiness, the vocabulary, the context, and the
options a scorer cannot honour (more than one new token, several choices, streaming,
sampling), each refused by name.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from prefixscore.engine.loop.request import TokenizedRequest
from prefixscore.engine.requests.answers import PromptRows
from prefixscore.engine.requests.invalid_input import InvalidInput
from prefixscore.engine.requests.kind import Done
from prefixscore.engine.requests.known_positions import Known, KnownPositions, Positions, common_prefix
from prefixscore.engine.requests.likelihood import check_top_logprobs, check_vocabulary_head, token_positions
from prefixscore.engine.requests.validation import RequestTokenizer
from prefixscore.engine.runtime.token_rows import TokenRows
from prefixscore.model.call_inputs import TOP_LOGPROBS

# vLLM's and OpenAI's default for `max_tokens` when a request leaves it out
DEFAULT_MAX_TOKENS = 16


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
class PromptPlan:
    """Where one prompt's positions come from: 1 .. taken_upto - 1 from a kept prompt (`known`) or
    from the request's prompt `sibling` (planned before it), the rest from the rows of its engine
    request `part` (from position max(taken_upto - 1, 0): TokenizedRequest.prefix_rows)."""

    part: int
    taken_upto: int = 0
    known: Known | None = None
    sibling: int | None = None


@dataclasses.dataclass(frozen=True)
class PlannedCompletions:
    prompts: list[np.ndarray]  # each prompt's token ids [n_i] int64
    texts: list[str] | None  # the prompts as sent, when they were texts
    requests: tuple[TokenizedRequest, ...]  # one per prompt, in plan order
    plans: tuple[PromptPlan, ...]  # per prompt (as sent)
    order: tuple[int, ...]  # the prompts in plan order (a sibling is planned before the prompts it serves)
    max_tokens: int  # 0 or 1
    echo: bool
    logprobs: int | None

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


def _taken(
    prompt: np.ndarray, before: np.ndarray | None, known: KnownPositions | None
) -> tuple[int, Known | None, bool]:
    """How many of a prompt's leading tokens' positions it takes, and from where: (upto, the kept
    prompt, or the prompt planned before it, `before`: True), whichever shares the most with it, at
    most all but its last (a prompt computes its last position's row); (0, None, False) when that
    is a token or none (no position to take)."""
    most = len(prompt) - 1
    kept, upto = known.longest(prompt, most) if known is not None else (None, 0)
    upto = upto if kept is not None else 0
    shared = min(common_prefix(before, prompt), most) if before is not None else 0
    if max(upto, shared) < 2:
        return 0, None, False
    return (upto, kept, False) if upto >= shared else (shared, None, True)


def plan(requests: RequestTokenizer, inp: CompletionsInput, known: KnownPositions | None = None) -> PlannedCompletions:
    """Validate a completions request and plan its engine requests (see the module doc). `known`:
    prompts whose positions earlier requests computed."""
    max_tokens = _options(inp)
    check_vocabulary_head(requests)
    rows, texts = _prompt_rows(requests, inp)
    limit = requests.max_sequence_tokens
    over = np.flatnonzero(rows.lengths + max_tokens > limit)
    if over.size:
        j = int(over[0])
        field = "prompt" if len(rows) == 1 else f"prompt[{j}]"
        asked = f" + {max_tokens} new token" if max_tokens else ""
        raise InvalidInput(field, f"{int(rows.lengths[j])} tokens{asked}, over the model's limit of {limit}")
    requests.check_request_tokens(rows.total)
    prompts = [rows.flat[rows.offsets[j] : rows.offsets[j + 1]] for j in range(len(rows))]
    # in the order of their tokens: the prompt a prompt shares the most with, among those before
    # it, is the one just before it
    order = sorted(range(len(prompts)), key=lambda j: prompts[j].tolist())
    plans: list[PromptPlan] = [PromptPlan(0)] * len(prompts)
    parts = []
    for part, j in enumerate(order):
        prompt, n = prompts[j], len(prompts[j])
        before = order[part - 1] if part else None
        upto, kept, from_before = _taken(prompt, prompts[before] if before is not None else None, known)
        plans[j] = PromptPlan(part, upto, kept, before if from_before else None)
        first_row = max(upto - 1, 0)
        # the positions it needs, each once: from the first not taken (the row before it, which a
        # kept prompt or the sibling ran too, gives this prompt's token there), and the next token's
        requested = n - upto if upto else n
        answer = PromptRows(n - first_row)
        parts.append(TokenizedRequest(tuple(prompt.tolist()), [], (), answer, False, requested, first_row))
    return PlannedCompletions(
        prompts, texts, tuple(parts), tuple(plans), tuple(order), max_tokens, bool(inp.echo), inp.logprobs
    )


def _own_positions(tokens: np.ndarray, start: int, rows: np.ndarray) -> Positions:
    """Positions start .. n-1 of a prompt from its rows (row i: position start + i's log-prob;
    the last row, after the prompt, is not one)."""
    logprobs, top_ids, top_logprobs = token_positions(rows[:-1], tokens[start:])
    return Positions(logprobs, top_ids.astype(np.int32), top_logprobs)


def prompt_logprobs(
    planned: PlannedCompletions, results: Sequence[np.ndarray], known: KnownPositions | None = None
) -> list[PromptLogprobs]:
    """Each prompt's positions: those taken from a kept prompt or a sibling, then its own rows
    (`results`: per engine request, its rows [rows, TOKEN_COLUMNS]). `known`: where to keep them
    for later requests (each over the kept prompt its first positions came from, which holds them)."""
    whole: dict[int, Positions] = {}
    kept_as: dict[int, Known | None] = {}
    out: dict[int, PromptLogprobs] = {}
    k = TOP_LOGPROBS
    for j in planned.order:
        tokens, prompt = planned.prompts[j], planned.plans[j]
        rows = results[prompt.part]
        start = max(prompt.taken_upto, 1)  # its first position not taken
        own = _own_positions(tokens, start, rows)
        parent = prompt.known
        if prompt.sibling is not None:
            taken = whole[prompt.sibling].head(start - 1)
            parent = kept_as.get(prompt.sibling)
        elif prompt.known is not None and known is not None:
            taken = known.positions(prompt.known, start)
        else:
            taken = own.head(0)
        whole[j] = Positions.join([taken, own])
        if known is not None:
            if parent is None and start > 1:  # what it was taken over is not kept: keep it whole
                kept_as[j] = known.keep(tokens, whole[j], None, 1)
            else:
                kept_as[j] = known.keep(tokens, own, parent, start)
        last = rows[-1]
        out[j] = PromptLogprobs(
            tokens=tokens,
            logprobs=np.concatenate([[np.nan], whole[j].logprobs]).astype(np.float32),
            top_ids=np.concatenate([np.zeros((1, k), np.int64), whole[j].top_ids]).astype(np.int64),
            top_logprobs=np.concatenate([np.full((1, k), np.nan, np.float32), whole[j].top_logprobs]),
            next_top_ids=last[1 + k :].astype(np.int64),
            next_top_logprobs=last[1 : 1 + k],
        )
    return [out[j] for j in range(len(planned.prompts))]


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
        return prompt_logprobs(planned, [d.answer for d in done], self.known)
