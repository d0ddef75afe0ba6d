"""Shared fixtures: tiny Hugging Face checkpoints made by transformers itself (the oracle),
and a plain PyTorch forward pass of `query + item` to compare against."""

from __future__ import annotations

import os

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
# The transformers oracles (and numpy's BLAS) on one thread, here and in every subprocess: torch's
# idle OpenMP threads spin for each other, and on a saturated machine (CI: two cores, two pytest
# workers, XLA compiling beside them) a tiny model's forward pass on two threads cost about 25x the
# CPU of one. Only the threads that run an eager model change, not its arithmetic. Before torch starts.
os.environ.setdefault("OMP_NUM_THREADS", "1")
# One persistent compile cache for the whole run: this process, pytest-xdist's workers and every
# server, bench or mesh subprocess a test starts (they inherit the variable), so a shape compiles
# once per run wherever it is first met. Fresh for each run unless the caller names one: a test
# that counts compilations sees the same cache on a developer's machine as on CI.
if "PREFIXSCORE_COMPILE_CACHE_DIR" not in os.environ:  # xdist's workers inherit the controller's
    import atexit
    import shutil
    import tempfile

    _RUN_CACHE = tempfile.mkdtemp(prefix="prefixscore-test-jax-cache-")
    os.environ["PREFIXSCORE_COMPILE_CACHE_DIR"] = _RUN_CACHE
    atexit.register(shutil.rmtree, _RUN_CACHE, ignore_errors=True)

# XLA:CPU's LLVM backend at its lowest optimisation, without its expensive passes, and its fused
# loops emitted by the classic emitters instead of the MLIR fusion emitters: the suite's executables
# run for milliseconds on tiny models but took seconds each to compile. The first two took about
# 40% off the compile time of tests/test_config_inventory.py; the emitters 58% of the CPU seconds
# of compiling 4 call shapes of a small Qwen3 (16.1 -> 6.8 s) and a third of test_heads.py and
# test_likelihood.py's (83 -> 56 s). The HLO and its passes are unchanged and there is no fast math
# either way, but the emitted code is not the same: under the classic emitters the CPU attention's
# online softmax overflowed on masked rows until its exponent was clamped (kernels/xla.py
# `_online_step`; the default emitters gave finite scores without it, and it changes no exponent <= 0).
# Level 1 instead of 0 was measured over the whole suite (docs/benchmarks.md "The test suite's XLA
# flags"): the files that run SmolLM2's 30 layers many times ran faster, the compile-bound ones
# slower, 26% more in all, and it moved a W8A8 score across an activation's rounding boundary.
# Set before jax starts; subprocesses inherit it.
FAST_COMPILE = (
    "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true --xla_cpu_use_fusion_emitters=false"
)
if FAST_COMPILE not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {FAST_COMPILE}".strip()


def xla_flags(devices: int) -> str:
    """XLA_FLAGS for a subprocess with `devices` simulated CPU devices (and the run's other flags)."""
    return f"{os.environ['XLA_FLAGS']} --xla_force_host_platform_device_count={devices}"


import jax  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

if jax.default_backend() == "gpu":
    # The tests compare float32 arithmetic with float32 oracles: GPUs would run the oracles'
    # (and the tests' own) float32 matmuls as TF32. float32 engines set this themselves.
    jax.config.update("jax_default_matmul_precision", "highest")

from prefixscore.engine.runtime import compile_cache  # noqa: E402
from prefixscore.engine.runtime.buckets import Buckets  # noqa: E402
from prefixscore.model.config import ModelConfig  # noqa: E402

# every jit of the run through it, the tests' own (oracles, kernels) as well as the engines'
compile_cache.enable()

# Small buckets keep compile time of the test models to seconds.
SMALL_BUCKETS = Buckets(context=512, max_batch_tokens=256, prefill_chunk=128, max_prefill_tokens=256)
# one item bucket, one prefill bucket, 16-token pages: two small executables per test model
ONE_SHAPE_BUCKETS = Buckets(
    context=512,
    tokens=(128,),
    prefill=(0, 128),
    max_batch_tokens=128,
    prefill_chunk=64,
    max_prefill_tokens=128,
    page_tokens=16,
    segments=4,
    labels=(8,),
    head_rows=32,
)

# a small Qwen3-style model for engine-level tests with random weights (model/weights.random_params)
SMALL_QWEN3 = ModelConfig(
    family="qwen3",
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
    qk_norm=True,
    tie_word_embeddings=True,
    max_position_embeddings=1024,
)

