"""Prompts scored whole, token by token: the work of vLLM's `/v1/completions` as scorers call it.

lm-evaluation-harness (`local-completions`), perplexity filters and judges send prompts with
`echo` and `logprobs` and at most one new token: they want the log-probability of every
prompt token given the tokens before it, and perhaps the greedy next token. That is the
likelihood path (engine/requests/likelihood.py) over whole prompts, planned here as engine requests.

A prompt is cut at fixed positions. Its first page (the prefix pool's page, 128 tokens by
default) comes from whole sequences: rows 0 .. 31 (row j reads token j and gives the log-prob of
token j + 1) from an item of at most 33 tokens, the page's other rows from one of at least 34,
which the CPU attention computes one way and the other, each whatever the item's length; a
prompt shorter than a page (a zero-shot task's) prefills nothing and runs in one call. Past the
page, every SEGMENT_ROWS (32) tokens: segment k holds the rows of tokens 32k .. 32k + 31, from one
item of at most 33 tokens over the context `prompt[:32k]`, the prefix of its engine request.
Where a position is computed, over which context, in which item and at which place in it, thus
follows from the position alone, never from the prompt's length or company: a position's log-prob
is the same bits whether the prompt came alone or among others, in any order, over positions kept
from an earlier request or not (a context's K/V are the same however it was prefilled, and an
item reads a context's first tokens the same way from any prefix that starts with them:
docs/design.md "The same answer whatever the call").

- the positions an earlier prompt computed (`KnownPositions`: the longest kept prompt this one
  starts with) are taken as they are: only the items from the first unknown position on run;
- an item two prompts of the request both need (the same context and the same tokens) runs once;
- a context is prefilled once, and only the longest of those that start alike: a context that
  another prompt's longer one starts with is read from that one's pages (its engine request's
  prefix is the longer context, `read_prefix` its own length), so a prompt's contexts cost one
  prefill, past the whole pages the prefix cache lends it.

Each position's log-prob is the one a plain forward pass over that prompt gives. Validated
once, before any device work: prompt forms, emptiness, the vocabulary, the context, and the
options a scorer cannot honour (more than one new token, several choices, streaming,
sampling), each refused by name.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Sequence

import numpy as np

from prefixscore.engine.loop.request import TokenizedRequest
from prefixscore.engine.requests.answers import TokenLogprobs
from prefixscore.engine.requests.invalid_input import InvalidInput
from prefixscore.engine.requests.kind import Done
from prefixscore.engine.requests.known_positions import Known, KnownPositions, Positions
from prefixscore.engine.requests.likelihood import (
    ItemLikelihood,
    check_top_logprobs,
    check_vocabulary_head,
    read_likelihoods,
)
from prefixscore.engine.requests.validation import RequestTokenizer
from prefixscore.engine.runtime.token_rows import TokenRows
from prefixscore.kernels.xla import ITEM_BLOCK
from prefixscore.model.call_inputs import TOP_LOGPROBS

# vLLM's and OpenAI's default for `max_tokens` when a request leaves it out
DEFAULT_MAX_TOKENS = 16
# the rows of a segment, read from one item of at most SEGMENT_ROWS + 1 tokens: an item the CPU
# attention always computes one way (kernels/xla.py: a short item), whatever its length
SEGMENT_ROWS = ITEM_BLOCK


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
    """One engine request of a completions request: items over one context (its prefix)."""

    request: TokenizedRequest


@dataclasses.dataclass(frozen=True)
class Piece:
    """Rows `rows_from` .. `rows_to` - 1 of a prompt (row j: the log-prob of token j + 1, or after
    the last token the next one's top) from item `item` of part `part`, which starts at row `start`."""

    part: int
    item: int
    start: int
    rows_from: int
    rows_to: int


@dataclasses.dataclass(frozen=True)
class PromptPlan:
    """Where one prompt's positions come from: 1 .. known_upto - 1 from a kept prompt (`known`),
    the rest from its pieces, in order."""

    known: Known | None
    known_upto: int
    pieces: tuple[Piece, ...]


@dataclasses.dataclass(frozen=True)
class PlannedCompletions:
    prompts: list[np.ndarray]  # each prompt's token ids [n_i] int64
    texts: list[str] | None  # the prompts as sent, when they were texts
    parts: tuple[CompletionPart, ...]
    plans: tuple[PromptPlan, ...]  # per prompt
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


def _items(n: int, first_row: int, first_page: int) -> list[tuple[int, int, int, int]]:
    """The items a prompt of n tokens needs for its rows from `first_row` on: (context, item end,
    first row, row after the last) each. The rows of its first page (`first_page` tokens, at least
    SEGMENT_ROWS) come from whole sequences: rows 0 .. SEGMENT_ROWS - 1 from one of at most
    SEGMENT_ROWS + 1 tokens, the page's others from one of at least SEGMENT_ROWS + 2 (the CPU
    attention computes a longer item in blocks from its first token, whatever its length). Past
    the page, segment k holds rows k * SEGMENT_ROWS .. (k + 1) * SEGMENT_ROWS - 1 from one item
    of at most SEGMENT_ROWS + 1 tokens over the prompt's first k * SEGMENT_ROWS tokens. Each row
    is read from the same item however long the prompt is."""
    out = []
    page_end = min(first_page, n)
    long_first = n >= SEGMENT_ROWS + 2 and page_end > SEGMENT_ROWS
    short_to = SEGMENT_ROWS if long_first else page_end
    if first_row < short_to:
        out.append((0, min(SEGMENT_ROWS + 1, n), 0, short_to))
    if long_first and first_row < page_end:
        out.append((0, min(first_page + 1, n), SEGMENT_ROWS, page_end))
    for k in range(max(first_row, first_page) // SEGMENT_ROWS, (n - 1) // SEGMENT_ROWS + 1):
        at = k * SEGMENT_ROWS
        out.append((at, min(at + SEGMENT_ROWS + 1, n), at, min(at + SEGMENT_ROWS, n)))
    return out


def _requested_positions(
    prompts: list[np.ndarray],
    wanted: list[tuple[Known | None, int, list[tuple[bytes, bytes, int, int, int]]]],
    where: dict[tuple[bytes, bytes], tuple[int, int]],
    parts: int,
) -> list[int]:
    """Per part, the rows the request needs that it is the first to read: each row (a prompt's
    tokens up to it: prompts that start alike share their first rows) once over the whole request,
    those of a kept prompt not at all (the row before the first unknown position is one: the kept
    prompt computed it, and it is run again because only its own token's log-prob was kept). Their
    sum is what the request asks the device for; the items compute more (each item holds one token
    past its rows, its last row's target; two prompts that part within a segment each run that
    segment)."""
    out = [0] * parts
    trie: dict[tuple[int, int], int] = {}  # (position before, token) -> position
    counted: set[int] = set()
    for prompt, (_, upto, pieces) in zip(prompts, wanted, strict=True):
        at_row, node = [], 0
        for token in prompt.tolist():
            node = trie.setdefault((node, token), len(trie) + 1)
            at_row.append(node)
        for context, item, _, rows_from, rows_to in pieces:
            part = where[context, item][0]
            for row in range(max(rows_from, upto), rows_to):
                if at_row[row] not in counted:
                    counted.add(at_row[row])
                    out[part] += 1
    return out


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
    top = TOP_LOGPROBS if inp.logprobs is None else inp.logprobs
    prompts = [rows.flat[rows.offsets[j] : rows.offsets[j + 1]] for j in range(len(rows))]
    # whole sequences give a prompt's first page: a prompt shorter than it (a zero-shot task's)
    # prefills nothing and runs in one call
    first_page = max(requests.limits.page_tokens, SEGMENT_ROWS)
    # per context (its tokens): the items over it, each named by its tokens up to its end
    contexts: dict[bytes, dict[bytes, np.ndarray]] = collections.defaultdict(dict)
    read_from: dict[bytes, bytes] = {b"": b""}  # per context: the longest starting with it, whose pages it reads
    wanted: list[tuple[Known | None, int, list[tuple[bytes, bytes, int, int, int]]]] = []
    for prompt in prompts:
        kept, upto = known.longest(prompt, len(prompt) - 1) if known is not None else (None, 0)
        upto = upto if kept is not None else 0
        pieces = []
        segments = _items(len(prompt), max(upto - 1, 0), first_page)
        longest = prompt[: segments[-1][0]].tobytes()  # this prompt's last context holds its others
        for context, end, rows_from, rows_to in segments:
            at, item = prompt[:context].tobytes(), prompt[:end].tobytes()
            contexts[at].setdefault(item, prompt[context:end])
            pieces.append((at, item, context, rows_from, rows_to))
            if at:
                read_from[at] = max(read_from.get(at, at), longest, key=lambda c: (len(c), c))
        wanted.append((kept, upto, pieces))
    # the longest context first; a context another prompt's longer one starts with is read from
    # that one's pages (the longest such), prefilled once
    order = sorted(contexts, key=len, reverse=True)
    where = {(at, item): (p, i) for p, at in enumerate(order) for i, item in enumerate(contexts[at])}
    requested = _requested_positions(prompts, wanted, where, len(order))
    parts = []
    for p, at in enumerate(order):
        prefix = tuple(np.frombuffer(read_from[at], prompts[0].dtype).tolist())
        read = len(at) // prompts[0].itemsize if read_from[at] != at else None
        items = TokenRows.from_lists(list(contexts[at].values()))
        answer = TokenLogprobs(top)
        parts.append(CompletionPart(TokenizedRequest(prefix, items, (), answer, not prefix, requested[p], read)))
    plans = tuple(
        PromptPlan(kept, upto, tuple(Piece(*where[at, item], start, lo, hi) for at, item, start, lo, hi in pieces))
        for kept, upto, pieces in wanted
    )
    return PlannedCompletions(prompts, texts, tuple(parts), plans, max_tokens, bool(inp.echo), inp.logprobs)


def prompt_logprobs(
    planned: PlannedCompletions, results: list[list[ItemLikelihood]], known: KnownPositions | None = None
) -> list[PromptLogprobs]:
    """Each prompt's positions: those a kept prompt holds, then its items' (`results`: per part,
    per item). `known`: where to keep them for later requests (each over the kept prompt its first
    positions came from, which holds them)."""
    out = []
    for tokens, prompt in zip(planned.prompts, planned.plans, strict=True):
        n, start = len(tokens), max(prompt.known_upto, 1)  # its first position not kept
        parts = []
        for piece in prompt.pieces:
            item = results[piece.part][piece.item]
            lo, hi = max(piece.rows_from, start - 1) - piece.start, min(piece.rows_to, n - 1) - piece.start
            parts.append(
                Positions(item.logprobs[lo:hi], item.top_ids[lo:hi].astype(np.int32), item.top_logprobs[lo:hi])
            )
        own = Positions.join(parts)
        whole = own
        if prompt.known is not None and known is not None:
            whole = Positions.join([known.positions(prompt.known, start), own])
        last = results[prompt.pieces[-1].part][prompt.pieces[-1].item]  # the piece ending at the prompt's end
        out.append(
            PromptLogprobs(
                tokens=tokens,
                logprobs=np.concatenate([[np.nan], whole.logprobs]).astype(np.float32),
                top_ids=np.concatenate([np.zeros((1, TOP_LOGPROBS), np.int64), whole.top_ids]).astype(np.int64),
                top_logprobs=np.concatenate([np.full((1, TOP_LOGPROBS), np.nan, np.float32), whole.top_logprobs]),
                next_top_ids=last.next_top_ids,
                next_top_logprobs=last.next_top_logprobs,
            )
        )
        if known is not None:
            known.keep(tokens, own, prompt.known, start)
    return out


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
