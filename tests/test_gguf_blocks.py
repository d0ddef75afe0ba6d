"""model/gguf_blocks.py: quantized GGUF tensors split into int8 values and per-block scales/offsets rebuild gguf-py's
own dequantization bit for bit, for data gguf-py quantizes and for random K-quant blocks; and the served path
(model/quant.py: the split as a QuantizedMatrix, stacked over layers, dequantized inside a jitted call for W8A16 and on
the host for --quantize none) gives gguf-py's `gguf.quants.dequantize` bit for bit, for every type served and for a
projection whose layers mix types (Q4_K_M)."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES, GGUFReader, GGUFWriter
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize, quantize

from prefixscore.model.gguf_blocks import Blocks, split_blocks
from prefixscore.model.quant import QuantizedMatrix, host_dequantize, stack_layers
from prefixscore.model.quant import dequantize as served_dequantize

# type -> (elements per scale, value range, has an offset)
LAYOUT = {
    Q.Q8_0: (32, (-128, 127), False),
    Q.Q4_0: (32, (-8, 7), False),
    Q.Q4_1: (32, (0, 15), True),
    Q.Q5_0: (32, (-16, 15), False),
    Q.Q5_1: (32, (0, 31), True),
    Q.Q4_K: (32, (0, 15), True),
    Q.Q5_K: (32, (0, 31), True),
    Q.Q6_K: (16, (-32, 31), False),
}
QUANTIZABLE = [Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1]
# where each K-quant keeps its float16 super-block scales (d, and dmin where it has one)
K_FLOAT16_FIELDS = {Q.Q4_K: (0, 2), Q.Q5_K: (0, 2), Q.Q6_K: (208,)}


def quantized(qtype: Q, rows: int, cols: int, seed: int = 0) -> np.ndarray:
    """[rows, bytes per row] of `qtype`: gguf-py's quantization of a random matrix where it can quantize the type,
    else random super-blocks whose float16 scales are overwritten with finite ones (every bit pattern of the rest is
    a valid K-quant block)."""
    rng = np.random.default_rng(seed)
    if qtype in QUANTIZABLE:
        return quantize(rng.standard_normal((rows, cols), dtype=np.float32), qtype)
    super_block, type_size = GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, size=(rows * cols // super_block, type_size), dtype=np.uint8)
    for at in K_FLOAT16_FIELDS[qtype]:
        # both signs: nothing in the format makes d or dmin positive
        raw[:, at : at + 2] = rng.uniform(-0.05, 0.05, size=(len(raw), 1)).astype(np.float16).view(np.uint8)
    return raw.reshape(rows, -1)


def rebuilt(b: Blocks) -> np.ndarray:
    out = b.values.astype(np.float32) * np.repeat(b.scale, b.block, axis=1)
    if b.offset is not None:
        out = out + np.repeat(b.offset, b.block, axis=1)
    return out


@pytest.mark.parametrize("qtype", list(LAYOUT), ids=lambda q: q.name)
def test_split_rebuilds_gguf_dequantization_bit_exactly(qtype):
    rows, cols = 24, 768
    data = quantized(qtype, rows, cols)
    b = split_blocks(data, qtype, (rows, cols))

    block, (lo, hi), has_offset = LAYOUT[qtype]
    assert b is not None and b.block == block
    assert b.values.dtype == np.int8 and b.values.shape == (rows, cols)
    assert lo <= b.values.min() and b.values.max() <= hi
    assert b.scale.dtype == np.float32 and b.scale.shape == (rows, cols // block)
    if has_offset:
        assert b.offset is not None and b.offset.dtype == np.float32 and b.offset.shape == (rows, cols // block)
    else:
        assert b.offset is None
    want = dequantize(data, qtype).reshape(rows, cols)
    assert np.isfinite(want).all()
    # as bits: also tells -0.0 from 0.0
    np.testing.assert_array_equal(rebuilt(b).view(np.uint32), want.view(np.uint32))


def served(layers: list[tuple[np.ndarray, Q]], rows: int, cols: int) -> tuple[np.ndarray, np.ndarray]:
    """Each layer's GGUF data split, transposed to [in, out] and stacked as a load serves them: (the jitted
    dequantization a W8A16 product multiplies, the host one of --quantize none), each [layers, rows, cols] float32."""
    import jax
    import jax.numpy as jnp

    def matrix(data: np.ndarray, qtype: Q) -> QuantizedMatrix:
        b = split_blocks(data, qtype, (rows, cols))
        assert b is not None
        offset = None if b.offset is None else b.offset.T
        return QuantizedMatrix(values=b.values.T, scale=b.scale.T, offset=offset)

    stacked = stack_layers([matrix(data, qtype) for data, qtype in layers])
    on_device = np.asarray(jax.jit(served_dequantize, static_argnums=1)(stacked, jnp.float32))
    return on_device.swapaxes(1, 2), np.asarray(host_dequantize(stacked)).swapaxes(1, 2)


@pytest.mark.parametrize("qtype", list(LAYOUT), ids=lambda q: q.name)
def test_served_dequantization_is_gguf_py_bit_for_bit(qtype):
    rows, cols = 24, 768
    data = quantized(qtype, rows, cols, seed=3)
    want = dequantize(data, qtype).reshape(rows, cols)
    for got in served([(data, qtype)], rows, cols):
        np.testing.assert_array_equal(got[0].view(np.uint32), want.view(np.uint32))


def test_served_dequantization_of_layers_mixing_types_is_gguf_py_bit_for_bit():
    """One projection's layers in several types, as a Q4_K_M file holds them: blocks of 16 and 32, with and without
    a minimum (stacked at the finest block, absent minimums zero)."""
    rows, cols = 8, 512
    qtypes = [Q.Q6_K, Q.Q4_K, Q.Q8_0, Q.Q5_K, Q.Q4_1, Q.Q5_0]
    layers = [(quantized(qtype, rows, cols, seed=4 + i), qtype) for i, qtype in enumerate(qtypes)]
    for got in served(layers, rows, cols):
        for i, (data, qtype) in enumerate(layers):
            want = dequantize(data, qtype).reshape(rows, cols)
            np.testing.assert_array_equal(got[i].view(np.uint32), want.view(np.uint32), err_msg=qtype.name)


@pytest.mark.parametrize("qtype", [Q.Q4_K, Q.Q5_K, Q.Q6_K], ids=lambda q: q.name)
def test_random_k_blocks_reach_the_whole_value_range(qtype):
    """Every value of the documented range occurs, so no bit of a packed value is lost or misplaced unseen."""
    b = split_blocks(quantized(qtype, 8, 512, seed=1), qtype, (8, 512))
    lo, hi = LAYOUT[qtype][1]
    assert b is not None and set(np.unique(b.values)) == set(range(lo, hi + 1))


@pytest.mark.parametrize("qtype", [Q.Q4_1, Q.Q4_K, Q.Q6_K], ids=lambda q: q.name)
def test_split_of_a_tensor_read_from_a_gguf_file(tmp_path, qtype):
    """GGUFReader's tensor.data and its innermost-first shape give the (rows, cols) the docstring promises."""
    rows, cols = 3, 512
    data = quantized(qtype, rows, cols, seed=2)
    path = tmp_path / "m.gguf"
    w = GGUFWriter(path, "llama")
    w.add_tensor("w", data, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()

    (t,) = GGUFReader(path).tensors
    assert t.tensor_type == qtype
    b = split_blocks(t.data, t.tensor_type, (int(t.shape[1]), int(t.shape[0])))
    assert b is not None
    want = dequantize(data, qtype).reshape(rows, cols)
    np.testing.assert_array_equal(rebuilt(b).view(np.uint32), want.view(np.uint32))


@pytest.mark.parametrize("qtype", [Q.F32, Q.F16, Q.BF16, Q.Q2_K, Q.Q3_K], ids=lambda q: q.name)
def test_unsplit_types_give_none(qtype):
    assert split_blocks(np.zeros((2, 256), dtype=np.uint8), qtype, (2, 256)) is None


def test_data_of_the_wrong_size_is_refused():
    data = quantized(Q.Q4_0, 2, 64)
    with pytest.raises(ValueError, match="Q4_0"):
        split_blocks(data, Q.Q4_0, (2, 96))
    with pytest.raises(ValueError, match="Q4_0"):
        split_blocks(data, Q.Q4_0, (2, 48))
