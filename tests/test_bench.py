"""`prefixscore bench`: a CI-sized smoke run of every workload and mode, and the FLOP model."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
import time

import pytest
from helpers import tools
from helpers.bench import parse

from prefixscore.bench import command as bench
from prefixscore.bench import reports
from prefixscore.bench import workloads as wl
from prefixscore.bench.session import Bench
from prefixscore.model import flops
from prefixscore.model.presets import RANDOM_PRESETS
from prefixscore.telemetry import host_cost

# py-spy's own refusal to attach: the OS denies it another process's memory (ptrace)
PY_SPY_REFUSED = re.compile(r"permission denied|operation not permitted", re.IGNORECASE)
SMOKE = [
    "bench",
    "--host-requests",
    "4",
    "--rerank-docs",
    "2",
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
    "--w3-requests",
    "4",
    "--w4-requests",
    "6",
    "--w4-concurrency",
    "3",
    "--w4-query-tokens",
    "40",
    "--w4-items",
    "4",
    "--w4-item-tokens",
    "6",
]

# w1-cold and the three concurrent gRPC workloads, as small as they go (docs/benchmarks.md, shares of W1-cold)
SHARES = [
    "bench",
    "--model",
    "tiny-qwen3",
    "--workload",
    "w1-cold,w4,w2,w3-grpc",
    "--runs",
    "2",
    "--no-progress",
    "--query-tokens",
    "64",
    "--items",
    "8",
    "--item-tokens",
    "4",
    "--w4-requests",
    "8",
    "--w4-concurrency",
    "4",
    "--w4-query-tokens",
    "32",
    "--w4-items",
    "4",
    "--w4-item-tokens",
    "4",
    "--w2-requests",
    "4",
    "--concurrency",
    "2",
    "--w2-max-query",
    "64",
    "--w2-max-items",
    "8",
    "--w2-max-item-tokens",
    "8",
    "--w3-requests",
    "4",
    "--w3-docs",
    "4",
    "--w3-max-doc-tokens",
    "16",
]


def test_flops_match_design_accounting() -> None:
    """docs/benchmarks.md: Qwen3-0.6B, W1: ~13.4 TFLOP items, ~2.2 TFLOP prefill, ~0.16 TFLOP head."""
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
    want = {(w, m) for w in ("w1-cold", "w1-warm", "w3") for m in wl.MODES} | {
        (w, "prefix")
        for w in wl.CONCURRENT
        if w != "w5"  # "all" but w5: it needs a router (test_prefix_affinity)
    }
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
            # host-rerank sends text: its tokens (and so its FLOPs) are the server's to know
            assert key in r or (r["workload"] == "host-rerank" and key in ("peak_flops_per_s",)), key
        assert r["items_per_s"] > 0
        if r["workload"] != "host-rerank":
            assert r["flops_per_request"] > 0 and 0 < r["utilisation"] < 2
        assert r["latency_ms"]["p50"] <= r["latency_ms"]["p99"]
        assert r["steady_state_compilations"] == 0 or r["mode"] == "packed"
        if r["mode"] != "packed":
            assert 0 <= r["padding_share"] < 1
            # the tokens requested (each needed once) and computed, from the serving loop's metrics
            assert 0 < r["requested_tokens"] <= r["computed_tokens"] <= r["bucket_tokens"], r
            assert r["computed_over_requested"] == round(r["computed_tokens"] / r["requested_tokens"], 3)
    by = {(r["workload"], r["mode"]): r for r in records}
    assert by[("w2", "prefix")]["transport"].startswith("grpc ") and by[("w2", "prefix")]["requests"] == 6
    assert by[("w4", "prefix")]["transport"].startswith("grpc ") and by[("w4", "prefix")]["requests"] == 6
    assert by[("w3-grpc", "prefix")]["transport"].startswith("grpc ") and by[("w3-grpc", "prefix")]["requests"] == 4
    for w in ("w2", "w3", "w3-grpc", "w4"):
        assert by[(w, "prefix")][reports.SHARE_KEY] > 0
    assert by[("host-rerank", "prefix")]["transport"].startswith("http ") and by[("host", "prefix")]["requests"] == 4
    assert reports.SHARE_KEY not in by[("w1-cold", "prefix")] and reports.SHARE_KEY not in by[("w1-warm", "prefix")]
    assert by[("w1-cold", "prefix")]["transport"] == "in-process"
    assert by[("w1-warm", "prefix")]["prefix_cache_hit_rate"] == 1.0
    assert by[("w1-cold", "prefix")]["prefix_cache_hit_rate"] == 0.0
    assert set(by[("w1-cold", "prefix")]["speedup"]) == {"packed", "sequential"}
    table = capsys.readouterr().out
    assert "items/s" in table and "w1-cold" in table and "peak:" in table and "comp/req" in table


def test_bench_over_grpc_target(tmp_path) -> None:
    """--target: the workloads go to a running server (here one in a thread)."""
    from prefixscore import Scorer
    from prefixscore.service.core import ServerConfig
    from prefixscore.service.process import ServerThread

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
    # what the server serves, from its model info (the flags it was started with are its own)
    assert all(r["quantization"] == {"weights": "none"} and r["quantize"] is None for r in records)


def test_bench_records_what_it_quantized(tmp_path, capsys) -> None:
    """--quantize and --activations reach the model load, and each record says what it measured:
    the flags asked for and what the load made of them."""
    defaults = parse(["bench"])
    assert (defaults.quantize, defaults.activations) == ("auto", "auto")
    out = tmp_path / "int8.json"
    small = ["--query-tokens", "32", "--items", "4", "--item-tokens", "4", "--runs", "1", "--no-progress"]
    args = parse(["bench", "--model", "tiny-qwen3", *small, "--quantize", "int8", "--activations", "none"])
    args.json_path = str(out)
    assert args.func(args) == 0
    (record,) = json.loads(out.read_text())
    assert (record["quantize"], record["activations"]) == ("int8", "none")
    assert record["quantization"] == {"weights": "int8", "activations": "none"}
    assert "projections int8, activations none" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        parse(["bench", "--quantize", "int4"])


def test_bench_flop_rate_shares_of_w1_cold(tmp_path, capsys) -> None:
    """W4, W2 and W3 over gRPC: concurrent runs, each with its FLOP rate as a share of W1-cold's."""
    out = tmp_path / "shares.json"
    args = parse([*SHARES, "--json", str(out)])
    assert args.func(args) == 0
    records = json.loads(out.read_text())
    assert [(r["workload"], r["mode"]) for r in records] == [
        ("w1-cold", "prefix"),
        ("w4", "prefix"),
        ("w2", "prefix"),
        ("w3-grpc", "prefix"),
    ]
    by = {r["workload"]: r for r in records}
    assert by["w1-cold"]["transport"] == "in-process" and by["w1-cold"]["achieved_flops_per_s"] > 0
    want = {"w4": (8, 4, 8 * 4), "w2": (4, 2, None), "w3-grpc": (4, 2, 4 * 4)}
    for w, (requests, clients, items) in want.items():
        r = by[w]
        assert r["transport"].startswith("grpc ") and r["concurrency"] == clients and r["requests"] == requests, w
        assert items is None or r["items"] == items, w
        assert r["items_per_s"] > 0 and r["achieved_flops_per_s"] > 0, w
        assert r[reports.SHARE_KEY] > 0, w
        assert r[reports.SHARE_KEY] == pytest.approx(r["achieved_flops_per_s"] / by["w1-cold"]["achieved_flops_per_s"])
        assert r["padding_share"] is None or 0 <= r["padding_share"] < 1, w
        assert 0 <= r["prefix_cache_hit_rate"] <= 1, w
    assert by["w4"]["prefix_cache_hit_rate"] == 0.0  # every W4 query is new
    printed = capsys.readouterr().out
    for name in ("W4", "W2", "W3-grpc"):
        assert f"{name} {by[name.lower()][reports.SHARE_KEY]:.2f} of W1-cold's model FLOP rate" in printed


