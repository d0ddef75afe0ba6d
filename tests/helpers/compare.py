"""Comparing probabilities where they are small: in log space, so a tolerance is relative to each
probability (a full-vocabulary probability of 2e-5 that moves by 1e-6 moves by 5% of itself)."""

from __future__ import annotations

import numpy as np


def log_gap(got: object, want: object) -> float:
    """The largest |log(got) - log(want)| over matching probabilities (shapes must agree)."""
    a, b = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert a.shape == b.shape, (a.shape, b.shape)
    assert (a > 0).all() and (b > 0).all(), "a probability of 0 has no logarithm: compare it apart"
    return float(np.abs(np.log(a) - np.log(b)).max()) if a.size else 0.0
