"""Conversations rendered by the model's chat template: a reward model's conversation to classify
(engine/requests/classify.py), or one whose next assistant turn each candidate is
(engine/requests/score.py)."""

from __future__ import annotations

from prefixscore.engine.requests.invalid_input import InvalidInput
from prefixscore.model.tokenizer import TextTokenizer

# a text no conversation holds: the content of the turn the candidates fill, found in the rendering
_TURN = "\x00prefixscore-turn\x00"


def conversations(tokenizer: TextTokenizer | None, messages: object) -> list[str]:
    """One conversation or a list of them -> each rendered whole by the chat template (the
    text a reward model reads; conversations that share their leading turns share tokens)."""
    if tokenizer is None or not getattr(tokenizer.hf, "chat_template", None):
        raise InvalidInput("messages", "the model's tokenizer has no chat template; send input instead")
    if not isinstance(messages, list) or not messages:
        raise InvalidInput("messages", "must be a conversation (a list of messages) or a list of conversations")
    many = [messages] if isinstance(messages[0], dict) else messages
    texts = []
    for j, conversation in enumerate(many):
        where = "messages" if many is not messages else f"messages[{j}]"
        if not isinstance(conversation, list) or not conversation:
            raise InvalidInput(where, "must be a non-empty list of messages")
        for k, message in enumerate(conversation):
            if not (
                isinstance(message, dict)
                and isinstance(message.get("role"), str)
                and isinstance(message.get("content"), str)
            ):
                raise InvalidInput(f"{where}[{k}]", 'must be {"role": str, "content": str}')
        try:
            texts.append(tokenizer.hf.apply_chat_template(conversation, tokenize=False))
        except Exception as err:  # the template's own check (roles out of order, ...)
            raise InvalidInput(where, f"the chat template refused it: {err}") from err
    return texts


def candidate_turns(tokenizer: TextTokenizer | None, messages: object, candidates: object) -> tuple[str, list[str]]:
    """A conversation and candidate assistant turns -> the query (the conversation rendered up
    to the next assistant turn's content) and the items (each candidate + the turn's end)."""
    if not isinstance(candidates, list) or not all(isinstance(it, str) for it in candidates):
        raise InvalidInput("items", "with messages, items are the candidate assistant turns' texts")
    if not isinstance(messages, list) or not messages or not isinstance(messages[0], dict):
        raise InvalidInput("messages", "must be a conversation (a list of messages)")
    (text,) = conversations(tokenizer, [*messages, {"role": "assistant", "content": _TURN}])
    before, found, after = text.partition(_TURN)
    if not found:
        raise InvalidInput("messages", "the chat template does not render an assistant turn's content as it is")
    return before, [c + after for c in candidates]
