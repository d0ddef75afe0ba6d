"""Embedding requests: inputs tokenized as sentence-transformers tokenizes them, laid out for the
score path, and their pooled vectors finished (engine/requests/pooling.py).

A text input is its prompt (named, given, or the model's default) followed by the text,
tokenized as one string with the tokenizer's special tokens: `tokenizer(prompt + text)`,
exactly as `SentenceTransformer.encode` does. Token-id inputs are sequences as given (no
prompt, no special tokens added).

**Truncation, then the prompt.** An input longer than the model's sequence limit (its
`max_seq_length`, the context, the largest item) is refused, naming it, or with `truncate`
cut to fit: tokens leave the text's end (`right`, sentence-transformers' own truncation) or its
start (`left`); the prompt and the tokenizer's start and end tokens stay.

**The prompt as a shared prefix.** The prompt's tokens (as sentence-transformers counts them:
the prompt tokenized alone, less a trailing special token) start every input of the request.
They but the last (which a text's first token may merge into), where all inputs start with them,
are the request's prefix: the same for every request with that prompt, prefilled once and kept in
the prefix cache for the next, and each input is an item over it, so the forward pass is the plain
one of the whole input whatever the split. The prompt's tokens stay
out of a mean or a cls when the model's Pooling says `include_prompt: false` (each item's
`skip`: the prompt's tokens the prefix did not take). A mean or cls that includes the prompt
pools every token of the sequence, so such inputs run whole, as do inputs with no prompt.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from prefixscore.engine.loop.request import TokenizedRequest
from prefixscore.engine.requests.answers import Pooled
from prefixscore.engine.requests.invalid_input import InvalidInput
from prefixscore.engine.requests.kind import Done
from prefixscore.engine.requests.known_positions import common_prefix
from prefixscore.engine.requests.pooling import PoolRows, unit_rows
from prefixscore.engine.requests.rendered_texts import RenderedTexts
from prefixscore.engine.requests.validation import RequestTokenizer
from prefixscore.engine.runtime.token_rows import TokenRows
from prefixscore.model.sentence_config import LAST, Pooling

TRUNCATION_DIRECTIONS = ("right", "left")


@dataclasses.dataclass
class EmbedInput:
    """An embedding request as a transport received it (OpenAI's and TEI's fields)."""

    input: object  # a text, texts, token ids, or token-id lists
    prompt_name: str | None = None  # one of the model's named prompts (None: its default, if any)
    prompt: str | None = None  # a prompt's text, instead of a name
    dimensions: int | None = None  # keep the first n dimensions, then normalize (None: all)
    normalize: bool | None = None  # None: as the model does (a Normalize module)
    truncate: bool = False  # an input over the limit: refused (False) or cut to fit
    truncation_direction: str = "right"  # the side of the text a cut input loses tokens from


@dataclasses.dataclass(frozen=True)
class ValidatedEmbed:
    request: TokenizedRequest
    dimensions: int
    normalize: bool
    prompt_tokens: int  # every input whole (its prompt and special tokens included)
    truncated: tuple[int, ...] = ()  # the inputs cut to fit

    @property
    def requests(self) -> tuple[TokenizedRequest, ...]:
        return (self.request,)

    def finish(self, pooled: np.ndarray) -> np.ndarray:
        """The request's pooled vectors [inputs, hidden] -> its embeddings [inputs, dimensions]:
        the first `dimensions` kept (Matryoshka truncation), then each scaled to unit L2 norm when
        asked; in that order, as sentence-transformers' `encode(truncate_dim=, normalize_embeddings=True)`."""
        out = pooled[:, : self.dimensions]
        return (unit_rows(out) if self.normalize else out).astype(np.float32)


