"""`prefixscore.client`: the Python client of the gRPC ScoreService (see service/client.py)."""

from prefixscore.service.client import (
    AsyncScoreClient,
    AsyncScoreStream,
    RerankedDocument,
    RerankResult,
    ScoreClient,
    ScoreResult,
    ScoreStream,
    Usage,
    retry_after_ms,
)

__all__ = [
    "AsyncScoreClient",
    "AsyncScoreStream",
    "RerankedDocument",
    "RerankResult",
    "ScoreClient",
    "ScoreResult",
    "ScoreStream",
    "Usage",
    "retry_after_ms",
]
