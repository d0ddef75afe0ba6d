"""`prefixscore bench`: a CI-sized smoke run of every workload and mode, and the FLOP model."""

from __future__ import annotations

import argparse
import json

import pytest

from prefixscore.model import flops
from prefixscore.model.presets import RANDOM_PRESETS
from prefixscore.service import bench

SMOKE = [
    "bench",
    "--model",
    "tiny-qwen3",
    "--workload",
    "all",
    "--mode",
    "all",
    "--runs",
    "2",
    "--no-progress",
    "--query-tokens",
    "60",
    "--items",
    "12",
    "--item-tokens",
    "6",
    "--sequential-items",
    "3",
    "--w2-requests",
    "6",
    "--concurrency",
    "3",
    "--w2-max-query",
    "200",
    "--w2-max-items",
    "20",
    "--w2-max-item-tokens",
    "30",
    "--w3-docs",
    "4",
    "--w3-max-doc-tokens",
    "60",
]


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="prefixscore")
    bench.register(parser.add_subparsers(dest="command"))
    return parser.parse_args(argv)


def test_flops_match_design_accounting() -> None:
    """DESIGN.md: Qwen3-0.6B, W1: ~13.4 TFLOP items, ~2.2 TFLOP prefill, ~0.16 TFLOP head."""
    cfg = RANDOM_PRESETS["qwen3-0.6b-random"][0]
    f = flops.request(cfg, 2000, [20] * 500, apply_softmax=False, n_labels=2)
    assert f["items"] / 1e12 == pytest.approx(13.4, rel=0.02)
    assert f["prefill"] / 1e12 == pytest.approx(2.2, rel=0.02)
    assert f["head"] / 1e12 == pytest.approx(0.16, rel=0.05)
    warm = flops.request(cfg, 2000, [20] * 500, apply_softmax=True, n_labels=2, prefill=False)
    assert warm["prefill"] == 0 and warm["head"] == 500 * 2 * cfg.hidden_size * 2


def test_bench_smoke_all_workloads_and_modes(tmp_path, capsys) -> None:
    out = tmp_path / "bench.json"
    args = parse([*SMOKE, "--json", str(out)])
    assert args.func is bench.run
    assert args.func(args) == 0
    records = json.loads(out.read_text())
    got = {(r["workload"], r["mode"]) for r in records}
    want = {(w, m) for w in ("w1-cold", "w1-warm", "w3") for m in bench.MODES} | {("w2", "prefix")}
    assert got == want
    for r in records:
        for key in (
            "model",
            "dtype",
            "backend",
            "devices",
            "commit",
            "items_per_s",
            "latency_ms",
            "compile_seconds",
            "padding_share",
            "flops_per_request",
            "achieved_flops_per_s",
            "peak_flops_per_s",
            "utilisation",
            "attention",
            "buckets",
            "machine",
        ):
            assert key in r, key
        assert r["items_per_s"] > 0 and r["flops_per_request"] > 0
        assert 0 < r["utilisation"] < 2
        assert r["latency_ms"]["p50"] <= r["latency_ms"]["p99"]
        assert r["steady_state_compilations"] == 0 or r["mode"] == "packed"
        if r["mode"] != "packed":
            assert 0 <= r["padding_share"] < 1
    by = {(r["workload"], r["mode"]): r for r in records}
    assert by[("w2", "prefix")]["transport"].startswith("grpc ") and by[("w2", "prefix")]["requests"] == 6
    assert by[("w1-cold", "prefix")]["transport"] == "in-process"
    assert by[("w1-warm", "prefix")]["prefix_cache_hit_rate"] == 1.0
    assert by[("w1-cold", "prefix")]["prefix_cache_hit_rate"] == 0.0
    assert set(by[("w1-cold", "prefix")]["speedup"]) == {"packed", "sequential"}
    table = capsys.readouterr().out
    assert "items/s" in table and "w1-cold" in table and "peak:" in table


def test_bench_over_grpc_target(tmp_path) -> None:
    """--target: the workloads go to a running server (here one in a thread)."""
    from prefixscore import Scorer
    from prefixscore.service.server import ServerConfig, ServerThread

    scorer = Scorer.load("tiny-qwen3")
    cfg = ServerConfig(
        host="127.0.0.1", port=0, metrics_port=None, warmup=False, loaded=scorer.model, engine=scorer.engine
    )
    with ServerThread(cfg) as server:
        out = tmp_path / "remote.json"
        args = parse([*SMOKE, "--workload", "w1-cold,w2", "--target", server.target, "--json", str(out)])
        assert args.func(args) == 0
    records = json.loads(out.read_text())
    assert [(r["workload"], r["mode"]) for r in records] == [("w1-cold", "prefix"), ("w2", "prefix")]
    assert all(r["target"] == server.target and r["backend"] == "remote" and r["items_per_s"] > 0 for r in records)
