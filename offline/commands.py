"""The `prefixscore batch` and `prefixscore eval` subcommands (registered by cli.py)."""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from prefixscore.engine import options


def register(sub: argparse._SubParsersAction) -> None:
    add_batch(sub)
    add_eval(sub)


def _add_backend(p: argparse.ArgumentParser) -> None:
    """In process (--model) or running servers (--target, repeatable)."""
    p.add_argument(
        "--target",
        action="append",
        default=[],
        help="a server's HTTP API (host:port or URL); repeat for a fleet: each query goes to the target "
        "its prefix key picks. Without it, the model runs in this process",
    )
    options.add_flags(p)  # in process: the engine, as `serve` builds it (engine/options.py)
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

    scorer = Scorer.load(**options.values(args))
    return ScorerBackend(scorer)


def add_batch(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "batch",
        help="run an OpenAI-format batch file of /v1/score, /v1/rerank and /v1/embeddings requests",
        description="Run a batch file (one JSON line per request: custom_id, method, url, body) through "
        "/v1/score, /v1/rerank and /v1/embeddings, in process or on running servers; write one line per request in "
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
    try:
        backend = backend_from(args)
        try:
            summary = run_batch(
                args.input, out, backend, window_lines=args.window_lines, window_bytes=args.window_bytes
            )
        finally:
            if hasattr(backend, "close"):
                backend.close()
    except KeyboardInterrupt:  # Ctrl-C: every line written is whole and synced (run_batch's finally)
        print(f"\nbatch: interrupted; --resume continues {args.output}", file=sys.stderr)
        return 130
    print(summary.text(), file=sys.stderr)
    return 0


def add_eval(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "eval",
        help="rerank a first-stage run and report nDCG@10, MRR@10 and recall@k before and after",
        description="Rerank each query's first --depth documents of a first-stage TREC run with the reranker "
        "(the rerank API's template), report trec_eval's nDCG@10, MRR@10 and recall@k of the run before and "
        "after, and write the reranked run.",
    )
    p.add_argument("--run", required=True, help="the first-stage run (TREC: qid Q0 docid rank score tag)")
    p.add_argument("--beir", help="a BEIR dataset directory: corpus.jsonl, queries.jsonl, qrels/SPLIT.tsv")
    p.add_argument("--split", default="test", help="with --beir: the qrels split [%(default)s]")
    p.add_argument("--qrels", help="qrels: TREC (qid iter docid rel) or BEIR's TSV")
    p.add_argument("--corpus", help="documents: BEIR's corpus.jsonl or a TSV of id<TAB>text")
    p.add_argument("--queries", help="queries: BEIR's queries.jsonl or a TSV of id<TAB>text")
    p.add_argument("--depth", type=int, default=100, help="documents reranked per query [%(default)s]")
    p.add_argument("--recall-at", type=int, nargs="+", default=[100], help="recall cut-offs [%(default)s]")
    p.add_argument("--instruction", help="the template's task instruction (default: the template's)")
    p.add_argument("--per-query", action="store_true", help="report each query too")
    p.add_argument("-o", "--output", help="write the reranked run here (TREC)")
    p.add_argument("--tag", default="prefixscore", help="the reranked run's tag [%(default)s]")
    p.add_argument(
        "--target", help="a server's gRPC address (host:port): rerank there; without it, --model runs in process"
    )
    options.add_flags(p)  # in process: the engine, as `serve` builds it (engine/options.py)
    p.set_defaults(func=run_eval_command)


def run_eval_command(args: argparse.Namespace) -> int:
    from prefixscore.offline import trec
    from prefixscore.offline.cross_encoder import CrossEncoder
    from prefixscore.offline.evaluation import measure, rerank, table

    if args.beir:
        args.corpus = args.corpus or os.path.join(args.beir, "corpus.jsonl")
        args.queries = args.queries or os.path.join(args.beir, "queries.jsonl")
        args.qrels = args.qrels or os.path.join(args.beir, "qrels", f"{args.split}.tsv")
    missing = [flag for flag in ("qrels", "corpus", "queries") if not getattr(args, flag)]
    if missing:
        print(f"eval: give --beir DIR or --{' --'.join(missing)}", file=sys.stderr)
        return 2
    run = trec.read_run(args.run)
    qrels = trec.read_qrels(args.qrels)
    top = trec.cut(run, args.depth)
    docs = trec.read_texts(args.corpus, {d for scores in top.values() for d in scores})
    queries = trec.read_texts(args.queries, set(run))
    if args.target:
        encoder = CrossEncoder(target=args.target, instruction=args.instruction)
    else:
        encoder = CrossEncoder(instruction=args.instruction, **options.values(args))
    reranked = rerank(run, queries, docs, encoder, args.depth, progress=sys.stderr.isatty())
    if args.output:
        trec.write_run(args.output, reranked, args.tag)
    print(table(measure(run, qrels, args.recall_at), measure(reranked, qrels, args.recall_at), args.per_query))
    return 0
