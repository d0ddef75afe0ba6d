"""The start-up attention check (kernels/selfcheck.py): every implementation passes it at the
model shapes, a wrong one is caught, a server whose kernels are wrong never reports SERVING, and
a passing check is kept with the compile cache, keyed by what decides its programs."""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import shutil
import types
from collections.abc import Iterator
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest
from conftest import SMALL_BUCKETS
from jax.experimental.pallas import tpu as pltpu

from prefixscore.engine.runtime import compile_cache
from prefixscore.engine.runtime.scoring_engine import ScoringEngine
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
    # the CPU's attention also gives each row the same bits one token later in its call
    moved = {name + selfcheck.MOVED for name in CALLS} if impl == "xla" else set()
    assert set(errors) == CALLS | moved
    assert max(errors[name] for name in CALLS) <= selfcheck.TOLERANCE[dtype]
    assert all(errors[name] == 0.0 for name in moved)


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


def test_the_plain_call_runs_the_steps_of_a_model_without_sliding_layers():
    """A model with no sliding layer traces its window as the Python int NO_WINDOW, and the kernels
    then leave out their windowed steps: the check's plain call must run those plain steps, or a
    fault in them (the path most models serve) would pass it. An implementation wrong only there
    is caught on the plain call alone."""
    from prefixscore.kernels.paged import never_windowed

    def plain_steps_off(q, k, v, pk, pv, meta):
        out = xla.paged_attention(q, k, v, pk, pv, meta)
        return out * 1.5 if never_windowed(meta.window) else out

    impl = types.SimpleNamespace(**{n: getattr(xla, n) for n in xla.__all__}, SEGMENT_ALIGN=xla.SEGMENT_ALIGN)
    impl.paged_attention = plain_steps_off
    errors = selfcheck.check(impl, *BENCH_CPU, "float32")
    assert errors["paged_attention"] > 1e-2 and errors["paged_attention_windowed"] < 1e-5


def test_rows_whose_bits_follow_their_place_fail_the_check_within_the_reference_tolerance():
    """An implementation that promises the same bits anywhere in a call (SAME_BITS_ANYWHERE) and
    gives a row other last bits at an odd place in the stream (as XLA:CPU's matrix products gave
    the CPU's short items on an AMD Zen 4) is refused at start-up, though it is far within the
    reference tolerance: the check moves the stream's runs a token later and compares bits."""

    def placed(q, k, v, pool_k, pool_v, meta):
        out = xla.paged_attention(q, k, v, pool_k, pool_v, meta)
        odd = (jnp.arange(out.shape[0]) % 2)[:, None, None]
        return out * (1 + odd * 2.0**-22)  # two units in the last place, at odd places only

    impl = types.SimpleNamespace(
        **{n: getattr(xla, n) for n in xla.__all__}, SEGMENT_ALIGN=xla.SEGMENT_ALIGN, SAME_BITS_ANYWHERE=True
    )
    impl.paged_attention = placed
    errors = selfcheck.check(impl, *BENCH_CPU, "float32")
    assert max(errors[name] for name in CALLS) <= selfcheck.TOLERANCE["float32"] / 10
    assert min(errors[name + selfcheck.MOVED] for name in CALLS) > 0
    with pytest.raises(
        selfcheck.KernelCheckFailed,
        match=r"'placed' gives a token other bits one place later.*paged_attention moved a token off by.*"
        r"--attention reference",
    ):
        selfcheck.verify("placed", impl, *BENCH_CPU, "float32")


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
    monkeypatch.setattr(selfcheck, "verdict_path", lambda *a: None)  # with no kept verdicts
    engine = tiny_scorer.engine
    errors = engine.check_attention()
    assert engine.replica().check_attention() == errors and computed == [xla]
    for _ in range(2):
        with pytest.raises(selfcheck.KernelCheckFailed, match=r"'broken'.*paged_attention off by"):
            selfcheck.verify_once("broken", broken_attention, *BENCH_CPU, "float32")
    assert computed == [xla, broken_attention]


