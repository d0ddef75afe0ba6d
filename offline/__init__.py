"""Offline work: `prefixscore batch` (OpenAI batch files through /v1/score, /v1/rerank and
/v1/embeddings), the sentence-transformers-style `CrossEncoder` and `SentenceTransformer`, and
`prefixscore eval` (rerank a first-stage run and measure it)."""
