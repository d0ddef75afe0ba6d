"""The output head a model scores with, as the API reports it, and a classifier's activations.

A causal LM's head is its vocabulary: a request names label tokens and gets their next-token
probabilities (the device computes them). A sequence classifier's head is its `score`
projection: a request names no labels, the device returns the raw logits of every label, and
the activation the request asked for is applied here, on the host, when the scores are read
back (engine/batcher.py take_results): one compiled head serves every activation.
"""

from __future__ import annotations

import numpy as np

from prefixscore.model.config import ModelConfig

CAUSAL_LM = "causal_lm"
SEQUENCE_CLASSIFICATION = "sequence_classification"
# a classifier request's `activation`: "auto" (the default) is a sigmoid for a one-label head
# or a multi-label problem_type, else a softmax over the labels; "none" returns raw logits
ACTIVATIONS = ("auto", "none", "sigmoid", "softmax")


def head_kind(cfg: ModelConfig) -> str:
    """CAUSAL_LM or SEQUENCE_CLASSIFICATION."""
    return SEQUENCE_CLASSIFICATION if cfg.num_labels else CAUSAL_LM


def resolve(cfg: ModelConfig, activation: str) -> str:
    """A classifier's activation for a request ("auto" resolved); the caller has checked the name."""
    if activation != "auto":
        return activation
    return "sigmoid" if cfg.num_labels == 1 or cfg.multi_label else "softmax"


def activate(logits: np.ndarray, activation: str) -> np.ndarray:
    """[rows, labels] raw logits -> the activation's outputs ("" and "none": as they are), float32."""
    if activation in ("", "none"):
        return logits
    x = logits.astype(np.float64)
    if activation == "sigmoid":
        return (1.0 / (1.0 + np.exp(-x))).astype(np.float32)
    e = np.exp(x - x.max(axis=-1, keepdims=True))
    return (e / e.sum(axis=-1, keepdims=True)).astype(np.float32)
