"""The prefix key: which cached prefix a request will use, as a short string a router can hash.

Replicas each keep their own prefix pool, so a query's requests should reach one replica.
Routing is the job of Envoy, a mesh or a gateway (deploy/envoy, docs/operations.md); this
module only names the key they route on. Clients send it as the `x-prefixscore-prefix-key`
header (gRPC metadata); the server computes it too and echoes it (gRPC initial metadata,
HTTP response header), so any client learns it from one call; Envoy derives it from an HTTP
body that came without one (deploy/envoy/prefix_key.lua computes the same function).

The key is CRC-32 (zlib's, IEEE) of the UTF-8 bytes of

    "<kind>\\n<instruction>\\n<query>"

as 8 lowercase hex digits, where kind is `rerank` (a rerank: the template wraps the query and
its instruction, empty for the default) or `score` (a text query); a query of token ids is
`score-ids` with the ids as little-endian 32-bit integers in place of the text; an embedding
request is `embed` with its prompt's name as the instruction and no query. What the prefix also
depends on but every replica of one deployment shares (the model, the template) is left
out: a client need not know them, and a request's `model` field is only echoed. CRC-32 is
not a digest of identity, only a routing key: two queries that share it share a replica,
nothing else (the router hashes the key again onto its ring).
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence

import numpy as np

HEADER = "x-prefixscore-prefix-key"


def _key(kind: str, instruction: str, query: bytes) -> str:
    head = f"{kind}\n{instruction}\n".encode()
    return f"{zlib.crc32(query, zlib.crc32(head)):08x}"


def for_score(query: str | Sequence[int] | np.ndarray) -> str:
    """The key of a Score request (or stream) over `query`, text or token ids."""
    if isinstance(query, str):
        return _key("score", "", query.encode())
    return _key("score-ids", "", np.asarray(query, dtype="<i4").tobytes())


def for_embed(prompt_name: str | None = None) -> str:
    """The key of an embedding request: its prompt by name (the prefix the engine caches; empty
    or absent: the model's default prompt), no query."""
    return _key("embed", prompt_name or "", b"")


def for_rerank(query: str, instruction: str | None = None) -> str:
    """The key of a Rerank request (empty or absent instruction: the template's default)."""
    return _key("rerank", instruction or "", query.encode())
