"""The benchmark workloads (W1-W6; W7 in bench/w7.py, W8 in bench/w8.py; docs/benchmarks.md): their names, and their
requests as generators (token ids).

Every size is a parameter, so CI-sized smoke runs use the same code as the
published figures. Token ids are drawn from a fixed seed: two runs send the
same requests.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

# "yes" / "no" in the 151936-token Qwen vocabulary (W1, docs/benchmarks.md)
QWEN_LABELS = (9454, 2753)
QWEN_VOCAB = 151936
# the reranker prompt the rerank workloads (W3 over text, host-rerank) are defined by, whatever the
# model: named, since `--template auto` serves no rerank on a model it does not recognize
RERANK_TEMPLATE = "qwen3-reranker"
W3_SUFFIX_TOKENS = 12  # "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n" after each document

# the workloads `prefixscore bench --workload` runs, and the modes a request is scored in
WORKLOADS = (
    "w1-cold",
    "w1-warm",
    "w2",
    "w3",
    "w3-grpc",
    "w4",
    "host",
    "host-rerank",
    "w5",
    "w6",
    "w6-one-by-one",
    "w7",
    "w8",
    "soak",
    "faults",
)
# W7's modes (bench/w7.py): the engine's two transports, then the baselines
W7_MODES = ("completions", "grpc", "hf", "llamacpp")
# W8's modes (bench/w8.py): the engine over HTTP, gRPC, in process, without the cached instruction, and
# sentence-transformers
W8_MODES = ("http", "grpc", "inprocess", "whole", "st")
MODES = ("prefix", "packed", "sequential")
# many clients at once through gRPC (host-rerank: HTTP); the server runs its prefix path only
CONCURRENT = ("w2", "w3-grpc", "w4", "host", "host-rerank", "w5")
# W5 through a router, twice over new queries: clients sending the prefix key, then none
W5_MODES = ("affinity", "no-key")


@dataclasses.dataclass(frozen=True)
class Request:
    query: list[int]
    items: list[list[int]]
    labels: list[int]
    apply_softmax: bool = False

    @property
    def item_tokens(self) -> int:
        return sum(len(it) for it in self.items)


@dataclasses.dataclass
class Sizes:
    """Workload sizes (defaults: docs/benchmarks.md)."""

    w1_query: int = 2000
    w1_items: int = 500
    w1_item_tokens: int = 20
    sequential_items: int = 10  # the sequential baseline scores this many items per request
    w2_requests: int = 64
    w2_concurrency: int = 16
    w2_query: tuple[int, int] = (200, 3000)
    w2_items: tuple[int, int] = (1, 1000)
    w2_item_tokens: tuple[int, int] = (5, 200)
    w2_hot_queries: int = 8
    w2_hot_share: float = 0.3
    w3_header: int = 60
    w3_query: tuple[int, int] = (20, 100)
    w3_docs: int = 100
    w3_doc_tokens: tuple[int, int] = (50, 300)
    w3_requests: int = 64  # w3-grpc: one concurrent run needs more requests than W1's few runs to fill 16 clients
    w4_requests: int = 256
    w4_concurrency: int = 64
    w4_query: int = 300
    w4_items: int = 10
    w4_item_tokens: int = 20
    w6_conversation: int = 1000
    w6_responses: int = 64
    w6_response_tokens: tuple[int, int] = (50, 300)


def label_ids(vocab: int, tokenizer: object | None = None) -> list[int]:
    """Two label ids: "yes"/"no" where a tokenizer can say so, else the Qwen ids (mod vocab)."""
    if vocab == QWEN_VOCAB or tokenizer is None:
        return [t % vocab for t in QWEN_LABELS]
    ids = [tokenizer.encode(w)[0] for w in ("yes", "no")]  # type: ignore[attr-defined]
    return ids if ids[0] != ids[1] else [t % vocab for t in QWEN_LABELS]


class Generator:
    """Random token ids and log-uniform sizes from one seed."""

    def __init__(self, vocab: int, seed: int = 0) -> None:
        self.vocab = vocab
        self.rng = np.random.default_rng(seed)

    def tokens(self, n: int) -> list[int]:
        return self.rng.integers(0, self.vocab, n).tolist()

    def log_uniform(self, lo: int, hi: int) -> int:
        return int(round(math.exp(self.rng.uniform(math.log(lo), math.log(hi)))))


def w2_ranges(max_query: int, max_items: int, max_item_tokens: int) -> dict[str, tuple[int, int]]:
    """Sizes' W2 ranges (log-uniform) capped at the given maxima: queries from 200 tokens, 1 item
    and more, items from 5 tokens (or each maximum, when it is below that floor)."""
    return {
        "w2_query": (min(200, max_query), max_query),
        "w2_items": (1, max_items),
        "w2_item_tokens": (min(5, max_item_tokens), max_item_tokens),
    }


def w1(gen: Generator, sizes: Sizes, labels: list[int], cold: bool, runs: int) -> list[Request]:
    """W1: a 2,000-token query, 500 items x 20 tokens. cold: a new query every request."""
    query = gen.tokens(sizes.w1_query)
    out = []
    for _ in range(runs):
        if cold:
            query = gen.tokens(sizes.w1_query)
        out.append(Request(query, [gen.tokens(sizes.w1_item_tokens) for _ in range(sizes.w1_items)], labels))
    return out


def w2(gen: Generator, sizes: Sizes, labels: list[int], n: int) -> list[Request]:
    """W2: mixed traffic; log-uniform query, item count and item length; a share reuses hot queries."""
    hot = hot_queries(gen, sizes)
    return [w2_request(gen, sizes, labels, hot) for _ in range(n)]


def hot_queries(gen: Generator, sizes: Sizes) -> list[list[int]]:
    """W2's hot queries, the ones a share of its requests reuse."""
    return [gen.tokens(gen.log_uniform(*sizes.w2_query)) for _ in range(sizes.w2_hot_queries)]


