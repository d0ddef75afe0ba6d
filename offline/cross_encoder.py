"""`CrossEncoder`: sentence-transformers' CrossEncoder interface (`predict`, `rank`) over the
reranker of the HTTP rerank API: the same template, labels and relevance (the template's
record: engine/requests/templates.py; `template=` in process, default `auto`), in process or from a server;
or, for a sequence classifier loaded in process, over its head, as sentence-transformers scores it.

A classifier scores each pair exactly as sentence-transformers' `CrossEncoder(model_dir)` (6.x):
the pair's token ids are the tokenizer's chat template rendered over the messages
`[{"role": "query", ...}, {"role": "document", ...}]` when the tokenizer has one, else
`tokenizer(query, document)` (special tokens included); the activation is the one it saved
(`config_sentence_transformers.json` or config.json's `sentence_transformers.activation_fn`, a
torch.* class), else a sigmoid for one label and the raw logits for several.

A decoder reranker has one output, like a cross-encoder with `num_labels=1`: its logit is the one
its template's relevance is the sigmoid of (log p(yes) - log p(no) for qwen3-reranker, the raw
"Yes" logit for bge-reranker-v2-gemma), and the default activation (sigmoid, as
sentence-transformers uses for one label) turns it back into the API's relevance, which is what
`predict` returns by default.
Pairs are scored grouped by query, so each query's prompt is prefilled once and cached for its
documents, whatever the order of the pairs.
"""

from __future__ import annotations

import importlib
import json
import logging
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import numpy as np