class EmbedKind:
    """Embeddings (see the module doc) for one model and its pooling (None: it serves none).
    Result: [inputs, dimensions] float32."""

    name = "embed"
    input_type = EmbedInput

    def __init__(self, requests: RequestTokenizer, pooling: Pooling | None) -> None:
        self.requests = requests
        self.pooling = pooling
        limits = [requests.max_sequence_tokens]
        if pooling is not None and pooling.max_seq_length:
            limits.append(pooling.max_seq_length)
        self.max_tokens = min(limits)  # one input, whole
        chat = pooling.chat if pooling is not None else None
        # a checkpoint whose texts are rendered through the chat template (engine/requests/rendered_texts.py)
        self.rendered = RenderedTexts(requests.tokenizer, chat) if chat and requests.tokenizer else None

    def plan(self, inp: EmbedInput) -> ValidatedEmbed:
        """The request in token ids, or InvalidInput naming the field; no device work."""
        pooling, dimensions, normalize = self._options(inp)
        texts, ids = _inputs(inp.input)
        if texts is not None:
            prompt = self._prompt(inp, pooling)
            sequences, prompt_len, kept, end_ids = self._texts(texts, prompt, inp.truncate)
        else:
            if inp.prompt is not None or inp.prompt_name is not None:
                field = "prompt" if inp.prompt is not None else "prompt_name"
                raise InvalidInput(field, "applies to text inputs; token-id inputs are sequences as given")
            sequences = [list(s) for s in self.requests.item_ids(ids, field="input", truncating=True)]
            prompt_len, kept, end_ids = 0, 0, []
        # the prompt's run is the prefix (less, at most, the token its end merges into a text's
        # first), and an item fits the largest item bucket
        split = prompt_len > 0 and _splits(pooling)
        limit = min(self.max_tokens, self.requests.max_item_tokens + (prompt_len - 1 if split else 0))
        truncated = self._fit(sequences, limit, kept, end_ids, inp.truncate, inp.truncation_direction)
        request = self._layout(sequences, prompt_len, pooling)
        self.requests.check_request_tokens(len(request.prefix) + request.items.total)
        prompt_tokens = sum(map(len, sequences))
        return ValidatedEmbed(request, dimensions, normalize, prompt_tokens, tuple(truncated))

    def answer(self, plan: ValidatedEmbed, done: Sequence[Done]) -> np.ndarray:
        (pooled,) = done
        return plan.finish(pooled.answer)

    def stream_open(self, inp: EmbedInput) -> StreamPrompt:
        """An embedding stream's open (its `input` unused): the options every batch takes, checked
        as a request's are, and the prompt's shared run the stream pins (see the module doc): the
        prefix each batch of texts is laid out over, found in the prefix cache."""
        pooling, dimensions, _ = self._options(inp)
        prompt = self._prompt(inp, pooling)
        if self.rendered is not None and _splits(pooling):  # the frame's head, with or without a prompt
            head, _ = self.rendered.frame(prompt)
            return StreamPrompt(tuple(head[: len(head) - 1]), dimensions)
        if not prompt or not _splits(pooling):
            return StreamPrompt((), dimensions)
        tokenizer = self.requests.tokenizer
        if tokenizer is None:
            raise InvalidInput("prompt", f"model {self.requests.cfg.name!r} has no tokenizer for a prompt")
        alone, prompt_len = self._prompt_tokens(prompt)
        return StreamPrompt(tuple(alone[: prompt_len - 1]), dimensions)

    def _options(self, inp: EmbedInput) -> tuple[Pooling, int, bool]:
        """The model's pooling, the request's dimensions and normalization, its truncation checked."""
        pooling = self._pooling()
        dimensions = self._dimensions(inp.dimensions, pooling.dimension)
        normalize = pooling.normalize if inp.normalize is None else inp.normalize
        if not isinstance(normalize, bool):
            raise InvalidInput("normalize", f"{inp.normalize!r} is not a boolean")
        if not isinstance(inp.truncate, bool):
            raise InvalidInput("truncate", f"{inp.truncate!r} is not a boolean")
        if inp.truncation_direction not in TRUNCATION_DIRECTIONS:
            why = f"{inp.truncation_direction!r} is not one of {', '.join(TRUNCATION_DIRECTIONS)}"
            raise InvalidInput("truncation_direction", why)
        return pooling, dimensions, normalize

    def _pooling(self) -> Pooling:
        if self.pooling is None:
            raise InvalidInput(
                "input",
                f"model {self.requests.cfg.name!r} serves no embeddings: it has no sentence-transformers "
                "Pooling module (serve it with --pooling last or --pooling mean)",
            )
        return self.pooling

    @staticmethod
    def _dimensions(value: object, width: int) -> int:
        if value is None:
            return width
        if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= width:
            raise InvalidInput("dimensions", f"{value!r} is not an integer from 1 to the model's {width}")
        return value

    @staticmethod
    def _prompt(inp: EmbedInput, pooling: Pooling) -> str:
        if inp.prompt is not None and inp.prompt_name is not None:
            raise InvalidInput("prompt", "send a prompt or a prompt_name, not both")
        if inp.prompt is not None:
            if not isinstance(inp.prompt, str):
                raise InvalidInput("prompt", "must be a string")
            return inp.prompt
        name = inp.prompt_name if inp.prompt_name is not None else pooling.default_prompt_name
        if name is None:
            return ""
        if name not in pooling.prompts:
            known = ", ".join(sorted(pooling.prompts)) or "none"
            raise InvalidInput("prompt_name", f"{name!r} is not one of the model's prompts ({known})")
        return pooling.prompts[name]

    def _texts(self, texts: list[str], prompt: str, truncating: bool) -> tuple[list[list[int]], int, int, list[int]]:
        """Each input as `tokenizer(prompt + text)`, the prompt's tokens as sentence-transformers
        counts them (the prompt alone, less a trailing special token), and what a cut keeps: the
        leading tokens (start tokens and prompt) and the end tokens. Rendered through the chat
        template instead (engine/requests/rendered_texts.py), the frame's head is the prompt's run
        and what a cut keeps, with the template's tail when the checkpoint restores it. Texts
        surely over their limits are refused from their length, before tokenizing them (a cut one
        only by its characters' limit)."""
        tokenizer = self.requests.tokenizer
        if tokenizer is None:
            raise InvalidInput("input", f"model {self.requests.cfg.name!r} has no tokenizer; send token ids")
        limits = self.requests.limits
        if len(texts) > limits.max_items:
            why = f"{len(texts)} inputs exceed the limit of {limits.max_items} per request"
            raise InvalidInput("input", why, too_large=True)
        for j, text in enumerate(texts):
            if not text:
                raise InvalidInput(f"input[{j}]", "the input is empty")
            if len(prompt) + len(text) > limits.max_text_chars:
                raise InvalidInput(f"input[{j}]", f"text exceeds the limit of {limits.max_text_chars} characters")
            if not truncating:
                self.requests.check_chars(f"input[{j}]", len(prompt) + len(text), self.max_tokens)
        if limits.max_request_tokens is not None:
            chars = sum(map(len, texts)) + len(prompt) * len(texts)
            self.requests.check_chars("input", chars, limits.max_request_tokens)
        if self.rendered is not None:  # the prompt is the system message: the frame's head is the shared run
            head, tail = self.rendered.frame(prompt)
            kept_tail = tail if self.rendered.chat.restore_suffix else []
            return self.rendered.ids(texts, prompt), len(head), len(head), kept_tail
        sequences = tokenizer.encode_whole_many([prompt + text for text in texts])
        prompt_len = self._prompt_tokens(prompt)[1] if prompt else 0
        return sequences, prompt_len, max(prompt_len, len(tokenizer.start_ids)), tokenizer.end_ids

    def _prompt_tokens(self, prompt: str) -> tuple[list[int], int]:
        """The prompt tokenized alone, and its tokens as sentence-transformers counts them (less a
        trailing special token)."""
        tokenizer = self.requests.tokenizer
        assert tokenizer is not None
        alone = tokenizer.encode_whole_many([prompt])[0]
        special = set(tokenizer.hf.all_special_ids)
        return alone, len(alone) - (1 if alone and alone[-1] in special else 0)

    @staticmethod
    def _fit(
        sequences: list[list[int]], limit: int, kept: int, end_ids: list[int], truncate: bool, direction: str
    ) -> list[int]:
        """Each sequence within `limit` tokens: refused, naming the input, or cut (in place) from
        its text: never from its first `kept` tokens (start tokens and prompt) nor its end tokens.
        Returns the indices of the inputs cut."""
        truncated = []
        for j, seq in enumerate(sequences):
            over = len(seq) - limit
            if over <= 0:
                continue
            if not truncate:
                why = f"{len(seq)} tokens, over the limit of {limit} (ask truncate to cut it)"
                raise InvalidInput(f"input[{j}]", why)
            tail = len(end_ids) if end_ids and seq[-len(end_ids) :] == end_ids else 0
            text = seq[kept : len(seq) - tail]
            if over >= len(text):
                raise InvalidInput(f"input[{j}]", f"its prompt and special tokens alone reach {limit} tokens")
            text = text[: len(text) - over] if direction == "right" else text[over:]
            sequences[j] = seq[:kept] + text + seq[len(seq) - tail :]
            truncated.append(j)
        return truncated

    def _layout(self, sequences: list[list[int]], prompt_len: int, pooling: Pooling) -> TokenizedRequest:
        """The prompt's shared run as the prefix, or whole sequences (see the module doc)."""
        shared = 0
        if prompt_len and _splits(pooling):
            # the prompt's tokens but its last, which a text's first may merge into: the same
            # prefix for every request with this prompt, so the cache serves them all
            shared = min(prompt_len - 1, min(map(len, sequences)) - 1)  # each item keeps a token
            first = np.asarray(sequences[0])
            for seq in sequences[1:]:
                shared = min(shared, common_prefix(first, np.asarray(seq)))
        skip = 0 if pooling.include_prompt or pooling.mode == LAST else prompt_len - shared
        items = TokenRows.from_lists([seq[shared:] for seq in sequences])
        empty = np.flatnonzero(items.lengths <= skip)
        if empty.size:
            # sentence-transformers pools nothing there (a zero vector): refused, not answered with one
            why = (
                "no token of it is pooled: the prompt's tokens stay out of the pool (include_prompt false) and "
                "its text adds none past them (its first token merged with the prompt's last)"
            )
            raise InvalidInput(f"input[{int(empty[0])}]", why)
        over = np.flatnonzero(items.lengths > self.requests.max_item_tokens)
        if over.size:
            j = int(over[0])
            limit = self.requests.max_item_tokens
            why = f"{int(items.lengths[j])} tokens after the prompt's shared run, over the item limit of {limit}"
            raise InvalidInput(f"input[{j}]", why)
        pool = PoolRows(pooling.mode, np.full(len(sequences), skip, np.int64), pooling.dimension)
        prefix = tuple(sequences[0][:shared])
        return TokenizedRequest(prefix, items, (), Pooled(pool), not prefix)


