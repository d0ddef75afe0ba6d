"""`SentenceTransformer`: sentence-transformers' embedding interface (`encode`, `similarity`) over
a model loaded in process, pooled as the checkpoint's own modules say (engine/requests/embedding.py).

`encode` follows sentence-transformers' order of operations: the model's vectors (pooled, and
normalized when its modules end in Normalize), then `truncate_dim`, then `normalize_embeddings`.
Its inputs go to the engine `batch_size` at a time; the prompt of each batch is the prefix the
engine caches, so it is prefilled once for all of them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from prefixscore.engine.requests.pooling import unit_rows

if TYPE_CHECKING:
    from prefixscore.engine.scorer import Scorer


class SentenceTransformer:
    """`SentenceTransformer("path/to/checkpoint")` (loaded as `Scorer.load` loads it, with its
    keywords) or `SentenceTransformer(scorer)`."""

    def __init__(self, model: str | Scorer, **load_kwargs: Any) -> None:
        from prefixscore.engine.scorer import Scorer

        self.scorer = model if isinstance(model, Scorer) else Scorer.load(model, **load_kwargs)
        pooling = self.scorer.model.pooling
        if pooling is None:
            raise ValueError(
                f"model {self.scorer.model.name!r} has no sentence-transformers Pooling module; "
                "load it with pooling='last' or pooling='mean'"
            )
        self.pooling = pooling
        self.prompts = dict(pooling.prompts)
        self.default_prompt_name = pooling.default_prompt_name
        self.similarity_fn_name = pooling.similarity

    @property
    def max_seq_length(self) -> int:
        """The longest input, in tokens, its prompt and special tokens included."""
        return self.scorer.kinds["embed"].max_tokens  # type: ignore[attr-defined]

    def get_embedding_dimension(self) -> int:
        return self.pooling.dimension

    get_sentence_embedding_dimension = get_embedding_dimension

    def encode(
        self,
        sentences: str | Sequence[str],
        prompt_name: str | None = None,
        prompt: str | None = None,
        batch_size: int = 32,
        convert_to_numpy: bool = True,
        convert_to_tensor: bool = False,
        normalize_embeddings: bool = False,
        truncate_dim: int | None = None,
    ) -> Any:
        """Embeddings [len(sentences), dimension] float32 (one sentence: [dimension]), as
        sentence-transformers' `encode` returns them: a numpy array, a torch tensor
        (`convert_to_tensor`; torch needed), or a list of tensors (neither)."""
        if batch_size < 1:
            raise ValueError(f"batch_size: {batch_size} is not a positive integer")
        single = isinstance(sentences, str)
        texts = [sentences] if single else list(sentences)
        if truncate_dim is not None and not 1 <= truncate_dim <= self.pooling.dimension:
            raise ValueError(f"truncate_dim: {truncate_dim} is not from 1 to {self.pooling.dimension}")
        parts = [
            self.scorer.embed(texts[at : at + batch_size], prompt_name=prompt_name, prompt=prompt)
            for at in range(0, len(texts), batch_size)
        ]
        out = np.concatenate(parts) if parts else np.zeros((0, self.pooling.dimension), np.float32)
        if truncate_dim is not None:
            out = out[:, :truncate_dim]
        if normalize_embeddings:
            out = unit_rows(out)
        out = out.astype(np.float32)
        if single:
            out = out[0]
        if convert_to_numpy and not convert_to_tensor:
            return out
        import torch

        return torch.from_numpy(out) if convert_to_tensor else list(torch.from_numpy(np.atleast_2d(out)))

    def similarity(self, a: Any, b: Any) -> Any:
        """[len(a), len(b)] similarities by the model's `similarity_fn_name` (cosine, dot, or the
        negative euclidean or manhattan distance), a torch tensor as sentence-transformers returns."""
        import torch

        x = np.atleast_2d(np.asarray(a, np.float64))
        y = np.atleast_2d(np.asarray(b, np.float64))
        name = self.similarity_fn_name
        if name == "cosine":
            scores = unit_rows(x) @ unit_rows(y).T
        elif name == "dot":
            scores = x @ y.T
        elif name == "euclidean":
            scores = -np.linalg.norm(x[:, None, :] - y[None, :, :], axis=2)
        else:  # manhattan (model/sentence_config.py admits these four)
            scores = -np.abs(x[:, None, :] - y[None, :, :]).sum(axis=2)
        return torch.from_numpy(scores.astype(np.float32))
