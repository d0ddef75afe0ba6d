"""prefixscore: score many items against one query with a decoder LLM over a shared, cached prefix."""

from __future__ import annotations

from typing import TYPE_CHECKING

__all__ = ["CrossEncoder", "Scorer", "SentenceTransformer", "Usage", "__version__"]
from prefixscore.version import __version__

if TYPE_CHECKING:
    from prefixscore.engine.scorer import Scorer, Usage
    from prefixscore.offline.cross_encoder import CrossEncoder
    from prefixscore.offline.sentence_transformer import SentenceTransformer


def __getattr__(name: str):
    # Lazy: `prefixscore.client` users should not pay for importing jax.
    if name == "CrossEncoder":
        from prefixscore.offline import cross_encoder

        return cross_encoder.CrossEncoder
    if name == "SentenceTransformer":
        from prefixscore.offline import sentence_transformer

        return sentence_transformer.SentenceTransformer
    if name in __all__:
        from prefixscore.engine import scorer

        return getattr(scorer, name)
    raise AttributeError(f"module 'prefixscore' has no attribute {name!r}")
