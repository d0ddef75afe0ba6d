"""`prefixscore.client`: the Python client of the gRPC ScoreService (see client/score_client.py)."""

from prefixscore.client.score_client import (
    AsyncScoreClient,
    AsyncScoreStream,
    BatchRefused,
    EmbedResult,
    Likelihood,
    RerankedDocument,
    RerankResult,
    Retry,
    ScoreClient,
    ScoreResult,
    ScoreStream,
    Usage,
    retry_after_ms,
    tls_credentials,
)

__all__ = [
    "AsyncScoreClient",
    "AsyncScoreStream",
    "BatchRefused",
    "EmbedResult",
    "Likelihood",
    "RerankedDocument",
    "RerankResult",
    "Retry",
    "ScoreClient",
    "ScoreResult",
    "ScoreStream",
    "Usage",
    "retry_after_ms",
    "tls_credentials",
]
