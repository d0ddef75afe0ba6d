"""Quantized GGUF tensors (llama.cpp) as int8 values plus per-block float32 scales and offsets.

Dequantized to float32 a weight takes 4 bytes per element (2 in bfloat16); kept on the device as 8-bit blocks it
takes 1 byte plus one or two floats per 16 or 32 elements, so a quantized checkpoint keeps most of its memory saving
once loaded. The split loses nothing: for every type it splits,

    values.astype(np.float32) * np.repeat(scale, block, axis=1) + np.repeat(offset, block, axis=1)

(no offset term when `offset` is None) is bit-exactly `gguf.quants.dequantize`: the scales and offsets are the
float32 products gguf-py forms itself, and its last two float32 operations are that multiply and that add (its
`- dmin * m` is the add of the negated product, which IEEE rounds the same way).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

# one super-block's values [n, elements], scales [n, sub-blocks] and offsets [n, sub-blocks] or None
_Split = tuple[np.ndarray, np.ndarray, np.ndarray | None]


@dataclasses.dataclass(frozen=True)
class Blocks:
    """A quantized matrix as int8 values and per-block scales (and minimums)."""

    values: np.ndarray  # [rows, cols] int8
    scale: np.ndarray  # [rows, cols // block] float32
    # [rows, cols // block] float32: added after scaling (GGUF's block minimum); None: symmetric
    offset: np.ndarray | None
    block: int  # input elements per scale


def _f16(raw: np.ndarray) -> np.ndarray:
    """[n, 2] bytes holding a float16 as float32 [n, 1], converted as gguf-py converts it."""
    return raw.view(np.float16).astype(np.float32)


def _nibbles(packed: np.ndarray) -> np.ndarray:
    """[..., k] bytes as [..., 2k] 4-bit values: llama.cpp packs the first k in low nibbles, the next k in high."""
    return np.concatenate([packed & 0x0F, packed >> 4], axis=-1)


def _k_scales(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The 12 bytes of a Q4_K/Q5_K super-block as its 8 six-bit scales and 8 six-bit minimums, [n, 8] each: the
    first four of each sit in the low 6 bits of bytes 0-3 (scales) and 4-7 (minimums); the last four have their low
    4 bits in bytes 8-11 (scales low nibble, minimums high) and their top 2 bits in the top bits of bytes 0-7."""
    sc, mn, low = packed[:, 0:4], packed[:, 4:8], packed[:, 8:12]
    scales = np.concatenate([sc & 0x3F, (low & 0x0F) | ((sc >> 2) & 0x30)], axis=1)
    minimums = np.concatenate([mn & 0x3F, (low >> 4) | ((mn >> 2) & 0x30)], axis=1)
    return scales, minimums


def _q8_0(b: np.ndarray) -> _Split:
    # d: f16, qs: 32 int8
    return b[:, 2:].view(np.int8), _f16(b[:, 0:2]), None


def _q4_0(b: np.ndarray) -> _Split:
    # d: f16, qs: 16 bytes of nibbles stored with a bias of 8
    return _nibbles(b[:, 2:]).astype(np.int8) - np.int8(8), _f16(b[:, 0:2]), None


def _q4_1(b: np.ndarray) -> _Split:
    # d: f16, m: f16, qs: 16 bytes of nibbles
    return _nibbles(b[:, 4:]).astype(np.int8), _f16(b[:, 0:2]), _f16(b[:, 2:4])


def _five_bits(qh: np.ndarray, qs: np.ndarray) -> np.ndarray:
    """Q5_0/Q5_1's 32 values 0..31: the 4 low bits from nibbles, bit 4 of value i from bit i of the 4 qh bytes."""
    return (_nibbles(qs) | (np.unpackbits(qh, axis=1, bitorder="little") << 4)).astype(np.int8)


def _q5_0(b: np.ndarray) -> _Split:
    # d: f16, qh: 4 bytes, qs: 16 bytes; stored with a bias of 16
    return _five_bits(b[:, 2:6], b[:, 6:]) - np.int8(16), _f16(b[:, 0:2]), None


