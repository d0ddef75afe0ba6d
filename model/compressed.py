"""compressed-tensors checkpoints (what llm-compressor writes and vLLM users publish): the
`quantization_config` read key by key, and the tensors of its 8-bit projections.

Read exactly: one config group of 8-bit Linear layers, int8 (`int-quantized`, or
`pack-quantized` at 8 bits: four values an int32 word) or fp8 e4m3 (`float-quantized`,
`naive-quantized`) weights, symmetric, one scale per output channel or per tensor; activations
none (W8A16), dynamic per token, or static per tensor (a stored `input_scale`). Every key of the
config is in model/config_inventory.QUANTIZATION_KEYS, computed or refused naming the key and
its value; group-wise and block weights, int4 packing, zero points, act-order, an 8-bit KV
cache, sparsity and rotations are refused.

The `ignore` list is held to the tensors: a projection it names must be full precision and
every other one 8-bit, so a checkpoint that contradicts its own config is refused instead of
read half-way. The output head is never served 8-bit (model/quant.py): a head the checkpoint
quantized anyway is dequantized at load.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import numpy as np

from prefixscore.model.config_inventory import QUANTIZATION_KEYS, Field
from prefixscore.model.quant import DYNAMIC, FP8, INT8, NONE, STATIC, QuantizedMatrix

QUANT_METHOD = "compressed-tensors"
_ARGS = ("weights", "input_activations")


class CompressedTensorsError(ValueError):
    """A compressed-tensors checkpoint this loader does not compute (named key and value)."""


@dataclasses.dataclass(frozen=True)
class CompressedScheme:
    """What a compressed-tensors checkpoint holds, once its config is checked."""

    weights: str  # INT8 | FP8
    activations: str  # NONE | DYNAMIC | STATIC
    ignore: tuple[str, ...]  # modules kept in full precision: names, or "re:" regular expressions

    def ignores(self, module: str) -> bool:
        """Whether `module` ("model.layers.0.mlp.down_proj") is in the ignore list (compressed-tensors'
        matching: a name equal to the module's, or a "re:" expression matching it)."""
        return any(re.match(rule[3:], module) if rule.startswith("re:") else rule == module for rule in self.ignore)


def _flatten(config: Mapping[str, Any]) -> dict[str, Any]:
    """The config's keys as inventory names: top-level ones, "config_groups.*.<key>" of each group
    and "config_groups.*.<args>.<key>" of its quantization args."""
    flat: dict[str, Any] = {}
    for key, value in config.items():
        flat[key] = value
        if key != "config_groups" or not isinstance(value, Mapping):
            continue
        for group in value.values():
            if not isinstance(group, Mapping):  # a preset's name -> targets: refused below by its type
                continue
            for gkey, gvalue in group.items():
                flat[f"config_groups.*.{gkey}"] = gvalue
                if gkey in _ARGS and isinstance(gvalue, Mapping):
                    flat.update({f"config_groups.*.{gkey}.{k}": v for k, v in gvalue.items()})
    return flat


def read_scheme(config: Mapping[str, Any]) -> CompressedScheme:
    """The checkpoint's scheme from its `quantization_config`; every key is checked against the
    inventory (an unknown key, or a value not computed, refuses the load naming it)."""
    inventory: dict[str, Field] = {f.name: f for f in QUANTIZATION_KEYS}
    flat = _flatten(config)
    for key, value in flat.items():
        field = inventory.get(key)
        if field is None:
            raise CompressedTensorsError(
                f"config.json quantization_config.{key} is not in prefixscore's inventory: "
                "whether it changes scores is unknown"
            )
        refusal = field.refusal(value, flat)
        if refusal:
            raise CompressedTensorsError(f"config.json quantization_config.{refusal}")
    weights = flat["config_groups.*.weights"]
    inputs = flat.get("config_groups.*.input_activations")
    if inputs is None:
        activations = NONE
    else:
        activations = DYNAMIC if inputs.get("dynamic") is True else STATIC
    return CompressedScheme(
        weights=INT8 if weights.get("type", "int").lower() == "int" else FP8,
        activations=activations,
        ignore=tuple(config.get("ignore") or ()),
    )


def unpack_int8(packed: np.ndarray, shape: Iterable[int]) -> np.ndarray:
    """`pack-quantized` at 8 bits: each int32 word holds four values, the first in the lowest
    byte, each stored as value + 128. -> int8 [out, in]."""
    rows, cols = (int(n) for n in shape)
    as_bytes = np.ascontiguousarray(packed, dtype="<i4").view(np.uint8).reshape(rows, -1)
    return (as_bytes[:, :cols].astype(np.int16) - 128).astype(np.int8)


def projection_reader(
    scheme: CompressedScheme,
    get: Callable[[str], np.ndarray],
    has: Callable[[str], bool],
    projections: frozenset[str],
) -> tuple[Callable[[str], np.ndarray | QuantizedMatrix], Callable[[str], bool]]:
    """`get` and `has` for model/weights.params_from_hf_tensors: an 8-bit projection's "<module>.weight"
    comes back as its values and scales ([out, in], the checkpoint's layout); anything else as stored.
    projections: the projections' tensor names inside a layer ("self_attn.q_proj.weight", weights.PROJECTIONS)."""

    def _is_projection(module: str) -> bool:
        parts = module.split(".", 3)  # model, layers, {i}, the name inside the layer
        return len(parts) == 4 and parts[:2] == ["model", "layers"] and f"{parts[3]}.weight" in projections

    def eight_bit(module: str) -> bool:
        return has(f"{module}.weight_scale")

    def exists(name: str) -> bool:
        return has(name) or (name.endswith(".weight") and has(f"{name.removesuffix('.weight')}.weight_packed"))

    def read(name: str) -> np.ndarray | QuantizedMatrix:
        module = name.removesuffix(".weight")
        if not name.endswith(".weight"):
            return get(name)
        if not eight_bit(module):
            if _is_projection(module) and not scheme.ignores(module):
                raise CompressedTensorsError(
                    f"model weights: {module} is full precision but quantization_config's ignore list "
                    f"{list(scheme.ignore)} does not name it (a checkpoint contradicting its config)"
                )
            return get(name)
        if scheme.ignores(module):
            raise CompressedTensorsError(
                f"model weights: {module} is 8-bit but quantization_config's ignore list names it"
            )
        if has(f"{module}.weight_packed"):
            values = unpack_int8(get(f"{module}.weight_packed"), get(f"{module}.weight_shape"))
        else:
            values = get(name)
        kind = INT8 if np.dtype(values.dtype) == np.int8 else FP8
        if kind != scheme.weights:
            raise CompressedTensorsError(
                f"model weights: {name} holds {values.dtype} values, quantization_config says {scheme.weights}"
            )
        stored_scale = np.asarray(get(f"{module}.weight_scale"))
        # compressed_tensors dequantizes in the scale's dtype (a bfloat16 scale: a bfloat16 product)
        product = str(stored_scale.dtype)
        # one scale per output row, or one per tensor (shape [1]) repeated to every row: exact
        scale = np.broadcast_to(stored_scale.astype(np.float32).reshape(-1, 1), (values.shape[0], 1))
        if not _is_projection(module):
            # a head (or any other Linear) quantized anyway is served in full precision
            return (values.astype(np.float32).astype(stored_scale.dtype) * stored_scale).astype(np.float32)
        input_scale = None
        if scheme.activations == STATIC:
            input_scale = np.float32(np.asarray(get(f"{module}.input_scale"), np.float32).reshape(()))
        return QuantizedMatrix(
            values=values, scale=np.ascontiguousarray(scale), input_scale=input_scale, product=product
        )

    return read, exists
