"""prefixscore.bench: the benchmark harness (`prefixscore bench`): workloads, host cost, profiles."""
