"""The public API: committed stubs match the .proto, buf lint is clean, the public names (docs/design.md) exist."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from helpers import tools

ROOT = Path(__file__).resolve().parents[1]
PROTO_DIR = ROOT / "protos"
PACKAGE_DIR = PROTO_DIR / "prefixscore" / "v1"

# lines that carry the generator's version, not the API: compared without the numbers
VERSION_PATTERNS = [
    (re.compile(r"Protobuf Python Version: [\d.]+"), "Protobuf Python Version: X"),
    (re.compile(r"(_runtime_version\.Domain\.PUBLIC,\s*)\d+,\s*\d+,\s*\d+,"), r"\1X,"),
    (re.compile(r"GRPC_GENERATED_VERSION = '[\d.]+'"), "GRPC_GENERATED_VERSION = 'X'"),
]


def _normalise(text: str) -> str:
    for pattern, repl in VERSION_PATTERNS:
        text = pattern.sub(repl, text)
    return text


def test_committed_stubs_match_the_proto(tmp_path):
    protos = sorted(p.relative_to(PROTO_DIR).as_posix() for p in PACKAGE_DIR.glob("*.proto"))
    assert protos, "no .proto files"
    cmd = [
        sys.executable,
        "-m",
        "grpc_tools.protoc",
        f"-I{PROTO_DIR}",
        f"--python_out={tmp_path}",
        f"--pyi_out={tmp_path}",
        f"--grpc_python_out={tmp_path}",
        *protos,
    ]
    subprocess.run(cmd, check=True, cwd=ROOT)
    generated = sorted((tmp_path / "prefixscore" / "v1").glob("*_pb2*.py*"))
    assert len(generated) == 3 * len(protos)
    for fresh in generated:
        committed = PACKAGE_DIR / fresh.name
        assert committed.is_file(), f"{committed} is not committed; regenerate (see .ci/proto-tools.sh)"
        assert _normalise(committed.read_text()) == _normalise(fresh.read_text()), (
            f"{committed.name} is stale: python -m grpc_tools.protoc -Iprotos --python_out=protos "
            "--pyi_out=protos --grpc_python_out=protos protos/prefixscore/v1/*.proto"
        )


def test_buf_lint_is_clean():
    buf = tools.buf()
    result = subprocess.run([buf, "lint"], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
    listed = subprocess.run([buf, "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    assert "prefixscore/v1/score_service.proto" in listed  # the lint really looked at our file


def test_public_names():
    from prefixscore.v1 import score_service_pb2 as pb

    service = pb.DESCRIPTOR.services_by_name["ScoreService"]
    assert service.full_name == "prefixscore.v1.ScoreService"
    methods = {m.name: (m.client_streaming, m.server_streaming) for m in service.methods}
    assert methods == {
        "Score": (False, False),
        "ScoreStream": (True, True),
        "GetModelInfo": (False, False),
        "Rerank": (False, False),
        "Embed": (False, False),
        "EmbedStream": (True, True),
        "Run": (False, False),
    }
    request = pb.ScoreRequest.DESCRIPTOR.fields_by_name
    assert set(request) >= {"query", "items", "label_token_ids", "labels", "apply_softmax", "item_first"}
    assert set(pb.Usage.DESCRIPTOR.fields_by_name) >= {"prompt_tokens", "cached_tokens", "items"}
    assert set(pb.RerankRequest.DESCRIPTOR.fields_by_name) >= {"query", "documents", "top_n", "return_documents"}
