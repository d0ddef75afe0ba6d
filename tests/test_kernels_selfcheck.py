"""The start-up attention check (kernels/selfcheck.py): every implementation passes it at the
model shapes, a wrong one is caught, and a server whose kernels are wrong never reports SERVING."""

from __future__ import annotations

import contextlib
import types
from collections.abc import Iterator

import jax
import jax.numpy as jnp
import pytest
from conftest import SMALL_BUCKETS
from jax.experimental.pallas import tpu as pltpu

from prefixscore.engine.scoring_engine import ScoringEngine
from prefixscore.kernels import dispatch, selfcheck, xla
from prefixscore.kernels.paged import causal_by_region
from prefixscore.model.loader import load_model
from prefixscore.service.core import ServerConfig, StartupFailed
from prefixscore.service.process import ServerThread

QWEN3_06B = (16, 8, 128)  # heads, kv heads, head_dim
BENCH_CPU = (4, 2, 64)
# what the check runs: the attention the decoder runs per layer, on a plain and a windowed layer
CALLS = {"paged_attention", "paged_attention_windowed"}


@contextlib.contextmanager
def interpreted(name: str) -> Iterator[None]:
    """Pallas TPU kernels in the TPU interpreter off TPU (GPU kernels interpret themselves off GPU)."""
    if name == "pallas_tpu" and jax.default_backend() != "tpu":
        with pltpu.force_tpu_interpret_mode():
            yield
    else:
        yield


@pytest.mark.parametrize(
    ("impl", "shape", "dtype"),
    [
        ("xla", QWEN3_06B, "bfloat16"),
        ("xla", BENCH_CPU, "float32"),
        ("pallas_tpu", QWEN3_06B, "bfloat16"),  # interpret mode off TPU
        ("pallas_gpu", BENCH_CPU, "float32"),  # interpret mode off GPU
    ],
)
def test_implementations_pass(impl: str, shape: tuple[int, int, int], dtype: str):
    with interpreted(impl):
        errors = selfcheck.verify(impl, dispatch.get(impl), *shape, dtype)
    assert set(errors) == CALLS
    assert max(errors.values()) <= selfcheck.TOLERANCE[dtype]


def test_a_wrong_merge_is_caught():
    from helpers import broken_attention

    errors = selfcheck.check(broken_attention, *BENCH_CPU, "float32")
    assert set(errors) == CALLS
    assert min(errors.values()) > 1e-2  # far outside float32 noise: the check has teeth
    with pytest.raises(selfcheck.KernelCheckFailed, match=r"'broken'.*paged_attention off by.*--attention xla"):
        selfcheck.verify("broken", broken_attention, *BENCH_CPU, "float32")


def test_nan_fails():
    nan_prefix = lambda *a: tuple(x * jnp.nan for x in xla.paged_prefix_attention(*a))  # noqa: E731
    impl = types.SimpleNamespace(**{n: getattr(xla, n) for n in xla.__all__}, SEGMENT_ALIGN=xla.SEGMENT_ALIGN)
    impl.paged_prefix_attention = nan_prefix
    impl.paged_attention = lambda q, k, v, pk, pv, meta: xla.merge_attention(
        *nan_prefix(q, pk, pv, meta), *causal_by_region(xla.ragged_item_attention, q, k, v, meta)
    )
    with pytest.raises(selfcheck.KernelCheckFailed, match=r"paged_attention off by nan.*--attention xla"):
        selfcheck.verify("nan", impl, *BENCH_CPU, "float32")


def test_server_with_wrong_kernels_never_serves(monkeypatch):
    monkeypatch.setitem(dispatch.IMPLEMENTATIONS, "broken", "helpers.broken_attention")
    loaded = load_model("tiny-qwen3", "float32")
    engine = ScoringEngine(loaded.cfg, loaded.params, "float32", SMALL_BUCKETS, attn_impl="broken")
    assert engine.attn_impl == "broken" and engine.segment_align == xla.SEGMENT_ALIGN
    config = ServerConfig(host="127.0.0.1", port=0, metrics_port=None, loaded=loaded, engine=engine, warmup=False)
    srv = ServerThread(config).start(wait_ready=False)
    try:
        with pytest.raises(StartupFailed, match="KernelCheckFailed: attention implementation 'broken'"):
            srv.wait_ready(120)
        assert not srv.server.service.ready
    finally:
        srv.stop()


def test_an_engine_checks_once_per_process_and_a_failing_kernel_fails_every_engine(monkeypatch, tiny_scorer):
    """A second engine of the same attention shapes in the process (here a replica) takes the
    first one's errors instead of running the check again; a failing implementation still
    fails every engine, the second from the kept errors."""
    from helpers import broken_attention

    computed = []
    check = selfcheck.check
    monkeypatch.setattr(selfcheck, "check", lambda impl, *a: computed.append(impl) or check(impl, *a))
    monkeypatch.setattr(selfcheck, "_CHECKED", {})  # as in a fresh process
    engine = tiny_scorer.engine
    errors = engine.check_attention()
    assert engine.replica().check_attention() == errors and computed == [xla]
    for _ in range(2):
        with pytest.raises(selfcheck.KernelCheckFailed, match=r"'broken'.*paged_attention off by"):
            selfcheck.verify_once("broken", broken_attention, *BENCH_CPU, "float32")
    assert computed == [xla, broken_attention]
