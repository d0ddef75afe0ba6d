"""`prefixscore serve` as a real subprocess: start-up logs, `score` and `models` against it,
and a graceful SIGTERM drain (health NOT_SERVING, new RPCs refused, the open stream finishes, exit 0)."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.request

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from helpers.service import LABELS, SERVE, ServerLog, scrape, serve_process, wait_for

from prefixscore import cli
from prefixscore.client import ScoreClient
from prefixscore.service.server import SERVICE

QUERY = "Is this sentence about rivers?"
ITEMS = ["The Seine flows through Paris.", "Cats sleep a lot."]


@dataclasses.dataclass
class Served:
    proc: subprocess.Popen
    events: ServerLog
    target: str = ""
    metrics_port: int = 0
    http_port: int = 0

    def event(self, name: str) -> dict | None:
        return next((e for e in list(self.events) if e.get("event") == name), None)


@pytest.fixture(scope="module")
def served():
    proc, events = serve_process(SERVE)
    served = Served(proc, events)
    try:
        listening = wait_for(lambda: served.event("listening") or proc.poll() is not None, 120, "listening")
        assert proc.poll() is None, f"serve exited: {served.events}"
        served.target = f"127.0.0.1:{listening['port']}"
        served.metrics_port = listening["metrics_port"]
        served.http_port = listening["http_port"]
        wait_for(lambda: served.event("ready") or proc.poll() is not None, 300, "ready")
        assert proc.poll() is None, f"serve exited: {served.events}"
        yield served
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)


def test_startup_logs_say_what_the_server_is(served):
    loaded = served.event("model_loaded")
    assert loaded["model"] == "tiny-qwen3" and loaded["dtype"] == "float32" and loaded["devices"] == ["cpu:0"]
    assert loaded["buckets"]["max_prefill_tokens"] == 256 and loaded["buckets"]["max_batch_tokens"] == 256
    assert loaded["pool_pages"] > 0 and loaded["pool_bytes"] > 0
    warmed = served.event("warmed_up")
    assert {"compilations", "compile_seconds", "seconds"} <= set(warmed)


def test_score_command_table_and_json(served, tiny_scorer, capsys):
    args = [
        "score",
        "--target",
        served.target,
        "-q",
        QUERY,
        "-i",
        ITEMS[0],
        "-i",
        ITEMS[1],
        "--label-ids",
        *map(str, LABELS),
    ]
    assert cli.main(args) == 0
    table = capsys.readouterr().out.splitlines()
    assert table[0].split() == ["item", *map(str, LABELS)] and table[1].startswith("The Seine")
    assert table[-1].startswith("usage: prompt_tokens=")
    assert cli.main([*args, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    np.testing.assert_allclose(out["scores"], tiny_scorer.score(QUERY, ITEMS, LABELS), rtol=1e-5)
    assert out["usage"]["items"] == 2 and out["label_token_ids"] == LABELS


def test_score_command_reads_jsonl(served, tmp_path, capsys):
    path = tmp_path / "requests.jsonl"
    lines = [{"query": QUERY, "items": ITEMS}, {"query": [5, 6, 7], "items": [[8, 9], [10]], "apply_softmax": True}]
    path.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    assert (
        cli.main(["score", "--target", served.target, "--jsonl", str(path), "--label-ids", "28", "1017", "--json"]) == 0
    )
    results = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [len(r["scores"]) for r in results] == [2, 2]
    assert all(abs(sum(row) - 1) < 1e-5 for row in results[1]["scores"])  # softmax over the labels


def test_score_command_reports_bad_input(served, capsys):
    assert cli.main(["score", "--target", served.target, "-q", QUERY, "-i", "x", "--label-ids", "99999999"]) == 1
    assert "INVALID_ARGUMENT: label_token_ids" in capsys.readouterr().err


def test_models_command(served, capsys):
    assert cli.main(["models"]) == 0
    assert "tiny-qwen3" in capsys.readouterr().out
    assert cli.main(["models", "--target", served.target]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["model"] == "tiny-qwen3" and info["limits"]["max_item_tokens"] == 8192  # the context


def test_http_port_and_template_flags(served, capsys):
    """`serve --http-port --template` from the command line: the HTTP API answers beside gRPC,
    with the template asked for, and the `rerank` command ranks through it."""
    base = f"http://127.0.0.1:{served.http_port}"
    with urllib.request.urlopen(f"{base}/ready") as ready:
        assert ready.status == 200
    with urllib.request.urlopen(f"{base}/v1/models") as models:
        assert "none" in json.dumps(json.loads(models.read()))
    with ScoreClient(served.target) as client:
        assert client.model_info().template == "none"
    docs = ["-d", "The Seine flows through Paris.", "-d", "Cats sleep a lot."]
    assert cli.main(["rerank", "--target", served.target, "-q", QUERY, *docs, "--json"]) == 0
    results = json.loads(capsys.readouterr().out)["results"]
    assert sorted(r["index"] for r in results) == [0, 1]
    assert results[0]["relevance_score"] >= results[1]["relevance_score"]


def test_console_script_is_installed():
    script = shutil.which("prefixscore", path=os.path.dirname(sys.executable))
    assert script, "the `prefixscore` entry point is not installed (pip install -e .)"
    out = subprocess.run([script, "models"], capture_output=True, text=True, timeout=120, check=True).stdout
    assert "smollm2-135m" in out


def test_serve_flags_default_from_the_environment(monkeypatch):
    for name, value in dict(
        MODEL="bench-cpu",
        DTYPE="bfloat16",
        HOST="127.0.0.2",
        PORT="6000",
        METRICS_PORT="off",
        MAX_QUEUE_ITEMS="99",
        WARMUP="0",
    ).items():
        monkeypatch.setenv(f"PREFIXSCORE_{name}", value)
    args = cli.build_parser().parse_args(["serve"])
    assert (args.model, args.dtype, args.host, args.port, args.metrics_port) == (
        "bench-cpu",
        "bfloat16",
        "127.0.0.2",
        6000,
        None,
    )
    assert args.max_queue_items == 99 and args.warmup is False
    for name in ("MODEL", "PORT", "METRICS_PORT", "HOST", "DTYPE"):
        monkeypatch.delenv(f"PREFIXSCORE_{name}")
    args = cli.build_parser().parse_args(["serve"])
    assert (args.model, args.host, args.port, args.metrics_port) == ("smollm2-135m", "0.0.0.0", 50051, 9090)


def test_sigterm_drains_then_exits(served, tiny_scorer):
    """Runs last in this module: it stops the shared server."""
    channel = grpc.insecure_channel(served.target)
    health = health_pb2_grpc.HealthStub(channel)
    status = lambda: health.Check(health_pb2.HealthCheckRequest(service=SERVICE), timeout=10).status  # noqa: E731
    assert status() == health_pb2.HealthCheckResponse.SERVING
    with ScoreClient(served.target) as client:
        session = client.stream(QUERY, LABELS)
        first = session.send(ITEMS[:1])
        assert scrape(served.metrics_port)["prefixscore_open_streams"] == 1

        served.proc.send_signal(signal.SIGTERM)
        wait_for(lambda: status() == health_pb2.HealthCheckResponse.NOT_SERVING, 30, "NOT_SERVING after SIGTERM")
        with pytest.raises(grpc.RpcError) as refused:
            client.score(QUERY, ITEMS, LABELS, timeout=30)
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE

        second = session.send(ITEMS[1:])  # the open stream is still served while draining
        usage = session.close()
    np.testing.assert_allclose(first + second, tiny_scorer.score(QUERY, ITEMS, LABELS), rtol=1e-5)
    assert usage.items == 2
    assert served.proc.wait(60) == 0
    channel.close()
    names = [e.get("event") for e in served.events.complete()]
    assert names.index("draining") < names.index("stopped")


def test_serve_exits_nonzero_when_the_model_cannot_load(tmp_path):
    missing = tmp_path / "missing.gguf"
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "prefixscore.cli",
            "serve",
            "--model",
            str(missing),
            "--host",
            "127.0.0.1",
            "--port",
            "0",
            "--metrics-port",
            "off",
            "--log-format",
            "json",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "JAX_PLATFORMS": "cpu"},
    )
    assert result.returncode == 1
    failed = [json.loads(line) for line in result.stderr.splitlines() if '"startup_failed"' in line]
    assert failed and "does not exist" in failed[0]["error"]


def test_sigterm_during_a_background_compile_exits_within_two_seconds(tmp_path):
    """Served early, the rest of the shapes compiling in the background (bench-cpu has dozens):
    SIGTERM with nothing in flight drains at once, and the process must exit within 2 s of it,
    not when the compile in progress ends (the interpreter would join the compiling threads; a
    bench-cpu shape takes several seconds to compile). Beside the whole suite on 2 cores the
    exit took 1.0-1.3 s, so the README's bound is 2 s. Whether a compile is still running when the
    drain ends is the machine's timing (a small shape may finish within it): the process then says
    it abandoned the compile (`exiting`), or that the warm-up stopped before the exit
    (`warmup_stopped`); either way within the bound."""
    # a compile cache of its own: cached shapes would finish the warm-up before the signal
    env = {"PREFIXSCORE_COMPILE_CACHE_DIR": str(tmp_path / "compile-cache")}
    args = ["--model", "bench-cpu", "--host", "127.0.0.1", "--port", "0", "--metrics-port", "off"]
    proc, events = serve_process(args, env)
    try:
        seen = lambda name: any(e.get("event") == name for e in list(events))  # noqa: E731
        wait_for(lambda: seen("serving_early") or proc.poll() is not None, 300, "serving early")
        assert proc.poll() is None and not seen("warmed_up"), events
        signalled = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(30)
        took = time.monotonic() - signalled
        assert code == 0, events
        assert took < 2.0, f"exited {took:.1f} s after SIGTERM"
        wait_for(lambda: seen("exiting") or seen("warmup_stopped"), 5, "the exiting or warmup_stopped event")
        abandoned = [e.get("abandoned") for e in events if e.get("event") == "exiting"]
        assert abandoned in ([], ["background compile"]), events
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)


def test_serve_flags_are_server_config_fields_with_its_defaults(monkeypatch):
    """`serve` with no flags and no environment is ServerConfig() (service/config.py states each
    default once); each flagged field is set by its flag and by its environment variable."""
    from prefixscore import choices
    from prefixscore.model.config import DTYPES
    from prefixscore.model.quant_choice import ACTIVATION_CHOICES, QUANTIZE_CHOICES
    from prefixscore.service.config import ServerConfig, flag_fields

    assert choices.DTYPES == tuple(DTYPES)
    assert (choices.QUANTIZE, choices.ACTIVATIONS) == (QUANTIZE_CHOICES, ACTIVATION_CHOICES)
    for field, flag in flag_fields():
        monkeypatch.delenv(flag.env_name(field.name), raising=False)
    defaults = cli.config_from_args(cli.build_parser().parse_args(["serve"]))
    assert defaults == ServerConfig()
    # a value unlike the default for each flag, as the flag's text and the config's value
    samples = {int: ("7", 7), float: ("0.25", 0.25), str: ("x.gguf", "x.gguf")}
    for field, flag in flag_fields():
        if flag.choices:
            text = value = flag.choices[-1]
        elif flag.nargs:
            text, value = "yes", ("yes",)
        elif flag.parse in samples:
            text, value = samples[flag.parse]
        else:  # booleans and ports-or-off: the opposite of the default
            text = "off" if field.default not in (None, False) else ("1" if field.default is False else "8080")
            value = flag.parse(text)
        value = value * flag.scale if flag.scale != 1.0 else value
        by_flag = cli.config_from_args(cli.build_parser().parse_args(["serve", flag.flag_name(field.name), text]))
        monkeypatch.setenv(flag.env_name(field.name), text)
        by_env = cli.config_from_args(cli.build_parser().parse_args(["serve"]))
        monkeypatch.delenv(flag.env_name(field.name))
        assert getattr(by_flag, field.name) == getattr(by_env, field.name) == value != field.default, field.name
