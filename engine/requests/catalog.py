"""The request kinds a model serves (engine/requests/kind.py), built in one place for the
service (service/core.py) and the in-process `Scorer` (engine/scorer.py).

A kind enters as one row: a name and a factory that builds it from what every kind may need
(`KindContext`). The built-in kinds are rows of `BUILT_IN`; a kind from outside the package
(a plug-in, a test) is `register`ed before the service or the Scorer is built, and is then
served by the generic routes (gRPC `Run`, HTTP `POST /v1/run/{kind}`) like any other.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator

from prefixscore.engine.requests.classify import ClassifyKind
from prefixscore.engine.requests.completions import CompletionsKind
from prefixscore.engine.requests.embedding import EmbedKind
from prefixscore.engine.requests.invalid_input import InvalidInput
from prefixscore.engine.requests.kind import RequestKind
from prefixscore.engine.requests.likelihood import LikelihoodKind
from prefixscore.engine.requests.rerank import RerankKind
from prefixscore.engine.requests.score import ScoreKind
from prefixscore.engine.requests.template_choice import TemplateChoice
from prefixscore.engine.requests.templates import RerankTemplate
from prefixscore.engine.requests.validation import Limits, RequestTokenizer
from prefixscore.model.loader import LoadedModel
from prefixscore.model.sentence_config import Pooling


@dataclasses.dataclass(frozen=True)
class KindContext:
    """What a kind is built from: the model's validation and tokenization (its limits, head and
    tokenizer), its reranker template (None: no rerank; `no_template` says why) and its pooling
    (None: no embeddings)."""

    requests: RequestTokenizer
    template: RerankTemplate | None = None
    no_template: str = ""
    pooling: Pooling | None = None


KindFactory = Callable[[KindContext], RequestKind]

BUILT_IN: dict[str, KindFactory] = {
    ScoreKind.name: lambda c: ScoreKind(c.requests),
    LikelihoodKind.name: lambda c: LikelihoodKind(c.requests),
    RerankKind.name: lambda c: RerankKind(c.requests, c.template, c.no_template),
    ClassifyKind.name: lambda c: ClassifyKind(c.requests),
    CompletionsKind.name: lambda c: CompletionsKind(c.requests),
    EmbedKind.name: lambda c: EmbedKind(c.requests, c.pooling),
}

_registered: dict[str, KindFactory] = {}


def register(name: str, factory: KindFactory) -> None:
    """Serve one more kind from the next service or Scorer built on."""
    if name in BUILT_IN or name in _registered:
        raise ValueError(f"a kind named {name!r} is already served")
    _registered[name] = factory


def unregister(name: str) -> None:
    del _registered[name]


@contextlib.contextmanager
def registered(name: str, factory: KindFactory) -> Iterator[None]:
    """`register` for the life of a block."""
    register(name, factory)
    try:
        yield
    finally:
        unregister(name)


class Kinds:
    """Every kind a model serves, by name, built once (a kind may keep state between requests:
    /v1/completions keeps the positions it computed)."""

    def __init__(self, context: KindContext) -> None:
        self.context = context
        self._kinds = {name: build(context) for name, build in {**BUILT_IN, **_registered}.items()}

    @property
    def requests(self) -> RequestTokenizer:
        return self.context.requests

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(self._kinds)

    def __getitem__(self, name: str) -> RequestKind:
        kind = self._kinds.get(name)
        if kind is None:
            raise InvalidInput("kind", f"{name!r} is not served here; the kinds: {', '.join(self._kinds)}")
        return kind


def for_model(model: LoadedModel, limits: Limits, template: RerankTemplate | None, choice: TemplateChoice) -> Kinds:
    """The kinds a loaded model serves within `limits`, its reranker template as `choice` bound it
    (engine/requests/template_choice.py)."""
    no_template = choice.refusal() if model.tokenizer is not None else ""
    requests = RequestTokenizer(model.cfg, model.tokenizer, limits)
    return Kinds(KindContext(requests, template, no_template, model.pooling))
