"""prefixscore.telemetry: what every layer reports through: structured logs bound to request
ids, the Prometheus metrics (and the host-cost collector), for the engine and the transports."""
