"""8-bit weights (model/quant.py): what the engine computes against a float64 numpy forward of
the documented scheme, on one device and on meshes, what it lowers to, and what stays full
precision.

- The reference (tests/helpers/quant_reference.py) quantizes the preset's original float weights
  itself, with its own constants and its own RoPE: per-channel weight scale max |w| / 127 (fp8:
  / 448), int8 values round-half-even, fp8 values by torch's float8_e4m3fn cast.
- `--quantize int8|fp8` stores exactly those values and scales, bit for bit.
- W8A8 (int8 and fp8, dynamic activations): the scores equal the reference's forward with
  per-token scale max |x| / 127 (fp8: / 448; 1 for a zero token), int8 activations
  round-half-even clipped to [-127, 127] (fp8: clipped to +-448, converted), products of the
  8-bit operands times both scales.
- W8A16 (activations none): the scores equal the same forward with plain dequantized weights.
- Meshes (tp 2 x dp 2, tp 4 with the KV heads replicated) score like one device; the per-channel scales of column-split
  projections are split on the model axis with their columns, those of row-split ones replicated
  (the dynamic activation scale of a row-split projection is the max over the model axis).
- Lowered for "tpu" and "cuda", W8A8 multiplies 8-bit operands (one dot_general per projection);
  W8A16 dequantizes first (no 8-bit dot operand).
- The embedding and the output head (vocabulary, untied lm_head, classifier score rows) stay in
  the served dtype, bit for bit the checkpoint's.
- Impossible choices are refused naming the flag (before anything is compiled).

W8A8 agrees with its reference (and a mesh with one device) only while no activation sits so
close to a rounding boundary that float32 (or partial sums added in another order) rounds it the
other way: one such flip moves these log-probabilities by about 5e-4 (measured: with the stored
int8 values truncated instead of rounded, one activation 5e-6 of a step from a tie flips on a
mesh). The data here has none within 1e-7 (relative) of a boundary (6 within 1e-6); the failure
messages count them, to tell a flip from a bug.

The mesh part needs 8 simulated CPU devices, which must be set before jax starts: this file runs
itself as a script in a subprocess for it (as tests/test_mesh.py does), started when the module
starts so that it compiles beside the one-device engines.
"""

from __future__ import annotations

import functools
import json
import os
import re
import subprocess
import sys
import tempfile

import jax
import ml_dtypes
import numpy as np
import pytest
from conftest import make_torch_model, xla_flags
from helpers.quant_reference import PUBLISHED_QMAX, full_precision_params, quantize_channels, reference_log_probs
from helpers.quant_reference import reference_matmul as reference_matmul_of

from prefixscore.engine.runtime.buckets import Buckets
from prefixscore.model.presets import RANDOM_PRESETS
from prefixscore.model.quant import FP8, INT8, NONE, QuantizationError, QuantizedMatrix

MODEL = "tiny-qwen3"  # random Qwen3 (q/k norms, tied head), vocabulary 49152
VOCAB = RANDOM_PRESETS[MODEL][0].vocab_size
# one item region (every item below in one call) and one prefill region (the whole query):
# each engine compiles one executable
BUCKETS = Buckets(
    context=128,
    tokens=(64,),
    prefill=(0, 64),
    max_batch_tokens=64,
    prefill_chunk=64,
    max_prefill_tokens=64,
    page_tokens=16,
    segments=4,
    labels=(8,),
    head_rows=256,
)
_RNG = np.random.default_rng(7)
QUERY = _RNG.integers(0, VOCAB, 40).tolist()
ITEMS = [_RNG.integers(0, VOCAB, n).tolist() for n in (1, 5, 9, 16)]
LABELS = [0, 3, 17, 1000, VOCAB - 1]
# on log-probabilities: W8A8 against its float64 forward (float32 activations, quantized; see the
# module docstring on ties); W8A16 (float32 against float64) and meshes (partial sums added in
# another order) to float32 rounding
W8A8_TOLERANCE = 1e-4
W8A16_TOLERANCE = 1e-5
MESH_TOLERANCE = 1e-5
DEVICES = 8
MESHES = [(2, 2), (4, 1)]  # (tp, dp)
MESH_SCHEMES = ["dynamic", "none"]  # int8 weights, W8A8 and W8A16
PROJECTIONS = ("attn.wq", "attn.wk", "attn.wv", "attn.wo", "mlp.w_gate", "mlp.w_up", "mlp.w_down")
COLUMN_SPLIT = {"attn.wq", "attn.wk", "attn.wv", "mlp.w_gate", "mlp.w_up"}  # o and down: row-split