def test_w6_reward_model_through_classify_against_one_by_one(tmp_path, capsys) -> None:
    """W6 on the one-logit reward preset: a conversation with candidate responses in one
    /v1/classify body (its shared pages prefilled once) and the same inputs one body each, both
    over HTTP, with W1-cold's FLOP rate (no label ids: a classifier scores its own head) in the
    same run."""
    out = tmp_path / "w6.json"
    sizes = ["--query-tokens", "64", "--items", "8", "--item-tokens", "8", "--runs", "1", "--no-progress"]
    w6 = ["--w6-conversation", "96", "--w6-responses", "6", "--w6-max-response-tokens", "60"]
    args = parse(["bench", "--model", "bench-cpu-reward", "--workload", "w1-cold,w6,w6-one-by-one", *sizes, *w6])
    args.json_path = str(out)
    assert args.func(args) == 0
    by = {r["workload"]: r for r in json.loads(out.read_text())}
    assert by["w1-cold"]["transport"] == "in-process"
    for w in ("w6", "w6-one-by-one"):
        assert by[w]["transport"].startswith("http ") and by[w]["items"] == 6, w
        assert by[w][reports.SHARE_KEY] > 0 and by[w]["steady_state_compilations"] == 0, w
    assert "W6 " in capsys.readouterr().out