def _q5_1(b: np.ndarray) -> _Split:
    # d: f16, m: f16, qh: 4 bytes, qs: 16 bytes
    return _five_bits(b[:, 4:8], b[:, 8:]), _f16(b[:, 0:2]), _f16(b[:, 2:4])


def _k_scale_offset(b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K's 8 sub-block scales d * sc and offsets -(dmin * m), in gguf-py's float32 order."""
    scales, minimums = _k_scales(b[:, 4:16])
    return _f16(b[:, 0:2]) * scales.astype(np.float32), -(_f16(b[:, 2:4]) * minimums.astype(np.float32))


def _q4_k(b: np.ndarray) -> _Split:
    # d: f16, dmin: f16, scales: 12 bytes, qs: 128 bytes (4 chunks of 32 bytes, each two sub-blocks of nibbles)
    values = _nibbles(b[:, 16:].reshape(-1, 4, 32)).reshape(-1, 256).astype(np.int8)
    return values, *_k_scale_offset(b)


def _q5_k(b: np.ndarray) -> _Split:
    # d: f16, dmin: f16, scales: 12 bytes, qh: 32 bytes (bit j of byte k: bit 4 of value k of sub-block j), qs as Q4_K
    low = _nibbles(b[:, 48:].reshape(-1, 4, 32)).reshape(-1, 8, 32)
    high = (b[:, None, 16:48] >> np.arange(8, dtype=np.uint8)[:, None]) & 1
    values = (low | (high << 4)).reshape(-1, 256).astype(np.int8)
    return values, *_k_scale_offset(b)


def _q6_k(b: np.ndarray) -> _Split:
    # ql: 128 bytes (2 halves of 64 bytes of nibbles), qh: 64 bytes (2 halves of 32 bytes, four 2-bit fields each),
    # scales: 16 int8, d: f16; values stored with a bias of 32
    low = _nibbles(b[:, 0:128].reshape(-1, 2, 64)).reshape(-1, 2, 4, 32)
    high = (b[:, 128:192].reshape(-1, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8)[:, None]) & 3
    values = (low | (high << 4)).reshape(-1, 256).astype(np.int8) - np.int8(32)
    return values, _f16(b[:, 208:210]) * b[:, 192:208].view(np.int8).astype(np.float32), None


# type -> (splitter of [n, type size] bytes, input elements per scale)
_SPLITTERS: dict[GGMLQuantizationType, tuple[Callable[[np.ndarray], _Split], int]] = {
    GGMLQuantizationType.Q8_0: (_q8_0, 32),
    GGMLQuantizationType.Q4_0: (_q4_0, 32),
    GGMLQuantizationType.Q4_1: (_q4_1, 32),
    GGMLQuantizationType.Q5_0: (_q5_0, 32),
    GGMLQuantizationType.Q5_1: (_q5_1, 32),
    GGMLQuantizationType.Q4_K: (_q4_k, 32),
    GGMLQuantizationType.Q5_K: (_q5_k, 32),
    GGMLQuantizationType.Q6_K: (_q6_k, 16),
}


def split_blocks(data: np.ndarray, qtype: GGMLQuantizationType, shape: tuple[int, int]) -> Blocks | None:
    """`shape` is (rows, cols) in numpy order (GGUF lists dims innermost first, so rows = tensor.shape[1], cols =
    tensor.shape[0]); blocks run along cols. None for a type this module does not split (F32, F16, BF16, and quantized
    types not listed)."""
    entry = _SPLITTERS.get(qtype)
    if entry is None:
        return None
    split, block = entry
    rows, cols = shape
    super_block, type_size = GGML_QUANT_SIZES[qtype]
    if cols % super_block or data.nbytes != rows * (cols // super_block) * type_size:
        raise ValueError(
            f"{GGMLQuantizationType(qtype).name} data of {data.nbytes} bytes is not a ({rows}, {cols}) matrix "
            f"(rows of {super_block}-element blocks of {type_size} bytes)"
        )
    values, scale, offset = split(np.ascontiguousarray(data).reshape(-1).view(np.uint8).reshape(-1, type_size))
    return Blocks(
        values=values.reshape(rows, cols),
        scale=scale.reshape(rows, -1),
        offset=None if offset is None else offset.reshape(rows, -1),
        block=block,
    )
