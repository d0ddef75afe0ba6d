"""8-bit weights: how a projection is held on the device and multiplied.

A decoder projection (q, k, v, o, gate, up, down) is either a plain array in the served dtype
or a `QuantizedMatrix`: 8-bit values (int8, or fp8 e4m3) and float32 scales, one per output
column and per block of the input dimension (a block as wide as the input: one scale per
output channel). GGUF's formats with a block minimum (Q4_1, Q4_K, ...) add an offset per
block. What a matrix holds says how it is multiplied (`matmul`), so the decoder has one call
per projection and no branch on a scheme:

- **W8A16** (`activations` "none"): the values are dequantized in the served dtype inside the
  jitted step (one layer at a time, under the layer scan) and multiplied as before; the
  result equals the dequantized model's, and the device holds a byte per weight.
- **W8A8** (`activations` "dynamic" or "static"): the activations are quantized too, per token
  at run time (dynamic: scale = max |x| / QMAX over the token's features) or with the
  checkpoint's per-tensor `input_scale` (static); int8 x int8 -> int32 or fp8 x fp8 -> float32
  on the 8-bit units, then rescaled by both scales. Needs one scale per output channel and no
  offset (per-block weight scales would need a per-block sum of products).

Rounding and clipping (the float64 reference in the tests follows this): int8 values are
round-half-to-even of x / scale clipped to [-127, 127] (static activations to [-128, 127], the
range compressed-tensors calibrates for); fp8 values are x / scale clipped to [-448, 448] and
converted (round to nearest even). A dynamic scale of an all-zero token is 1.

The embedding, the norms, the attention, the prefix pool and the output head (a vocabulary's
label rows, a classifier's score rows) are never 8-bit: a quantized score head is how an FP8
reranker came to return 0.0 for everything elsewhere.

Why not qwix (the JAX quantization library): its QArray dequantizes as (q - zero_point) * scale,
which reproduces GGUF's d * q + m only up to a rounding (and not at all where d is 0), and its
interception works on flax modules, while the projections here are three explicit calls in
model/decoder.py; the int8 product itself is one `lax.dot_general`.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from flax import struct

from prefixscore.model.shards import UNSPLIT, ModelShards

INT8, FP8 = "int8", "fp8"
# the storage dtype of each 8-bit kind, and the largest magnitude it quantizes to
STORAGE: dict[str, np.dtype] = {INT8: np.dtype(np.int8), FP8: np.dtype(ml_dtypes.float8_e4m3fn)}
QMAX: dict[str, float] = {INT8: 127.0, FP8: 448.0}
# activation schemes: W8A16, per-token at run time, a stored per-tensor scale
NONE, DYNAMIC, STATIC = "none", "dynamic", "static"
ACTIVATIONS = (NONE, DYNAMIC, STATIC)


class QuantizationError(ValueError):
    """A quantization the checkpoint or the choice cannot take (raised before any device work)."""


def kind_of(values: np.ndarray | jax.Array) -> str:
    """INT8 or FP8 from the values' dtype."""
    for kind, dtype in STORAGE.items():
        if np.dtype(values.dtype) == dtype:
            return kind
    raise QuantizationError(f"quantized values of dtype {values.dtype} are neither int8 nor float8_e4m3fn")


@struct.dataclass
class QuantizedMatrix:
    """A projection [in, out] held as 8-bit values and float32 scales (leading axes: stacked layers)."""

    values: jax.Array  # [..., in, out] int8 | float8_e4m3fn
    scale: jax.Array  # [..., in / block, out] float32 (in / block == 1: per output channel)
    offset: jax.Array | None = None  # [..., in / block, out] float32: added after scaling; None: symmetric
    input_scale: jax.Array | None = None  # [...] float32: the static activation scale (compressed-tensors)
    activations: str = struct.field(pytree_node=False, default=NONE)  # NONE | DYNAMIC | STATIC
    # the dtype a dequantized value is rounded to before the served dtype: the checkpoint's scale
    # dtype (compressed_tensors multiplies values by a bfloat16 scale in bfloat16), float32 for GGUF
    product: str = struct.field(pytree_node=False, default="float32")

    @property
    def kind(self) -> str:
        return kind_of(self.values)

    @property
    def block(self) -> int:
        """Input elements per scale."""
        return self.values.shape[-2] // self.scale.shape[-2]

    @property
    def per_channel(self) -> bool:
        return self.scale.shape[-2] == 1

    def describe(self) -> str:
        """What it is, for the log and the model info ("int8 per channel", "int8 blocks of 32 with a minimum")."""
        where = "per channel" if self.per_channel else f"blocks of {self.block}"
        return f"{self.kind} {where}" + (" with a minimum" if self.offset is not None else "")