def test_bench_rounds_take_shares_per_round_and_their_median(tmp_path, capsys) -> None:
    """--rounds 3: the workload list three times; each round's W4 share is against that round's
    W1-cold, and the median over rounds is printed."""
    argv = list(SHARES)
    argv[argv.index("w1-cold,w4,w2,w3-grpc")] = "w1-cold,w4"
    out = tmp_path / "rounds.json"
    args = parse([*argv, "--rounds", "3", "--json", str(out)])
    assert args.func(args) == 0
    records = json.loads(out.read_text())
    assert [(r["workload"], r["round"]) for r in records] == [(w, k) for k in range(3) for w in ("w1-cold", "w4")]
    shares = []
    for k in range(3):
        base, w4 = (next(r for r in records if r["round"] == k and r["workload"] == w) for w in ("w1-cold", "w4"))
        assert w4[reports.SHARE_KEY] == pytest.approx(w4["achieved_flops_per_s"] / base["achieved_flops_per_s"])
        shares.append(w4[reports.SHARE_KEY])
    printed = capsys.readouterr().out
    assert "W4 (round 3) " in printed
    median = sorted(shares)[1]
    assert (
        f"w4 over 3 rounds: median {sorted(r['items_per_s'] for r in records if r['workload'] == 'w4')[1]:.1f}"
        in printed
    )
    assert f"median share of W1-cold's model FLOP rate {median:.2f}" in printed


def test_w4_requests_are_small_and_all_new() -> None:
    sizes = wl.Sizes(w4_query=30, w4_items=3, w4_item_tokens=5)
    reqs = wl.w4(wl.Generator(1000, seed=1), sizes, [7, 8], 12)
    assert len(reqs) == 12
    assert all(len(r.query) == 30 and len(r.items) == 3 and r.item_tokens == 15 for r in reqs)
    assert all(r.labels == [7, 8] and not r.apply_softmax for r in reqs)
    assert len({tuple(r.query) for r in reqs}) == 12
    assert wl.Sizes().w4_query == 300 and wl.Sizes().w4_concurrency == 64 and wl.Sizes().w4_requests == 256


