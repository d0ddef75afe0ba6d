"""Pick the attention implementation per backend; overridable by name.

Every implementation exposes the same two functions with the reference's
signatures (kernels/reference.py):
  shared_prefix_attention(q, k, v, prefix_k, prefix_v, prefix_len) -> [b, t, heads, d]
  causal_attention(q, k, v) -> [b, s, heads, d]
"""

from __future__ import annotations

import os
from types import ModuleType

import jax

from prefixscore.kernels import reference

# name -> module path; fast paths register here as they land
IMPLEMENTATIONS = {"reference": "prefixscore.kernels.reference", "xla": "prefixscore.kernels.reference"}
# backend -> default implementation name
DEFAULTS = {"cpu": "xla", "gpu": "xla", "cuda": "xla", "tpu": "xla"}
ENV_OVERRIDE = "PREFIXSCORE_ATTENTION"


def resolve(name: str | None = None, backend: str | None = None) -> str:
    """The implementation name to use: explicit > $PREFIXSCORE_ATTENTION > backend default."""
    name = name or os.environ.get(ENV_OVERRIDE) or DEFAULTS.get(backend or jax.default_backend(), "xla")
    if name not in IMPLEMENTATIONS:
        raise ValueError(f"attention implementation {name!r} unknown; choose from {sorted(IMPLEMENTATIONS)}")
    return name


def get(name: str) -> ModuleType:
    """The module implementing `name` (imported lazily: GPU/TPU kernels import their backends)."""
    if name in ("reference", "xla"):
        return reference
    import importlib

    return importlib.import_module(IMPLEMENTATIONS[name])