@dataclasses.dataclass(frozen=True)
class StreamPrompt:
    """An embedding stream's open: the prompt's shared run it pins (empty: its inputs run whole)."""

    prefix: tuple[int, ...]
    dimensions: int  # of each embedding


def _splits(pooling: Pooling) -> bool:
    """Whether inputs with a prompt run as items over its shared run: last-token pooling reads
    the last token alone, and a mean or cls without the prompt skips the prompt's tokens; a
    mean or cls over the prompt pools every token, so such inputs run whole."""
    return pooling.mode == LAST or not pooling.include_prompt


def _inputs(value: object) -> tuple[list[str] | None, object]:
    """(texts, None) or (None, token-id lists): OpenAI's `input` forms, a string, strings, token
    ids, or lists of them."""
    if isinstance(value, str):
        return [value], None
    if not isinstance(value, (list, tuple, TokenRows)) or not len(value):
        raise InvalidInput("input", "must be a text, a list of texts, token ids, or a list of token-id lists")
    if isinstance(value, TokenRows):
        return None, value
    if all(isinstance(v, str) for v in value):
        return list(value), None
    if all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        return None, [list(value)]
    if any(isinstance(v, str) for v in value):
        raise InvalidInput("input", "mixes texts and token ids; send all inputs the same way")
    return None, list(value)
