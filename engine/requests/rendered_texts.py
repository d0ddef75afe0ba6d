"""Texts rendered through the tokenizer's chat template, as sentence-transformers 6 renders an
input of a checkpoint it saved with the `message` modality (model/sentence_config.py ChatInputs).

A text becomes the conversation [system: the prompt, when there is one; user: the text], rendered
by `apply_chat_template` with the checkpoint's arguments and tokenized without adding special
tokens (the template writes its own). Every input rendered under one prompt starts with the same
run of tokens (the template's start, the system message, the user turn's header) and ends with the
same tail (the turn's end): the run found by rendering two different texts is the input's frame,
the head a prefix the prefix cache serves to every input, the tail what a text cut to fit keeps.
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np

from prefixscore.engine.requests.known_positions import common_prefix
from prefixscore.model.sentence_config import ChatInputs
from prefixscore.model.tokenizer import TextTokenizer

# two texts that tokenize differently from the first token to the last: what is common to their
# renders is the template's, never a text's (sentence-transformers finds a template's tail the same way)
_FILLERS = ("0", "1 2 3 4")


class RenderedTexts:
    """Renders texts for one tokenizer and one checkpoint's chat arguments (see the module doc)."""

    def __init__(self, tokenizer: TextTokenizer, chat: ChatInputs) -> None:
        self.tokenizer = tokenizer
        self.chat = chat

    def _content(self, text: str) -> Any:
        return text if self.chat.format == "flat" else [{"type": "text", "text": text}]

    def conversation(self, text: str, prompt: str) -> list[dict[str, Any]]:
        """The messages a text is rendered as (an empty prompt adds no system message)."""
        system = [{"role": "system", "content": self._content(prompt)}] if prompt else []
        return [*system, {"role": "user", "content": self._content(text)}]

    def texts(self, texts: list[str], prompt: str) -> list[str]:
        hf = self.tokenizer.hf
        arguments = dict(self.chat.template_kwargs)
        return [hf.apply_chat_template(self.conversation(t, prompt), tokenize=False, **arguments) for t in texts]

    def ids(self, texts: list[str], prompt: str) -> list[list[int]]:
        """Each text's rendered conversation in token ids."""
        return self.tokenizer.encode_many(self.texts(texts, prompt))

    @functools.lru_cache(maxsize=64)  # noqa: B019 - one per prompt, for the life of the kind
    def frame(self, prompt: str) -> tuple[list[int], list[int]]:
        """The head and the tail every input rendered under `prompt` has (see the module doc)."""
        a, b = (np.asarray(ids) for ids in self.ids(list(_FILLERS), prompt))
        head = common_prefix(a, b)
        tail = common_prefix(a[head:][::-1], b[head:][::-1])
        return a[:head].tolist(), a[len(a) - tail :].tolist()