# ---- the float64 reference (tests/helpers/quant_reference.py) --------------------------------


@functools.cache
def _full_params():
    """The preset's full-precision weights, which `--quantize int8|fp8` quantizes at load."""
    return full_precision_params(MODEL)


def reference_scores(
    kind: str, activations: str, near_ties: list | None = None, query: list[int] = QUERY
) -> np.ndarray:
    """[items, labels] log-probabilities of the reference, quantizing the original float weights itself."""
    cfg = RANDOM_PRESETS[MODEL][0]
    return np.array(
        [reference_log_probs(cfg, _full_params(), query + item, kind, activations, near_ties)[LABELS] for item in ITEMS]
    )


def _ties(kind: str) -> str:
    """For a failure message: the W8A8 reference's activations near a rounding boundary."""
    near: list[tuple[float, int]] = []
    reference_scores(kind, "dynamic", near)
    counts = {eps: sum(n for e, n in near if e == eps) for eps in (1e-7, 1e-6)}
    return (
        f"activations of the reference near a rounding boundary: {counts[1e-7]} within 1e-7 (relative), "
        f"{counts[1e-6]} within 1e-6; float32 rounding one the other way moves log-probabilities by ~5e-4"
    )


# ---- shared engines --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def scorers():
    """(quantize, activations) -> a loaded Scorer, each loaded once for the module."""
    from prefixscore import Scorer
    from prefixscore.engine.runtime import compile_cache

    compile_cache.enable()  # as the engine does, but before the first load: its random weights' build too
    loaded = {}

    def get(quantize: str, activations: str):
        if (quantize, activations) not in loaded:
            loaded[quantize, activations] = Scorer.load(
                MODEL, buckets=BUCKETS, quantize=quantize, activations=activations
            )
        return loaded[quantize, activations]

    yield get
    for scorer in loaded.values():
        scorer.runner.close()


@pytest.fixture(scope="module")
def log_scores(scorers):
    """(quantize, activations) -> the engine's [items, labels] log-probabilities (float64)."""
    cache = {}

    def get(quantize: str, activations: str) -> np.ndarray:
        if (quantize, activations) not in cache:
            probs = scorers(quantize, activations).score(QUERY, ITEMS, LABELS)
            cache[quantize, activations] = np.log(np.asarray(probs, np.float64))
        return cache[quantize, activations]

    return get


class Part:
    """A part of this file run as a script with 8 CPU devices, in the background (its output in
    files: a pipe nobody reads would stall it)."""

    def __init__(self, part: str) -> None:
        env = {**os.environ, "XLA_FLAGS": xla_flags(DEVICES), "JAX_PLATFORMS": "cpu"}
        self.out, self.err = tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+")
        self.proc = subprocess.Popen([sys.executable, __file__, part], env=env, stdout=self.out, stderr=self.err)

    def result(self, timeout: float = 900) -> dict:
        returncode = self.proc.wait(timeout)
        self.out.seek(0)
        self.err.seek(0)
        assert returncode == 0, self.err.read()[-4000:]
        return json.loads(self.out.read().splitlines()[-1])

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.out.close()
        self.err.close()


@pytest.fixture(scope="module", autouse=True)
def mesh_part(request):
    """The mesh part, started with the module (when its test is selected), so that its
    compilations overlap the one-device ones."""
    wanted = any(
        getattr(item, "module", None) is request.module
        and item.originalname == "test_int8_on_meshes_scores_like_one_device"
        for item in request.session.items
    )
    part = Part("mesh") if wanted else None
    yield part
    if part is not None:
        part.close()


# ---- 1. the scheme against its float64 reference ---------------------------------------------