from prefixscore.model.head import output_head
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
    (None: its default, as the rerank API; a classifier has no template). `activation_fn`: the
    default of `predict` and `rank` (None: as sentence-transformers picks it, module docstring)."""

    def __init__(
        self,
        model: str | Scorer | ScoreClient | None = None,
        *,
        target: str | None = None,
        instruction: str | None = None,
        activation_fn: Callable | None = None,
        **load_kwargs: Any,
    ) -> None:
        from prefixscore.client.score_client import ScoreClient
        from prefixscore.engine.scorer import Scorer

        model_dir = Path(model) if isinstance(model, str) and Path(model).is_dir() else None
        if target is not None:
            model = ScoreClient(target)
        elif model is None or isinstance(model, str):
            from prefixscore.model.presets import DEFAULT_MODEL

            model = Scorer.load(model or DEFAULT_MODEL, **load_kwargs)
        self.backend = model
        self.instruction = instruction
        # a classifier's head scores its own label rows; a causal reranker has one output (module docstring)
        head = output_head(model.cfg) if isinstance(model, Scorer) else None
        self.classifier = head is not None and head.own_rows
        self.num_labels = head.rows if head is not None and self.classifier else 1
        if self.classifier and model.model.tokenizer is None:  # type: ignore[union-attr]
            raise ValueError("a classifier scores text pairs as sentence-transformers: the model needs a tokenizer")
        if activation_fn is None and self.classifier:
            saved = _saved_activation(model_dir) if model_dir is not None else None
            activation_fn = saved or (_sigmoid if self.num_labels == 1 else None)
        self.activation_fn = activation_fn

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

    def _classifier_logits(self, query: str, documents: list[str], batch_size: int) -> np.ndarray:
        """[len(documents), num_labels] raw logits of the classifier's head over each pair's ids
        (as sentence-transformers builds them). The ids all the pairs share (at least the query's)
        are the cached prefix and the rest of each pair its item: where the split falls changes no
        score, each pair is still read whole."""
        hf = self.backend.model.tokenizer.hf  # type: ignore[union-attr]
        if hf.chat_template:  # sentence-transformers 6 renders a pair through the chat template when there is one
            messages = [[{"role": "query", "content": query}, {"role": "document", "content": d}] for d in documents]
            ids = hf.apply_chat_template(messages, tokenize=True)["input_ids"]
        else:
            ids = hf([query] * len(documents), documents)["input_ids"]
        shared = min(len(x) for x in ids) - 1  # every item keeps a token
        for k in range(shared):
            if any(x[k] != ids[0][k] for x in ids):
                shared = k
                break
        prefix = ids[0][:shared]
        chunks = [
            self.backend.score(prefix, [x[shared:] for x in ids[start : start + batch_size]], activation="none")
            for start in range(0, len(ids), batch_size)
        ]
        return np.concatenate([np.asarray(c, dtype=np.float32).reshape(-1, self.num_labels) for c in chunks])

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
        """One score per (query, document) pair: a float32 numpy array, [pairs] for one label and
        [pairs, num_labels] for several (a single pair given alone: a numpy float32, or its row),
        as sentence-transformers. `activation_fn` is applied to the logits (default: the
        model's, `self.activation_fn`; a causal reranker's sigmoid gives the API's relevance);
        `apply_softmax` then takes a softmax over several labels (none with one).
        `convert_to_tensor`: a torch tensor (torch needed); neither conversion: a list of torch
        tensors, one per pair."""
        singular = bool(sentences) and isinstance(sentences, (list, tuple)) and isinstance(sentences[0], str)
        pairs: list[Pair] = [sentences] if singular else list(sentences)  # type: ignore[list-item]
        if show_progress_bar is None:
            show_progress_bar = log.getEffectiveLevel() in (logging.INFO, logging.DEBUG)
        if activation_fn is None:
            activation_fn = self.activation_fn
        raw = np.zeros((len(pairs), self.num_labels), dtype=np.float32)
        by_query: dict[str, list[int]] = {}
        for i, pair in enumerate(pairs):
            if len(pair) != 2:
                raise ValueError(f"sentences[{i}]: expected a (query, document) pair, got {len(pair)} texts")
            by_query.setdefault(pair[0], []).append(i)
        progress = Progress(len(pairs), label="predict") if show_progress_bar else None
        done = 0
        for query, rows in by_query.items():
            if self.classifier:
                raw[rows] = self._classifier_logits(query, [pairs[i][1] for i in rows], batch_size)
                done += len(rows)
                if progress:
                    progress.update(lines=len(rows), items=len(rows), bytes_read=done)
                continue
            for start in range(0, len(rows), batch_size):
                chunk = rows[start : start + batch_size]
                raw[chunk, 0] = self._relevance(query, [pairs[i][1] for i in chunk])
                done += len(chunk)
                if progress:
                    progress.update(lines=len(chunk), items=len(chunk), bytes_read=done)
        if progress:
            progress.finish()
        if self.classifier:
            scores = raw if activation_fn is None else _apply(activation_fn, raw)
        else:  # the relevance is the causal reranker's sigmoid of its logit
            scores = raw if activation_fn is None else _apply(activation_fn, _relevance_logits(raw))
        if self.num_labels == 1:
            scores = scores[:, 0]
        elif apply_softmax:
            scores = _softmax(scores)
        if convert_to_numpy and not convert_to_tensor:
            out: Any = scores
        else:  # a tensor, or a list of its rows (neither conversion), as sentence-transformers (torch needed)
            import torch

            out = torch.from_numpy(scores) if convert_to_tensor else list(torch.from_numpy(scores))
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
        the first `top_k` when given; the scores are Python floats, as sentence-transformers'
        (which refuses models of several labels too). `apply_softmax`, `convert_to_numpy` and
        `convert_to_tensor` are taken and change nothing, as there (its deprecated arguments)."""
        if self.num_labels != 1:
            raise ValueError(
                "CrossEncoder.rank() only works for models with num_labels=1. "
                "Consider using CrossEncoder.predict() with input pairs instead."
            )
        scores = self.predict(
            [[query, doc] for doc in documents],
            batch_size=batch_size,
            show_progress_bar=show_progress_bar,
            activation_fn=activation_fn,
        )
        results: list[dict[Literal["corpus_id", "score", "text"], int | float | str]] = []
        for i, score in enumerate(scores.tolist()):
            results.append({"corpus_id": i, "score": score})
            if return_documents:
                results[-1]["text"] = documents[i]
        results = sorted(results, key=lambda r: r["score"], reverse=True)
        return results[:top_k]


def _relevance_logits(relevance: np.ndarray) -> np.ndarray:
    """A causal reranker's logits (the sigmoid's argument: log p(yes) - log p(no), or a label's raw
    logit), recovered from its relevance."""
    with np.errstate(divide="ignore"):
        return (np.log(relevance) - np.log1p(-relevance)).astype(np.float32)


def _apply(fn: Callable, logits: np.ndarray) -> np.ndarray:
    """`fn` over [pairs, labels] logits; a torch module (nn.Identity, nn.Sigmoid, as
    sentence-transformers takes) gets a tensor."""
    if type(fn).__module__.startswith("torch"):
        import torch

        return fn(torch.from_numpy(logits)).numpy().astype(np.float32)
    return np.asarray(fn(logits), dtype=np.float32)


def _sigmoid(x: np.ndarray) -> np.ndarray:
    """sentence-transformers' default for one label (nn.Sigmoid), without needing torch."""
    return (1.0 / (1.0 + np.exp(-x.astype(np.float64)))).astype(np.float32)


def _softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x.astype(np.float64) - x.max(axis=-1, keepdims=True))
    return (e / e.sum(axis=-1, keepdims=True)).astype(np.float32)


def _saved_activation(model_dir: Path) -> Callable | None:
    """The activation a sentence-transformers checkpoint saved, looked up where it looks
    (config_sentence_transformers.json, then config.json's `sentence_transformers` key, then the
    pre-4.0 `sbert_ce_default_activation_function`): an instance of its torch.* class. Other
    paths are code it would not run without trust_remote_code: None (the default), as there."""
    paths = []
    st_config = model_dir / "config_sentence_transformers.json"
    if st_config.is_file():
        paths.append(json.loads(st_config.read_text()).get("activation_fn"))
    if (model_dir / "config.json").is_file():
        config = json.loads((model_dir / "config.json").read_text())
        paths.append((config.get("sentence_transformers") or {}).get("activation_fn"))
        paths.append(config.get("sbert_ce_default_activation_function"))
    path = next((p for p in paths if p and p.startswith("torch.")), None)
    if path is None:
        return None
    module, _, name = path.rpartition(".")
    return getattr(importlib.import_module(module), name)()
