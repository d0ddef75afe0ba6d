"""/v1/completions bodies: a request model as the engine's completions input, and each prompt's
log-probs (engine/requests/completions.py) as OpenAI's response, as vLLM writes it for echo and
logprobs. Nothing here knows the service or the event loop.

Tokens are reported as vLLM reports them: each id decoded alone (" the", not the vocabulary's
"Ġthe"), or "token_id:<id>" when asked (or when the model has no tokenizer). A position's top
log-probs map a token to its log-prob: the `logprobs` most likely tokens there, then the token
actually there if it is not among them; -inf is written -9999.0, as OpenAI does.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable

import numpy as np

from prefixscore.engine.requests.completions import CompletionsInput, PlannedCompletions, PromptLogprobs
from prefixscore.model.tokenizer import TextTokenizer
from prefixscore.service.http_schemas import (
    CompletionChoice,
    CompletionLogprobs,
    CompletionsRequest,
    CompletionsResponse,
    CompletionUsage,
)

# what OpenAI writes for a log-prob of -inf (JSON has no infinity)
FLOOR = -9999.0


def completions_input(body: CompletionsRequest) -> CompletionsInput:
    """A /v1/completions body as the engine's input (validated there, once): its fields by name."""
    names = {field.name for field in dataclasses.fields(CompletionsInput)}
    return CompletionsInput(**body.model_dump(include=names))


def _namer(tokenizer: TextTokenizer | None, as_ids: bool, ids: np.ndarray) -> Callable[[int], str]:
    """A token's reported string, for every id the response names (each decoded once)."""
    if as_ids or tokenizer is None:
        return lambda t: f"token_id:{t}"
    unique = np.unique(ids).tolist()
    names = dict(zip(unique, tokenizer.pieces(unique), strict=True))
    return names.__getitem__


def _logprob(value: float) -> float | None:
    return None if np.isnan(value) else max(float(value), FLOOR)


def _top(names: Callable[[int], str], ids: np.ndarray, logprobs: np.ndarray, k: int, token: int, own: float) -> dict:
    """The k most likely tokens at a position, then the token there if not among them (two ids
    that decode alike keep the likelier's entry)."""
    top: dict[str, float] = {}
    for t, lp in zip(ids[:k].tolist(), logprobs[:k].tolist(), strict=True):
        top.setdefault(names(t), max(lp, FLOOR))
    top.setdefault(names(token), max(float(own), FLOOR))
    return top


def _choice(
    index: int,
    planned: PlannedCompletions,
    prompt: PromptLogprobs,
    names: Callable[[int], str] | None,
    tokenizer: TextTokenizer | None,
) -> CompletionChoice:
    """One prompt's choice: the prompt (echo) and the new token (max_tokens 1); `names` None:
    no logprobs were asked for."""
    text = ""
    if planned.echo:
        sent = planned.texts[index] if planned.texts is not None else None
        text = sent if sent is not None else (tokenizer.decode(prompt.tokens.tolist()) if tokenizer else "")
    new = int(prompt.next_top_ids[0])
    if planned.max_tokens:
        text += tokenizer.decode([new]) if tokenizer else ""
    if names is None:
        return CompletionChoice(index=index, text=text)
    k = planned.logprobs or 0
    shown: list[int] = prompt.tokens.tolist() if planned.echo else []
    logprobs = [_logprob(v) for v in prompt.logprobs.tolist()] if planned.echo else []
    tops: list[dict[str, float] | None] = [None] if shown else []
    tops += [
        _top(names, prompt.top_ids[i], prompt.top_logprobs[i], k, shown[i], prompt.logprobs[i])
        for i in range(1, len(shown))
    ]
    if planned.max_tokens:
        new_lp = float(prompt.next_top_logprobs[0])
        shown.append(new)
        logprobs.append(_logprob(new_lp))
        tops.append(_top(names, prompt.next_top_ids, prompt.next_top_logprobs, k, new, new_lp))
    strings = [names(t) for t in shown]
    offsets = np.concatenate([[0], np.cumsum([len(s) for s in strings])[:-1]]).astype(int).tolist() if shown else []
    return CompletionChoice(
        index=index,
        text=text,
        logprobs=CompletionLogprobs(tokens=strings, token_logprobs=logprobs, top_logprobs=tops, text_offset=offsets),
    )


def completions_response(
    planned: PlannedCompletions,
    prompts: list[PromptLogprobs],
    tokenizer: TextTokenizer | None,
    as_token_ids: bool,
    model: str,
    request_id: str,
) -> CompletionsResponse:
    """Each prompt's choice, in order, and the usage (every prompt whole, and its new token)."""
    names = None  # no logprobs asked for: no token is named
    if planned.logprobs is not None:
        named = [p.tokens for p in prompts] if planned.echo else []
        if planned.logprobs and planned.echo:
            named += [p.top_ids[1:, : planned.logprobs].ravel() for p in prompts]
        if planned.max_tokens:
            named += [p.next_top_ids[: max(1, planned.logprobs)] for p in prompts]
        names = _namer(tokenizer, as_token_ids, np.concatenate(named))
    choices = [_choice(i, planned, p, names, tokenizer) for i, p in enumerate(prompts)]
    completion_tokens = planned.max_tokens * len(prompts)
    usage = CompletionUsage(
        prompt_tokens=planned.prompt_tokens,
        completion_tokens=completion_tokens,
        total_tokens=planned.prompt_tokens + completion_tokens,
    )
    return CompletionsResponse(
        id=f"cmpl-{request_id}", created=int(time.time()), model=model, choices=choices, usage=usage
    )
