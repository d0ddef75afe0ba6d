"""The reranker template at start: which one serves (engine/requests/template_choice.py), said once in the
log, and a known-answer check of it once the server is ready after its warm-up.

The check reranks a few built-in (query, relevant, irrelevant) triples through the same path as
any rerank (validation, the device loop, the template's relevance). It passes when the relevant
document wins every triple: gauge `prefixscore_template_check_passed{template}` 1, else 0 and a
warning in the log with each triple's two relevances. It never refuses anything: random and tiny
models fail it by nature; a real reranker that fails it is served a prompt or a formula it was
not trained with. It runs only after a warm-up (`--warmup true`, the default) and not for the `none`
template (its prompt is the client's own).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Awaitable, Callable

from prometheus_client import Gauge

from prefixscore.engine.requests import template_choice
from prefixscore.engine.requests.kind import RequestKind, Served
from prefixscore.engine.requests.rerank import RerankInput, RerankKind
from prefixscore.engine.requests.templates import RerankTemplate
from prefixscore.model.loader import LoadedModel
from prefixscore.telemetry.logs import event

log = logging.getLogger("prefixscore.service")

# (query, a document that answers it, a document about something else)
TRIPLES = (
    (
        "What is the capital of France?",
        "Paris is the capital and largest city of France.",
        "Bananas are a good source of potassium and vitamin B6.",
    ),
    (
        "How many legs does a spider have?",
        "Spiders have eight legs, unlike insects, which have six.",
        "The Eiffel Tower was completed in 1889 for the World's Fair.",
    ),
    (
        "Who wrote the play Romeo and Juliet?",
        "Romeo and Juliet is a tragedy written by William Shakespeare.",
        "Photosynthesis turns light, water and carbon dioxide into sugar in plants.",
    ),
)


@dataclasses.dataclass(frozen=True)
class CheckResult:
    passed: bool
    relevance: list[tuple[float, float]]  # per triple: the relevant document's, the irrelevant one's


def at_start(requested: str, loaded: LoadedModel) -> tuple[RerankTemplate | None, template_choice.TemplateChoice]:
    """The template serving `loaded` and why; a model with a tokenizer and no template is said
    once in the log (rerank is refused until `--template` names one)."""
    template, choice = template_choice.bind(requested, loaded)
    if template is None and loaded.tokenizer is not None:
        event(log, "rerank_refused", level=logging.WARNING, template=requested, reason=choice.refusal())
    return template, choice


def verdict(scores: list[list[float]]) -> CheckResult:
    """Each triple's [relevant, irrelevant] relevance -> the check's result."""
    pairs = [(float(s[0]), float(s[1])) for s in scores]
    return CheckResult(all(rel > irrel for rel, irrel in pairs), pairs)


async def run(
    serve: Callable[[RequestKind, RerankInput, str], Awaitable[Served]], passed: Gauge, rerank: RerankKind
) -> CheckResult | None:
    """The check on the service's device loop (`serve`: a request of a kind, answered; None:
    not run, see the module doc); the gauge `passed` and the log say how it went."""
    template = rerank.template
    if template is None or template.record.client_phrased:
        return None
    try:
        answers = await asyncio.gather(
            *(
                serve(rerank, RerankInput(q, [relevant, irrelevant]), "TemplateCheck")
                for q, relevant, irrelevant in TRIPLES
            )
        )
    except Exception as err:  # shutting down, a full queue, a context too short: no verdict, nothing refused
        event(log, "template_check_skipped", level=logging.WARNING, error=f"{type(err).__name__}: {err}")
        return None
    # each document's relevance in the request's order (the result ranks them)
    result = verdict([RerankTemplate.relevance(a.done[0].answer) for a in answers])
    passed.labels(template.name).set(int(result.passed))
    event(
        log,
        "template_check",
        level=logging.INFO if result.passed else logging.WARNING,
        template=template.name,
        passed=result.passed,
        relevance=[[round(a, 4), round(b, 4)] for a, b in result.relevance],
    )
    return result
