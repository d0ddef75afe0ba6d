"""`Scorer`: the in-process public API (`from prefixscore import Scorer`)."""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Sequence

import numpy as np

from prefixscore.model.buckets import Buckets
from prefixscore.model.engine import PrefixKV, ScoringEngine
from prefixscore.model.loader import LoadedModel, load_model
from prefixscore.model.presets import DEFAULT_MODEL
from prefixscore.service.prefix_cache import PrefixCache
from prefixscore.service.requests import Limits, RequestTokenizer, TokenizedRequest

MODES = ("prefix", "sequential", "packed")


@dataclasses.dataclass(frozen=True)
class Usage:
    prompt_tokens: int  # query + all items, as a plain forward of each would see them once
    cached_tokens: int  # prefix tokens served from the prefix cache (no prefill ran)
    items: int


class Scorer:
    """Scores items against a query with SGLang `/v1/score` semantics (see DESIGN.md).

    `score` is thread-safe; device work is serialised by a lock (the gRPC
    service uses its own batching worker instead).
    """

    def __init__(
        self, model: LoadedModel, engine: ScoringEngine, limits: Limits | None = None, prefix_cache_bytes: int = 1 << 30
    ) -> None:
        self.model = model
        self.engine = engine
        self.requests = RequestTokenizer(model.cfg, model.tokenizer, limits or Limits.for_engine(engine))
        self.prefix_cache: PrefixCache[PrefixKV] = PrefixCache(prefix_cache_bytes, lambda kv: kv.nbytes)
        self.last_usage = Usage(0, 0, 0)
        self._lock = threading.Lock()

    @classmethod
    def load(
        cls,
        model: str = DEFAULT_MODEL,
        dtype: str = "float32",
        *,
        buckets: Buckets | None = None,
        attn_impl: str | None = None,
        prefix_cache_bytes: int = 1 << 30,
    ) -> Scorer:
        """Load a preset, local HF directory, .gguf file or hub id (see model/loader.py)."""
        loaded = load_model(model, dtype)
        return cls(
            loaded, ScoringEngine(loaded.cfg, loaded.params, dtype, buckets, attn_impl), None, prefix_cache_bytes
        )

    @property
    def cfg(self):
        return self.model.cfg

    def score(
        self,
        query: str | Sequence[int],
        items: Sequence[str] | Sequence[Sequence[int]],
        label_token_ids: Sequence[int],
        apply_softmax: bool = False,
        item_first: bool = False,
        *,
        mode: str = "prefix",
    ) -> list[list[float]]:
        """Probabilities [len(items)][len(label_token_ids)] of each label as the next token
        after `query + item` (or `item + query` with item_first).

        mode: "prefix" (shared-prefix fast path), or the baselines "sequential"
        (one full forward per item) and "packed" (one sequence, block-diagonal mask).
        Raises ValueError (InvalidInput) naming the field for bad input, before device work.
        """
        if mode not in MODES:
            raise ValueError(f"mode: {mode!r} is not one of {MODES}")
        req = self.requests.request(query, items, label_token_ids, apply_softmax, item_first)
        if not req.items:
            self.last_usage = Usage(0, 0, 0)
            return []
        return self.score_tokens(req, mode).tolist()

    def score_tokens(self, req: TokenizedRequest, mode: str = "prefix") -> np.ndarray:
        """Score an already validated request -> [items, labels] float32."""
        labels, softmax = req.label_ids, req.apply_softmax
        with self._lock:
            cached = 0
            if req.item_first:
                # no shared prefix exists: each item + query is its own sequence
                if mode == "sequential":
                    probs = np.concatenate([self.engine.score_sequences([s], labels, softmax) for s in req.items])
                else:
                    probs = self.engine.score_sequences(req.items, labels, softmax)
            elif mode == "sequential":
                full = [list(req.prefix) + it for it in req.items]
                probs = np.concatenate([self.engine.score_sequences([s], labels, softmax) for s in full])
            elif mode == "packed":
                probs = self.engine.score_packed(req.prefix, req.items, labels, softmax)
            else:
                kv = self.prefix_cache.get(req.prefix)
                if kv is None:
                    kv = self.engine.prefill(req.prefix)
                    self.prefix_cache.put(req.prefix, kv)
                else:
                    cached = len(req.prefix)
                probs = self.engine.score_items(kv, req.items, labels, softmax)
            self.last_usage = Usage(req.prompt_tokens, cached, len(req.items))
            return probs
