"""A client's gRPC channel: its options, the one service config that carries ring hash's load
balancing and the retry policy (`Retry`), TLS credentials."""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from typing import Any, Literal

import grpc

from prefixscore import prefix_key
from prefixscore.client.retry import Retry, retry_service_config

CHANNEL_OPTIONS = [("grpc.max_receive_message_length", 64 << 20), ("grpc.max_send_message_length", 64 << 20)]
Affinity = Literal["ring_hash"] | None

# gRPC's ring hash hashes a request header of our choosing (`requestHashHeader`, gRFC A76) only
# while this variable is true: grpcio's C core reads it when a channel parses its service config,
# that is when the channel is created (setting it after `import grpc` is fine; changing it later
# does not affect existing channels). Without it the field is dropped and every call on the
# channel fails INTERNAL "hash attribute not present". It changes nothing for other channels.
RING_HASH_ENV = "GRPC_EXPERIMENTAL_RING_HASH_SET_REQUEST_HASH_KEY"
_TRUE = frozenset({"1", "t", "true", "y", "yes"})  # what the C core parses as true (case-insensitive)


def _file(path: str | None) -> bytes | None:
    if path is None:
        return None
    with open(path, "rb") as f:
        return f.read()


def tls_credentials(ca: str | None = None, cert: str | None = None, key: str | None = None) -> grpc.ChannelCredentials:
    """TLS channel credentials from PEM files: `ca` verifies the server (None: the system's roots);
    `cert` and `key` are this client's certificate for mutual TLS."""
    if (cert is None) != (key is None):
        raise ValueError("mutual TLS needs both a client certificate and its key")
    return grpc.ssl_channel_credentials(_file(ca), _file(key), _file(cert))


def ring_hash_service_config(min_ring_size: int = 1024, max_ring_size: int = 4096) -> str:
    """gRPC service config (JSON) for client-side consistent hashing on the prefix key header:
    each call goes to the replica at its key's place on a ring of the target's addresses, the
    next one on the ring while that one cannot connect. `min_ring_size` as Envoy's
    (deploy/envoy); the C core caps the ring at 4096 entries unless a channel option raises it."""
    ring = {"minRingSize": min_ring_size, "maxRingSize": max_ring_size, "requestHashHeader": prefix_key.HEADER}
    return json.dumps({"loadBalancingConfig": [{"ring_hash_experimental": ring}]})


def service_config(affinity: Affinity = None, retry: Retry | None = None) -> str | None:
    """The one service config of a client's channel: ring hash's load balancing and the retry
    policy merged (a channel takes a single `grpc.service_config`); None when neither is asked."""
    config: dict[str, Any] = {}
    if affinity == "ring_hash":
        config.update(json.loads(ring_hash_service_config()))
    if retry is not None:
        config.update(json.loads(retry_service_config(retry)))
    return json.dumps(config) if config else None


def _enable_request_hash_header() -> None:
    """Set RING_HASH_ENV before a ring-hash channel is created (see its comment): unset, it is
    set for this process; set to anything but true, the user turned it off, so refuse."""
    value = os.environ.get(RING_HASH_ENV)
    if value is None:
        os.environ[RING_HASH_ENV] = "true"
    elif value.lower() not in _TRUE:
        raise RuntimeError(
            f"affinity='ring_hash' needs {RING_HASH_ENV}=true (it is {value!r}): without it gRPC "
            "ignores the hash header and fails every call (INTERNAL: hash attribute not present)"
        )


def channel_options(
    options: Sequence[tuple[str, Any]], affinity: Affinity, retry: Retry | None = None
) -> list[tuple[str, Any]]:
    """The channel's options: ours, then the caller's; with affinity or retry, our service config."""
    if affinity not in (None, "ring_hash"):
        raise ValueError(f"affinity: expected None or 'ring_hash', got {affinity!r}")
    names = {name for name, _ in options}
    if affinity is not None and names & {"grpc.service_config", "grpc.lb_policy_name"}:
        clash = sorted(names & {"grpc.service_config", "grpc.lb_policy_name"})
        raise ValueError(f"affinity='ring_hash' sets the load balancing itself: drop the option(s) {clash}")
    if retry is not None and "grpc.service_config" in names:
        raise ValueError("retry sets the service config itself: drop the option grpc.service_config")
    config = service_config(affinity, retry)
    if config is None:
        return [*CHANNEL_OPTIONS, *options]
    if affinity is not None:
        _enable_request_hash_header()
    # resolution disabled: a service config from DNS (TXT records) would replace this one;
    # retries on explicitly (the default in grpcio for years, but a policy without it is inert)
    ours = [("grpc.service_config", config), ("grpc.service_config_disable_resolution", 1)]
    if retry is not None:
        ours.append(("grpc.enable_retries", 1))
    return [*CHANNEL_OPTIONS, *ours, *options]
