"""`CrossEncoder`: sentence-transformers' CrossEncoder interface (`predict`, `rank`) over the
reranker of the HTTP rerank API: the same template, labels and relevance
(p(yes) / (p(yes) + p(no)) of the next token; engine/templates.py), in process or from a server.

A decoder reranker has one output, like a cross-encoder with `num_labels=1`: its logit is
log p(yes) - log p(no), and the default activation (sigmoid, as sentence-transformers uses for
one label) turns it back into the API's relevance, which is what `predict` returns by default.
Pairs are scored grouped by query, so each query's prompt is prefilled once and cached for its
documents, whatever the order of the pairs.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Literal

import numpy as np

from prefixscore.offline.progress import Progress

if TYPE_CHECKING:
    from prefixscore.client.score_client import ScoreClient
    from prefixscore.engine.scorer import Scorer

log = logging.getLogger("prefixscore.offline")

Pair = Sequence[str]  # (query, document)


class CrossEncoder:
    """`CrossEncoder("tiny-qwen3")` (a model loaded in process, as `Scorer.load` takes it),
    `CrossEncoder(scorer)`, `CrossEncoder(client)` or `CrossEncoder(target="host:50051")` (a
    running server's reranker over gRPC). `instruction`: the template's task instruction
    (None: its default, as the rerank API)."""

    def __init__(
        self,
        model: str | Scorer | ScoreClient | None = None,
        *,
        target: str | None = None,
        instruction: str | None = None,
        **load_kwargs: Any,
    ) -> None:
        from prefixscore.client.score_client import ScoreClient
        from prefixscore.engine.scorer import Scorer

        if target is not None:
            model = ScoreClient(target)
        elif model is None or isinstance(model, str):
            from prefixscore.model.presets import DEFAULT_MODEL

            model = Scorer.load(model or DEFAULT_MODEL, **load_kwargs)
        self.backend = model
        self.instruction = instruction
        self.num_labels = 1

    def _relevance(self, query: str, documents: list[str]) -> list[float]:
        """The API's relevance of each document, in the order given."""
        from prefixscore.engine.scorer import Scorer

        if isinstance(self.backend, Scorer):
            ranked = self.backend.rerank(query, documents, self.instruction)
        else:
            ranked = self.backend.rerank(query, documents, self.instruction).results
        out = [0.0] * len(documents)
        for r in ranked:
            out[r.index] = r.relevance_score
        return out

    def predict(
        self,
        sentences: list[tuple[str, str]] | list[list[str]] | tuple[str, str] | list[str],
        batch_size: int = 32,
        show_progress_bar: bool | None = None,
        activation_fn: Callable | None = None,
        apply_softmax: bool | None = False,
        convert_to_numpy: bool = True,
        convert_to_tensor: bool = False,
    ) -> Any:
        """One score per (query, document) pair: a float32 numpy array (a numpy float32 for a
        single pair given alone, as sentence-transformers). `activation_fn` is applied to the
        logits (default sigmoid: the API's relevance); `apply_softmax` changes nothing with one
        label, as in sentence-transformers. `convert_to_tensor`: a torch tensor (torch needed);
        neither conversion: a list of numpy float32."""
        singular = bool(sentences) and isinstance(sentences, (list, tuple)) and isinstance(sentences[0], str)
        pairs: list[Pair] = [sentences] if singular else list(sentences)  # type: ignore[list-item]
        if show_progress_bar is None:
            show_progress_bar = log.getEffectiveLevel() in (logging.INFO, logging.DEBUG)
        relevance = np.zeros(len(pairs), dtype=np.float32)
        by_query: dict[str, list[int]] = {}
        for i, pair in enumerate(pairs):
            if len(pair) != 2:
                raise ValueError(f"sentences[{i}]: expected a (query, document) pair, got {len(pair)} texts")
            by_query.setdefault(pair[0], []).append(i)
        progress = Progress(len(pairs), label="predict") if show_progress_bar else None
        done = 0
        for query, rows in by_query.items():
            for start in range(0, len(rows), batch_size):
                chunk = rows[start : start + batch_size]
                relevance[chunk] = self._relevance(query, [pairs[i][1] for i in chunk])
                done += len(chunk)
                if progress:
                    progress.update(lines=len(chunk), items=len(chunk), bytes_read=done)
        if progress:
            progress.finish()
        scores = relevance if activation_fn is None else _activated(activation_fn, relevance)
        if convert_to_tensor:
            import torch

            out: Any = torch.from_numpy(scores)
        elif convert_to_numpy:
            out = scores
        else:
            out = list(scores)
        return out[0] if singular else out

    def rank(
        self,
        query: str,
        documents: list[str],
        top_k: int | None = None,
        return_documents: bool = False,
        batch_size: int = 32,
        show_progress_bar: bool | None = None,
        activation_fn: Callable | None = None,
        apply_softmax: bool = False,
        convert_to_numpy: bool = True,
        convert_to_tensor: bool = False,
    ) -> list[dict[Literal["corpus_id", "score", "text"], int | float | str]]:
        """`[{"corpus_id", "score"(, "text")}]`, highest score first (ties: lower index first),
        the first `top_k` when given."""
        scores = self.predict(
            [[query, doc] for doc in documents],
            batch_size=batch_size,
            show_progress_bar=show_progress_bar,
            activation_fn=activation_fn,
            apply_softmax=apply_softmax,
            convert_to_numpy=convert_to_numpy,
            convert_to_tensor=convert_to_tensor,
        )
        results: list[dict[Literal["corpus_id", "score", "text"], int | float | str]] = []
        for i, score in enumerate(scores):
            results.append({"corpus_id": i, "score": score})
            if return_documents:
                results[-1]["text"] = documents[i]
        results = sorted(results, key=lambda r: r["score"], reverse=True)
        return results[:top_k]


def _activated(fn: Callable, relevance: np.ndarray) -> np.ndarray:
    """`fn` over the logits log p(yes) - log p(no) (recovered from the relevance); a torch module
    (nn.Identity, nn.Sigmoid, as sentence-transformers takes) gets a tensor."""
    with np.errstate(divide="ignore"):
        logits = (np.log(relevance) - np.log1p(-relevance)).astype(np.float32)
    if type(fn).__module__.startswith("torch"):
        import torch

        return fn(torch.from_numpy(logits)).numpy().astype(np.float32)
    return np.asarray(fn(logits), dtype=np.float32)
