"""The layout is the architecture: imports only point down (cli > bench, offline > service >
engine > model > kernels, and inside engine/ its rooms; telemetry and the client apart; the
leaf modules import nothing of the project), the device loop imports no request kind, and the
two transports never import each other. The contracts live in
pyproject.toml and `lint-imports` (import-linter) checks them; `make lint` runs it. These tests
run it on the tree, and on copies of the tree with one upward import planted, to show each
contract can fail."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
LINT_IMPORTS = Path(sys.executable).with_name("lint-imports")
# the product's folders and top-level modules (the package `prefixscore` is the repo root)
PACKAGES = ("bench", "client", "engine", "kernels", "model", "offline", "service", "telemetry")


def _lint_imports(root: Path, package_parent: Path | None = None) -> subprocess.CompletedProcess:
    """lint-imports over pyproject.toml's contracts, with `prefixscore` found under `package_parent`."""
    env = dict(os.environ)
    if package_parent is not None:  # ahead of the editable install's finder
        env["PYTHONPATH"] = str(package_parent)
    return subprocess.run(
        [str(LINT_IMPORTS), "--no-cache", str(root / "pyproject.toml")],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_the_tree_keeps_every_import_contract() -> None:
    run = _lint_imports(ROOT)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "0 broken" in run.stdout


@pytest.fixture(scope="module")
def tree_copy(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The package's Python files copied to <tmp>/prefixscore (no tests, no deploy, no venv)."""
    parent = tmp_path_factory.mktemp("layout")
    package = parent / "prefixscore"
    package.mkdir()
    for path in ROOT.glob("*.py"):
        shutil.copy(path, package / path.name)
    for name in PACKAGES:
        shutil.copytree(ROOT / name, package / name, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", parent / "pyproject.toml")
    return parent


# (the module an upward import is planted in, the import, the contract it breaks)
PLANTED = [
    ("model/planted.py", "from prefixscore.service import core", "cli > bench, offline > service"),
    ("kernels/planted.py", "from prefixscore.model import config", "cli > bench, offline > service"),
    ("engine/planted.py", "from prefixscore.offline import batch", "cli > bench, offline > service"),
    ("client/planted.py", "from prefixscore.service import core", "the client needs only"),
    ("telemetry/planted.py", "from prefixscore.engine.loop import batcher", "telemetry imports no other part"),
    ("engine/loop/planted.py", "from prefixscore.engine.requests import answers", "the device loop imports no"),
    ("engine/runtime/planted.py", "from prefixscore.engine.loop import work_unit", "engine rooms: scorer > build"),
    ("prefix_key_planted.py", None, "the leaf modules import nothing"),
    ("service/planted.py", None, "the two transports never import each other: HTTP imports no gRPC"),
    ("service/planted_grpc.py", None, "the two transports never import each other: gRPC imports no HTTP"),
]


@pytest.mark.parametrize(("where", "line", "contract"), PLANTED, ids=[p[0] for p in PLANTED])
def test_a_planted_upward_import_breaks_its_contract(tree_copy: Path, where: str, line: str | None, contract: str):
    package = tree_copy / "prefixscore"
    if where == "prefix_key_planted.py":  # the leaf itself gains an import
        target = package / "prefix_key.py"
        original = target.read_text()
        target.write_text(original + "\nfrom prefixscore.engine.runtime import buckets  # noqa\n")
    elif where == "service/planted.py":  # an HTTP module gains an import of the gRPC wire mapping
        target = package / "service" / "http_bodies.py"
        original = target.read_text()
        target.write_text(original + "\nfrom prefixscore.service import wire  # noqa\n")
    elif where == "service/planted_grpc.py":  # the gRPC server gains an import of the HTTP schemas
        target = package / "service" / "server.py"
        original = target.read_text()
        target.write_text(original + "\nfrom prefixscore.service import http_schemas  # noqa\n")
    else:
        target, original = package / where, None
        target.write_text(line + "\n")
    try:
        run = _lint_imports(tree_copy, tree_copy)
    finally:
        if original is None:
            target.unlink()
        else:
            target.write_text(original)
    assert run.returncode != 0, run.stdout
    broken = [line for line in run.stdout.splitlines() if line.endswith("BROKEN")]
    # a leaf that imports upward also breaks the client's contract (the client imports the leaf)
    assert any(name.startswith(contract) for name in broken), run.stdout


def _cycles(package_parent: Path | None = None) -> list[list[str]]:
    """Groups of the package's modules that import each other in a circle (any import: at the
    top, in a function, or only under TYPE_CHECKING), found on grimp's graph (import-linter's)."""
    code = (
        "import grimp, json\n"
        "g = grimp.build_graph('prefixscore', include_external_packages=False)\n"
        "edges = {m: g.find_modules_directly_imported_by(m) for m in g.modules}\n"
        # a module in a circle reaches itself; the circle is what it reaches that reaches it back
        "def reach(m):\n"
        "    seen, todo = set(), list(edges[m])\n"
        "    while todo:\n"
        "        n = todo.pop()\n"
        "        if n not in seen:\n"
        "            seen.add(n)\n"
        "            todo.extend(edges[n])\n"
        "    return seen\n"
        "reached = {m: reach(m) for m in edges}\n"
        "circles = {tuple(sorted(n for n in reached[m] if m in reached[n])) for m in edges if m in reached[m]}\n"
        "print(json.dumps(sorted(map(list, circles))))\n"
    )
    env = dict(os.environ)
    if package_parent is not None:
        env["PYTHONPATH"] = str(package_parent)
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    return json.loads(run.stdout)


def test_no_module_imports_itself_through_others(tree_copy: Path) -> None:
    """No import circle, type-only ones included; one planted (model/config.py importing the
    weights, which import it) is found."""
    assert _cycles() == []
    target = tree_copy / "prefixscore" / "model" / "config.py"
    original = target.read_text()
    target.write_text(original + "\nif False:\n    from prefixscore.model import weights  # noqa\n")
    try:
        planted = _cycles(tree_copy)
    finally:
        target.write_text(original)
    assert any("prefixscore.model.config" in c and "prefixscore.model.weights" in c for c in planted), planted


# what a request kind is made of: its modules' names and the flags a kind was once carried as
KIND_WORDS = (
    "per_token", "raw_logits", "apply_softmax", "top_logprobs", "PoolRows", "payload.pool",
    "payload.activation", "OUTPUT_HIDDEN", "OUTPUT_TOKEN", "LabelScores", "TokenLogprobs", "Pooled",
    "ScoreKind", "RerankKind", "ClassifyKind", "LikelihoodKind", "EmbedKind", "CompletionsKind",
)  # fmt: skip
# the loop's files: they see only what a kind declares as data (engine/loop/request.py's Answer)
LOOP_FILES = (*sorted((ROOT / "engine" / "loop").glob("*.py")), ROOT / "engine" / "runtime" / "planner.py")


def kind_words(paths) -> list[str]:
    return [f"{p.name}: {w}" for p in paths for w in KIND_WORDS if w in p.read_text()]


def test_the_loop_names_no_kind_and_no_kind_flag(tmp_path: Path) -> None:
    assert len(LOOP_FILES) > 5 and kind_words(LOOP_FILES) == []
    planted = tmp_path / "batcher.py"
    planted.write_text((ROOT / "engine" / "loop" / "batcher.py").read_text() + "\n# if unit.payload.pool:\n")
    assert kind_words([planted]) == ["batcher.py: payload.pool"]
