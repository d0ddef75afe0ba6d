"""The scoring engine: owns the parameters and the paged prefix pool on the device(s), and runs
planned calls. It validates nothing (callers do, before device work) and keeps no per-request
state: which pages hold which query is the prefix cache's business (engine/runtime/prefix_cache.py);
what goes into a call is the planner's (engine/runtime/planner.py). `launch` runs a CallPlan as it is.

One kind of device call (model/step.py), one executable per CallShape, compiled ahead of time
(`warmup`, or on first use) and kept in a table, so steady-state traffic never compiles. With
several devices the call runs under `shard_map` over a 2-D mesh (engine/runtime/mesh.py): on the
model axis each device holds its share of the heads, MLP columns, vocabulary rows and the
pool's KV heads; on the data axis the replicas each run their own prefill chunks (gathering
every replica's K/V for the pool write, so every replica of the pool gets every page) and
score their own share of the item region.
"""

from __future__ import annotations

import dataclasses
import functools
import threading
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from prefixscore.choices import DEFAULT_DTYPE
from prefixscore.engine.runtime import compile_cache, packed_call
from prefixscore.engine.runtime.buckets import Buckets
from prefixscore.engine.runtime.call_broadcast import ALONE, CallBroadcast
from prefixscore.engine.runtime.mesh import Layout, MeshShape, default_layout
from prefixscore.engine.runtime.planner import CallBuilder, CallPlan
from prefixscore.engine.runtime.pool_size import POOL_MEMORY_FRACTION, page_bytes, pool_pages
from prefixscore.engine.runtime.prefix_cache import PrefixCache
from prefixscore.engine.runtime.shared_steps import StepSharing
from prefixscore.engine.runtime.warmup import WarmupStage, compile_in_stages, plan_stages
from prefixscore.kernels import dispatch, selfcheck
from prefixscore.kernels.paged import pool_dtype
from prefixscore.model import flops, step
from prefixscore.model.call_inputs import LABEL_SETS, CallInputs, CallShape, ItemRegion, PageCopies, PrefillRegion
from prefixscore.model.config import DTYPES, ModelConfig
from prefixscore.model.weights import Weights
from prefixscore.telemetry.compiles import CompileCounter

# where a loop or branch on a runtime value syncs the host (step.score_call's static_head)
GPU_PLATFORMS = ("gpu", "cuda", "rocm")
# On CPUs each layer's per-token work runs in tiles, one tile size for every call of a model
# (decoder.per_tile: the same bits whatever the call's size; the MLP's activations stay in cache);
# accelerators run it whole. A tile holding any real token is computed whole, so a small call pays
# for its last tile's padding, and each tile pays a fixed cost (its loop step, its products'
# set-up). The tile is the smallest power of two, from CPU_TILE_FEWEST to CPU_TILE_MOST tokens,
# whose tokens take at least CPU_TILE_MACS multiply-adds through one layer's projections: a
# narrow model takes large tiles, a wide one small (measured on 2 cores, docs/benchmarks.md "A
# tile by the model's width": bench-cpu's layers, 0.79M multiply-adds a token, ran slower in
# 128-token tiles than in 256 on a Sapphire Rapids; SmolLM2-135M's, 3.5M, ran a W1 request as fast
# in 64 as in 256 on a Zen 4, and a one-prompt call in 0.21 s against 0.57 s)
CPU_TILE_MACS = 2**27
CPU_TILE_FEWEST, CPU_TILE_MOST = 64, 1024


def cpu_token_tile(cfg: ModelConfig) -> int:
    """The most tokens a CPU tile of `cfg`'s per-token work holds (Buckets.token_tile then takes
    the largest that divides every call's tokens)."""
    per_token = flops.linear_per_token(cfg) // (2 * cfg.num_layers)  # one layer's multiply-adds
    tile = CPU_TILE_FEWEST
    while tile < CPU_TILE_MOST and tile * per_token < CPU_TILE_MACS:
        tile *= 2
    return tile


def _all_fields(region: type, value: Any) -> Any:
    """`region` (a call-input dataclass) with every field set to `value` (one sharding for all)."""
    return region(**{field.name: value for field in dataclasses.fields(region)})


@dataclasses.dataclass
class _Slot:
    lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)
    exe: Any = None


