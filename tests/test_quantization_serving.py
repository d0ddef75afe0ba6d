"""An 8-bit model as a server reports it: GetModelInfo and /v1/models say what is 8-bit, how it
is multiplied and the weights' bytes on a device (fewer than full precision's), and a request
sees no difference in the API (same fields, same validation) and gets the scheme's scores: the
log-probabilities of the float64 W8A8 reference (tests/helpers/quant_reference.py, quantizing the
preset's float weights itself) within 1e-4."""

from __future__ import annotations

import grpc
import httpx
import jax
import numpy as np
import pytest
from conftest import SMALL_BUCKETS
from helpers.quant_reference import full_precision_params, reference_log_probs
from helpers.service import ITEMS, LABELS, server_config

from prefixscore import Scorer
from prefixscore.client import ScoreClient
from prefixscore.model.weights import projections
from prefixscore.service.process import ServerThread

QUERY = list(range(3, 40))


@pytest.fixture(scope="module")
def int8_scorer():
    return Scorer.load("tiny-qwen3", buckets=SMALL_BUCKETS, quantize="int8")


@pytest.fixture(scope="module")
def int8_server(int8_scorer):
    with ServerThread(server_config(int8_scorer, http_port=0)) as server:
        yield server


def _bytes(tree) -> int:
    return sum(leaf.nbytes for leaf in jax.tree.leaves(tree))


def test_model_info_reports_the_quantization(int8_server, int8_scorer, tiny_scorer):
    """(A full-precision model reports "none": tests/test_service_grpc.py, tests/test_http.py.)"""
    with ScoreClient(int8_server.target) as client:
        info = client.model_info()
    assert (info.quantization, info.activation_quantization) == ("int8", "dynamic")
    assert dict(info.quantized_projections)["layers.mlp.w_up"] == "int8 per channel"
    assert len(info.quantized_projections) == 7
    # one device: every weight on it, the projections a byte each (with their float32 scales)
    assert info.weight_bytes_per_device == _bytes(int8_scorer.model.params)
    full_projections = sum(w.nbytes for w in projections(tiny_scorer.model.params).values())
    saved = _bytes(tiny_scorer.model.params) - info.weight_bytes_per_device
    assert saved > 0.7 * full_projections  # float32 -> a byte a weight, plus a scale per column
    card = httpx.get(f"http://127.0.0.1:{int8_server.server.http_port}/v1/models").json()["data"][0]
    assert (card["quantization"], card["activation_quantization"]) == ("int8", "dynamic")
    assert card["quantized_projections"] == dict(info.quantized_projections)
    assert card["weight_bytes_per_device"] == info.weight_bytes_per_device


def test_requests_see_the_same_api(int8_server, int8_scorer):
    """Scores come back in the same shape, with the W8A8 reference's values (log-probabilities
    of about 2e-5 within 1e-4, as tests/test_quantization.py holds the engine), and bad input is
    refused as for any model."""
    params = full_precision_params("tiny-qwen3")
    want = np.array(
        [reference_log_probs(int8_scorer.cfg, params, QUERY + item, "int8", "dynamic")[LABELS] for item in ITEMS]
    )
    with ScoreClient(int8_server.target) as client:
        scores = np.array(client.score(QUERY, ITEMS, LABELS).scores, np.float64)
        assert scores.shape == (len(ITEMS), len(LABELS))
        np.testing.assert_allclose(np.log(scores), want, rtol=0, atol=1e-4)
        with pytest.raises(grpc.RpcError) as err:
            client.score(QUERY, [[]], LABELS)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