def test_bench_arguments_for_the_concurrent_workloads() -> None:
    args = parse(
        ["bench", "--workload", "all", "--w4-requests", "9", "--w4-concurrency", "5", "--w4-query-tokens", "7"]
    )
    # all but w5 (a router's), w6 (a classifier's), w7 and w8 (alone) and the soak (alone, for its duration)
    every = [w for w in wl.WORKLOADS if w not in ("w5", "w7", "w8", "soak", "faults") and not w.startswith("w6")]
    assert args.workload == every and {"w3-grpc", "w4"} <= set(args.workload)
    assert (args.w4_requests, args.w4_concurrency, args.w4_query_tokens) == (9, 5, 7)
    defaults = parse(["bench"])
    assert (defaults.w4_requests, defaults.w4_concurrency, defaults.w4_query_tokens) == (256, 64, 300)
    assert (defaults.w4_items, defaults.w4_item_tokens, defaults.concurrency, defaults.w3_requests) == (10, 20, 16, 64)
    with pytest.raises(SystemExit):
        parse(["bench", "--workload", "w9"])
    assert defaults.w8_clients == [1] and parse(["bench", "--w8-clients", "1,4"]).w8_clients == [1, 4]
    for bad in ("0", "1,1", "four", ""):
        with pytest.raises(SystemExit):
            parse(["bench", "--w8-clients", bad])


def test_flop_rate_shares_on_synthetic_records() -> None:
    def rec(workload: str, mode: str, rate: float | None, transport: str = "grpc x", clients: int = 16) -> dict:
        return {
            "workload": workload,
            "mode": mode,
            "achieved_flops_per_s": rate,
            "transport": transport,
            "concurrency": clients,
        }

    records = [
        rec("w1-cold", "prefix", 2e9, "in-process", 1),
        rec("w1-cold", "packed", 1e9, "in-process", 1),
        rec("w1-warm", "prefix", 3e9, "in-process", 1),
        rec("w2", "prefix", 1e9),
        rec("w3", "prefix", 5e8, "in-process", 1),
        rec("w3", "packed", 1e8, "in-process", 1),
        rec("w3-grpc", "prefix", 1.5e9),
        rec("w4", "prefix", 4e8, clients=64),
    ]
    reports.add_shares(records)
    got = {(r["workload"], r["mode"]): r.get(reports.SHARE_KEY) for r in records}
    assert got == {
        ("w1-cold", "prefix"): None,
        ("w1-cold", "packed"): None,
        ("w1-warm", "prefix"): None,
        ("w2", "prefix"): 0.5,
        ("w3", "prefix"): 0.25,
        ("w3", "packed"): 0.05,
        ("w3-grpc", "prefix"): 0.75,
        ("w4", "prefix"): 0.2,
    }
    lines = reports.share_lines(records)
    assert lines == [
        "W2 0.50 of W1-cold's model FLOP rate (1.0 GFLOP/s, gRPC, 16 clients)",
        "W3 0.25 of W1-cold's model FLOP rate (0.5 GFLOP/s, in-process)",
        "W3-grpc 0.75 of W1-cold's model FLOP rate (1.5 GFLOP/s, gRPC, 16 clients)",
        "W4 0.20 of W1-cold's model FLOP rate (0.4 GFLOP/s, gRPC, 64 clients)",
    ]
    # no W1-cold prefix record (or no FLOP rate for it): no shares
    for base in ([], [rec("w1-cold", "prefix", None, "in-process", 1)]):
        rest = [rec("w2", "prefix", 1e9), rec("w4", "prefix", 1e9)]
        reports.add_shares(base + rest)
        assert all(reports.SHARE_KEY not in r for r in rest) and reports.share_lines(rest) == []


def test_flops_of_a_partial_prefix_cache_hit() -> None:
    """A hit on part of the query (W3's shared header) saves only that part's prefill."""
    cfg = RANDOM_PRESETS["qwen3-0.6b-random"][0]
    b = object.__new__(Bench)  # flops() needs only the model's shapes
    b.cfg = cfg
    req = wl.Request(list(range(100)), [[1] * 20] * 5, [1, 2], apply_softmax=True)
    full = flops.request(cfg, 100, [20] * 5, True, 2)
    assert b.flops(req, 0) == full["total"]
    assert b.flops(req, 100) == b.flops(req, 101) == full["total"] - full["prefill"]
    rest = full["total"] - flops.request(cfg, 60, [], True, 2)["prefill"]
    assert b.flops(req, 60) == rest and full["total"] - full["prefill"] < rest < full["total"]


