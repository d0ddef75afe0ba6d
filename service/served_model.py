"""One description of the served model, made once at start-up and rendered by every surface:
the `model_loaded` log line, the `prefixscore_model_info` metric, gRPC's GetModelInfo and
HTTP's /v1/models. A field added here reaches them all alike; none assembles its own."""

from __future__ import annotations

import dataclasses
from collections.abc import Container, Mapping
from typing import Any

from prefixscore.engine.requests.template_choice import TemplateChoice
from prefixscore.engine.runtime.scoring_engine import ScoringEngine
from prefixscore.model.head import output_head
from prefixscore.model.loader import LoadedModel
from prefixscore.version import __version__


@dataclasses.dataclass(frozen=True)
class ServedModel:
    """What is served and how: the model, its head, the mesh, the kernels and the pool."""

    name: str
    family: str
    dtype: str
    vocab_size: int
    context_length: int  # the longest sequence served
    sliding_window: int | None  # a sliding-window model is served only inside its window, where it is exact
    max_position_embeddings: int
    head: str  # model/head.py: causal_lm or sequence_classification
    label_names: tuple[str, ...]  # a classifier's labels, in row order
    has_tokenizer: bool
    template: str | None  # the reranker prompt of Rerank and /v1/rerank (None: none, rerank is refused)
    template_reason: str  # why that one, or why none (engine/requests/template_choice.py)
    devices: tuple[str, ...]  # "platform:id" of each device the mesh covers
    tp_size: int  # devices on the mesh's model axis
    dp_size: int  # ... and on its data axis
    hosts: int  # processes (hosts) the mesh spans: 1, or a group's (engine/hosts/hosts.py)
    model_axis_hosts: int  # the most hosts a row of the model axis spans (1: its all-reduces stay on a host)
    kv_heads_per_device: int  # the pool's KV heads each device stores
    kv_head_copies: int  # how often each KV head is stored across the model axis (tp > kv_heads)
    attention: str  # the attention implementation (kernels/dispatch.py)
    buckets: dict[str, Any]  # the engine's buckets (engine/runtime/buckets.py), as plain values
    pool_pages: int
    pool_bytes: int  # the prefix pool's bytes on each device
    pool_tokens: int  # tokens of K/V the pool holds (its pages x the page's tokens)
    # the projections' 8-bit scheme (model/quant.py): "none", "int8" or "fp8"; how they are
    # multiplied ("none": W8A16, "dynamic", "static"; "" when nothing is 8-bit); each one's layout
    quantization: str
    activation_quantization: str
    quantized_projections: dict[str, str]
    weight_bytes_per_device: int  # the weights' bytes on the device holding the most
    # its embeddings (model/sentence_config.py): the pooling mode (None: it serves none), the
    # vectors' width, and the named prompts a request may ask for
    pooling: str | None = None
    embedding_dimensions: int | None = None
    prompt_names: tuple[str, ...] = ()
    # what a text input becomes: "text", or "message" (rendered by the chat template); None: no embeddings
    embedding_modality: str | None = None
    version: str = __version__

    @classmethod
    def of(cls, loaded: LoadedModel, engine: ScoringEngine, template: TemplateChoice) -> ServedModel:
        cfg, mesh, head = loaded.cfg, engine.layout.shape, output_head(loaded.cfg)
        return cls(
            name=loaded.name,
            family=cfg.family,
            dtype=loaded.dtype,
            vocab_size=cfg.vocab_size,
            context_length=cfg.context_length,
            sliding_window=cfg.sliding_window,
            max_position_embeddings=cfg.max_position_embeddings,
            head=head.kind,
            label_names=head.label_names,
            has_tokenizer=loaded.tokenizer is not None,
            template=template.template,
            template_reason=template.reason,
            devices=tuple(f"{d.platform}:{d.id}" for d in engine.devices),
            tp_size=mesh.model,
            dp_size=mesh.data,
            hosts=engine.layout.hosts,
            model_axis_hosts=engine.layout.model_axis_hosts,
            kv_heads_per_device=engine.layout.local_kv_heads,
            kv_head_copies=engine.layout.kv_repeats,
            attention=engine.attn_impl,
            buckets=dataclasses.asdict(engine.buckets),
            pool_pages=engine.pool_pages,
            pool_bytes=engine.pool_bytes,
            pool_tokens=engine.pool_pages * engine.buckets.page_tokens,
            quantization=str(loaded.quantization["weights"]),
            activation_quantization=str(loaded.quantization.get("activations", "")),
            quantized_projections=dict(loaded.quantization.get("projections", {})),
            weight_bytes_per_device=engine.weight_bytes_per_device,
            pooling=loaded.pooling.mode if loaded.pooling else None,
            embedding_dimensions=loaded.pooling.dimension if loaded.pooling else None,
            prompt_names=tuple(sorted(loaded.pooling.prompts)) if loaded.pooling else (),
            embedding_modality=("message" if loaded.pooling.chat else "text") if loaded.pooling else None,
        )

    def describe(self, names: Mapping[str, str] | None = None, only: Container[str] | None = None) -> dict[str, Any]:
        """The record as plain values (a list for each tuple, copies of its dicts), in its order:
        what every surface renders. `names` are a surface's own spellings of some fields (the
        record's name -> the surface's), `only` the surface's names it keeps (None: all)."""
        names = names or {}
        fields = {names.get(k, k): list(v) if isinstance(v, tuple) else v for k, v in dataclasses.asdict(self).items()}
        return {k: v for k, v in fields.items() if only is None or k in only}

    def log_fields(self) -> dict[str, Any]:
        """The `model_loaded` event's description of the model (JSON values)."""
        return self.describe(LOG_NAMES)

    def metric_labels(self) -> dict[str, str]:
        """The `prefixscore_model_info` labels: the few a dashboard groups by (dashboards key on
        these names, so the set stays as it is)."""
        labels = self.describe(METRIC_NAMES, only=METRIC_LABELS)
        return {k: ",".join(v) if isinstance(v, list) else str(v) for k, v in labels.items()}


# each surface's spellings of the record's fields, where it has its own
LOG_NAMES = {"name": "model", "has_tokenizer": "tokenizer"}
METRIC_NAMES = {"name": "model"}
METRIC_LABELS = ("model", "family", "dtype", "devices", "tp_size", "dp_size")
