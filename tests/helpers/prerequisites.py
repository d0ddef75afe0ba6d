"""What to do when a test's external tool, package or file is absent: skip on a developer's
machine, fail in CI (CI=true), so nothing CI is meant to check silently does not run.

Skips for a reason that holds on CI too (no accelerator, another OS) are not absences: they stay
plain pytest skips.
"""

from __future__ import annotations

import os
from typing import NoReturn

import pytest


def in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() in ("true", "1", "yes")


def missing(what: str, install: str) -> NoReturn:
    """`what` is not available; `install` says how to get it. Skips locally, fails in CI."""
    message = f"{what} is not available ({install})"
    if in_ci():
        pytest.fail(message)
    pytest.skip(message)