def test_thread_cpu_is_counted_by_kind_from_the_os() -> None:
    """A Python thread that spins is booked as python; the process total covers every kind."""
    before = host_cost.seconds_by_kind()
    if before is None:
        pytest.skip("no /proc on this platform")
    spun, release = threading.Event(), threading.Event()

    def spin() -> None:
        # half a second of this thread's own CPU (its clock, from the OS), however busy the
        # machine: a wall-clock half second got 0.2 s of CPU beside another pytest worker
        start, give_up = time.thread_time(), time.monotonic() + 60
        while time.thread_time() - start < 0.5 and time.monotonic() < give_up:
            pass
        spun.set()
        release.wait()  # alive while counted: an ended thread's time is booked as other

    spinner = threading.Thread(target=spin)
    spinner.start()
    spun.wait()
    after = host_cost.seconds_by_kind()
    release.set()
    spinner.join()
    assert after is not None and after["python"] - before["python"] >= 0.3
    assert after["total"] == pytest.approx(sum(after[k] for k in host_cost.KINDS))
    assert host_cost.kind_of(1, "tf_XLAEigen", set(), "python") == "xla"
    assert host_cost.kind_of(2, "python", set(), "python") == "xla"  # unnamed native: XLA's execution threads
    assert host_cost.kind_of(2, "python", {2}, "python") == "python"
    assert host_cost.kind_of(3, "grpc_global_tim", set(), "python") == "grpc"
    ms = host_cost.per_request({"python": 1.0, "total": 1.0}, {"python": 1.5, "xla": 0.5, "total": 2.0}, 100)
    assert ms["python"] == pytest.approx(5.0) and ms["total"] == pytest.approx(10.0)


def test_host_cost_of_a_served_process(tmp_path) -> None:
    """--serve-process: `prefixscore serve` in its own process; host (W4's shape over gRPC) and
    host-rerank (HTTP /v1/rerank) report requests/s and the server's CPU per request by kind."""
    out = tmp_path / "host.json"
    argv = ["bench", "--serve-process", "--model", "tiny-qwen3", "--workload", "host,host-rerank"]
    # 64 requests: enough Python CPU to span several of the OS's 10 ms accounting ticks
    argv += ["--host-requests", "64", "--w4-concurrency", "4", "--w4-query-tokens", "16", "--w4-items", "2"]
    argv += ["--w4-item-tokens", "4", "--rerank-docs", "2", "--no-progress", "--json", str(out)]
    argv += ["--serve-arg=--warmup=false", "--serve-arg=--max-batch-tokens=256", "--serve-arg=--max-prefill-tokens=256"]
    args = parse(argv)
    assert args.func(args) == 0
    records = {r["workload"]: r for r in json.loads(out.read_text())}
    assert set(records) == {"host", "host-rerank"}
    for r in records.values():
        cpu = r["host_cpu_ms_per_request"]
        assert r["requests"] == 64 and r["requests_per_s"] > 0 and cpu["python"] > 0
        assert cpu["total"] == pytest.approx(sum(cpu[k] for k in host_cost.KINDS))
    assert records["host-rerank"]["items"] == 128 and records["host-rerank"]["transport"].startswith("http")


