"""The one way to turn a model and its serving choices into a ready ScoringEngine.

The service (service/core.py), the in-process `Scorer` (engine/scorer.py), the bench and the
offline runner all build their engine here, so a new choice (a quantization scheme, several
hosts) is added once. The order matters and is kept here: a host of a group joins the group's
JAX runtime first (engine/hosts/hosts.py), then the model's config is read,
then the mesh is chosen (engine/runtime/mesh.py), then each weight is read and sent to its shards as
it arrives (the host holds about one stacked weight, never the whole model), then the engine
sizes its pool from the memory the weights left.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax

from prefixscore.engine import options
from prefixscore.engine.hosts.hosts import HostGroup, join
from prefixscore.engine.hosts.step_channel import StepLeader
from prefixscore.engine.runtime.buckets import Buckets
from prefixscore.engine.runtime.call_broadcast import ALONE
from prefixscore.engine.runtime.mesh import MeshPlacement
from prefixscore.engine.runtime.scoring_engine import ScoringEngine
from prefixscore.model.call_inputs import TOP_LOGPROBS
from prefixscore.model.head import output_head
from prefixscore.model.loader import LoadedModel, load_model
from prefixscore.model.quant_choice import QuantizeChoice
from prefixscore.model.sentence_config import LAST

log = logging.getLogger("prefixscore.engine")


# the fields of the engine's options, made from engine/options.py's rows (name, type, default):
# a new option is one row there, and EngineSpec has its field
EngineOptionFields = options.fields_class("EngineOptionFields", __name__, engine_only=True, frozen=True)


@dataclasses.dataclass(frozen=True)
class EngineSpec(EngineOptionFields):
    """What to serve and how: every choice that shapes the engine, in one record.

    Every engine option of engine/options.py (model, dtype, quantize, ... each with its row's type
    and default) is a field, inherited from EngineOptionFields, which is made from the table so
    that an option is declared once; the fields below are no option."""

    # None: the engine's default for the model's context (sized by max_batch_tokens and
    # max_prefill_tokens); or a function of the context
    buckets: Buckets | Callable[[int], Buckets] | None = None
    # the devices to lay the mesh over: all local ones (None), the first n, or these
    devices: int | Sequence[jax.Device] | None = None
    # several hosts as one replica (engine/hosts/hosts.py): this process's place in the group
    hosts: HostGroup = HostGroup()

    @classmethod
    def from_options(cls, values: Mapping[str, Any], **rest: Any) -> EngineSpec:
        """The spec of engine/options.py's option values (a command's flags, Scorer.load's keywords),
        options left out at their defaults; `rest`: the fields that are no option (buckets, devices, hosts)."""
        fields = {o.name: values.get(o.name, o.default) for o in options.OPTIONS if o.engine_field}
        return cls(**fields, **rest)

    def buckets_for(self, context_length: int) -> Buckets | None:
        """The buckets for a model of this context (None: the engine's default)."""
        if self.buckets is not None:
            return self.buckets(context_length) if callable(self.buckets) else self.buckets
        sizes = {"max_batch_tokens": self.max_batch_tokens, "max_prefill_tokens": self.max_prefill_tokens}
        sizes = {name: size for name, size in sizes.items() if size}
        return Buckets(context=context_length, **sizes) if sizes else None


@dataclasses.dataclass(frozen=True)
class BuiltEngine:
    """A loaded model and the engine built over it (compiled shapes come later: `warmup`)."""

    model: LoadedModel
    engine: ScoringEngine
    load_seconds: float  # reading, converting and placing the weights
    # the leader of several hosts: its step channel to the followers (the engine's broadcast),
    # which the service watches (service/group_watch.py); None otherwise
    steps: StepLeader | None = None


def build_engine(spec: EngineSpec, loaded: LoadedModel | None = None) -> BuiltEngine:
    """Load `spec.model` (unless `loaded` is a model already in memory) and build its engine.

    The mesh is chosen once the config is read, before any weight, so each weight goes to its
    shards as it is read; weights loaded elsewhere are placed by the engine on the same layout.
    """
    started = time.monotonic()
    join(spec.hosts)  # before any device is touched: the mesh spans every host's devices
    # the leader listens before the weights load, so followers connect while it loads
    steps = StepLeader(spec.hosts) if spec.hosts.several and spec.hosts.leader else None
    choice = QuantizeChoice(spec.quantize, spec.activations)
    placement = MeshPlacement(spec.dtype, spec.devices, tp=spec.tp_size, dp=spec.dp_size, quantize=choice)
    model = loaded or load_model(spec.model, spec.dtype, placement, choice, spec.pooling)
    load_seconds = time.monotonic() - started
    engine = ScoringEngine(
        model.cfg,
        model.params,
        model.dtype,
        _served_shapes(spec.buckets_for(model.cfg.context_length), model),
        spec.attn_impl,
        mesh=placement.for_model(model.cfg),
        compile_cache_dir=spec.compile_cache,
        pool_bytes=spec.pool_bytes,
        pool_memory_fraction=spec.pool_memory_fraction,
        broadcast=steps or ALONE,
    )
    if "fp8" in str(model.quantization["weights"]) and not has_fp8_units(engine.devices[0]):
        log.warning(
            "fp8 weights on %s, which has no fp8 matrix units: the fp8 matmuls run emulated (XLA widens "
            "the operands), with the same results and memory, without the speed of fp8 units",
            engine.devices[0].device_kind,
        )
    return BuiltEngine(model, engine, load_seconds, steps)


def _served_shapes(buckets: Buckets | None, model: LoadedModel) -> Buckets:
    """The buckets with every form of call the model's requests use, so that warm-up compiles them
    all: a model that serves embeddings returns its hidden columns in every call (Buckets.hidden),
    one that pools every token (mean, cls) has token-rows shapes (Buckets.token_rows), and one with
    a vocabulary head token-logprob shapes (likelihood, completions: Buckets.top_logprobs)."""
    buckets = buckets or Buckets.for_context(model.cfg.context_length)
    head = output_head(model.cfg)
    if head.rows and not head.own_rows:
        buckets = dataclasses.replace(buckets, top_logprobs=TOP_LOGPROBS)
    if model.pooling is None:
        return buckets
    return dataclasses.replace(buckets, hidden=model.cfg.hidden_size, token_rows=model.pooling.mode != LAST)


def has_fp8_units(device: jax.Device) -> bool:
    """Whether the device multiplies fp8 natively: NVIDIA compute capability 8.9 and newer (Ada,
    Hopper, Blackwell). CPUs and the TPUs served here (v5e, v6e) have int8 units, not fp8."""
    capability = getattr(device, "compute_capability", None)
    return device.platform == "gpu" and capability is not None and float(capability) >= 8.9