class ScoringEngine:
    """Planned calls in, label probabilities out; every call is one precompiled CallShape."""

    def __init__(
        self,
        cfg: ModelConfig,
        params: Weights,
        dtype: str = DEFAULT_DTYPE,
        buckets: Buckets | None = None,
        attn_impl: str | None = None,
        *,
        devices: int | Sequence[jax.Device] | None = None,
        mesh: MeshShape | Layout | None = None,
        compile_cache_dir: str | None = None,
        pool_bytes: int | None = None,
        pool_memory_fraction: float = POOL_MEMORY_FRACTION,
        broadcast: CallBroadcast = ALONE,
    ) -> None:
        CompileCounter.install()
        self.compile_cache_dir = compile_cache.enable(compile_cache_dir)
        self.cfg = cfg
        self.dtype = dtype
        self.buckets = buckets or Buckets.for_context(cfg.context_length)
        self.attn_impl = dispatch.resolve(attn_impl)
        self._impl = dispatch.get(self.attn_impl)
        self.layout = mesh if isinstance(mesh, Layout) else default_layout(cfg, dtype, devices, mesh)
        self.devices = self.layout.devices
        self.params = self.layout.place_weights(params)
        self.page_bytes = page_bytes(cfg, dtype, self.buckets.page_tokens, self.layout.local_kv_heads)
        device, max_pages = self.layout.local_devices[0], self.buckets.max_pages
        self.pool_pages = pool_pages(device, self.page_bytes, max_pages, pool_bytes, pool_memory_fraction)
        stored = pool_dtype(DTYPES[dtype], self._impl.POOL_AS_BITS)
        self._zeros = jax.jit(
            lambda: jnp.zeros(self._pool_shape(), stored), out_shardings=self.layout.pool
        )  # made on the devices (each its own KV heads), never shipped
        self._pool = (self._zeros(), self._zeros())
        # which pages hold which query: one book for the one pool, whoever drives the engine
        self.prefix_cache = PrefixCache(self.pool_pages, self.buckets.page_tokens, self.page_bytes)
        # held around planning a call and launching it: calls from any driver (the server's
        # worker, an in-process Scorer) launch in the order they were planned, so a call never
        # reads pages a call planned before it has not yet been launched to write
        self.calls_lock = threading.Lock()
        self._slots: dict[CallShape, _Slot] = {}
        # the buckets calls are planned in: every one, except during a staged warm-up, when only
        # those whose shapes are compiled (warmup_stages); swapped whole, read without a lock
        self.serving = self.buckets
        # the executables' per-token tile, which the planner counts computed tokens by (once: a
        # call may build several plans)
        self.token_tile = self._token_tile(self.devices[0].platform)
        self.shapes_ready = 0  # call shapes compiled by warm-up so far
        # float32 means float32 arithmetic: GPUs would otherwise run float32 matmuls as TF32
        # (about 1e-3 relative error); bfloat16 keeps the backend's default
        self._precision = "highest" if dtype == "float32" else None
        self._lock = threading.Lock()
        # tokens launched: the calls' buckets, those whose per-token work ran (a CPU skips tiles of
        # padding), and the real ones (padding share = 1 - real / device)
        self.stats = {
            "calls": 0,
            "device_tokens": 0,
            "computed_tokens": 0,
            "tokens": 0,
            "items": 0,
            "prefill_tokens": 0,
            "rows": 0,
        }
        # told every call (and pool reset) before it happens here: with several hosts, the
        # leader's step channel, so every host runs the same step (engine/runtime/call_broadcast.py)
        self.broadcast = broadcast

    def replica(self) -> ScoringEngine:
        """Another engine in this process over the same placed weights, layout, buckets and
        attention, with a prefix pool (and pool pages) of its own: a second replica. Its
        programs are this engine's, on inputs of the same shapes and shardings, so the two share
        their executables: a shape either one compiled the other launches without tracing it."""
        twin = ScoringEngine(
            self.cfg,
            self.params,
            self.dtype,
            self.buckets,
            self.attn_impl,
            mesh=self.layout,
            compile_cache_dir=self.compile_cache_dir or compile_cache.OFF[0],
            pool_bytes=self.pool_bytes,
        )
        twin._slots, twin._lock = self._slots, self._lock
        return twin

    @property
    def n_devices(self) -> int:
        return len(self.devices)

    @property
    def data_replicas(self) -> int:
        """Item streams per call: one per replica on the data axis."""
        return self.layout.shape.data

    @property
    def segment_align(self) -> int:
        """Segment starts in a call's stream: a multiple of this (the attention's query block)."""
        return int(self._impl.SEGMENT_ALIGN)

    @property
    def step_sharing(self) -> StepSharing | None:
        """The key steps the attention lets short prefill chunks take together (None: none)."""
        block = int(self._impl.SHARED_BLOCK)
        if not block:
            return None
        b = self.buckets
        return StepSharing(block, int(self._impl.key_step_pages(b.page_tokens, b.max_pages)))

    @property
    def pool_bytes(self) -> int:
        """The pool's bytes on each device (its KV heads' share)."""
        return self.pool_pages * self.page_bytes

    @property
    def weight_bytes_per_device(self) -> int:
        """The weights' bytes on the device that holds the most (8-bit projections: a byte a
        weight, with their scales), counted from the placed shards themselves."""
        held = {device: 0 for device in self.layout.local_devices}
        for leaf in jax.tree.leaves(self.params):
            for shard in leaf.addressable_shards:
                held[shard.device] += shard.data.nbytes
        return max(held.values())

    def _pool_shape(self) -> tuple[int, ...]:
        """The whole pool (every stored KV head; each device holds its model shard's)."""
        c = self.cfg
        return (c.num_layers, self.layout.kv_heads, self.pool_pages, self.buckets.page_tokens, c.head_dim)

    def builder(self) -> CallBuilder:
        """An empty plan for the next call (engine/runtime/planner.py), in the shapes compiled so far
        (all of them, unless a staged warm-up is still under way)."""
        return CallBuilder(
            self.serving, self.data_replicas, self.segment_align, self.pool_pages, self.token_tile, self.step_sharing
        )

    # ---- executables ----------------------------------------------------------
    def _executable(self, shape: CallShape) -> Any:
        """The compiled executable for a call shape, compiling it on first use (once, thread-safe)."""
        with self._lock:
            slot = self._slots.setdefault(shape, _Slot())
        with slot.lock:
            if slot.exe is None:
                slot.exe = self._traced(shape, self.devices[0].platform).lower().compile()
        return slot.exe

    def compiled(self, shape: CallShape) -> bool:
        """Whether the call shape's executable is built (a call of it launches without compiling)."""
        with self._lock:
            slot = self._slots.get(shape)
        return slot is not None and slot.exe is not None

    def lower_for(self, shape: CallShape, platform: str) -> jax.stages.Lowered:
        """A call shape lowered for `platform` ("cuda", "tpu") with that platform's kernels, on
        any machine: proves the kernels lower for real hardware without it."""
        with dispatch.lowering_for(platform):
            return self._traced(shape, platform).lower(lowering_platforms=(platform,))

    def call_specs(self, shape: CallShape) -> CallInputs:
        """ShapeDtypeStructs (with shardings) of a call's inputs: what an executable is traced on."""
        b, d, layout = self.buckets, self.data_replicas, self.layout
        rep = lambda *s, t=jnp.int32: jax.ShapeDtypeStruct(s, t, sharding=layout.replicated)  # noqa: E731
        dev = lambda *s, t=jnp.int32: jax.ShapeDtypeStruct((d, *s), t, sharding=layout.items)  # noqa: E731
        tp, ti, r, lb = shape.prefill_tokens, shape.item_tokens, shape.rows, shape.labels
        return CallInputs(
            prefill=PrefillRegion(*(dev(tp) for _ in range(7)), dev(), dev(tp), dev(tp)),
            items=ItemRegion(
                dev(ti), dev(ti), dev(ti), dev(ti), dev(r), dev(r), dev(r, t=jnp.int8), dev(r), dev(), dev()
            ),
            page_table=rep(b.segments, b.max_pages),
            prefix_len=rep(b.segments),
            labels=rep(lb),
            label_sets=rep(LABEL_SETS, lb),
            max_chunk_len=rep(),
            copies=PageCopies(*(rep(b.copy_slots) for _ in range(4))),
        )

    def _call_shardings(self) -> CallInputs:
        rep, split = self.layout.replicated, self.layout.items
        return CallInputs(
            prefill=_all_fields(PrefillRegion, split),
            items=_all_fields(ItemRegion, split),
            page_table=rep,
            prefix_len=rep,
            labels=rep,
            label_sets=rep,
            max_chunk_len=rep,
            copies=_all_fields(PageCopies, rep),
        )

    def _token_tile(self, platform: str) -> int | None:
        """Tokens per tile of each layer's per-token work on `platform` (None: all at once)."""
        return self.buckets.token_tile(cpu_token_tile(self.cfg)) if platform == "cpu" else None

    def _traced(self, shape: CallShape, platform: str) -> jax.stages.Traced:
        spec = lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding)  # noqa: E731
        params = jax.tree.map(spec, self.params)
        pool = spec(self._pool[0])
        partition = jax.tree.map(lambda s: s.spec, self._call_shardings())
        weights, pool_spec, rep = self.layout.weight_specs(self.params), self.layout.pool.spec, P()
        call_fn = functools.partial(
            self._call_fn,
            static_head=platform in GPU_PLATFORMS,
            token_tile=self._token_tile(platform),
            top_logprobs=shape.top_logprobs,
            hidden=shape.hidden > 0,
        )
        mapped = jax.shard_map(
            call_fn,
            mesh=self.layout.mesh,
            in_specs=(weights, pool_spec, pool_spec, partition),
            out_specs=(rep, pool_spec, pool_spec),
            check_vma=False,
        )
        with jax.default_matmul_precision(self._precision):
            return jax.jit(mapped, donate_argnums=(1, 2)).trace(params, pool, pool, self.call_specs(shape))

    def _call_fn(
        self,
        params: Weights,
        pool_k: jax.Array,
        pool_v: jax.Array,
        call: CallInputs,
        static_head: bool,
        token_tile: int | None,
        top_logprobs: int,
        hidden: bool,
    ):
        probs, pool_k, pool_v = step.score_call(
            params,
            self.cfg,
            pool_k,
            pool_v,
            call,
            impl=self._impl,
            head_rows=self.buckets.head_rows,
            static_head=static_head,
            token_tile=token_tile,
            shards=self.layout.shards,
            replicas=self.layout.replicas,
            top_logprobs=top_logprobs,
            hidden=hidden,
        )
        # [replicas * R, L (+ TOKEN_COLUMNS) (+ hidden)]
        return self.layout.replicas.gather(probs), pool_k, pool_v

    def compiled_text(self, shape: CallShape) -> str:
        """The compiled HLO of one call shape (compiled now if it was not yet)."""
        return self._executable(shape).as_text()

    def hlo_texts(self) -> list[str]:
        """The compiled HLO of every executable built so far (bench --profile maps kernels to scopes)."""
        with self._lock:
            slots = list(self._slots.values())
        return [slot.exe.as_text() for slot in slots if slot.exe is not None]

    def executable_keys(self) -> list[CallShape]:
        """Every executable the engine can be asked for with its buckets."""
        return self.buckets.call_shapes()

    def warmup(
        self, workers: int | None = None, progress: Callable[[int, int], None] | None = None
    ) -> dict[str, float]:
        """Compile every call shape up front, in stages (in parallel: XLA compiles without the GIL).
        Returns {"executables", "compilations", "seconds"}; with a warm cache, compilations is 0."""
        return self.compile_stages(self.warmup_stages(), workers, progress)

    def warmup_stages(self) -> list[WarmupStage]:
        """Every call shape, in stages in the order traffic needs them (engine/runtime/warmup.py)."""
        return plan_stages(self.buckets)

    def compile_stages(
        self,
        stages: Sequence[WarmupStage],
        workers: int | None = None,
        progress: Callable[[int, int], None] | None = None,
        on_stage: Callable[[], None] | None = None,
        stop: threading.Event | None = None,
        nice: int = 0,
    ) -> dict[str, float]:
        """Compile the stages' shapes in order (engine/runtime/warmup.py `compile_in_stages`); once
        a stage is compiled, calls are planned in its buckets and `on_stage()` is called. `stop`
        set: no further shape is started, and calls are planned in every bucket again (compiling
        on first use). `nice`: the compiling threads' niceness, below the threads that serve."""

        def ready(stage: WarmupStage) -> None:
            self.shapes_ready += len(stage.shapes)
            self.serving = stage.buckets
            if on_stage:
                on_stage()

        report = compile_in_stages(stages, self._executable, ready, workers, progress, stop, nice)
        if stop is not None and stop.is_set():
            # Stopped part-way (its server shut down): planning goes back to every bucket, each shape
            # compiled on first use, as without a warm-up. The engine may outlive the server (a
            # Scorer's, in process): work needing a later stage must not wait for one never coming.
            self.serving = self.buckets
        return report

    def check_attention(self) -> dict[str, float]:
        """The attention implementation against the reference at this model's head shapes and
        dtype, on this process's device (kernels/selfcheck.py), once per process for those (a
        replica's check is its twin's). Returns max errors per call; raises
        selfcheck.KernelCheckFailed past the tolerance."""
        heads, kv = self.layout.local_heads, self.layout.local_kv_heads  # each device's
        return selfcheck.verify_once(self.attn_impl, self._impl, heads, kv, self.cfg.head_dim, self.dtype)

    # ---- running a plan -----------------------------------------------------------
    def launch(self, plan: CallPlan) -> jax.Array:
        """Run one planned call (asynchronously) -> probabilities [replicas * R, L] on the device;
        plan.spans say which rows are whose. The pool's pages written by the call's prefill
        chunks are visible to every later call (calls run in launch order)."""
        exe = self._executable(plan.shape)
        # after compiling: a follower never waits for the leader's compile
        self.broadcast.call(plan.shape, plan.inputs)
        # numpy in: the executable ships it by its input shardings, about a quarter of the host
        # time a separate jax.device_put of the pytree takes (measured: 0.26 vs 1.0 ms a call)
        probs, *self._pool = exe(self.params, *self._pool, plan.inputs)
        self.stats["calls"] += 1
        self.stats["device_tokens"] += plan.device_tokens
        self.stats["computed_tokens"] += plan.computed_tokens
        self.stats["tokens"] += plan.prefill_tokens + plan.item_tokens
        self.stats["prefill_tokens"] += plan.prefill_tokens
        self.stats["items"] += plan.items
        self.stats["rows"] += int(plan.inputs.items.n_rows.sum())
        return probs

    def run(self, shape: CallShape, inputs: CallInputs) -> jax.Array:
        """Run one call of `shape` over `inputs` (arrays of call_specs' shapes and dtypes) as it is,
        telling no other host: a follower's launch of the call its leader sent
        (engine/hosts/follower_steps.py); a planned call is `launch`ed."""
        probs, *self._pool = self._executable(shape)(self.params, *self._pool, inputs)
        self.stats["calls"] += 1
        return probs

    def pool_lost(self) -> bool:
        """Whether a failed call took the pool with it: calls donate it, so a call that fails
        after its launch leaves buffers that are deleted or carry its error."""
        try:
            if any(part.is_deleted() for part in self._pool):
                return True
            jax.block_until_ready(self._pool)  # raises the failed call's error
        except Exception:
            return True
        return False

    def reset_pool(self) -> None:
        """A new, zeroed pool after pool_lost (every prefix must be prefilled again)."""
        self.broadcast.reset()
        self._pool = (self._zeros(), self._zeros())

    # ---- packed baseline ------------------------------------------------------------
    def score_packed(
        self, query_ids: Sequence[int], items: Sequence[Sequence[int]], label_ids: Sequence[int], apply_softmax: bool
    ) -> np.ndarray:
        """Query and all items in one sequence under a block-diagonal mask (the seeds' `packed`,
        engine/runtime/packed_call.py): a baseline, on one device's whole model (a model axis of 1)."""
        if self.layout.shape.model > 1 or self.layout.hosts > 1:
            raise ValueError("the packed baseline runs the whole model on each device of one host: use tp-size 1")
        with jax.default_matmul_precision(self._precision):
            return packed_call.score_packed(
                self.params, self.cfg, self.buckets.labels, query_ids, items, label_ids, apply_softmax
            )
