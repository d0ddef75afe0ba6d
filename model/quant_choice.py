"""What a load does with each projection: the operator's `--quantize` and `--activations`
against what the checkpoint holds, decided per tensor as it is read (model/weights.py).

--quantize:
- auto (default): a checkpoint's 8-bit projections stay 8-bit as published (GGUF blocks,
  compressed-tensors channels); full-precision ones stay as they are;
- none: every projection in the served dtype (8-bit ones dequantized);
- int8 | fp8: every projection 8-bit with one scale per output channel, quantized at load from
  full precision or requantized from a file's dequantized values (logged as such).
--activations:
- auto (default): the checkpoint's scheme (compressed-tensors' input_activations; GGUF: none),
  and dynamic for --quantize int8|fp8 (as vLLM's online fp8);
- dynamic: per-token 8-bit activations (W8A8); none: W8A16.

The embedding and the output head are never 8-bit (model/quant.py): only the seven projections
of each layer are decided here.
"""

from __future__ import annotations

import collections
import dataclasses

import numpy as np

from prefixscore import choices
from prefixscore.model.quant import (
    DYNAMIC,
    FP8,
    INT8,
    NONE,
    QuantizationError,
    QuantizedMatrix,
    host_dequantize,
    quantize_per_channel,
    stack_layers,
)

# the flags' names (a leaf the command lines read without JAX); model/quant.py's NONE, INT8, FP8,
# DYNAMIC are among them (tests/test_engine_options.py)
AUTO = choices.AUTO
QUANTIZE_CHOICES = choices.QUANTIZE
ACTIVATION_CHOICES = choices.ACTIVATIONS


@dataclasses.dataclass(frozen=True)
class QuantizeChoice:
    """The operator's choice (--quantize, --activations): validated on construction."""

    quantize: str = AUTO
    activations: str = AUTO

    def __post_init__(self) -> None:
        if self.quantize not in QUANTIZE_CHOICES:
            raise QuantizationError(f"--quantize {self.quantize!r} is not one of {', '.join(QUANTIZE_CHOICES)}")
        if self.activations not in ACTIVATION_CHOICES:
            raise QuantizationError(f"--activations {self.activations!r} is not one of {', '.join(ACTIVATION_CHOICES)}")
        if self.quantize == NONE and self.activations == DYNAMIC:
            raise QuantizationError("--activations dynamic needs 8-bit weights, but --quantize is none")

    @property
    def at_load(self) -> str | None:
        """The kind every projection is quantized to at load (None: as the checkpoint holds it)."""
        return self.quantize if self.quantize in (INT8, FP8) else None

    def eight_bit(self, checkpoint_8bit: bool) -> bool:
        """Whether the projections will be 8-bit, given whether the checkpoint's are."""
        return self.at_load is not None or (checkpoint_8bit and self.quantize == AUTO)

    def activations_for(self, checkpoint_activations: str) -> str:
        """The activation scheme served, given the checkpoint's (NONE for a full-precision one)."""
        if self.activations != AUTO:
            return self.activations
        if self.quantize == NONE:  # dequantized: nothing is left to multiply in 8 bits
            return NONE
        return DYNAMIC if self.at_load else checkpoint_activations

    def check_checkpoint(self, checkpoint_8bit: bool) -> None:
        """Refuses, before any weight is read, 8-bit activations for projections that will not be
        8-bit (a full-precision checkpoint without --quantize int8|fp8)."""
        if self.activations == DYNAMIC and not self.eight_bit(checkpoint_8bit):
            raise QuantizationError(
                "--activations dynamic needs 8-bit weights, and this checkpoint is full precision: "
                "add --quantize int8 or fp8"
            )


class ProjectionConverter:
    """Applies a QuantizeChoice to one load's projections and counts what became of them (the log)."""

    def __init__(self, choice: QuantizeChoice) -> None:
        self.choice = choice
        self.became: collections.Counter[str] = collections.Counter()

    def layer(self, tensor: np.ndarray | QuantizedMatrix) -> np.ndarray | QuantizedMatrix:
        """One layer's projection [in, out] as it will be stacked."""
        kind = self.choice.at_load
        if isinstance(tensor, QuantizedMatrix):
            if self.choice.quantize == NONE:
                self.became[f"{tensor.describe()} -> dequantized"] += 1
                return host_dequantize(tensor)
            if kind is None or (tensor.kind == kind and tensor.per_channel and tensor.offset is None):
                self.became[f"{tensor.describe()} kept"] += 1
                return tensor
            self.became[f"{tensor.describe()} -> requantized {kind} per channel"] += 1
            return quantize_per_channel(host_dequantize(tensor), kind)
        if kind is None:
            return tensor
        self.became[f"quantized at load to {kind} per channel"] += 1
        return quantize_per_channel(tensor, kind)

    def stack(self, name: str, layers: list[np.ndarray | QuantizedMatrix]) -> np.ndarray | QuantizedMatrix:
        """The layers stacked [layers, in, out] (8-bit ones multiplied as W8A16 until
        `with_activations`); layers of both sorts (a file with some projections
        in F16) are all dequantized, which is exact."""
        quantized = [isinstance(t, QuantizedMatrix) for t in layers]
        if all(quantized):
            return stack_layers(layers)
        if any(quantized):
            self.became[f"{name}: float and 8-bit layers mixed -> dequantized"] += 1
            layers = [host_dequantize(t) if isinstance(t, QuantizedMatrix) else t for t in layers]
        return np.stack(layers)

    def summary(self) -> str:
        """What became of the projections, for the start-up log ("" when nothing was 8-bit)."""
        return "; ".join(f"{what}: {count}" for what, count in sorted(self.became.items()))
