"""`ServerConfig`: everything `prefixscore serve` can set, each field's default and its flag.

The CLI's `serve` flags are derived from these fields (cli.py `add_config_flags`): the flag's
name, its environment variable (PREFIXSCORE_<NAME>), its type, its choices and its default
come from here, so a default is stated once; the engine's options (model, dtype, quantize,
template, pool, mesh...) come as declared in engine/options.py, which `bench`, `eval`, `batch`
and `Scorer.load` read too. This module imports nothing heavy (no JAX, no
gRPC): the CLI reads it for every subcommand.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from prefixscore.engine import options

if TYPE_CHECKING:
    from prefixscore.engine.build import EngineSpec
    from prefixscore.engine.hosts.hosts import HostGroup
    from prefixscore.engine.runtime.buckets import Buckets
    from prefixscore.engine.runtime.scoring_engine import ScoringEngine
    from prefixscore.model.loader import LoadedModel


def parse_bool(text: str) -> bool:
    return text.strip().lower() in ("1", "true", "yes", "on")


def parse_port_or_off(text: str) -> int | None:
    """A port, 0 for any free one, or off (None)."""
    return None if text.strip().lower() in ("off", "none", "-1") else int(text)


def parse_list(text: str) -> tuple[str, ...]:
    """A comma-separated list (an environment variable's spelling of a repeated flag)."""
    return tuple(part for part in text.split(",") if part)


@dataclasses.dataclass(frozen=True)
class Flag:
    """How a ServerConfig field is set from the command line and the environment."""

    help: str
    parse: Callable[[str], Any]  # the text of a flag or an environment variable -> the value
    name: str = ""  # the flag without its dashes; "": the field's name with dashes
    env: str = ""  # the environment variable after PREFIXSCORE_; "": the flag's name in capitals
    choices: tuple[str, ...] | None = None
    nargs: str | None = None  # "+": the flag takes several values (a tuple field)
    # the flag's unit against the field's, e.g. milliseconds for a field in seconds: field = flag * scale
    scale: float = 1.0

    def flag_name(self, field: str) -> str:
        return "--" + (self.name or field.replace("_", "-"))

    def env_name(self, field: str) -> str:
        return "PREFIXSCORE_" + (self.env or self.flag_name(field)[2:].replace("-", "_").upper())


def _flag(default: Any, help: str, parse: Callable[[str], Any] = str, **how: Any) -> Any:
    """A ServerConfig field with its default and its flag (see Flag)."""
    return dataclasses.field(default=default, metadata={"flag": Flag(help, parse, **how)})


def _option_flag(option: options.EngineOption) -> dict[str, Flag]:
    """The metadata of the field of an engine option: its flag, as declared in engine/options.py."""
    return {"flag": Flag(option.help, option.parse, name=option.flag, env=option.env, choices=option.choices)}


# a field with its flag for each engine option, made from engine/options.py's rows (name, type,
# default, flag): a new option is one row there, and `serve` has its field, flag and variable
EngineOptionFlags = options.fields_class("EngineOptionFlags", __name__, metadata=_option_flag)


@dataclasses.dataclass
class ServerConfig(EngineOptionFlags):
    """Everything `prefixscore serve` can set; each field with a Flag is a `serve` flag.

    The engine's options (model, dtype, quantize, ... with their types, defaults and flags) are
    fields inherited from EngineOptionFlags, made from engine/options.py's table so that each is
    declared once (they come first, as `serve --help` lists them); the fields below are serve's own."""

    host: str = _flag("0.0.0.0", "address the gRPC (and HTTP) server binds")
    port: int = _flag(50051, "gRPC port; 0 picks a free one", int)  # 0: see ScoreServer.port
    metrics_port: int | None = _flag(
        9090, "Prometheus /metrics port; 0 picks a free one, 'off' disables", parse_port_or_off
    )
    http_port: int | None = _flag(
        None,
        "HTTP API port (/v1/score, /v1/rerank, /v1/classify, /v1/embeddings, /v1/completions, /v1/models, "
        "/health, /ready); 0 picks a free one; "
        "'off' (the default) disables",
        parse_port_or_off,
    )
    classify_labels: tuple[str, ...] = _flag(
        (),
        "a causal LM's /v1/classify labels: label strings, one token each (their softmax is each input's "
        "probs); a classifier model needs none (environment: comma-separated)",
        parse_list,
        nargs="+",
    )
    max_queue_items: int = _flag(65_536, "items waiting for the device before RESOURCE_EXHAUSTED", int)
    max_items: int = _flag(10_000, "items per request or stream batch", int)
    drain_seconds: float = _flag(30.0, "on SIGTERM, how long in-flight RPCs may finish", float)
    warmup: bool = _flag(True, "compile every shape bucket before SERVING", parse_bool)
    serve_early: bool = _flag(
        True,
        "with --warmup: SERVING once the smallest shapes are compiled, the rest compiled in the background "
        "and used as each is ready; false: all before SERVING",
        parse_bool,
    )
    # None: the engine's default for the model's context, sized by max_batch_tokens and
    # max_prefill_tokens (engine options); or buckets (or a function of the context) given in code
    buckets: Buckets | Callable[[int], Buckets] | None = None
    # several hosts as one replica (engine/hosts/hosts.py): every host runs serve with the same flags
    # and its own --host-index; unset on a multi-host TPU slice: the slice's, from its environment
    num_hosts: int | None = _flag(
        None, "hosts serving this model together, one process each (JAX's multi-controller runtime)", int
    )
    host_index: int | None = _flag(
        None, "this host's index in the group: 0 is the leader (the API, planning); others follow", int
    )
    coordinator: str | None = _flag(
        None, "HOST:PORT of the leader: JAX's coordination service on PORT, the step channel on PORT+1"
    )
    host_timeout_s: float = _flag(
        10.0,
        "seconds a host of the group may be silent, or leave a call unfinished, before the group fails",
        float,
        name="host-timeout",
    )
    batch_wait_s: float = _flag(
        0.0,
        "milliseconds to wait before an idle device's first batch so more requests join it",
        float,
        name="batch-wait-ms",
        scale=1e-3,
    )
    # ---- limits against careless or hostile clients (docs/operations.md) ----
    max_message_bytes: int = _flag(64 << 20, "bytes of one gRPC message or HTTP request body", int)
    max_queue_tokens: int = _flag(1 << 22, "item tokens waiting for the device before RESOURCE_EXHAUSTED", int)
    max_request_tokens: int = _flag(1 << 20, "tokens of one request or stream batch (query + items)", int)
    # each ScoreStream pins its query; past it RESOURCE_EXHAUSTED
    max_streams: int = _flag(256, "ScoreStreams open at once", int)
    max_concurrent_rpcs: int = _flag(1024, "RPCs in progress at once, health included", int)
    stream_idle_timeout_s: float = _flag(
        120.0, "seconds a stream may neither send nor read before it is ended", float, name="stream-idle-timeout"
    )
    max_pending_batches: int = _flag(
        32, "batches of a stream accepted but not yet sent back before its reads pause", int
    )
    keepalive_time_s: float = _flag(
        60.0, "seconds between keepalive pings of idle connections", float, name="keepalive-time"
    )
    keepalive_timeout_s: float = _flag(
        20.0, "seconds a ping may go unanswered before the connection is closed", float, name="keepalive-timeout"
    )
    max_connection_idle_s: float = _flag(
        600.0, "seconds a connection may have no calls", float, name="max-connection-idle"
    )
    max_connection_age_s: float = _flag(
        3600.0, "seconds before a connection is recycled (GOAWAY), to rebalance", float, name="max-connection-age"
    )
    max_connection_age_grace_s: float = _flag(
        60.0, "seconds calls may finish after that", float, name="max-connection-age-grace"
    )
    # ---- security ----
    metrics_host: str | None = _flag(None, "address the metrics endpoint binds (default: --host)")
    reflection: bool = _flag(False, "serve gRPC reflection (grpcurl without the .proto)", parse_bool)
    tls_cert: str | None = _flag(None, "server certificate (PEM); with --tls-key, TLS only (reloaded on change)")
    tls_key: str | None = _flag(None, "its private key (PEM)")
    tls_client_ca: str | None = _flag(None, "CA (PEM) client certificates must be signed by: mutual TLS")
    auth_tokens_file: str | None = _flag(None, "accepted bearer tokens, one a line; every call but health needs one")
    loaded: LoadedModel | None = None  # a model already in memory (tests, embedding): `model` is not loaded
    engine: ScoringEngine | None = None  # with `loaded`: an engine already built (and compiled) for it

    def engine_spec(self) -> EngineSpec:
        """The engine this configuration serves (engine/build.py)."""
        from prefixscore.engine.build import EngineSpec

        return EngineSpec.from_options(options.values(self), buckets=self.buckets, hosts=self.host_group())

    def host_group(self) -> HostGroup:
        """This process's place in its group of hosts (engine/hosts/hosts.py); raises HostGroupError."""
        from prefixscore.engine.hosts.hosts import HostGroup

        return HostGroup.from_flags(self.num_hosts, self.host_index, self.coordinator, self.host_timeout_s)


def flag_fields() -> list[tuple[dataclasses.Field, Flag]]:
    """ServerConfig's fields that are `serve` flags, in order, with their Flag."""
    return [(f, f.metadata["flag"]) for f in dataclasses.fields(ServerConfig) if "flag" in f.metadata]
