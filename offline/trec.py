"""Retrieval files: TREC runs and qrels, BEIR's qrels TSV, and the texts of queries and documents
(BEIR's corpus.jsonl / queries.jsonl, or `id<TAB>text` TSV as MS MARCO ships them)."""

from __future__ import annotations

import json
from collections.abc import Iterable

Run = dict[str, dict[str, float]]  # query id -> document id -> score
Qrels = dict[str, dict[str, int]]  # query id -> document id -> graded relevance


def read_run(path: str) -> Run:
    """A TREC run: `qid Q0 docid rank score tag` per line (the rank column is not used: trec_eval
    orders by score)."""
    run: Run = {}
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            parts = line.split()
            if not parts:
                continue
            if len(parts) != 6:
                raise ValueError(f"{path}:{n}: expected 'qid Q0 docid rank score tag', got {line.strip()!r}")
            run.setdefault(parts[0], {})[parts[2]] = float(parts[4])
    return run


def read_qrels(path: str) -> Qrels:
    """TREC qrels (`qid iter docid rel`) or BEIR's TSV (`query-id<TAB>corpus-id<TAB>score`, header)."""
    qrels: Qrels = {}
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            parts = line.split()
            if not parts or (n == 1 and parts[0] == "query-id"):
                continue
            if len(parts) == 4:
                qid, _, doc, rel = parts
            elif len(parts) == 3:
                qid, doc, rel = parts
            else:
                raise ValueError(f"{path}:{n}: expected TREC qrels or BEIR's TSV, got {line.strip()!r}")
            qrels.setdefault(qid, {})[doc] = int(rel)
    return qrels


def read_texts(path: str, wanted: set[str] | None = None) -> dict[str, str]:
    """id -> text from BEIR's JSONL (`_id`, `text`, optional `title`: "title text") or a TSV of
    `id<TAB>text`; only the ids in `wanted` when given (a corpus is read as a stream, and only
    the documents of the run are kept)."""
    texts: dict[str, str] = {}
    with open(path, encoding="utf-8") as f:
        for line in f:
            if not line.strip():
                continue
            if path.endswith(".jsonl"):
                obj = json.loads(line)
                key, title = str(obj["_id"]), obj.get("title") or ""
                text = f"{title} {obj['text']}" if title else obj["text"]
            else:
                key, _, text = line.rstrip("\n").partition("\t")
            if wanted is None or key in wanted:
                texts[key] = text
    return texts


def ranked(scores: dict[str, float]) -> list[tuple[str, float]]:
    """A query's documents in trec_eval's order: score descending, ties by document id descending."""
    return sorted(scores.items(), key=lambda kv: (kv[1], kv[0]), reverse=True)


def write_run(path: str, run: Run, tag: str) -> None:
    with open(path, "w", encoding="utf-8") as f:
        for qid in run:
            for rank, (doc, score) in enumerate(ranked(run[qid]), 1):
                f.write(f"{qid} Q0 {doc} {rank} {score:.8g} {tag}\n")


def cut(run: Run, depth: int) -> Run:
    """Each query's first `depth` documents in trec_eval's order."""
    return {qid: dict(ranked(scores)[:depth]) for qid, scores in run.items()}


def queries_of(run: Run, qrels: Iterable[str]) -> list[str]:
    """The queries trec_eval measures: in the run and judged."""
    judged = set(qrels)
    return [q for q in run if q in judged]
