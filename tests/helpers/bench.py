"""`prefixscore bench`'s command line as the CLI parses it, for tests that run the bench in process."""

from __future__ import annotations

import argparse

from prefixscore.bench import command as bench


def parse(argv: list[str]) -> argparse.Namespace:
    """`argv` (starting with "bench") parsed by the bench's own subcommand parser."""
    parser = argparse.ArgumentParser(prog="prefixscore")
    bench.register(parser.add_subparsers(dest="command"))
    return parser.parse_args(argv)
