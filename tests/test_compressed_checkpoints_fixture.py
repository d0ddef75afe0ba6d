"""The compressed-tensors fixtures (helpers/compressed_checkpoints.py) are what they say: the config
llm-compressor writes, int8/fp8 values with scales of the right shape, output heads left alone, and
a transformers oracle whose weights are exactly values * scale. Tests of the loader lean on these
files; if a compressed_tensors upgrade changes what they hold, this fails first."""

from __future__ import annotations

import pytest
import torch
import transformers
from conftest import make_torch_model
from helpers.compressed_checkpoints import (
    SCHEMES,
    calibration_batches,
    dequantized_oracle,
    dequantized_weight,
    fake_quant_oracle,
    quantization_config,
    read_tensors,
    stored_values,
    write_compressed,
)

# scheme -> (format, weight strategy, stored dtype, input activations: None or (type, strategy, dynamic))
EXPECTED = {
    "int8-w8a8": ("int-quantized", "channel", torch.int8, ("int", "token", True)),
    "fp8-w8a8": ("float-quantized", "channel", torch.float8_e4m3fn, ("float", "token", True)),
    "fp8-tensor-static": ("float-quantized", "tensor", torch.float8_e4m3fn, ("float", "tensor", False)),
    "int8-w8a16": ("pack-quantized", "channel", torch.int32, None),
    "fp8-w8a16": ("naive-quantized", "channel", torch.float8_e4m3fn, None),
}
ATTENTION = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj")
LINEARS = ATTENTION + ("mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")


def test_every_scheme_is_checked():
    assert set(EXPECTED) == set(SCHEMES)


@pytest.mark.parametrize("scheme", list(SCHEMES))
def test_compressed_fixture_is_what_it_says(tmp_path, scheme):
    model = make_torch_model("qwen3", seed=3)  # tied embeddings: lm_head is the embedding table
    dst = write_compressed(model, tmp_path, scheme)
    fmt, strategy, stored, inputs = EXPECTED[scheme]

    qc = quantization_config(dst)
    assert qc["quant_method"] == "compressed-tensors"
    assert qc["quantization_status"] == "compressed"
    assert qc["format"] == fmt
    assert qc["ignore"] == ["lm_head"]
    assert list(qc["config_groups"]) == ["group_0"]
    group = qc["config_groups"]["group_0"]
    assert group["targets"] == ["Linear"] and group["format"] == fmt
    weights = group["weights"]
    assert (weights["num_bits"], weights["strategy"], weights["symmetric"]) == (8, strategy, True)
    assert weights["dynamic"] is False
    assert weights["type"] == ("int" if stored in (torch.int8, torch.int32) else "float")
    if inputs is None:
        assert group["input_activations"] is None
    else:
        got = group["input_activations"]
        assert (got["type"], got["strategy"], got["dynamic"], got["num_bits"], got["symmetric"]) == (*inputs, 8, True)

    tensors = read_tensors(dst)
    assert not any(k.startswith("lm_head") for k in tensors)  # tied and unquantized: not stored at all
    assert not any(k.endswith("zero_point") for k in tensors)  # symmetric: compressed_tensors drops them
    for layer in range(model.config.num_hidden_layers):
        for linear in LINEARS:
            name = f"model.layers.{layer}.{linear}"
            out_features, in_features = model.get_submodule(name).weight.shape
            values = tensors[f"{name}.weight_packed" if stored == torch.int32 else f"{name}.weight"]
            assert values.dtype == stored
            if stored == torch.int32:  # 4 int8 values a word, plus the unpacked shape
                assert values.shape == (out_features, in_features // 4)
                assert tensors[f"{name}.weight_shape"].tolist() == [out_features, in_features]
            else:
                assert values.shape == (out_features, in_features)
            scale = tensors[f"{name}.weight_scale"]
            assert scale.dtype == torch.float32  # the model's dtype
            assert scale.shape == ((out_features, 1) if strategy == "channel" else (1,))
            assert (f"{name}.input_scale" in tensors) == (inputs is not None and not inputs[2])
            # the scales are real: the dequantized weight is the original one, to rounding
            w = model.get_submodule(name).weight.detach()
            err = (dequantized_weight(tensors, name) - w).abs()
            if stored == torch.float8_e4m3fn:  # 3 mantissa bits; subnormals below 2^-6 step 2^-9
                assert (err <= w.abs() / 16 + scale * 2**-9).all()
            else:
                assert (err <= scale * 0.5 + 1e-7).all()
                assert stored_values(tensors, name).abs().max() >= 127

    oracle = dequantized_oracle(dst, transformers.Qwen3ForCausalLM)
    for name, module in oracle.named_modules():
        if isinstance(module, torch.nn.Linear) and name != "lm_head":
            assert torch.equal(module.weight, dequantized_weight(tensors, name)), name
            assert not hasattr(module, "quantization_scheme")  # a plain Linear: no activation QDQ
    assert torch.equal(oracle.lm_head.weight, model.lm_head.weight)

    # transformers' default route fake-quantizes the inputs of W8A8 layers; weight-only matches the oracle
    ids = torch.tensor([[5, 17, 42, 99, 3, 250, 7, 8]])
    with torch.no_grad():
        plain, fake = oracle(ids).logits, fake_quant_oracle(dst, transformers.Qwen3ForCausalLM)(ids).logits
    assert torch.equal(plain, fake) == (inputs is None)


def test_static_input_scale_is_calibrated(tmp_path):
    """FP8 static: input_scale = max |input| over the calibration batches / 448. Layer 0's q_proj
    sees the normed embeddings, which no quantized layer precedes, so the oracle recomputes it."""
    model = make_torch_model("qwen3", seed=3)
    dst = write_compressed(model, tmp_path, "fp8-tensor-static")
    oracle = dequantized_oracle(dst, transformers.Qwen3ForCausalLM)
    seen = []
    q_proj = oracle.model.layers[0].self_attn.q_proj
    hook = q_proj.register_forward_pre_hook(lambda _m, args: seen.append(args[0].abs().max()))
    with torch.no_grad():
        for ids in calibration_batches(model.config.vocab_size):
            oracle(input_ids=ids)
    hook.remove()
    want = torch.stack(seen).max() / torch.finfo(torch.float8_e4m3fn).max
    assert torch.allclose(read_tensors(dst)["model.layers.0.self_attn.q_proj.input_scale"], want.reshape(1), rtol=1e-6)


def test_classifier_head_stays_float(tmp_path):
    model = make_torch_model("qwen3", seed=4, classifier=True, num_labels=3, pad_token_id=0)
    dst = write_compressed(model, tmp_path, "fp8-w8a8")
    assert quantization_config(dst)["ignore"] == ["score"]
    tensors = read_tensors(dst)
    assert tensors["score.weight"].dtype == torch.float32 and "score.weight_scale" not in tensors
    oracle = dequantized_oracle(dst, transformers.Qwen3ForSequenceClassification)
    assert torch.equal(oracle.score.weight, model.score.weight)
