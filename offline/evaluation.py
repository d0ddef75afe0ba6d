"""`prefixscore eval`: rerank a first-stage run with the reranker and measure both with trec_eval's
measures (pytrec_eval): nDCG@10, MRR@10 and recall@k.

trec_eval's definitions hold throughout: documents are ordered by score, ties by document id
descending; nDCG's gain is the graded relevance itself (rel / log2(rank + 1)); a document is
relevant from relevance 1; only queries both in the run and in the qrels are measured. MRR@10 is
trec_eval's reciprocal rank over each query's first 10 documents.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import pytrec_eval

from prefixscore.offline.cross_encoder import CrossEncoder
from prefixscore.offline.progress import Progress
from prefixscore.offline.trec import Qrels, Run, cut


@dataclasses.dataclass(frozen=True)
class Report:
    names: list[str]  # the measures, in order: nDCG@10, MRR@10, R@k...
    mean: dict[str, float]
    per_query: dict[str, dict[str, float]]


def measure(run: Run, qrels: Qrels, recall_at: Sequence[int] = (100,)) -> Report:
    """nDCG@10, MRR@10 and recall@k of `run` (per query and their mean over the queries measured)."""
    recall = ",".join(str(k) for k in recall_at)
    full = pytrec_eval.RelevanceEvaluator(qrels, {"ndcg_cut.10", f"recall.{recall}"}).evaluate(run)
    top10 = pytrec_eval.RelevanceEvaluator(qrels, {"recip_rank"}).evaluate(cut(run, 10))
    names = ["nDCG@10", "MRR@10", *(f"R@{k}" for k in recall_at)]
    per_query = {
        qid: {
            "nDCG@10": m["ndcg_cut_10"],
            "MRR@10": top10[qid]["recip_rank"],
            **{f"R@{k}": m[f"recall_{k}"] for k in recall_at},
        }
        for qid, m in full.items()
    }
    mean = {n: sum(q[n] for q in per_query.values()) / len(per_query) if per_query else 0.0 for n in names}
    return Report(names, mean, per_query)


def rerank(
    run: Run, queries: dict[str, str], docs: dict[str, str], encoder: CrossEncoder, depth: int, progress: bool
) -> Run:
    """Each query's first `depth` documents scored by the reranker (the run's order below them is
    dropped: the reranked run holds what was reranked)."""
    top = cut(run, depth)
    missing = sorted({d for scores in top.values() for d in scores} - docs.keys())
    if missing:
        raise ValueError(f"corpus: {len(missing)} documents of the run are missing (first: {missing[0]})")
    lost = sorted(q for q in top if q not in queries)
    if lost:
        raise ValueError(f"queries: {len(lost)} queries of the run are missing (first: {lost[0]})")
    bar = Progress(sum(map(len, top.values())), label="rerank") if progress else None
    out: Run = {}
    done = 0
    for qid, scores in top.items():
        ids = list(scores)
        relevance = encoder.predict([(queries[qid], docs[d]) for d in ids], batch_size=max(1, len(ids)))
        out[qid] = {d: float(s) for d, s in zip(ids, relevance, strict=True)}
        done += len(ids)
        if bar:
            bar.update(lines=1, items=len(ids), bytes_read=done)
    if bar:
        bar.finish()
    return out


def table(before: Report, after: Report, per_query: bool) -> str:
    """The report: the means (and each query's, on request), first stage against reranked."""
    lines = [f"{'query':<16}{'measure':<10}{'first-stage':>12}{'reranked':>12}{'change':>10}"]

    def rows(qid: str, b: dict[str, float], a: dict[str, float]) -> None:
        for n in before.names:
            lines.append(
                f"{qid:<16}{n:<10}{b.get(n, 0.0):>12.4f}{a.get(n, 0.0):>12.4f}{a.get(n, 0.0) - b.get(n, 0.0):>+10.4f}"
            )

    if per_query:
        for qid in before.per_query:
            rows(qid, before.per_query[qid], after.per_query.get(qid, {}))
    rows(f"mean ({len(before.per_query)})", before.mean, after.mean)
    return "\n".join(lines)