def dequantize(w: QuantizedMatrix, dtype: jnp.dtype, xp=jnp) -> jax.Array | np.ndarray:
    """The matrix in `dtype` ([..., in, out]): values x scale (+ offset) in float32, rounded to the
    checkpoint's scale dtype, then cast, as a dequantizing loader computes it. xp: jax.numpy in the
    step, numpy on the host (a load that serves full precision)."""
    *lead, n_in, n_out = w.values.shape
    blocks = w.scale.shape[-2]
    values = xp.asarray(w.values).astype(xp.float32).reshape(*lead, blocks, n_in // blocks, n_out)
    full = values * xp.asarray(w.scale)[..., :, None, :]
    if w.offset is not None:
        full = full + xp.asarray(w.offset)[..., :, None, :]
    return full.reshape(*lead, n_in, n_out).astype(jnp.dtype(w.product)).astype(dtype)


def matmul(x: jax.Array, w: jax.Array | QuantizedMatrix, split: ModelShards = UNSPLIT) -> jax.Array:
    """x [..., in] @ w [in, out] -> [..., out] in x's dtype, by what `w` holds (module docstring).

    split: the model axis when w's input dimension is split across it (the o and down
    projections): a dynamic activation scale is then the max over every device's features, so
    a mesh quantizes each token exactly as one device does."""
    if not isinstance(w, QuantizedMatrix):
        return x @ w
    if w.activations == NONE:
        return x @ dequantize(w, x.dtype)
    kind = w.kind
    xf = x.astype(jnp.float32)
    if w.activations == STATIC:
        x_scale = w.input_scale.astype(jnp.float32)
        low = -128.0 if kind == INT8 else -QMAX[kind]
    else:
        top = split.max(jnp.max(jnp.abs(xf), axis=-1, keepdims=True))
        x_scale = jnp.where(top > 0, top / QMAX[kind], 1.0)
        low = -QMAX[kind]
    scaled = jnp.clip(xf / x_scale, low, QMAX[kind])
    if kind == INT8:
        xq, accumulate = jnp.round(scaled).astype(jnp.int8), jnp.int32
    else:
        xq, accumulate = scaled.astype(jnp.float8_e4m3fn), jnp.float32
    acc = jax.lax.dot_general(
        xq, w.values, (((x.ndim - 1,), (0,)), ((), ())), preferred_element_type=accumulate
    )  # [..., out]
    return (acc.astype(jnp.float32) * x_scale * w.scale[0]).astype(x.dtype)


def quantize_per_channel(w: np.ndarray, kind: str) -> QuantizedMatrix:
    """A full-precision projection [in, out] (host) as `kind` values with one scale per output
    channel: scale = max |w| over the column / QMAX (1 for an all-zero column)."""
    w = np.asarray(w, dtype=np.float32)
    top = np.max(np.abs(w), axis=0, keepdims=True)  # [1, out]
    scale = np.where(top > 0, top / np.float32(QMAX[kind]), np.float32(1.0)).astype(np.float32)
    scaled = np.clip(w / scale, -QMAX[kind], QMAX[kind])
    values = np.round(scaled).astype(np.int8) if kind == INT8 else scaled.astype(STORAGE[FP8])
    return QuantizedMatrix(values=values, scale=scale)


def host_dequantize(w: QuantizedMatrix) -> np.ndarray:
    """`dequantize` on the host, in float32."""
    return dequantize(w, np.float32, np)


def stack_layers(layers: Sequence[QuantizedMatrix]) -> QuantizedMatrix:
    """Per-layer host matrices [in, out] stacked [layers, in, out] under one scan. Files mix
    formats across layers (a Q4_K_M file holds Q6_K and Q4_K projections: blocks of 16 and 32,
    with and without a minimum), so scales are repeated to the finest block and absent offsets
    become -0.0: both exact (x + -0.0 is x for every x, where x + 0.0 turns a -0.0 weight into 0.0)."""
    kinds = {m.kind for m in layers}
    if len(kinds) > 1:
        raise QuantizationError(f"quantized weights: one projection mixes {sorted(kinds)} values across layers")
    statics = {m.input_scale is None for m in layers}
    products = {m.product for m in layers}
    if len(statics) > 1 or len(products) > 1:
        raise QuantizationError(
            "quantized weights: the layers of one projection differ in input_scale or in their scales' dtype"
        )
    block = math.gcd(*(m.block for m in layers))
    with_offset = any(m.offset is not None for m in layers)

    def finer(a: np.ndarray, m: QuantizedMatrix) -> np.ndarray:
        return np.repeat(np.asarray(a, np.float32), m.block // block, axis=0)

    scale = np.stack([finer(m.scale, m) for m in layers])
    offset = None
    if with_offset:
        offset = np.stack([finer(m.offset if m.offset is not None else np.full_like(m.scale, -0.0), m) for m in layers])
    input_scale = None if layers[0].input_scale is None else np.stack([np.float32(m.input_scale) for m in layers])
    return QuantizedMatrix(
        values=np.stack([np.asarray(m.values) for m in layers]),
        scale=scale,
        offset=offset,
        input_scale=input_scale,
        product=layers[0].product,
    )


def with_activations(w: QuantizedMatrix, activations: str, name: str) -> QuantizedMatrix:
    """`w` multiplied with `activations` (NONE: W8A16), refused naming both where it cannot be."""
    if activations != NONE and (not w.per_channel or w.offset is not None):
        raise QuantizationError(
            f"--activations {activations}: {name} is {w.describe()}, and 8-bit activations need one "
            "symmetric scale per output channel; use --activations none, or --quantize int8|fp8 to "
            "requantize per channel"
        )
    if activations == STATIC and w.input_scale is None:
        raise QuantizationError(f"static activations: {name} has no input_scale in the checkpoint")
    return dataclasses.replace(w, activations=activations, input_scale=w.input_scale if activations == STATIC else None)
