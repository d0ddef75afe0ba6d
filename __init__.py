"""prefixscore: score many items against one query with a decoder LLM over a shared, cached prefix."""

from prefixscore.service.scorer import Scorer, Usage

__all__ = ["Scorer", "Usage"]
__version__ = "0.1.0"
