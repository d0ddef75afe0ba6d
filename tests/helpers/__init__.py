"""Code the test modules share: fixtures' building blocks, external tools, deliberately broken
implementations. No tests live here (pytest collects tests/test_*.py); test modules import these
modules, never each other."""
