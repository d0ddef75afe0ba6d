"""`prefixscore bench --workload soak`: a short real soak against a server in this process, and
the trend judgement on synthetic series (it passes noise and fails growth)."""

from __future__ import annotations

import json

import numpy as np
import pytest
from helpers.bench import parse

from prefixscore.bench import command as bench
from prefixscore.bench import soak

# W2 as small as it goes: the 2 cores of CI keep up with 4 clients and the windows fill with requests
SOAK = [
    "bench",
    "--model",
    "tiny-qwen3",
    "--workload",
    "soak",
    "--duration",
    "20s",
    "--window",
    "5s",
    "--concurrency",
    "4",
    "--w2-max-query",
    "64",
    "--w2-max-items",
    "8",
    "--w2-max-item-tokens",
    "8",
    "--no-progress",
]
WINDOW_FIELDS = {
    "window",
    "end_s",
    "rss_mib",
    "pinned",
    "pool_pages_used",
    "queue_depth",
    "open_streams",
    "inflight",
    "requests",
    "latency_p50_ms",
    "latency_p99_ms",
    "codes",
    "unexpected",
    "server_codes",
}


def test_a_short_soak_passes_and_reports_every_window(tmp_path, capsys, caplog) -> None:
    out = tmp_path / "soak.json"
    args = parse([*SOAK, "--json", str(out)])
    rc = args.func(args)
    printed = capsys.readouterr().out
    (record,) = json.loads(out.read_text())
    assert rc == 0, printed
    assert record["passed"] and not record["failures"] and not record["unsettled"]
    windows = record["windows"]
    assert [w["window"] for w in windows] == list(range(1, 5))  # one warm-up window, the three a trend needs
    for w in windows:
        assert WINDOW_FIELDS <= set(w), w
        assert w["rss_mib"] > 0 and not w["unexpected"]
        assert not any(w["server_codes"].get(code) for code in soak.SERVER_FAILURES)
    # past the warm-up, every window answered requests. The warm-up window compiles the call
    # shapes: on CI's loaded runner (2.5x slower that run) it answered none in its 5 s
    assert all(w["requests"] > 0 for w in windows[soak.WARMUP_WINDOWS :]), windows
    codes = {code for w in windows for code in w["codes"]}
    # every kind of outcome the mix makes happened: answers, cancels, expired deadlines, bad inputs refused
    assert {"OK", "CANCELLED", "DEADLINE_EXCEEDED", "INVALID_ARGUMENT"} <= codes
    assert {t["metric"] for t in record["trends"]} == set(soak.TOLERANCES)
    assert "verdict: PASS" in printed and soak.HEAD in printed
    # the mix cancels streams while their queries are pinned: no result reaches a cancelled wait
    assert not [r for r in caplog.records if "callback failed" in r.getMessage()]


def _windows(series: dict[str, list[float]]) -> list[dict]:
    n = len(next(iter(series.values())))
    return [
        {"window": k + 1, "requests": 10, "unexpected": {}, "server_codes": {}, **{m: v[k] for m, v in series.items()}}
        for k in range(n)
    ]


def test_the_trend_judgement_passes_noise_and_fails_growth() -> None:
    rng = np.random.default_rng(0)
    n = 30
    flat = {
        "rss_mib": (900 + rng.normal(0, 5, n)).tolist(),
        "pinned": rng.integers(0, 5, n).astype(float).tolist(),
        "latency_p99_ms": (80 + rng.exponential(20, n)).tolist(),
    }
    trends = soak.judge(_windows(flat))
    assert [t.metric for t in trends] == ["rss_mib", "pinned", "latency_p99_ms"]  # no samples: not judged
    assert all(t.passed for t in trends), trends
    assert soak.verdict(_windows(flat), trends, {}) == []

    # 2 MiB a window: 56 MiB over the judged run, past 16 MiB + 2% of ~930 MiB + 3 sigma of 0.5 MiB noise
    leaking = {"rss_mib": (900 + 2 * np.arange(n) + rng.normal(0, 0.5, n)).tolist()}
    (rss,) = soak.judge(_windows(leaking))
    assert not rss.passed and rss.slope == pytest.approx(2.0, abs=0.05)
    assert "rss_mib grows" in soak.verdict(_windows(leaking), [rss], {})[0]
    # one pinned prefix more every other window: a leak of pins, not noise
    pins = {"pinned": [2.0 + k // 2 for k in range(n)]}
    assert not soak.judge(_windows(pins))[0].passed


def test_the_verdict_fails_unexpected_codes_stalls_short_runs_and_an_unsettled_end() -> None:
    windows = _windows({"rss_mib": [900.0] * 5})
    windows[2]["unexpected"] = {"unary INTERNAL": 1}
    windows[3]["requests"] = 0
    windows[4]["server_codes"] = {"UNKNOWN": 2}
    failures = soak.verdict(windows, soak.judge(windows), {"prefixscore_prefix_cache_pinned": 1.0})
    assert len(failures) == 4, failures
    assert "1 x unary INTERNAL" in failures[0] and "2 x UNKNOWN" in failures[1]
    assert "stall" in failures[2] and "not back to zero" in failures[3]
    short = _windows({"rss_mib": [900.0] * 3})
    assert "a trend needs 3" in soak.verdict(short, soak.judge(short), {})[0]


def test_soak_arguments() -> None:
    args = parse(["bench", "--workload", "soak", "--duration", "1h", "--window", "90s"])
    assert (args.workload, args.duration, args.window) == (["soak"], 3600.0, 90.0)
    assert parse(["bench", "--workload", "soak", "--duration", "2.5m"]).duration == 150.0
    assert "soak" not in parse(["bench", "--workload", "all"]).workload  # it runs alone, for its duration
    with pytest.raises(SystemExit):
        parse(["bench", "--duration", "soon"])
    with pytest.raises(SystemExit):
        bench.run(parse(["bench", "--workload", "w2,soak"]))
