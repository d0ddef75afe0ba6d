"""W1-shaped batch lines for `prefixscore batch` (docs/benchmarks.md, "Batch files"): W1 queries
(2,000 tokens, 500 items of 20 tokens, 2 labels, token ids; other sizes on request), each
query's items split over several /v1/score lines, all lines shuffled, as a file of offline work
arrives.

    python -m prefixscore.bench.batch_lines OUT.jsonl --model bench-cpu --queries 8 --items-per-line 100
"""

from __future__ import annotations

import argparse
import json
import random

from prefixscore.bench.workloads import Generator, Sizes, label_ids, w1
from prefixscore.model.presets import RANDOM_PRESETS


def write_lines(path: str, vocab: int, queries: int, items_per_line: int, sizes: Sizes, seed: int = 0) -> int:
    """Write the file; returns its number of lines."""
    gen = Generator(vocab, seed)
    requests = w1(gen, sizes, label_ids(vocab), cold=True, runs=queries)
    lines = []
    for q, req in enumerate(requests):
        for start in range(0, len(req.items), items_per_line):
            body = {
                "query": req.query,
                "items": req.items[start : start + items_per_line],
                "label_token_ids": req.labels,
            }
            lines.append({"custom_id": f"w1-{q}-{start}", "method": "POST", "url": "/v1/score", "body": body})
    random.Random(seed).shuffle(lines)
    with open(path, "w", encoding="utf-8") as f:
        for line in lines:
            f.write(json.dumps(line, separators=(",", ":")) + "\n")
    return len(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("output")
    p.add_argument("--model", default="bench-cpu", choices=sorted(RANDOM_PRESETS), help="its vocabulary")
    p.add_argument("--queries", type=int, default=8)
    p.add_argument("--items-per-line", type=int, default=100)
    p.add_argument("--query-tokens", type=int, default=Sizes.w1_query, help="W1's unless given")
    p.add_argument("--items", type=int, default=Sizes.w1_items, help="items per query")
    p.add_argument("--item-tokens", type=int, default=Sizes.w1_item_tokens)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    vocab = RANDOM_PRESETS[args.model][0].vocab_size
    sizes = Sizes(w1_query=args.query_tokens, w1_items=args.items, w1_item_tokens=args.item_tokens)
    print(write_lines(args.output, vocab, args.queries, args.items_per_line, sizes, args.seed))


if __name__ == "__main__":
    main()