def w2_request(gen: Generator, sizes: Sizes, labels: list[int], hot: list[list[int]]) -> Request:
    """One W2 request: over one of `hot` (a share of them) or a new query."""
    if gen.rng.random() < sizes.w2_hot_share:
        query = hot[int(gen.rng.integers(0, len(hot)))]
    else:
        query = gen.tokens(gen.log_uniform(*sizes.w2_query))
    items = [gen.tokens(gen.log_uniform(*sizes.w2_item_tokens)) for _ in range(gen.log_uniform(*sizes.w2_items))]
    return Request(query, items, labels)


def w3(gen: Generator, sizes: Sizes, labels: list[int], n: int) -> list[Request]:
    """W3: reranker prompt; a fixed header shared by all, a new query per request, documents
    (plus the prompt's fixed suffix) as items, apply_softmax over yes/no."""
    header = gen.tokens(sizes.w3_header)
    suffix = gen.tokens(W3_SUFFIX_TOKENS)
    out = []
    for _ in range(n):
        query = header + gen.tokens(gen.log_uniform(*sizes.w3_query))
        docs = [gen.tokens(gen.log_uniform(*sizes.w3_doc_tokens)) + suffix for _ in range(sizes.w3_docs)]
        out.append(Request(query, docs, labels, apply_softmax=True))
    return out


def w4(gen: Generator, sizes: Sizes, labels: list[int], n: int) -> list[Request]:
    """W4: many small requests; each its own new 300-token query with 10 items x 20 tokens.

    No query repeats (not even across warm-up and timed requests), so every request
    pays its prefill: the workload measures whether the service batches the prefills
    and items of many queries into one device call, not how well it caches.
    """
    return [
        Request(gen.tokens(sizes.w4_query), [gen.tokens(sizes.w4_item_tokens) for _ in range(sizes.w4_items)], labels)
        for _ in range(n)
    ]


def w6(gen: Generator, sizes: Sizes, n: int) -> list[Request]:
    """W6: a reward model judging best-of-N: a new 1,000-token conversation per request and 64
    candidate responses of 50-300 tokens (log-uniform), scored by a classifier head (no labels)."""
    return [
        Request(
            gen.tokens(sizes.w6_conversation),
            [gen.tokens(gen.log_uniform(*sizes.w6_response_tokens)) for _ in range(sizes.w6_responses)],
            [],
        )
        for _ in range(n)
    ]


def w5(gen: Generator, sizes: Sizes, labels: list[int], queries: int, chunk: int, hot_requests: int) -> list[Request]:
    """W5: repeated queries as a router in front of several replicas sees them. Each of `queries`
    W1 queries (its items in requests of `chunk`, as the seed workloads' clients sent them) and
    `hot_requests` W2-shaped requests over W2's hot queries, in a random order (many clients at
    once). Every query is new to the replicas: only the requests after its first can hit."""
    out = []
    for _ in range(queries):
        (whole,) = w1(gen, sizes, labels, cold=True, runs=1)
        out += [Request(whole.query, whole.items[j : j + chunk], labels) for j in range(0, len(whole.items), chunk)]
    hot = dataclasses.replace(sizes, w2_hot_share=1.0)  # W2's requests, every one over a hot query
    out += w2(gen, hot, labels, hot_requests)
    order = gen.rng.permutation(len(out))
    return [out[j] for j in order]


def ideal_prefill_tokens(reqs: list[Request]) -> int:
    """The query tokens one cache that saw every request prefills: each distinct query's once."""
    return sum(len(q) for q in {tuple(r.query) for r in reqs})


def ideal_hit_rate(reqs: list[Request]) -> float:
    """The hit rate of one cache that saw every request: all but each distinct query's first."""
    distinct = len({tuple(r.query) for r in reqs})
    return 1 - distinct / len(reqs) if reqs else 0.0


# words the host-rerank workload's texts are drawn from (any text works: the server tokenizes it)
WORDS = (
    "the a river city light stone music table water green red blue house car apple paris "
    "seven open market small large north south winter summer garden bridge road window"
).split()


@dataclasses.dataclass(frozen=True)
class RerankTexts:
    """A rerank request in text (HTTP /v1/rerank): `items` are the documents."""

    query: str
    items: list[str]


def rerank_texts(gen: Generator, n: int, docs: int, query_words: int = 40, doc_words: int = 20) -> list[RerankTexts]:
    """host-rerank: a new text query per request and `docs` documents of `doc_words` words."""

    def text(words: int) -> str:
        return " ".join(WORDS[i] for i in gen.rng.integers(0, len(WORDS), words))

    return [RerankTexts(text(query_words), [text(doc_words) for _ in range(docs)]) for _ in range(n)]