def test_another_processes_python_threads_are_told_apart_from_native_ones(tmp_path) -> None:
    """--target-pid: py-spy names the interpreter's threads of a running process; the rest of
    its threads are native (XLA's, gRPC's)."""
    tools.py_spy()  # an absent py-spy fails in CI; one the sandbox forbids to attach is skipped below
    ready = tmp_path / "tids"
    code = (
        "import threading, time, pathlib\n"
        "t = threading.Thread(target=time.sleep, args=(60,), daemon=True); t.start()\n"
        f"pathlib.Path({str(ready)!r}).write_text(f'{{threading.main_thread().native_id}} {{t.native_id}}')\n"
        "time.sleep(60)\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", code])
    try:
        deadline = time.monotonic() + 30
        while not ready.exists() or not ready.read_text():
            assert time.monotonic() < deadline and proc.poll() is None
            time.sleep(0.05)
        want = {int(t) for t in ready.read_text().split()}
        try:
            got = host_cost.interpreter_thread_ids(proc.pid)
        except RuntimeError as err:
            # skipped only where py-spy itself refuses to attach (a sandbox that forbids reading
            # another process's memory); any other failure is the code's, and fails in CI
            if not PY_SPY_REFUSED.search(str(err)) and os.environ.get("CI") == "true":
                raise
            pytest.skip(f"py-spy cannot attach here: {err}")
        assert got == want
        seconds = host_cost.seconds_by_kind(proc.pid, got)
        assert seconds is not None and seconds["total"] >= seconds["python"] >= 0
    finally:
        proc.kill()
        proc.wait()


# how far llama.cpp's 8-bit activations move a choice's log-likelihood from transformers' float32
# (0.82 nats at most over W7's 96 choices, docs/benchmarks.md); a choice read one position off
# moves by several nats
LLAMACPP_DRIFT = 1.0


def test_w7_llamacpp_prefix_recipe_scores_like_hf(tmp_path) -> None:
    """W7's llama.cpp baseline (llama-cpp-python over SmolLM2's GGUF, `make setup-llamacpp`; it
    builds from source, so CI does not install it): each choice's log-likelihood from the logits
    of its own tokens after the longest cached prefix is lm-eval's `hf` backend's on the same
    weights, up to llama.cpp's 8-bit activations (Q4_1 x Q8_1 dot products)."""
    pytest.importorskip("llama_cpp", reason="llama-cpp-python builds from source: make setup-llamacpp")
    out = tmp_path / "w7.json"
    sizes = ["--w7-header", "64", "--w7-questions", "3", "--w7-min-question", "8", "--w7-max-question", "12"]
    args = parse(
        ["bench", "--model", "smollm2-135m", "--workload", "w7", "--w7-modes", "hf,llamacpp", "--no-progress", *sizes]
    )
    args.json_path = str(out)
    assert args.func(args) == 0
    by = {r["mode"]: r for r in json.loads(out.read_text())}
    assert set(by) == {"hf", "llamacpp"} and by["llamacpp"]["choices"] == 12
    assert "prefill_tokens" not in by["llamacpp"]  # a baseline: no engine counts
    assert by["llamacpp"]["max_abs_diff_vs_hf"] < LLAMACPP_DRIFT, by["llamacpp"]


