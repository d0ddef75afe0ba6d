"""prefixscore.service: the transports (gRPC server, HTTP API) over one transport-neutral core,
with wire mapping, security, request ids, logs and metrics."""