TINY_SHAPES = dict(
    vocab_size=320,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
)
# Gemma 2 and 3: a query scale, both soft caps (Gemma 3's attention cap is inert, as in transformers)
# and a 48-token window
GEMMA2_OPTIONS = dict(
    tie_word_embeddings=False,
    rms_norm_eps=1e-5,
    head_dim=16,
    query_pre_attn_scalar=24,
    attn_logit_softcapping=5.0,
    final_logit_softcapping=3.0,
    sliding_window=48,
)
FAMILY_OPTIONS = {
    "llama": dict(tie_word_embeddings=False, rope_theta=10000.0),
    "mistral": dict(tie_word_embeddings=False, rope_theta=10000.0),
    "qwen2": dict(tie_word_embeddings=False, rope_theta=1_000_000.0),
    "qwen3": dict(tie_word_embeddings=True, rope_theta=1_000_000.0, head_dim=16),
    # Gemma: every computed field off its default (the inventory adds few trials for these families)
    "gemma": dict(tie_word_embeddings=False, rms_norm_eps=1e-5, head_dim=16, hidden_act="gelu_pytorch_tanh"),
    "gemma2": GEMMA2_OPTIONS,
    "gemma3_text": dict(
        **GEMMA2_OPTIONS,
        layer_types=["sliding_attention", "full_attention"],
        rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
            "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 20000.0},
        },
    ),
}


def make_torch_model(family: str, seed: int = 0, classifier: bool = False, **overrides):
    """A randomly initialised transformers model of the family (eval mode, float32, eager attention:
    the plain softmax(QK^T)V the fast paths must equal); `classifier`: its *ForSequenceClassification
    (`num_labels` among the overrides)."""
    import torch
    import transformers

    config_cls, model_cls = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
        "gemma": (transformers.GemmaConfig, transformers.GemmaForCausalLM),
        "gemma2": (transformers.Gemma2Config, transformers.Gemma2ForCausalLM),
        "gemma3_text": (transformers.Gemma3TextConfig, transformers.Gemma3ForCausalLM),
    }[family]
    torch.manual_seed(seed)
    if classifier:  # Gemma 3's text classifier is named apart from the multimodal one
        name = model_cls.__name__.replace("ForCausalLM", "ForSequenceClassification")
        model_cls = getattr(transformers, {"gemma3_text": "Gemma3TextForSequenceClassification"}.get(family, name))
    config = config_cls(**{**TINY_SHAPES, **FAMILY_OPTIONS[family], **overrides})
    model = model_cls._from_config(config, attn_implementation="eager").eval()
    # HF initialises norms to exactly 1: perturb them so a missing or misplaced norm weight shows.
    # Its std-0.02 q/k weights give near-uniform attention, blind to positions: sharpen them so
    # RoPE, the q/k layout and the causal/prefix masks all move the scores.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith(".bias"):  # HF initialises biases to 0: a dropped one would not show
                p.add_(0.1 * torch.randn_like(p))
            if "q_proj.weight" in name or "k_proj.weight" in name:
                p.mul_(12.0)
            if name == "score.weight":  # logits of a few units, so every activation moves
                p.mul_(10.0)
    return model


def torch_label_probs(model, sequences, labels, apply_softmax: bool) -> np.ndarray:
    """The oracle: a plain forward pass of each whole sequence, read at its last token. [n, labels] float64."""
    import torch

    out = []
    with torch.no_grad():
        for seq in sequences:
            logits = model(torch.tensor([list(seq)])).logits[0, -1].double()
            probs = (
                torch.softmax(logits[list(labels)], -1) if apply_softmax else torch.softmax(logits, -1)[list(labels)]
            )
            out.append(probs.numpy())
    return np.array(out)


@pytest.fixture(scope="session")
def hf_checkpoints(tmp_path_factory):
    """family -> (directory with config.json + model.safetensors, the torch model)."""
    out = {}
    for family in FAMILY_OPTIONS:
        model = make_torch_model(family)
        path = tmp_path_factory.mktemp(f"hf-{family}")
        model.save_pretrained(path)
        out[family] = (path, model)
    return out


@pytest.fixture(scope="session")
def tiny_scorer():
    from prefixscore import Scorer

    # a random model no record recognizes (`auto` would serve no rerank): Qwen3-Reranker's prompt, named
    return Scorer.load("tiny-qwen3", buckets=SMALL_BUCKETS, template="qwen3-reranker")


# ---- over a module's `server` fixture (a ServerThread): a client and a raw stub ----------------
@pytest.fixture(scope="module")
def client(server):
    from prefixscore.client import ScoreClient

    with ScoreClient(server.target) as c:
        yield c


@pytest.fixture(scope="module")
def stub(server):
    import grpc

    from prefixscore.v1 import score_service_pb2_grpc as pb_grpc

    channel = grpc.insecure_channel(server.target)
    yield pb_grpc.ScoreServiceStub(channel)
    channel.close()
