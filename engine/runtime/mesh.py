"""Where every array lives on a 2-D device mesh (data, model), and how large each axis is.

- **model** (tensor parallel): attention heads, MLP columns and vocabulary rows split across
  the axis; q/k/v and gate/up by column, o and down by row (one all-reduce each per layer,
  model/decoder.py), the embedding and the vocabulary head by row (model/shards.py). The
  prefix pool is split by KV head, so a device stores only the heads it computes.
- **data**: each replica holds its model shard and a whole pool (every page on every
  replica), runs its own share of a call's prefill chunks (their K/V gathered for every
  replica's pool write) and scores its own share of the items.

Weights name their dimensions by logical axes (model/weights.py); `RULES`, the one table
here, maps logical axes to mesh axes. Two layouts differ from the checkpoint's, both
decided here from the logical axes alone:
- **KV heads replicated** when the model axis has more devices than the model has KV heads
  (GQA with TP > kv_heads): each KV head is stored TP / kv_heads times, in order, so device d
  holds the head its query heads read (query heads per KV head stay contiguous);
- **the vocabulary padded** to a multiple of the axis (zero rows no token id reaches and the
  log-sum-exp masks out).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import mesh_utils
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from prefixscore.engine.runtime.buckets import round_up
from prefixscore.model.config import DTYPES, ModelConfig
from prefixscore.model.quant_choice import QuantizeChoice
from prefixscore.model.shards import DataReplicas, ModelShards
from prefixscore.model.weights import Weights, leaf_axes, place_all, weight_bytes

DATA, MODEL = "data", "model"
# logical axis -> mesh axis; a logical axis not named here is replicated
RULES: Mapping[str, str] = {"vocab": MODEL, "q_heads": MODEL, "kv_heads": MODEL, "mlp": MODEL}
# the prefix pool [layers, kv_heads, pages, page_tokens, head_dim]
POOL_AXES = ("layers", "kv_heads", None, None, None)
# the default model axis leaves the pool at least this share of a device's memory
MIN_POOL_SHARE = 0.25


class MeshError(ValueError):
    """A mesh the model or the devices cannot take (raised before any device work)."""


@dataclasses.dataclass(frozen=True)
class MeshShape:
    """Devices on each axis: data (replicas) x model (tensor parallel)."""

    data: int
    model: int

    @property
    def devices(self) -> int:
        return self.data * self.model

    def __str__(self) -> str:
        return f"dp={self.data} x tp={self.model}"


def model_sizes(cfg: ModelConfig, devices: int) -> list[int]:
    """Every model-axis size this model can be split in on `devices` devices: it divides the
    devices, the query heads and the MLP width, and divides the KV heads or is a multiple of
    them (then each KV head is stored TP / kv_heads times)."""
    kv = cfg.num_kv_heads
    return [
        tp
        for tp in range(1, devices + 1)
        if devices % tp == 0
        and cfg.num_heads % tp == 0
        and cfg.intermediate_size % tp == 0
        and (kv % tp == 0 or tp % kv == 0)
        and cfg.vocab_size >= tp * tp  # every vocabulary shard holds real rows
    ]


def choose_mesh(
    cfg: ModelConfig,
    devices: int,
    tp: int | None = None,
    dp: int | None = None,
    weight_bytes: int = 0,
    device_bytes: int | None = None,
) -> MeshShape:
    """The mesh for `devices` devices. tp / dp as asked (either alone: the other fills the
    devices); neither: the smallest model axis whose weight shard leaves the pool at least
    MIN_POOL_SHARE of a device (device_bytes None, as on CPUs: 1), the rest data.
    Raises MeshError naming the valid sizes."""
    valid = model_sizes(cfg, devices)
    if tp is not None and tp < 1 or dp is not None and dp < 1:
        raise MeshError(f"mesh: tp-size and dp-size must be at least 1 (got tp={tp}, dp={dp})")
    if tp is None and dp is not None:
        if devices % dp:
            raise MeshError(f"mesh: dp-size {dp} does not divide the {devices} devices")
        tp = devices // dp
    if tp is None:
        fits = [t for t in valid if device_bytes is None or weight_bytes / t <= (1 - MIN_POOL_SHARE) * device_bytes]
        if not fits:
            raise MeshError(
                f"mesh: {weight_bytes / 2**30:.1f} GiB of weights do not fit {devices} device(s) of "
                f"{(device_bytes or 0) / 2**30:.1f} GiB with room for the prefix pool at any tp-size in {valid}"
            )
        tp = fits[0]
    check_model_size(cfg, tp, devices)
    if dp is None:
        if devices % tp:
            raise MeshError(f"mesh: tp-size {tp} does not divide the {devices} devices (valid: {valid})")
        dp = devices // tp
    if dp * tp > devices:
        raise MeshError(f"mesh: dp-size {dp} x tp-size {tp} = {dp * tp} devices, but {devices} are available")
    return MeshShape(dp, tp)


def check_model_size(cfg: ModelConfig, tp: int, devices: int) -> None:
    """Raises MeshError naming the valid sizes unless tp splits this model."""
    if tp not in model_sizes(cfg, tp):
        raise MeshError(
            f"mesh: tp-size {tp} does not split this model ({cfg.num_heads} query heads, "
            f"{cfg.num_kv_heads} KV heads, MLP width {cfg.intermediate_size}); valid tp-sizes on "
            f"{devices} device(s): {model_sizes(cfg, devices)}"
        )


def device_grid(shape: MeshShape, devices: list[jax.Device]) -> np.ndarray:
    """The devices as a [data, model] grid. On a TPU slice jax's mesh_utils orders them so the
    model axis, which carries an all-reduce per layer, runs over neighbouring chips' ICI links;
    elsewhere (CPU, GPU) and for a subset it cannot place, host by host: a row of the model axis
    holds one host's devices where the host has that many, so its all-reduces stay off the
    network between hosts and only the data axis (a gather per call) crosses it."""
    try:
        return mesh_utils.create_device_mesh((shape.data, shape.model), devices, allow_split_physical_axes=True)
    except (ValueError, NotImplementedError):
        by_host = sorted(devices, key=lambda d: (d.process_index, d.id))
        return np.array(by_host).reshape(shape.data, shape.model)


def hosts_per_row(grid: np.ndarray) -> int:
    """The most hosts one row of the model axis spans (1: every all-reduce stays within a host)."""
    return max(len({d.process_index for d in row}) for row in grid)


class Layout:
    """A model's arrays on a (data, model) mesh: the shardings, the per-device shapes, and the
    placement of weights (checkpoint layout in, mesh layout out)."""

    def __init__(self, cfg: ModelConfig, shape: MeshShape, devices: Sequence[jax.Device]) -> None:
        if shape.devices > len(devices):
            raise MeshError(f"mesh: {shape} needs {shape.devices} devices, {len(devices)} available")
        check_model_size(cfg, shape.model, len(devices))
        self.cfg = cfg
        self.shape = shape
        self.mesh = Mesh(device_grid(shape, list(devices)[: shape.devices]), (DATA, MODEL))
        # KV heads as stored: replicated up to the model axis when it has more devices than heads
        self.kv_heads = max(cfg.num_kv_heads, shape.model)
        self.kv_repeats = self.kv_heads // cfg.num_kv_heads
        self.vocab_rows = round_up(cfg.vocab_size, shape.model)
        self.shards = ModelShards(MODEL, shape.model, cfg.vocab_size)
        self.replicas = DataReplicas(DATA, shape.data)
        self.replicated = NamedSharding(self.mesh, P())
        self.items = NamedSharding(self.mesh, P(DATA))  # leading axis: one entry per data replica
        self.pool = NamedSharding(self.mesh, self.spec(POOL_AXES))

    @property
    def devices(self) -> list[jax.Device]:
        """Every device of the mesh, on every host."""
        return list(self.mesh.devices.flat)

    @property
    def local_devices(self) -> list[jax.Device]:
        """The mesh's devices this process drives (all of them, on one host)."""
        return [d for d in self.devices if d.process_index == jax.process_index()]

    @property
    def hosts(self) -> int:
        return len({d.process_index for d in self.devices})

    @property
    def model_axis_hosts(self) -> int:
        """The most hosts a row of the model axis spans (1: its all-reduces stay within a host)."""
        return hosts_per_row(self.mesh.devices)

    @property
    def local_kv_heads(self) -> int:
        return self.kv_heads // self.shape.model

    @property
    def local_heads(self) -> int:
        return self.cfg.num_heads // self.shape.model

    @staticmethod
    def spec(axes: Sequence[str | None]) -> P:
        return P(*(RULES.get(axis) if axis else None for axis in axes))

    def weight_spec(self, name: str, shape: tuple[int, ...]) -> P:
        """One weight's PartitionSpec, by its flat name ("layers.attn.wq", "layers.attn.wq.scale")."""
        return self.spec(leaf_axes(name, shape))

    def weight_specs(self, weights: Weights) -> Weights:
        """A PartitionSpec per weight (the tree `weights` has): shard_map's in_specs."""
        return place_all(weights, lambda name, array: self.weight_spec(name, array.shape))

    def place(self, name: str, array: np.ndarray | jax.Array) -> jax.Array:
        """One weight (flat name, checkpoint layout) onto its shards: KV heads replicated and
        the vocabulary padded as the mesh needs, then each device sent only its slice."""
        axes = leaf_axes(name, array.shape)
        array = self._mesh_layout(array, axes)
        sharding = NamedSharding(self.mesh, self.spec(axes))
        if isinstance(array, jax.Array) and array.sharding.is_equivalent_to(sharding, array.ndim):
            return array  # placed as it was read
        if not sharding.is_fully_addressable:
            # a mesh over several hosts: this host sends only its own devices' slices (device_put
            # would first compare the whole array across hosts, a collective per weight)
            host = np.asarray(array)
            return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])
        return jax.device_put(array, sharding)

    def place_weights(self, weights: Weights) -> Weights:
        """Every weight onto its shards (`place` leaves one already there as it is)."""
        return place_all(weights, self.place)

    def _mesh_layout(self, array: np.ndarray | jax.Array, axes: Sequence[str | None]) -> np.ndarray | jax.Array:
        """Checkpoint layout -> mesh layout (a no-op for an array already in it: its sizes are
        no longer the checkpoint's)."""
        xp = np if isinstance(array, np.ndarray) else jnp
        hd = self.cfg.head_dim
        for dim, axis in enumerate(axes):
            size = array.shape[dim]
            if axis == "kv_heads" and self.kv_repeats > 1 and size == self.cfg.num_kv_heads * hd:
                heads = array.reshape(*array.shape[:dim], self.cfg.num_kv_heads, hd, *array.shape[dim + 1 :])
                heads = xp.repeat(heads, self.kv_repeats, axis=dim)  # head h -> copies h*r .. h*r + r - 1
                array = heads.reshape(*array.shape[:dim], self.kv_heads * hd, *array.shape[dim + 1 :])
            elif axis == "vocab" and size == self.cfg.vocab_size < self.vocab_rows:
                pad = [(0, 0)] * array.ndim
                pad[dim] = (0, self.vocab_rows - size)
                array = xp.pad(array, pad)
        return array


