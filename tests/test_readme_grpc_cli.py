"""The README's `buf curl` commands, run as written against a real server (tiny-qwen3 on loopback).

The commands are parsed from the README's fenced block that follows the line naming this file, so
the README and the test cannot drift; only `localhost:50051` is replaced by the test server's
address. The grpcurl block above it must send the same request bodies to the same methods, which is
checked without a server (tests/test_security.py runs a real grpcurl over mutual TLS with a token).
"""

from __future__ import annotations

import json
import shlex
import subprocess
from pathlib import Path

import numpy as np
import pytest
from google.protobuf import json_format
from helpers import tools
from helpers.service import server_config

from prefixscore.client import ScoreClient
from prefixscore.service.process import ServerThread
from prefixscore.service.server import SERVICE
from prefixscore.v1 import score_service_pb2 as pb

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
BUF_MARKER = "tests/test_readme_grpc_cli.py"  # the README line introducing the `buf curl` block
GRPCURL_MARKER = "Score with grpcurl"
README_TARGET = "localhost:50051"
HEALTH = "grpc.health.v1.Health"
TIMEOUT_S = 60


def fenced_block_after(text: str, marker: str) -> str:
    """The body of the first ``` fenced block after the first line containing `marker`."""
    lines = text.splitlines()
    start = next((i for i, line in enumerate(lines) if marker in line), None)
    assert start is not None, f"README.md has no line containing {marker!r}"
    fences = [i for i in range(start + 1, len(lines)) if lines[i].lstrip().startswith("```")]
    assert len(fences) >= 2, f"no fenced block after {marker!r} in README.md"
    return "\n".join(lines[fences[0] + 1 : fences[1]])


def shell_commands(block: str) -> list[list[str]]:
    """Split a bash block into argv lists, as bash would: a trailing backslash continues the command,
    and a newline inside quotes (the multi-line JSON body) is part of the word."""
    commands: list[list[str]] = []
    pending = ""
    for line in block.splitlines():
        pending += line + "\n"
        if line.endswith("\\"):
            continue
        try:
            argv = shlex.split(pending.replace("\\\n", " "), comments=True)
        except ValueError:  # a quote is still open: the command goes on
            continue
        if argv:
            commands.append(argv)
        pending = ""
    assert not pending.strip(), f"unterminated command in README.md: {pending!r}"
    return commands


def data(argv: list[str]) -> dict | None:
    """The JSON request body given with -d (None if there is none)."""
    for flag in ("-d", "--data"):
        if flag in argv:
            return json.loads(argv[argv.index(flag) + 1])
    return None


def readme_buf_commands() -> dict[str, list[str]]:
    """{"list", "health", "score"} -> argv of the README's `buf curl` commands."""
    commands = shell_commands(fenced_block_after(README.read_text(), BUF_MARKER))
    out: dict[str, list[str]] = {}
    for argv in commands:
        assert argv[:2] == ["buf", "curl"], f"not a buf curl command: {argv}"
        url = argv[-1]
        kind = (
            "list"
            if "--list-services" in argv
            else "health"
            if url.endswith(f"/{HEALTH}/Check")
            else "score"
            if url.endswith(f"/{SERVICE}/Score")
            else None
        )
        assert kind is not None and kind not in out, f"unexpected command in README.md: {argv}"
        assert any(README_TARGET in a for a in argv), f"{argv} does not name {README_TARGET}"
        out[kind] = argv
    assert set(out) == {"list", "health", "score"}, f"README.md buf curl block has {sorted(out)}"
    return out


def score_request(argv: list[str]) -> pb.ScoreRequest:
    """The Score command's body parsed as the proto's ScoreRequest (fails on a wrong field name)."""
    body = data(argv)
    assert body is not None, f"no -d body: {argv}"
    return json_format.ParseDict(body, pb.ScoreRequest())


# ---- no server needed: the blocks parse, agree with each other and with the .proto ---------------
def test_readme_grpcurl_and_buf_blocks_agree():
    buf = readme_buf_commands()
    grpcurl = shell_commands(fenced_block_after(README.read_text(), GRPCURL_MARKER))
    assert [argv[0] for argv in grpcurl] == ["grpcurl"] * 3
    by_method = {argv[-1]: argv for argv in grpcurl}
    assert "list" in by_method
    for kind, method in (("health", f"{HEALTH}/Check"), ("score", f"{SERVICE}/Score")):
        assert method in by_method, f"the grpcurl block does not call {method}"
        assert data(by_method[method]) == data(buf[kind]), f"grpcurl and buf curl send different {method} bodies"

    request = score_request(buf["score"])
    assert request.query.text and len(request.items) == 2 and all(it.text for it in request.items)
    assert list(request.labels) == [" yes", " no"] and request.apply_softmax


# ---- the commands against a real server ----------------------------------------------------------
@pytest.fixture(scope="module")
def buf_bin() -> str:
    return tools.buf()


@pytest.fixture(scope="module")
def server(buf_bin, tiny_scorer):
    with ServerThread(server_config(tiny_scorer, reflection=True)) as srv:  # as the README runs it
        yield srv


@pytest.fixture(scope="module")
def run_readme(buf_bin, server):
    commands = readme_buf_commands()

    def run(kind: str) -> str:
        argv = [buf_bin, *(a.replace(README_TARGET, server.target) for a in commands[kind][1:])]
        result = subprocess.run(argv, capture_output=True, text=True, timeout=TIMEOUT_S, cwd=ROOT)
        assert result.returncode == 0, f"{shlex.join(argv)} -> rc {result.returncode}\n{result.stderr}"
        return result.stdout

    return run


def test_list_services(run_readme):
    services = set(run_readme("list").split())
    assert {SERVICE, HEALTH} <= services, services


def test_health_check(run_readme):
    assert json.loads(run_readme("health")) == {"status": "SERVING"}


def test_score_equals_python_client(run_readme, server):
    response = json.loads(run_readme("score"))
    scores = np.array([item["probabilities"] for item in response["scores"]], dtype=np.float64)
    assert scores.shape == (2, 2), response
    np.testing.assert_allclose(scores.sum(axis=1), 1.0, atol=1e-5)  # apply_softmax: over the 2 labels
    assert int(response["usage"]["items"]) == 2

    request = score_request(readme_buf_commands()["score"])
    with ScoreClient(server.target) as client:
        expected = client.score(
            request.query.text,
            [it.text for it in request.items],
            labels=list(request.labels),
            apply_softmax=request.apply_softmax,
            timeout=TIMEOUT_S,
        )
    np.testing.assert_allclose(scores, np.array(expected.scores), rtol=0, atol=1e-5)
    assert response["labelTokenIds"] == expected.label_token_ids
