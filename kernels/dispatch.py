"""Pick the attention implementation per backend; overridable by name.

Every implementation exposes the reference's functions and signatures
(kernels/reference.py; the stream and pool they read: kernels/paged.py):
  SEGMENT_ALIGN                                  segment starts the planner must align to
  POOL_AS_BITS                                   a 16-bit float pool stored as uint16 bits (paged.pool_dtype)
  SHARED_BLOCK                                   short prefill chunks' shared key steps (paged.SharedSteps; 0: none)
  key_step_pages(page_tokens, table_pages)       where SHARED_BLOCK is not 0: the pages of a shared key step
  paged_prefix_attention(q [T,h,d], pool_k, pool_v, meta) -> out, lse (float32)
  ragged_item_attention(q [n,h,d], k, v, item_ids, max_item_len,
                        window=NO_WINDOW, logits=DEFAULT_LOGITS) -> out, lse
  merge_attention(out_a, lse_a, out_b, lse_b) -> out
  paged_attention(q [T,h,d], k, v, pool_k, pool_v, meta) -> [T, h, d]   (what the decoder calls)
The meta carries each layer's sliding window and the model's AttentionLogits (softmax scale,
soft cap); ragged_item_attention takes them as arguments (kernels/paged.py).

Names: reference (the oracle, dense), xla (tiled XLA, the CPU path), pallas_tpu
(Mosaic TPU kernels), pallas_gpu (Pallas Triton kernels). Pick with the
`attn_impl` argument or $PREFIXSCORE_ATTENTION.
"""

from __future__ import annotations

import contextlib
import contextvars
import importlib
import os
from collections.abc import Iterator
from types import ModuleType

import jax

from prefixscore.kernels import reference

# name -> module path; fast paths register here as they land
IMPLEMENTATIONS = {
    "reference": "prefixscore.kernels.reference",
    "xla": "prefixscore.kernels.xla",
    "pallas_tpu": "prefixscore.kernels.pallas_tpu",
    "pallas_gpu": "prefixscore.kernels.pallas_gpu",
}
# backend -> default implementation name
DEFAULTS = {"cpu": "xla", "gpu": "pallas_gpu", "cuda": "pallas_gpu", "rocm": "xla", "tpu": "pallas_tpu"}
ENV_OVERRIDE = "PREFIXSCORE_ATTENTION"
# platforms jax lowers for -> the backend family a kernel compiles for
_FAMILY = {"cuda": "gpu", "rocm": "gpu", "gpu": "gpu", "tpu": "tpu", "cpu": "cpu"}
_TARGET: contextvars.ContextVar[str | None] = contextvars.ContextVar("prefixscore_kernel_target", default=None)


def target_backend() -> str:
    """The backend the kernels being traced will run on: "gpu", "tpu" or "cpu".

    The process's default backend, unless `lowering_for` says otherwise. Pallas kernels
    compile for their own backend and run in Pallas' interpreter anywhere else.
    """
    return _FAMILY.get(_TARGET.get() or jax.default_backend(), "cpu")


@contextlib.contextmanager
def lowering_for(platform: str) -> Iterator[None]:
    """Trace kernels for `platform` ("cuda", "tpu", ...) whatever this process runs on.

    With `jax.jit(...).trace(...).lower(lowering_platforms=(platform,))` this lowers the
    real (not interpreted) TPU and GPU kernels on a CPU-only machine: a test proves they
    lower, and that no production shape falls back to XLA, without the hardware.
    """
    if platform not in _FAMILY:
        raise ValueError(f"platform {platform!r} unknown; choose from {sorted(_FAMILY)}")
    token = _TARGET.set(platform)
    try:
        yield
    finally:
        _TARGET.reset(token)


def resolve(name: str | None = None, backend: str | None = None) -> str:
    """The implementation name to use: explicit > $PREFIXSCORE_ATTENTION > backend default."""
    name = name or os.environ.get(ENV_OVERRIDE) or DEFAULTS.get(backend or jax.default_backend(), "xla")
    if name not in IMPLEMENTATIONS:
        raise ValueError(f"attention implementation {name!r} unknown; choose from {sorted(IMPLEMENTATIONS)}")
    return name


def get(name: str) -> ModuleType:
    """The module implementing `name` (imported lazily: GPU/TPU kernels import their backends)."""
    if name == "reference":
        return reference

    return importlib.import_module(IMPLEMENTATIONS[name])
