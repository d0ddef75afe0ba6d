"""The layout is the architecture: data flows down one way (service -> engine -> model ->
kernels, telemetry beside every layer), and the two transports never import each other."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# a folder -> the product folders its modules may import from (besides itself)
MAY_IMPORT = {
    "kernels": set(),
    "model": {"kernels"},
    "telemetry": set(),
    "engine": {"model", "kernels", "telemetry"},
    "service": {"engine", "model", "telemetry", "v1"},
    "client": {"v1"},
}
PRODUCT = {*MAY_IMPORT, "bench", "cli", "v1"}


def _imports(path: Path) -> set[str]:
    """The prefixscore modules a file imports (at any depth, lazy imports too)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("prefixscore"):
            out.add(node.module)
            out.update(f"{node.module}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names if alias.name.startswith("prefixscore"))
    return out


def test_each_layer_imports_only_the_layers_below_it() -> None:
    wrong = []
    for folder, allowed in MAY_IMPORT.items():
        for path in sorted((ROOT / folder).glob("*.py")):
            for module in _imports(path):
                target = module.split(".")[1] if "." in module else ""
                if target in PRODUCT and target != folder and target not in allowed:
                    wrong.append(f"{path.relative_to(ROOT)} imports {module}")
    assert not wrong, "\n".join(wrong)


def test_the_transports_do_not_import_each_other() -> None:
    grpc_side, http_side = ROOT / "service" / "server.py", ROOT / "service" / "http_api.py"
    assert not any(m.startswith("prefixscore.service.http_api") for m in _imports(grpc_side))
    assert not any(m.startswith("prefixscore.service.server") for m in _imports(http_side))
