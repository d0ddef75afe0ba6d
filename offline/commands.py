"""The `prefixscore batch` and `prefixscore eval` subcommands (registered by cli.py)."""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from prefixscore.model.presets import DEFAULT_MODEL


def register(sub: argparse._SubParsersAction) -> None:
    add_batch(sub)


def _add_backend(p: argparse.ArgumentParser) -> None:
    """In process (--model) or running servers (--target, repeatable)."""
    p.add_argument(
        "--target",
        action="append",
        default=[],
        help="a server's HTTP API (host:port or URL); repeat for a fleet: each query goes to the target "
        "its prefix key picks. Without it, the model runs in this process",
    )
    p.add_argument("--model", default=DEFAULT_MODEL, help="in process: preset, HF directory, .gguf or hub id")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"), help="in process")
    p.add_argument(
        "--template",
        default="qwen3-reranker",
        choices=("qwen3-reranker", "chat", "none"),
        help="in process: the reranker template of /v1/rerank lines",
    )
    p.add_argument("--concurrency", type=int, default=16, help="with --target: requests in flight")
    p.add_argument(
        "--token-file", default=None, help="with --target: file holding the bearer token (or $PREFIXSCORE_TOKEN)"
    )


def backend_from(args: argparse.Namespace) -> Any:
    if args.target:
        from prefixscore.offline.remote import HttpBackend

        token = os.environ.get("PREFIXSCORE_TOKEN") or None
        if args.token_file:
            with open(args.token_file, encoding="utf-8") as f:
                token = f.read().strip()
        return HttpBackend(args.target, concurrency=args.concurrency, token=token)
    from prefixscore.engine.scorer import Scorer
    from prefixscore.offline.inprocess import ScorerBackend

    return ScorerBackend(Scorer.load(args.model, args.dtype, template=args.template))


def add_batch(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "batch",
        help="run an OpenAI-format batch file of /v1/score and /v1/rerank requests",
        description="Run a batch file (one JSON line per request: custom_id, method, url, body) through "
        "/v1/score and /v1/rerank, in process or on running servers; write one line per request in "
        "vLLM's run-batch output format.",
    )
    p.add_argument("input", help="the batch file (JSONL)")
    p.add_argument("-o", "--output", required=True, help="the output file (JSONL)")
    p.add_argument(
        "--resume", action="store_true", help="continue an interrupted run: skip custom_ids already in the output"
    )
    p.add_argument("--window-lines", type=int, default=4096, help="lines read (and grouped by query) at a time")
    p.add_argument("--window-bytes", type=int, default=64 << 20, help="input bytes read at a time, at most")
    _add_backend(p)
    p.set_defaults(func=run_batch_command)


def run_batch_command(args: argparse.Namespace) -> int:
    from prefixscore.offline.batch import run_batch
    from prefixscore.offline.output import OutputExists, OutputFile

    try:  # before the model loads: a refused output costs nothing
        out = OutputFile(args.output, args.resume)
    except OutputExists as err:
        print(f"batch: {err}", file=sys.stderr)
        return 2
    backend = backend_from(args)
    try:
        summary = run_batch(args.input, out, backend, window_lines=args.window_lines, window_bytes=args.window_bytes)
    finally:
        if hasattr(backend, "close"):
            backend.close()
    print(summary.text(), file=sys.stderr)
    return 0