@pytest.fixture
def own_compile_cache(tmp_path: Path) -> Iterator[Path]:
    """jax's persistent compile cache in tmp_path for one test (then the run's again): kept
    verdicts live beside it, out of reach of the run's other processes."""
    previous = jax.config.jax_compilation_cache_dir
    compile_cache.enable(tmp_path)
    try:
        yield tmp_path
    finally:
        compile_cache.enable(previous or compile_cache.default_dir())


def test_a_passing_check_is_kept_with_the_compile_cache_and_judged_when_taken(monkeypatch, own_compile_cache):
    """A fresh process (no errors in memory) takes a passing check's kept errors instead of
    checking again; kept errors are judged like computed ones; a file that does not hold every
    call's error is checked again and rewritten; a failing check is never kept."""
    from helpers import broken_attention

    computed = []
    check = selfcheck.check
    monkeypatch.setattr(selfcheck, "check", lambda impl, *a: computed.append(impl) or check(impl, *a))
    fresh = lambda: monkeypatch.setattr(selfcheck, "_CHECKED", {})  # noqa: E731  (as in a new process)
    fresh()
    path = selfcheck.verdict_path("xla", xla, *BENCH_CPU, "float32")
    assert path is not None and path.parent == own_compile_cache / selfcheck.VERDICTS and not path.exists()
    errors = selfcheck.verify_once("xla", xla, *BENCH_CPU, "float32")
    assert computed == [xla] and json.loads(path.read_text()) == errors
    fresh()
    assert selfcheck.verify_once("xla", xla, *BENCH_CPU, "float32") == errors and computed == [xla]
    # kept errors past the tolerance fail the start like computed ones
    path.write_text(json.dumps({**errors, "paged_attention_windowed": 0.5}))
    fresh()
    with pytest.raises(selfcheck.KernelCheckFailed, match=r"paged_attention_windowed off by 0.5"):
        selfcheck.verify_once("xla", xla, *BENCH_CPU, "float32")
    assert computed == [xla]
    # a call missing (or an unreadable file): the check runs again and keeps its errors
    for kept in (json.dumps({"paged_attention": 0.0}), "{not json"):
        path.write_text(kept)
        fresh()
        assert selfcheck.verify_once("xla", xla, *BENCH_CPU, "float32") == errors
        assert computed[-1] is xla and json.loads(path.read_text()) == errors
    assert computed == [xla] * 3
    fresh()
    with pytest.raises(selfcheck.KernelCheckFailed):
        selfcheck.verify_once("broken", broken_attention, *BENCH_CPU, "float32")
    assert computed[-1] is broken_attention
    assert not selfcheck.verdict_path("broken", broken_attention, *BENCH_CPU, "float32").exists()


def test_the_kept_verdict_is_keyed_by_what_decides_the_checked_programs(monkeypatch, tmp_path):
    """Another implementation source, compiler flag, matmul precision, dtype or head shape is
    another key (the check runs again); the same ones, the same key. An implementation built in
    the process (no source file) is never kept."""
    source = tmp_path / "edited_kernel.py"
    shutil.copy(Path(__file__).parent / "helpers" / "broken_attention.py", source)
    spec = importlib.util.spec_from_file_location("edited_kernel", source)
    edited = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(edited)
    key = lambda impl=edited, name="edited", shape=BENCH_CPU, dtype="float32": selfcheck.verdict_key(  # noqa: E731
        name, impl, *shape, dtype
    )
    first = key()
    assert first == key() and first is not None
    others = {
        "another implementation": key(xla, "xla"),
        "another name": key(name="xla"),
        "another dtype": key(dtype="bfloat16"),
        "other heads": key(shape=(8, 2, 64)),
    }
    with monkeypatch.context() as env:
        env.setenv("XLA_FLAGS", f"{os.environ.get('XLA_FLAGS', '')} --xla_cpu_enable_fast_math=true")
        others["another XLA flag"] = key()
    with jax.default_matmul_precision("highest"):
        others["another matmul precision"] = key()
    source.write_text(source.read_text() + "\n# one line more\n")
    others["an edited source"] = key()
    assert all(k not in (first, None) for k in others.values()), others
    assert len(set(others.values())) == len(others)
    assert (
        selfcheck.verdict_key("ns", types.SimpleNamespace(paged_attention=xla.paged_attention), *BENCH_CPU, "float32")
        is None
    )
