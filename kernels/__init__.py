"""prefixscore.kernels: shared-prefix attention (reference, per-backend fast paths, dispatch)."""
