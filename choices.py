"""The names an engine option may take: dtypes, 8-bit schemes, attention implementations,
reranker templates, and the default model.

A leaf: it imports nothing (no JAX), so every command line reads it cheaply, and the modules
that give these names a meaning (model/config.py's DTYPES, model/quant_choice.py,
kernels/dispatch.py, engine/requests/templates.py's RECORDS) take them from here or are tested to agree
(tests/test_engine_options.py). The options themselves (help, defaults, flags) are declared in
engine/options.py.
"""

from __future__ import annotations

AUTO = "auto"  # decided from the checkpoint (quantize, activations, template)

DEFAULT_MODEL = "smollm2-135m"  # the embedded SmolLM2 package (model/presets.py)
DTYPES = ("float32", "bfloat16")  # the weights' and the pool's dtype
DEFAULT_DTYPE = "float32"
# a classifier's activation of its logits (engine/requests/heads.py): its own (auto), none, or one asked
HEAD_ACTIVATIONS = (AUTO, "none", "sigmoid", "softmax")
# 8-bit projections: as the checkpoint holds them, dequantized, or quantized at load
QUANTIZE = (AUTO, "none", "int8", "fp8")
# how 8-bit projections are multiplied: per-token 8-bit activations (W8A8) or none (W8A16)
ACTIVATIONS = (AUTO, "dynamic", "none")
ATTENTION = ("reference", "xla", "pallas_tpu", "pallas_gpu")  # kernels/dispatch.py's IMPLEMENTATIONS
# the published reranker prompts (engine/requests/templates.py's RECORDS), and `auto`: recognized from the checkpoint
TEMPLATES = ("qwen3-reranker", "bge-reranker-v2-gemma", "mxbai-rerank-v2", "chat", "none")
TEMPLATE_CHOICES = (AUTO, *TEMPLATES)
DEFAULT_TEMPLATE = AUTO
# embeddings: a sentence-transformers checkpoint's own Pooling (auto), or a plain model's final
# hidden states pooled at the last token or averaged (engine/requests/pooling.py)
POOLING = (AUTO, "last", "mean")
