"""How far 8-bit projections move the embedded default's reranker scores: SmolLM2-135M (real
weights, the Q4_1 GGUF) loaded with `--quantize none` (dequantized to float32, the reference)
and requantized per output channel to int8, multiplied as W8A8 (dynamic per-token activations)
and as W8A16, on every (query, document) pair of docs/examples/beir-mini's first-stage run
(3 queries x 6 documents, as `prefixscore eval --depth 6` reranks them).

The bounds are the drift measured with `prefixscore eval` on the same pairs (docs/benchmarks.md,
"8-bit weights") times a margin: approximations measured, not guarantees. W8A16 moves a
relevance by up to 0.013 and keeps most of the order (Kendall's tau 0.87 to 1 per query: the
relevances of a query's six documents lie within 0.05 of each other); its scores are as
reproducible as float32's (a pair scores the same, to 1e-5, in any call), so its margin is
1.5. W8A8 moves them by up to 0.086 and reorders them (tau 0.07 to 0.73), and its scores are
not reproducible between calls: the same pair scored in another call (other items beside it,
the query's prefix from the cache) moved by up to 0.084, and the whole model by up to 0.062
under a 1e-6 relative change of the embeddings (W8A16: 2e-6): per-token 8-bit rounding
amplifies float32's last bits. Its margin is 2, and its tau bounds are weak; the max |dp| is
what binds.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from conftest import SMALL_BUCKETS

from prefixscore import Scorer
from prefixscore.offline import trec

BEIR_MINI = Path(__file__).resolve().parent.parent / "docs" / "examples" / "beir-mini"
# measured with `prefixscore eval --depth 6` at 11f6eb8 (SMALL_BUCKETS give the same scores)
MEASURED = {
    # activations: (max |p - p_full| over the 18 pairs, lowest per-query tau, mean tau), margin
    "dynamic": ((0.0857, 0.0667, 0.4222), 2.0),
    "none": ((0.0132, 0.8667, 0.9111), 1.5),
}


def kendall_tau_b(x: np.ndarray, y: np.ndarray) -> float:
    """Kendall's tau-b of two score vectors (ties counted as scipy.stats.kendalltau does)."""
    i, j = np.triu_indices(len(x), 1)
    dx, dy = np.sign(x[i] - x[j]), np.sign(y[i] - y[j])
    pairs = len(i)
    return float((dx * dy).sum() / np.sqrt((pairs - (dx == 0).sum()) * (pairs - (dy == 0).sum())))


def test_kendall_tau_b_agrees_with_its_definition():
    x = np.array([0.1, 0.4, 0.3, 0.9])
    assert kendall_tau_b(x, x) == 1.0
    assert kendall_tau_b(x, -x) == -1.0
    # one discordant pair of six: (5 - 1) / 6
    assert kendall_tau_b(x, np.array([0.1, 0.3, 0.4, 0.9])) == pytest.approx(4 / 6)
    # ties in y: tau-b = (C - D) / sqrt(6 * 5) with C = 5, D = 0
    assert kendall_tau_b(x, np.array([0.1, 0.3, 0.3, 0.9])) == pytest.approx(5 / np.sqrt(30))


def beir_mini_pairs() -> list[tuple[str, list[str]]]:
    """Each query's text and its six first-stage documents' texts, in docs/examples' order."""
    run = trec.cut(trec.read_run(str(BEIR_MINI / "bm25.trec")), 6)
    docs = trec.read_texts(str(BEIR_MINI / "corpus.jsonl"), {d for scores in run.values() for d in scores})
    queries = trec.read_texts(str(BEIR_MINI / "queries.jsonl"), set(run))
    return [(queries[q], [docs[d] for d in sorted(run[q])]) for q in sorted(run)]


def relevances(quantize: str, activations: str = "auto") -> list[np.ndarray]:
    """Each query's relevance of its documents (the rerank API's), in the order given."""
    # SmolLM2 is no published reranker (`auto` serves it no rerank): Qwen3-Reranker's prompt, as measured
    scorer = Scorer.load(
        "smollm2-135m", buckets=SMALL_BUCKETS, quantize=quantize, activations=activations, template="qwen3-reranker"
    )
    quantization = scorer.model.quantization
    if quantize == "none":
        assert quantization == {"weights": "none"}, quantization
    else:
        assert (quantization["weights"], quantization["activations"]) == (quantize, activations), quantization
    out = []
    for query, documents in beir_mini_pairs():
        scores = np.zeros(len(documents))
        for r in scorer.rerank(query, documents):
            scores[r.index] = r.relevance_score
        out.append(scores)
    return out


@pytest.fixture(scope="module")
def full_precision() -> list[np.ndarray]:
    return relevances("none")


@pytest.mark.parametrize("activations", ["dynamic", "none"])
def test_int8_drift_within_the_measured_bounds(full_precision, activations):
    got = relevances("int8", activations)
    (max_dp, lowest_tau, mean_tau), margin = MEASURED[activations]
    dp = max(float(np.abs(g - f).max()) for g, f in zip(got, full_precision, strict=True))
    taus = [kendall_tau_b(f, g) for g, f in zip(got, full_precision, strict=True)]
    assert dp <= margin * max_dp, (dp, taus)
    # tau's distance from a perfect 1 within the margin, for each query and on average
    assert min(taus) >= 1 - margin * (1 - lowest_tau), (dp, taus)
    assert np.mean(taus) >= 1 - margin * (1 - mean_tau), (dp, taus)
    # it is 8-bit: the scores did move
    assert dp > 0
