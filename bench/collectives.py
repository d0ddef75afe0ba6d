"""What a compiled device call moves between devices, read from its HLO, against its FLOPs.

Every collective of the compiled call is listed with the scope it runs in (the decoder's
`jax.named_scope`s: pool_write, attention, mlp, embed, head; the final gather), the mesh axis it
spans (read off its replica groups), its shape and whether it sits in the decoder layers'
loop (so runs once per layer). `traffic` turns that into bytes per token per layer on the
model axis and bytes per call, and predicts, from published peak figures, how long the
model axis's all-reduces take against the layer's matmuls on a few accelerators.
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Any

import numpy as np

from prefixscore.model import flops

# name -> (dense bfloat16 matmul peak FLOP/s, collective bandwidth per chip each way, bytes/s):
# v5e and v6e ICI per chip (1,600 and 3,584 Gbit/s), H100 SXM NVLink (900 GB/s both ways)
HARDWARE: dict[str, tuple[float, float]] = {
    "TPU v5e": (197e12, 200e9),
    "TPU v6e": (918e12, 448e9),
    "H100 SXM": (989e12, 450e9),
}
# the decoder's named scopes, innermost first (the pool write runs inside the attention's)
SCOPES = ("pool_write", "attention", "mlp", "embed", "head")
LAYER_SCOPES = ("pool_write", "attention", "mlp")
# a collective's result (one array, or a tuple of them: XLA combines independent all-reduces into
# one), its kind and its operands
_OP = re.compile(
    r"= (?P<result>\(.*?\)|\w+\[[\d,]*\]\S*) (?P<kind>all-reduce|all-gather|reduce-scatter|all-to-all|"
    r"collective-permute)\((?P<operands>[^)]*)\)"
)
_ARRAY = re.compile(r"(?P<dtype>\w+)\[(?P<shape>[\d,]*)\]")
_NAMED = re.compile(r"^\s*(?:ROOT )?(?P<name>%[\w.-]+) = .*op_name=\"(?P<op_name>[^\"]*)\"")
_DTYPES = {"f32": "float32", "bf16": "bfloat16", "f16": "float16", "s32": "int32", "pred": "bool"}


@dataclasses.dataclass(frozen=True)
class Collective:
    """One collective of a compiled call."""

    scope: str  # the decoder scope it runs in (SCOPES), or "gather" (the call's output)
    kind: str  # all-reduce, all-gather, reduce-scatter, all-to-all, collective-permute
    axis: str  # "model", "data", or "other" (groups that are neither axis)
    shape: tuple[int, ...]
    dtype: str
    per_layer: bool  # inside the decoder layers' loop: runs once per layer

    @property
    def bytes(self) -> int:
        return math.prod(self.shape) * np.dtype(_DTYPES.get(self.dtype, self.dtype)).itemsize


def collectives(hlo: str, mesh: Any) -> list[Collective]:
    """Every collective in a compiled module's text; `mesh`: the jax Mesh (data, model) it ran on.
    A combined collective (a tuple of arrays) is listed per array, each in its operand's scope."""
    grid = mesh.devices
    model = {frozenset(int(d.id) for d in row) for row in grid}
    data = {frozenset(int(d.id) for d in column) for column in grid.T}
    op_names = {m.group("name"): m.group("op_name") for m in map(_NAMED.match, hlo.splitlines()) if m}
    found = []
    for line in hlo.splitlines():
        match = _OP.search(line)
        if not match:
            continue
        groups_text = line.split("replica_groups=")[1].split("}}")[0] + "}"  # {{0,1},{2,3}}
        groups = {frozenset(int(x) for x in g.split(",")) for g in re.findall(r"\{([\d,]+)\}", groups_text)}
        axis = "model" if groups == model else "data" if groups == data else "other"
        name = re.search(r'op_name="([^"]*)"', line)
        own = name.group(1) if name else ""
        operands = [o.strip() for o in match.group("operands").split(",")]
        arrays = list(_ARRAY.finditer(match.group("result")))
        for i, array in enumerate(arrays):
            # a combined collective's array: the scope of the operand it reduces
            op_name = op_names.get(operands[i], own) if len(arrays) > 1 and i < len(operands) else own
            scope = next((s for s in SCOPES if f"/{s}/" in op_name), "gather")
            shape = tuple(int(x) for x in array.group("shape").split(",") if x)
            per_layer = "/while/body/" in op_name and scope in LAYER_SCOPES
            found.append(Collective(scope, match.group("kind"), axis, shape, array.group("dtype"), per_layer))
    return found


def traffic(engine: Any, shape: Any) -> dict[str, Any]:
    """What one call of `shape` moves (from its compiled HLO): bytes per token per layer on the
    model axis, per prefill token per layer on the data axis, and per call outside the layers;
    the projection FLOPs per token per layer on each device; and the predicted all-reduce time
    over matmul time per accelerator (a ring all-reduce sends 2 (tp - 1) / tp of its payload
    from each device)."""
    cfg, tp, dp = engine.cfg, engine.layout.shape.model, engine.layout.shape.data
    found = collectives(engine.compiled_text(shape), engine.layout.mesh)
    tokens = shape.prefill_tokens + shape.item_tokens
    per_layer = sum(c.bytes for c in found if c.per_layer and c.axis == "model") / tokens
    prefill_tokens = dp * shape.prefill_tokens  # every replica's prefill stream
    gathered = sum(c.bytes for c in found if c.per_layer and c.axis == "data")
    layer_flops = flops.linear_per_token(cfg) / cfg.num_layers / tp
    ring = 2 * (tp - 1) / tp
    return {
        "mesh": {"tp_size": tp, "dp_size": engine.layout.shape.data},
        "call": dataclasses.asdict(shape),
        "collectives": [dataclasses.asdict(c) for c in found],
        "bytes_per_token_per_layer": per_layer,
        # the prefill K/V every replica's pool write gathers (the data axis), per prefill token
        "bytes_per_prefill_token_per_layer_on_data_axis": gathered / prefill_tokens if prefill_tokens else 0.0,
        "bytes_per_call_outside_layers": sum(c.bytes for c in found if not c.per_layer),
        "flops_per_token_per_layer_per_device": layer_flops,
        "predicted_allreduce_over_matmul": {
            name: (ring * per_layer / bandwidth) / (layer_flops / peak) for name, (peak, bandwidth) in HARDWARE.items()
        },
    }


def format_traffic(moved: dict[str, Any]) -> str:
    """`traffic`'s report as `prefixscore bench --collectives` prints it."""
    mesh, call = moved["mesh"], moved["call"]
    lines = [
        f"mesh tp={mesh['tp_size']} dp={mesh['dp_size']}, call prefill={call['prefill_tokens']} "
        f"items={call['item_tokens']}: {moved['bytes_per_token_per_layer']:.0f} B per token per layer on the "
        f"model axis, {moved['bytes_per_call_outside_layers']:,} B per call outside the layers, "
        f"{moved['flops_per_token_per_layer_per_device'] / 1e6:.3g} MFLOP per token per layer per device",
        "predicted all-reduce / matmul time at peak: "
        + ", ".join(f"{name} {ratio:.2f}" for name, ratio in moved["predicted_allreduce_over_matmul"].items()),
    ]
    return "\n".join(lines)