def test_w7_through_completions_and_grpc(tmp_path, capsys) -> None:
    """W7 at its smallest on tiny-qwen3 (no transformers checkpoint: no hf baseline): lm-eval's
    batches of whole prompts through /v1/completions and each question's choices over its context
    through gRPC give the same log-likelihoods; the completions requests prefill the header, each
    question and each choice once (and a prompt's row before its own tokens), gRPC each question's
    context but its last token and the header it takes from the first question's."""
    out = tmp_path / "w7.json"
    sizes = ["--w7-header", "140", "--w7-questions", "3", "--w7-min-question", "6", "--w7-max-question", "12"]
    args = parse(["bench", "--model", "tiny-qwen3", "--workload", "w7", "--w7-batch", "8", "--no-progress", *sizes])
    args.json_path = str(out)
    assert args.func(args) == 0
    by = {r["mode"]: r for r in json.loads(out.read_text())}
    assert set(by) == {"completions", "grpc"} and all(r["choices"] == 12 for r in by.values())
    assert by["completions"]["max_abs_diff_vs_grpc"] < 1e-4 and by["completions"]["greedy_differs_vs_grpc"] == 0
    # completions: every position from a prompt's own prefill, each once (the tokens requested),
    # and each prompt's row before its first own position again (its token's log-prob is its own)
    prefilled = by["completions"]["prefill_tokens"]
    assert by["completions"]["item_tokens"] == 0
    assert by["completions"]["requested_tokens"] < prefilled <= by["completions"]["requested_tokens"] + 12, prefilled
    # gRPC: each question's context but its last token, the later two taking the 140-token
    # header from the first (its first 128-token page borrowed, the other 12 tokens copied)
    assert by["grpc"]["prefill_tokens"] == by["grpc"]["context_tokens"] - 3 - 2 * 140
    assert 0 < by["completions"]["head_flop_share"] < 1
    # the tokens needed, each once (prefixscore_requested_tokens_total): completions the header,
    # each question and each choice (the second batch reads its question's rows from the positions
    # the first kept); gRPC each question's context past the header it takes from the first's, and
    # each choice: the same tokens
    r = by["completions"]
    choice_tokens = r["prompt_tokens"] - 4 * r["context_tokens"]
    question_tokens = r["context_tokens"] - 3 * r["header_tokens"]
    assert r["requested_tokens"] == r["header_tokens"] + question_tokens + choice_tokens
    assert by["grpc"]["requested_tokens"] == r["context_tokens"] - 2 * r["header_tokens"] + choice_tokens
    assert all(x["computed_tokens"] >= x["requested_tokens"] for x in by.values())


def test_w8_embeddings_against_sentence_transformers(tmp_path) -> None:
    """W8 at its smallest, in tiny-qwen3's shapes (a sentence-transformers checkpoint it writes):
    every engine mode gives sentence-transformers' embeddings; with the instruction as the prompt
    it is prefilled once (but its last token, which may merge into a query's first), and without
    it (whole) every query computes it again. Each engine mode runs sequentially and with 2 clients
    at once (sentence-transformers once), with the same embeddings and token counts."""
    out = tmp_path / "w8.json"
    sizes = ["--w8-passages", "6", "--w8-queries", "5", "--w8-batch", "4", "--w8-clients", "1,2"]
    args = parse(["bench", "--model", "tiny-qwen3", "--workload", "w8", "--no-progress", *sizes])
    args.json_path = str(out)
    assert args.func(args) == 0
    records = json.loads(out.read_text())
    assert {(r["mode"], r["clients"]) for r in records} == {("st", 1)} | {
        (mode, clients) for mode in ("http", "grpc", "inprocess", "whole") for clients in (1, 2)
    }
    assert all(r["inputs"] == 11 and r["max_abs_diff_vs_st"] < 1e-5 for r in records), records
    by = {r["mode"]: r for r in records if r["clients"] == 1}
    # warmed up on the timed texts, one client's calls take no shape they did not compile
    assert all(by[mode]["compilations_while_timed"] == 0 for mode in ("http", "grpc", "inprocess", "whole")), by
    for r in records:  # 2 clients: the same work as one
        keys = ("prefill_tokens", "tokens", "requested_tokens")
        assert {k: r.get(k) for k in keys} == {k: by[r["mode"]].get(k) for k in keys}, r
    instruction = by["st"]["instruction_tokens"]
    for mode in ("http", "grpc", "inprocess"):  # the instruction but its last token, once for both query batches
        assert by[mode]["prefill_tokens"] == instruction - 1, by[mode]
    assert by["whole"]["prefill_tokens"] == 0
    shared = by["http"]["prefill_tokens"]
    # whole: each of the 5 queries computes the shared run itself; with the prompt it was computed once
    assert by["whole"]["tokens"] - by["http"]["tokens"] == 5 * shared - shared
    # the tokens needed, each once: every passage and query whole, the prompt's shared run once
    # (whole: once per query)
    inputs = by["st"]["passage_tokens"] + by["st"]["query_tokens"]
    for mode in ("http", "grpc", "inprocess"):
        assert by[mode]["requested_tokens"] == inputs - 4 * shared, by[mode]
    assert by["whole"]["requested_tokens"] == inputs
