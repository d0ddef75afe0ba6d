"""Offline work: `prefixscore batch` (OpenAI batch files through /v1/score and /v1/rerank),
the sentence-transformers-style `CrossEncoder`, and `prefixscore eval` (rerank a first-stage run
and measure it)."""
