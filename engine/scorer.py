"""`Scorer`: the in-process public API (`from prefixscore import Scorer`)."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import threading
import weakref
from collections.abc import Sequence
from typing import Any

import numpy as np

from prefixscore import choices
from prefixscore.engine import options
from prefixscore.engine.build import EngineSpec, build_engine
from prefixscore.engine.loop.batcher import Batcher
from prefixscore.engine.loop.device_loop import DeviceWorker
from prefixscore.engine.loop.request import TokenizedRequest
from prefixscore.engine.loop.work_unit import Ticket, WorkUnit
from prefixscore.engine.requests import catalog, heads, template_choice
from prefixscore.engine.requests.answers import LabelScores
from prefixscore.engine.requests.embedding import EmbedInput
from prefixscore.engine.requests.kind import Done, Served, served, to_run
from prefixscore.engine.requests.likelihood import ItemLikelihood
from prefixscore.engine.requests.rerank import RerankInput
from prefixscore.engine.requests.score import ScoreInput
from prefixscore.engine.requests.validation import Limits, RequestTokenizer
from prefixscore.engine.runtime.buckets import Buckets
from prefixscore.engine.runtime.scoring_engine import ScoringEngine
from prefixscore.model.call_inputs import OUTPUT_LOGIT, OUTPUT_SOFTMAX
from prefixscore.model.loader import LoadedModel
from prefixscore.telemetry.metrics import ServiceMetrics

MODES = ("prefix", "sequential", "packed")


@dataclasses.dataclass(frozen=True)
class Usage:
    prompt_tokens: int  # query + all items, as a plain forward of each would see them once
    cached_tokens: int  # prefix tokens served from the prefix cache (no prefill ran)
    items: int


@dataclasses.dataclass(frozen=True)
class RerankResult:
    index: int  # the document's index in the request
    relevance_score: float  # the template's relevance, in [0, 1]
    document: str


class Scorer:
    """Scores items against a query with SGLang `/v1/score` semantics (see the README).

    The same device loop as the gRPC service (EngineRunner: a DeviceWorker of its own), waited
    for on the caller's thread: the prefix cache pins the query's pages, the batcher plans
    calls that may mix requests (`score_requests`), the engine runs them. `score` is
    thread-safe.
    """

    def __init__(
        self,
        model: LoadedModel,
        engine: ScoringEngine,
        limits: Limits | None = None,
        template: str = choices.DEFAULT_TEMPLATE,
    ) -> None:
        self.model = model
        self.engine = engine
        # `auto`: the published reranker recognized from the checkpoint, else none (rerank refused)
        self.template, self.template_choice = template_choice.bind(template, model)
        # the service's kinds and validation, built as the service builds them
        limits = limits or Limits.for_engine(engine)
        self.kinds = catalog.for_model(model, limits, self.template, self.template_choice)
        self.runner = EngineRunner(engine)
        self.last_usage = Usage(0, 0, 0)
        self._lock = threading.Lock()

    @classmethod
    def load(
        cls,
        model: str = choices.DEFAULT_MODEL,
        dtype: str = choices.DEFAULT_DTYPE,
        *,
        buckets: Buckets | None = None,
        **engine_options: Any,
    ) -> Scorer:
        """Load a preset, local HF directory, .gguf file or hub id (see model/loader.py).
        engine_options: any option of engine/options.py by its name, as `serve`'s flags: template
        (the reranker prompt of `rerank`: auto, the published reranker recognized from the
        checkpoint, else `rerank` refuses; or a record's name, engine/requests/templates.py), attn_impl,
        tp_size and dp_size (the device mesh, engine/runtime/mesh.py), pool_bytes, pool_memory_fraction,
        compile_cache, quantize and activations (8-bit projections, model/quant_choice.py).
        Raises TypeError for a name that is no option."""
        options.check_names(engine_options)
        spec = EngineSpec.from_options({"model": model, "dtype": dtype, **engine_options}, buckets=buckets)
        built = build_engine(spec)
        template = engine_options.get("template", options.BY_NAME["template"].default)
        return cls(built.model, built.engine, template=template)

    @property
    def cfg(self):
        return self.model.cfg

    @property
    def requests(self) -> RequestTokenizer:
        """The model's validation and tokenization, shared by every kind."""
        return self.kinds.requests

    def serve(self, kind: str, inp: Any) -> Served:
        """A request of any kind (engine/requests/catalog.py), as the gRPC and HTTP APIs serve it:
        validated and planned, its requests run together on the device loop, then answered.
        Raises ValueError (InvalidInput) naming the field for bad input, before device work."""
        served_kind = self.kinds[kind]
        plan = served_kind.plan(inp)
        with self._lock:
            todo = to_run(plan)
            units = self.runner.run_requests(todo) if todo else []
            answer = served(served_kind, plan, [Done.of(u) for u in units])
            usage = answer.usage()
            self.last_usage = Usage(usage["prompt_tokens"], usage["cached_tokens"], usage["items"])
        return answer

    def score(
        self,
        query: str | Sequence[int],
        items: Sequence[str] | Sequence[Sequence[int]],
        label_token_ids: Sequence[int] = (),
        apply_softmax: bool = False,
        item_first: bool = False,
        *,
        mode: str = "prefix",
        activation: str = "auto",
    ) -> list[list[float]]:
        """Probabilities [len(items)][len(label_token_ids)] of each label as the next token
        after `query + item` (or `item + query` with item_first).

        A classifier model (`cfg.num_labels`; send no label_token_ids) returns its head's
        outputs [len(items)][num_labels] at the last token instead, as `activation` asks:
        "auto" (sigmoid for one label, softmax for several), "none" (raw logits), "sigmoid",
        "softmax"; the columns are `cfg.label_names`.
        mode: "prefix" (shared-prefix fast path), or the baselines "sequential"
        (one full forward per item) and "packed" (one sequence, block-diagonal mask).
        Raises ValueError (InvalidInput) naming the field for bad input, before device work.
        """
        if mode not in MODES:
            raise ValueError(f"mode: {mode!r} is not one of {MODES}")
        req = self.tokenize(query, items, label_token_ids, apply_softmax, item_first, activation)
        if not req.items:
            self.last_usage = Usage(0, 0, 0)
            return []
        return self.score_tokens(req, mode).tolist()

    def tokenize(
        self,
        query: str | Sequence[int],
        items: Sequence[str] | Sequence[Sequence[int]],
        label_token_ids: Sequence[int] = (),
        apply_softmax: bool = False,
        item_first: bool = False,
        activation: str = "auto",
    ) -> TokenizedRequest:
        """The validated token ids `score` runs (the same validation as the gRPC and HTTP APIs)."""
        inp = ScoreInput(
            query, items, label_token_ids, apply_softmax=apply_softmax, item_first=item_first, activation=activation
        )
        return self.kinds["score"].plan(inp).request

    def rerank(
        self,
        query: str,
        documents: Sequence[str],
        instruction: str | None = None,
        top_n: int | None = None,
        max_tokens_per_doc: int | None = None,
        truncate: str = "end",
        truncation_side: str = "right",
    ) -> list[RerankResult]:
        """Documents sorted by the template's relevance to `query`, highest first (the `top_n`
        first when given), as the gRPC Rerank and HTTP /v1/rerank return them."""
        answer = self.serve(
            "rerank",
            RerankInput(
                query,
                list(documents),
                instruction,
                top_n,
                max_tokens_per_doc=max_tokens_per_doc,
                truncate=truncate,
                truncation_side=truncation_side,
            ),
        )
        return [RerankResult(r.index, r.relevance_score, answer.plan.documents[r.index]) for r in answer.result]

    def loglikelihood(
        self, context: str | Sequence[int], continuations: Sequence[str] | Sequence[Sequence[int]]
    ) -> list[tuple[float, bool]]:
        """(log p(continuation | context), is_greedy) per continuation, as lm-evaluation-harness's
        `loglikelihood` returns them: the context is prefilled once and every continuation is
        scored over it as an item. Text: the context gets the model's start tokens, the
        continuations none; token ids are taken as given. Raises ValueError (InvalidInput)
        naming the field for bad input, before device work."""
        return [(item.total, item.is_greedy) for item in self.loglikelihood_tokens(context, continuations)]

    def loglikelihood_tokens(
        self, context: str | Sequence[int], continuations: Sequence[str] | Sequence[Sequence[int]]
    ) -> list[ItemLikelihood]:
        """Per continuation, its tokens' log-probs, whether each is the argmax, and the top
        log-probs at each position (engine/requests/likelihood.py ItemLikelihood)."""
        return self.serve("likelihood", ScoreInput(context, continuations, loglikelihood=True)).result

    def embed(
        self,
        inputs: str | Sequence[str] | Sequence[int] | Sequence[Sequence[int]],
        *,
        prompt_name: str | None = None,
        prompt: str | None = None,
        dimensions: int | None = None,
        normalize: bool | None = None,
        truncate: bool = False,
        truncation_direction: str = "right",
    ) -> np.ndarray:
        """Embeddings [inputs, dimensions] float32, as sentence-transformers' `encode` computes them
        on the same checkpoint (engine/requests/embedding.py): each text after its prompt (`prompt_name`,
        `prompt`, or the model's default), pooled as the model's Pooling says, the first
        `dimensions` kept, then L2-normalized when the model normalizes (or `normalize` says).
        The prompt is prefilled once and cached; each input runs over it. Raises ValueError
        (InvalidInput) naming the field for bad input, before device work."""
        inp = EmbedInput(inputs, prompt_name, prompt, dimensions, normalize, truncate, truncation_direction)
        return self.serve("embed", inp).result

    def score_tokens(self, req: TokenizedRequest, mode: str = "prefix") -> np.ndarray:
        """Score an already validated request -> [items, labels] float32."""
        rows = req.answer
        # the packed baseline returns probabilities only: a request for raw logits runs sequentially
        if mode == "packed" and not req.item_first and isinstance(rows, LabelScores) and rows.output != OUTPUT_LOGIT:
            with self._lock:
                probs = self.engine.score_packed(req.prefix, req.items, req.label_ids, rows.output == OUTPUT_SOFTMAX)
                self.last_usage = Usage(req.prompt_tokens, 0, len(req.items))
            return heads.activate(probs, rows.activation)
        if mode in ("sequential", "packed"):
            # one whole sequence per call: query + item (or item + query) over no prefix
            sequences = req.items if req.item_first else [list(req.prefix) + it for it in req.items]
            rows = [
                self.score_requests([dataclasses.replace(req, prefix=(), items=[s], item_first=True)])[0]
                for s in sequences
            ]
            self.last_usage = Usage(req.prompt_tokens, 0, len(req.items))
            return np.concatenate(rows)
        return self.score_requests([req])[0]

    def score_requests(self, reqs: Sequence[TokenizedRequest]) -> list[np.ndarray]:
        """Several validated requests at once: their prefills and items share device calls
        (each call is planned from all of them). Returns [items, labels] float32 per request;
        `last_usage` is the last request's."""
        with self._lock:
            scores, cached = self.runner.score_requests(reqs)
            last = reqs[-1]
            self.last_usage = Usage(last.prompt_tokens, cached[-1], len(last.items))
            return scores


class EngineRunner:
    """Runs validated requests on the service's one device loop and waits for them: the
    in-process path. It drives a `DeviceWorker` of its own over the engine (the same
    admission, planning, launch and read-back as the server's), and stops it when it is
    garbage collected or closed.
    """

    def __init__(self, engine: ScoringEngine) -> None:
        self.engine = engine
        started: concurrent.futures.Future = concurrent.futures.Future()
        self.worker = DeviceWorker(
            lambda: engine,
            ServiceMetrics(),
            max_queue_items=1 << 62,  # an in-process caller is bounded by its own requests
            on_ready=lambda err: started.set_exception(err) if err else started.set_result(None),
        )
        self.worker.start()
        started.result()
        self._closer = weakref.finalize(self, self.worker.stop, 30.0)

    @property
    def batcher(self) -> Batcher:
        assert self.worker.batcher is not None
        return self.worker.batcher

    def close(self) -> None:
        self._closer()

    def score_requests(self, reqs: Sequence[TokenizedRequest]) -> tuple[list[np.ndarray], list[int]]:
        """Scores [items, labels] and prefix tokens served from the cache, per request (run_requests)."""
        units = self.run_requests(reqs)
        return [unit.reply.answer for unit in units], [unit.reply.cached_tokens for unit in units]

    def run_requests(self, reqs: Sequence[TokenizedRequest]) -> list[WorkUnit]:
        """The requests' units, answered. The requests are queued together before the loop plans,
        so their prefills and items share calls; the first failure is raised (QueueFull when the
        prefix pool cannot hold them)."""
        units = [WorkUnit(r, Ticket(method="InProcess")) for r in reqs]
        left = threading.Semaphore(0)
        for unit in units:
            unit.reply.on_done = lambda _: left.release()
        submitted = []
        try:
            with self.worker.paused():  # plan once everything is queued
                for unit in units:
                    self.worker.submit(unit)
                    submitted.append(unit)
        except BaseException:
            for unit in submitted:
                self.worker.cancel(unit)
            raise
        for _ in units:
            left.acquire()
        for unit in units:
            if unit.reply.error is not None:
                raise unit.reply.error
        return units
