"""Checkpoints in the compressed-tensors format as vLLM users publish them (made by llm-compressor),
written from a tiny transformers model with the `compressed_tensors` package's own API: the tests'
independent picture of the format, not the loader's. `write_compressed` follows llm-compressor's
QuantizationModifier step by step (apply the config, min/max-observe the weights, calibrate static
input scales over a few forward passes, freeze, compress, save, write `quantization_config`);
`dequantized_oracle` and `fake_quant_oracle` are what transformers makes of the result."""

from __future__ import annotations

import copy
import json
import warnings
from pathlib import Path

import torch
from compressed_tensors.compressors import ModelCompressor
from compressed_tensors.offload import update_offload_parameter
from compressed_tensors.quantization import (
    QuantizationArgs,
    QuantizationConfig,
    QuantizationScheme,
    QuantizationStatus,
    QuantizationStrategy,
    apply_quantization_config,
    preset_name_to_scheme,
)
from compressed_tensors.quantization.utils import calculate_qparams
from safetensors import safe_open

# scheme name -> what the checkpoint holds. Every scheme targets the Linear layers and ignores the
# output heads (`lm_head`, and `score` for *ForSequenceClassification), as llm-compressor's
# examples do; the ignore list written to config.json is rebuilt by compressed_tensors from the
# Linear modules left unquantized.
SCHEMES: dict[str, str] = {
    "int8-w8a8": "INT8/W8A8 preset: int8 weights, symmetric, one scale per output channel; int8 inputs, "
    "dynamic per-token scales (nothing stored). format int-quantized",
    "fp8-w8a8": "FP8_DYNAMIC preset: float8_e4m3fn weights, one scale per output channel; fp8 inputs, "
    "dynamic per-token scales (nothing stored). format float-quantized",
    "fp8-tensor-static": "FP8 preset: float8_e4m3fn weights, one scale per tensor; fp8 inputs, one static "
    "scale per tensor (`input_scale`) calibrated with the static_minmax observer. format float-quantized",
    "int8-w8a16": "int8 weights, symmetric, one scale per output channel, no activation quantization "
    "(the W8A16 preset of older compressed-tensors; 0.20's is group-128). format pack-quantized: int32 "
    "`weight_packed` (4 values a word) + `weight_shape`",
    "fp8-w8a16": "float8_e4m3fn weights, one scale per output channel, no activation quantization "
    "(no preset: FP8_DYNAMIC without inputs). format naive-quantized",
}

# the presets llm-compressor users name (QuantizationModifier(scheme=...)); the weight-only
# schemes are spelled out, as 0.20 has no preset for them with per-channel weights
_PRESETS = {"int8-w8a8": "W8A8", "fp8-w8a8": "FP8_DYNAMIC", "fp8-tensor-static": "FP8"}


def _channel_weights(kind: str) -> QuantizationArgs:
    return QuantizationArgs(num_bits=8, type=kind, strategy=QuantizationStrategy.CHANNEL, symmetric=True, dynamic=False)


def quantization_scheme(scheme: str) -> QuantizationScheme:
    """The compressed_tensors QuantizationScheme of a SCHEMES name, targeting every Linear layer."""
    if scheme in _PRESETS:
        return preset_name_to_scheme(_PRESETS[scheme], ["Linear"])
    if scheme == "int8-w8a16":
        return QuantizationScheme(targets=["Linear"], weights=_channel_weights("int"))
    if scheme == "fp8-w8a16":
        return QuantizationScheme(targets=["Linear"], weights=_channel_weights("float"))
    raise KeyError(f"unknown scheme {scheme!r}; one of {sorted(SCHEMES)}")


def _min_max(value: torch.Tensor, strategy: str) -> tuple[torch.Tensor, torch.Tensor]:
    """What llm-compressor's min/max observers reduce: per output channel (rows of a weight) or the
    whole tensor."""
    if strategy == QuantizationStrategy.CHANNEL:
        return value.amin(dim=-1, keepdim=True), value.amax(dim=-1, keepdim=True)
    if strategy == QuantizationStrategy.TENSOR:
        return torch.aminmax(value)
    raise NotImplementedError(f"observer for strategy {strategy!r}")


