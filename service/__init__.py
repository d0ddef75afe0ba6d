"""prefixscore.service: the Scorer, gRPC server, device worker, batcher, prefix cache, metrics, client and CLI."""