def default_layout(
    cfg: ModelConfig,
    dtype: str,
    devices: int | Sequence[jax.Device] | None = None,
    mesh: MeshShape | None = None,
    *,
    tp: int | None = None,
    dp: int | None = None,
    eight_bit: bool = False,
) -> Layout:
    """The layout on `devices` (every device of every host by default; an int: the first that many):
    `mesh` if given, else tp / dp as asked, the rest chosen (engine/mesh.choose_mesh: the
    smallest model axis the weights fit with room for the pool, the rest data; eight_bit: the
    projections take a byte per weight)."""
    if devices is None:
        devices = jax.devices()
    elif isinstance(devices, int):
        devices = jax.devices()[:devices]
    devices = list(devices)
    if mesh is None:
        need = weight_bytes(cfg, DTYPES[dtype], eight_bit)
        here = [d for d in devices if d.process_index == jax.process_index()] or devices
        mesh = choose_mesh(cfg, len(devices), tp, dp, weight_bytes=need, device_bytes=device_memory(here[0]))
    return Layout(cfg, mesh, devices)


class MeshPlacement:
    """`load_model`'s place_for: once the model's config is read, the layout is chosen
    (default_layout: tp / dp as asked, the rest chosen) and each weight goes to its shards as
    it is read; `layout` is then the one to build the engine on."""

    def __init__(
        self,
        dtype: str,
        devices: int | Sequence[jax.Device] | None = None,
        tp: int | None = None,
        dp: int | None = None,
        quantize: QuantizeChoice | None = None,
    ) -> None:
        self.dtype, self.devices, self.tp, self.dp = dtype, devices, tp, dp
        self.quantize = quantize or QuantizeChoice()
        self.layout: Layout | None = None

    def __call__(self, cfg: ModelConfig) -> Callable[[str, np.ndarray], jax.Array]:
        self.layout = self._layout(cfg)
        return self.layout.place

    def for_model(self, cfg: ModelConfig) -> Layout:
        """The layout the weights were placed on (or, for weights loaded elsewhere, a new one)."""
        return self.layout or self._layout(cfg)

    def _layout(self, cfg: ModelConfig) -> Layout:
        eight_bit = self.quantize.eight_bit(checkpoint_8bit=bool(cfg.quant_weights))
        return default_layout(cfg, self.dtype, self.devices, tp=self.tp, dp=self.dp, eight_bit=eight_bit)


def device_memory(device: jax.Device) -> int | None:
    """A device's memory in bytes, where the backend reports it (not on CPUs)."""
    return (device.memory_stats() or {}).get("bytes_limit")