def _set_qparams(
    module: torch.nn.Module, base: str, args: QuantizationArgs, lo: torch.Tensor, hi: torch.Tensor
) -> None:
    # compressed_tensors' own scale formula (symmetric: absmax / (qrange / 2), i.e. /448 for fp8
    # and /127.5 for int8), stored in the parameters apply_quantization_config registered
    scale, zero_point = calculate_qparams(lo, hi, args)
    update_offload_parameter(module, f"{base}_scale", scale)
    if hasattr(module, f"{base}_zero_point"):
        update_offload_parameter(module, f"{base}_zero_point", zero_point)


def calibration_batches(vocab_size: int, n: int = 4, seed: int = 0) -> list[torch.Tensor]:
    """The token batches write_compressed calibrates static input scales on (random ids, seeded:
    the same every run, so a test can recompute the scales)."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab_size, (2, 16), generator=g) for _ in range(n)]


def write_compressed(model: torch.nn.Module, dst: Path, scheme: str) -> Path:
    """Quantize a copy of `model` (a tiny transformers *ForCausalLM / *ForSequenceClassification; left
    untouched) in `scheme` and save it at `dst` as llm-compressor does: config.json with
    `quantization_config` (status "compressed"), model.safetensors with the compressed tensors.
    Scales take the model's dtype (pass a bfloat16 model for bfloat16 scales, as in most published
    checkpoints). Returns `dst`."""
    dst = Path(dst)
    model = copy.deepcopy(model).eval()
    ignore = ["lm_head"] + (["score"] if hasattr(model, "score") else [])
    config = QuantizationConfig(config_groups={"group_0": quantization_scheme(scheme)}, ignore=ignore)
    # registers weight_scale/weight_zero_point (and input_* for static inputs) and swaps in the
    # forward that fake-quantizes (QDQ) with them
    apply_quantization_config(model, config, show_progress=False)
    quantized = [m for m in model.modules() if getattr(m, "quantization_scheme", None) is not None]

    # QuantizationModifier: weights first (memoryless min/max), at calibration start
    for m in quantized:
        m.quantization_status = QuantizationStatus.CALIBRATION
        args = m.quantization_scheme.weights
        with torch.no_grad():
            _set_qparams(m, "weight", args, *_min_max(m.weight, args.strategy))

    # then static input scales: a pre-forward hook feeds each batch's input to a static_minmax
    # observer (running min/max over all batches) and sets input_scale before the module's QDQ
    # forward uses it, so later layers see the earlier layers' quantization, as in llm-compressor
    hooks, seen = [], {}

    def observe_input(module: torch.nn.Module, args: tuple) -> None:
        qargs = module.quantization_scheme.input_activations
        lo, hi = _min_max(args[0].detach(), qargs.strategy)
        if module in seen:
            lo, hi = torch.minimum(lo, seen[module][0]), torch.maximum(hi, seen[module][1])
        seen[module] = (lo, hi)
        _set_qparams(module, "input", qargs, lo, hi)

    for m in quantized:
        inputs = m.quantization_scheme.input_activations
        if inputs is not None and inputs.dynamic is False:
            hooks.append(m.register_forward_pre_hook(observe_input))
    if hooks:
        with torch.no_grad():
            for ids in calibration_batches(model.config.vocab_size):
                model(input_ids=ids)
    for h in hooks:
        h.remove()
    for m in quantized:  # freeze_module_quantization
        m.quantization_status = QuantizationStatus.FROZEN

    # llm-compressor's save_pretrained wrapper: rebuild the config from the modules (groups, ignore
    # list, format inferred per module), compress in place, save, then add quantization_config
    compressor = ModelCompressor.from_pretrained_model(model)
    compressor.compress_model(model)
    model.save_pretrained(dst)
    compressor.update_config(str(dst))
    return dst


def read_tensors(dst: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint's model.safetensors, as stored."""
    with safe_open(str(Path(dst) / "model.safetensors"), framework="pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


def quantization_config(dst: Path) -> dict:
    """The `quantization_config` of the checkpoint's config.json."""
    return json.loads((Path(dst) / "config.json").read_text())["quantization_config"]


def stored_values(tensors: dict[str, torch.Tensor], module: str) -> torch.Tensor:
    """A quantized Linear's integer/fp8 values as float32 [out, in], unpacking pack-quantized
    (int32 words, each holding 32/8 = 4 consecutive int8 values, lowest bits first) by hand."""
    if f"{module}.weight_packed" in tensors:
        packed, shape = tensors[f"{module}.weight_packed"], tensors[f"{module}.weight_shape"].tolist()
        words = packed.to(torch.int64) & 0xFFFFFFFF
        nibbles = torch.stack([(words >> (8 * i)) & 0xFF for i in range(4)], dim=-1).reshape(shape[0], -1)
        # stored offset by 2^(bits-1) (unsigned); subtract to get the signed int8 value
        return (nibbles[:, : shape[1]] - 128).to(torch.float32)
    return tensors[f"{module}.weight"].to(torch.float32)


def dequantized_weight(tensors: dict[str, torch.Tensor], module: str) -> torch.Tensor:
    """values * weight_scale from the raw tensors (symmetric: no zero point), float32. The product is
    rounded to the scale's dtype first, as compressed_tensors' dequantize (and so transformers)
    computes it: with bfloat16 scales the weight is a bfloat16 product, not a float32 one."""
    scale = tensors[f"{module}.weight_scale"]
    return (stored_values(tensors, module).to(scale.dtype) * scale).to(torch.float32)


def dequantized_oracle(dst: Path, cls: type) -> torch.nn.Module:
    """The checkpoint loaded by transformers with its weights dequantized to float32 at load time
    (`CompressedTensorsConfig(dequantize=True)`, what `run_compressed=False` now means): plain Linear
    layers, weight = values * scale, activations NOT quantized (input_scale is dropped)."""
    from transformers import CompressedTensorsConfig

    with warnings.catch_warnings():
        # "...already has a `quantization_config`...": only the passed loading attributes count, as meant
        warnings.filterwarnings("ignore", message=".*already has a `quantization_config`")
        return cls.from_pretrained(
            dst,
            quantization_config=CompressedTensorsConfig(dequantize=True),
            dtype=torch.float32,
            device_map="cpu",
            attn_implementation="eager",
        ).eval()


def fake_quant_oracle(dst: Path, cls: type) -> torch.nn.Module:
    """The checkpoint loaded by transformers' default compressed-tensors route: compressed_tensors
    keeps its quantization scheme on each Linear, decompresses the weights on the first forward and
    fake-quantizes (QDQ) the input activations in every forward, per token (dynamic) or with the
    stored input_scale (static): the arithmetic a W8A8 kernel approximates."""
    return cls.from_pretrained(dst, dtype=torch.float32, device_map="cpu", attn_implementation="eager").eval()


# the seven projections of a decoder layer (what every scheme here quantizes)
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def int8_per_token_oracle(dst: Path, cls: type) -> torch.nn.Module:
    """`dequantized_oracle` with each projection's input fake-quantized per token as int8 W8A8 kernels
    serve a dynamic per-token checkpoint (vLLM's `dynamic_scaled_int8_quant`): scale = max |x| / 127
    over the token's features (1 for an all-zero token), values round-half-to-even of x / scale
    clipped to [-127, 127]. compressed_tensors' own QDQ (`fake_quant_oracle`) scales by max |x| /
    127.5 and clips to [-128, 127]: the calibration's picture, not the served product."""
    model = dequantized_oracle(dst, cls)

    def quantize_input(module: torch.nn.Module, args: tuple) -> tuple:
        x = args[0]
        top = x.abs().amax(dim=-1, keepdim=True)
        scale = torch.where(top > 0, top / 127.0, torch.ones_like(top))
        return (torch.round(x / scale).clamp(-127, 127) * scale, *args[1:])  # torch.round: half to even

    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and name.endswith(PROJECTIONS):
            module.register_forward_pre_hook(quantize_input)
    return model