def test_activation_rounding_is_the_documented_one() -> None:
    """quant.matmul on tokens built to hit the rules: a zero token (scale 1), exact halves (int8:
    to even), values that only fp8 rounds; equal to the reference, which takes another route."""
    from prefixscore.model.quant import DYNAMIC, matmul, quantize_per_channel

    rng = np.random.default_rng(0)
    w = rng.normal(size=(6, 5)).astype(np.float32)
    x = np.array(
        [
            [127.0, 0.5, 1.5, 2.5, -0.5, -3.5],  # scale 1: halves round to 0, 2, 2, -0, -4
            [0.0] * 6,  # a zero token: scale 1, all zeros
            [254.0, 1.0, 3.0, -5.0, 7.0, 0.25],  # scale 2: 0.5, 1.5, -2.5, 3.5 are halves too
            rng.normal(size=6),
        ],
        np.float32,
    )
    for kind in (INT8, FP8):
        qw = quantize_per_channel(w, kind)
        # the stored values and scales: the published per-channel rounding (fp8 by torch's cast)
        values, scale = quantize_channels(w, kind)
        np.testing.assert_array_equal(np.asarray(qw.scale, np.float64), scale, err_msg=kind)
        np.testing.assert_array_equal(np.asarray(qw.values).astype(np.float64), values, err_msg=kind)
        for activations in (DYNAMIC, NONE):
            got = np.asarray(jax.jit(matmul)(x, qw.replace(activations=activations)), np.float64)
            want = reference_matmul_of(x.astype(np.float64), w, kind, activations)
            atol = 1e-5 if activations == DYNAMIC else 1e-4  # W8A16: float32 sums of products up to 300
            np.testing.assert_allclose(got, want, rtol=1e-6, atol=atol, err_msg=f"{kind}/{activations}")
        assert np.all(np.asarray(jax.jit(matmul)(x[1:2], qw.replace(activations=DYNAMIC))) == 0)
    # round half to even, not away from zero: the first token's products tell them apart
    qw = quantize_per_channel(np.eye(6, dtype=np.float32), INT8).replace(activations=DYNAMIC)
    got = np.asarray(jax.jit(matmul)(x[:1], qw))
    np.testing.assert_allclose(got[0], [127.0, 0.0, 2.0, 2.0, 0.0, -4.0], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("kind", [INT8, FP8])
def test_w8a8_scores_equal_the_float64_forward_of_the_scheme(kind, log_scores) -> None:
    """Per-token dynamic activations: the engine's log-probabilities equal the reference's
    within 1e-4, and the reference of W8A16 is well outside that (the test sees the scheme)."""
    got = log_scores(kind, "dynamic")
    want = reference_scores(kind, "dynamic")
    diff = float(np.abs(got - want).max())
    assert diff <= W8A8_TOLERANCE, (diff, _ties(kind))
    other_scheme = float(np.abs(reference_scores(kind, NONE) - want).max())
    assert other_scheme > 10 * W8A8_TOLERANCE, other_scheme


def test_w8a16_scores_equal_the_float64_forward_of_the_dequantized_weights(scorers, log_scores) -> None:
    """Activations none: the dequantized model's scores (float32 rounding away from float64):
    log-probabilities (of probabilities about 2e-5) within 1e-5, a softmax over the labels within 1e-5."""
    scorer = scorers(INT8, NONE)
    got = log_scores(INT8, NONE)
    want = reference_scores(INT8, NONE)
    assert float(np.abs(got - want).max()) <= W8A16_TOLERANCE
    # a softmax over the labels (probabilities of a few tenths, where 1e-5 tells), on another
    # query: a call of the same shape (the cached query would compile an items-only call)
    query = QUERY[::-1]
    softmax = np.asarray(scorer.score(query, ITEMS, LABELS, apply_softmax=True), np.float64)
    label_logits = reference_scores(INT8, NONE, query=query)
    want_softmax = np.exp(label_logits) / np.exp(label_logits).sum(-1, keepdims=True)
    assert float(np.abs(softmax - want_softmax).max()) <= 1e-5
    assert float(np.abs(reference_scores(INT8, "dynamic") - want).max()) > 10 * W8A16_TOLERANCE


# ---- 2. meshes -------------------------------------------------------------------------------


def test_int8_on_meshes_scores_like_one_device(mesh_part, log_scores) -> None:
    """int8 weights, W8A8 dynamic and W8A16, on tp 2 x dp 2 and tp 4 (KV heads replicated):
    log-probabilities within 1e-5 of one device's; the placed scales of column-split projections
    split on the model axis with their columns, those of row-split ones (o, down) replicated."""
    assert mesh_part is not None
    result = mesh_part.result()
    assert set(result) == {f"{a}/tp{tp}xdp{dp}" for a in MESH_SCHEMES for tp, dp in MESHES}
    for name, r in result.items():
        activations = name.split("/")[0]
        diff = float(np.abs(np.asarray(r["log_probs"]) - log_scores(INT8, activations)).max())
        assert diff <= MESH_TOLERANCE, (name, diff, _ties(INT8) if activations != NONE else "")
        assert r["quantization"]["activations"] == activations, name
        tp = r["tp"]
        for projection in PROJECTIONS:
            leaves = {part: r["leaves"][f"layers.{projection}.{part}"] for part in ("values", "scale")}
            shape, spec, local = (leaves["scale"][k] for k in ("shape", "spec", "local_shape"))
            assert shape[1] == 1 and leaves["scale"]["dtype"] == "float32", (name, projection, shape)
            if projection in COLUMN_SPLIT:  # scales split with their columns
                assert leaves["values"]["spec"] == [None, None, "model"], (name, projection)
                assert spec == [None, None, "model"] and local == [shape[0], 1, shape[2] // tp], (name, projection)
                assert leaves["values"]["local_shape"][2] == local[2], (name, projection)
            else:  # row-split: the input rows split, every output channel's scale on every device
                assert leaves["values"]["spec"] == [None, "model", None], (name, projection)
                assert spec == [None, None, None] and local == shape, (name, projection)


def part_mesh() -> dict:
    from prefixscore import Scorer
    from prefixscore.engine.runtime import compile_cache
    from prefixscore.model.weights import flat_weights

    assert jax.device_count() == DEVICES, jax.devices()
    compile_cache.enable()
    # a quarter of the compile time of four sharded engines; what is checked here (placement,
    # the partial sums and the activation scale across devices) is the same program
    jax.config.update("jax_disable_most_optimizations", True)
    out = {}
    for activations in MESH_SCHEMES:
        for tp, dp in MESHES:
            scorer = Scorer.load(MODEL, buckets=BUCKETS, quantize=INT8, activations=activations, tp_size=tp, dp_size=dp)
            probs = np.asarray(scorer.score(QUERY, ITEMS, LABELS), np.float64)
            leaves = {}
            for name, array in flat_weights(scorer.model.params).items():
                if name.endswith((".values", ".scale")):
                    spec = list(array.sharding.spec) + [None] * (array.ndim - len(array.sharding.spec))
                    leaves[name] = {
                        "shape": list(array.shape),
                        "dtype": str(array.dtype),
                        "spec": spec,
                        "local_shape": list(array.addressable_shards[0].data.shape),
                    }
            out[f"{activations}/tp{tp}xdp{dp}"] = {
                "tp": tp,
                "log_probs": np.log(probs).tolist(),
                "leaves": leaves,
                "quantization": scorer.model.quantization,
            }
            scorer.runner.close()
    return out


# ---- 3. what it lowers to --------------------------------------------------------------------

_DOT = re.compile(r"stablehlo\.dot_general .*: \(tensor<([^>]*)>, tensor<([^>]*)>\) -> tensor<([^>]*)>")
EIGHT_BIT = {"i8", "f8E4M3FN"}


def _dots(text: str) -> list[tuple[tuple[str, str], tuple[str, str], str]]:
    """Every dot_general: ((lhs shape, element type), (rhs shape, type), result type)."""

    def split(t: str) -> tuple[str, str]:
        shape, _, element = t.rpartition("x")
        return shape, element

    return [(split(a), split(b), split(c)[1]) for a, b, c in _DOT.findall(text)]


@pytest.mark.parametrize("platform", ["tpu", "cuda"])
@pytest.mark.parametrize("kind", [INT8, FP8])
def test_w8a8_lowers_to_8bit_products(kind, platform, scorers) -> None:
    """The engine's call lowered for the accelerator: every projection of the layer scan is one
    dot_general of two 8-bit operands (int8 -> int32, fp8 -> float32), the weight operand the
    stored [in, out] values; the vocabulary head and the attention stay float."""
    scorer = scorers(kind, "dynamic")
    engine = scorer.engine
    text = engine.lower_for(max(engine.executable_keys()), platform).as_text()
    dots = _dots(text)
    eight_bit = [d for d in dots if d[0][1] in EIGHT_BIT or d[1][1] in EIGHT_BIT]
    storage = {INT8: "i8", FP8: "f8E4M3FN"}[kind]
    accumulate = {INT8: "i32", FP8: "f32"}[kind]
    assert eight_bit, "no 8-bit dot_general"
    for lhs, rhs, result in eight_bit:
        assert lhs[1] == rhs[1] == storage and result == accumulate, (lhs, rhs, result)
    cfg = scorer.cfg
    want = sorted(f"{w.values.shape[1]}x{w.values.shape[2]}" for w in _projections(scorer.model.params).values())
    weight_operands = sorted(rhs[0] for _, rhs, _ in eight_bit)
    assert len(weight_operands) % len(PROJECTIONS) == 0, weight_operands
    assert weight_operands == sorted(want * (len(weight_operands) // len(PROJECTIONS))), weight_operands
    # everything else multiplies float32: the attention, and the vocabulary head (hidden states
    # against [rows, hidden] of the embedding)
    floats = [d for d in dots if d not in eight_bit]
    assert floats and all(lhs[1] == rhs[1] == "f32" for lhs, rhs, _ in floats), floats
    hidden = f"x{cfg.hidden_size}"
    assert any(lhs[0].endswith(hidden) and rhs[0].endswith(hidden) for lhs, rhs, _ in floats)


@pytest.mark.parametrize("platform", ["tpu", "cuda"])
def test_w8a16_lowers_with_weights_dequantized_first(platform, scorers) -> None:
    """Activations none: the 8-bit weights enter the call as bytes and are dequantized inside it,
    so no dot_general has an 8-bit operand."""
    engine = scorers(INT8, NONE).engine
    text = engine.lower_for(max(engine.executable_keys()), platform).as_text()
    dots = _dots(text)
    assert dots
    assert not [d for d in dots if d[0][1] in EIGHT_BIT or d[1][1] in EIGHT_BIT], "an 8-bit dot under W8A16"
    signature = next(line for line in text.splitlines() if "func.func public @main(" in line)
    assert "xi8>" in signature, "the weights do not enter the call as int8"


# ---- 4. what stays full precision ------------------------------------------------------------


def _projections(params) -> dict:
    return {p: getattr(getattr(params.layers, p.split(".")[0]), p.split(".")[1]) for p in PROJECTIONS}


@pytest.mark.parametrize("kind", [INT8, FP8])
def test_preset_quantizes_the_seven_projections_and_nothing_else(kind, scorers) -> None:
    """--quantize int8|fp8 on a random preset: the seven projections are QuantizedMatrix (8-bit, one
    float32 scale per output channel), values and scales bit for bit the published rounding of
    the full-precision weights (tests/helpers/quant_reference.py; int8 also within half a step);
    the embedding (the tied head), the norms and the final norm are the full-precision model's,
    bit for bit; quantization_of and the loaded model report the projections."""
    from prefixscore.model.weights import quantization_of

    scorer = scorers(kind, "dynamic")
    params = jax.device_get(scorer.model.params)
    full = _full_params()
    assert params.lm_head is None and params.score is None  # tied: the head is the embedding
    for name in ("embed", "final_norm"):
        got, want = getattr(params, name), getattr(full, name)
        assert got.dtype == np.float32 and np.array_equal(got, want), name
    for name in ("attn_norm", "mlp_norm"):
        assert np.array_equal(getattr(params.layers, name), getattr(full.layers, name)), name
    for name in ("q_norm", "k_norm"):
        assert np.array_equal(getattr(params.layers.attn, name), getattr(full.layers.attn, name)), name
    storage = {INT8: np.dtype(np.int8), FP8: np.dtype(ml_dtypes.float8_e4m3fn)}[kind]
    for name, w in _projections(params).items():
        assert isinstance(w, QuantizedMatrix), name
        original = _projections(full)[name]
        assert w.values.dtype == storage and w.values.shape == original.shape, name
        assert w.scale.dtype == np.float32 and w.scale.shape == (original.shape[0], 1, original.shape[2]), name
        assert w.offset is None and w.input_scale is None and w.activations == "dynamic", name
        # one scale per output channel: its largest weight is +-127 (fp8: +-448) steps
        np.testing.assert_allclose(
            w.scale[:, 0, :], np.abs(original).max(axis=1) / PUBLISHED_QMAX[kind], rtol=1e-6, err_msg=name
        )
        for layer in range(original.shape[0]):
            values, scale = quantize_channels(original[layer], kind)
            np.testing.assert_array_equal(w.scale[layer].astype(np.float64), scale, err_msg=f"{name}[{layer}]")
            np.testing.assert_array_equal(w.values[layer].astype(np.float64), values, err_msg=f"{name}[{layer}]")
        if kind == INT8:
            step = w.scale.astype(np.float64)
            error = np.abs(w.values.astype(np.float64) * step - original.astype(np.float64))
            assert np.all(error <= step / 2 * (1 + 1e-5)), name
    want = {
        "weights": kind,
        "activations": "dynamic",
        "projections": {f"layers.{p}": f"{kind} per channel" for p in PROJECTIONS},
    }
    assert quantization_of(scorer.model.params) == want
    assert scorer.model.quantization == want


@pytest.mark.parametrize(
    ("family", "head", "options"),
    [("llama", "lm_head", {}), ("qwen3", "score", dict(classifier=True, num_labels=3))],
)
def test_heads_of_a_checkpoint_stay_in_the_served_dtype(tmp_path, family, head, options) -> None:
    """--quantize int8 on a checkpoint served in bfloat16: an untied lm_head and a classifier's
    score rows, and the embedding, are the checkpoint's tensors in bfloat16 exactly; the seven
    projections are int8 (nothing is compiled: the load alone)."""
    import jax.numpy as jnp

    from prefixscore.model.loader import load_model
    from prefixscore.model.quant_choice import QuantizeChoice
    from prefixscore.model.weights import quantization_of

    torch_model = make_torch_model(family, seed=3, **options)
    torch_model.save_pretrained(tmp_path)
    state = {k: v.float().numpy() for k, v in torch_model.state_dict().items()}
    loaded = load_model(str(tmp_path), "bfloat16", quantize=QuantizeChoice(INT8))
    params = jax.device_get(loaded.params)
    bf16 = jnp.dtype(jnp.bfloat16)
    for name, tensor in (("embed", "model.embed_tokens.weight"), (head, f"{head}.weight")):
        got = getattr(params, name)
        assert got is not None and not isinstance(got, QuantizedMatrix), name
        assert got.dtype == bf16, (name, got.dtype)
        np.testing.assert_array_equal(np.asarray(got), state[tensor].astype(bf16), err_msg=name)
    assert params.final_norm.dtype == bf16 and params.layers.attn_norm.dtype == bf16
    for name, w in _projections(params).items():
        assert isinstance(w, QuantizedMatrix) and w.values.dtype == np.int8, name
    report = quantization_of(loaded.params)
    assert report["weights"] == "int8" and set(report["projections"]) == {f"layers.{p}" for p in PROJECTIONS}
    assert loaded.quantization == report


# ---- 5. refusals -----------------------------------------------------------------------------


def test_impossible_choices_are_refused_naming_the_flag_before_compiling() -> None:
    """--quantize int4; --quantize none with --activations dynamic; --activations dynamic on a
    full-precision model without --quantize; and on the embedded GGUF, whose blocks carry a
    minimum (the check comes after its cached conversion, before anything is compiled)."""
    from prefixscore import Scorer
    from prefixscore.model.quant_choice import QuantizeChoice
    from prefixscore.telemetry.compiles import CompileCounter

    CompileCounter.install()
    with pytest.raises(QuantizationError, match="--quantize 'int4'"):
        QuantizeChoice("int4")
    with pytest.raises(QuantizationError, match="--quantize 'int4'"):
        Scorer.load(MODEL, quantize="int4")
    with pytest.raises(QuantizationError, match="--activations 'static'"):
        QuantizeChoice(INT8, "static")  # not an operator's choice: the checkpoint's scheme
    with pytest.raises(QuantizationError, match="--activations dynamic.*--quantize is none"):
        QuantizeChoice(NONE, "dynamic")
    with pytest.raises(QuantizationError, match="--activations dynamic.*full precision.*--quantize int8 or fp8"):
        Scorer.load(MODEL, buckets=BUCKETS, activations="dynamic")
    before = CompileCounter.obtained()
    with pytest.raises(QuantizationError) as err:
        Scorer.load("smollm2-135m", buckets=BUCKETS, activations="dynamic")
    message = str(err.value)
    assert "--activations dynamic" in message and "blocks of 32 with a minimum" in message, message
    assert "--activations none" in message and "--quantize int8|fp8" in message, message  # the ways out
    assert CompileCounter.obtained() == before


def main() -> None:
    print(json.dumps({"mesh": part_mesh}[sys.argv[1]]()))


if __name__ == "__main__":
    main()
