"""`prefixscore eval`: trec_eval's measures through pytrec_eval, checked against hand-computed
values (graded qrels, tied scores) and against an independent computation on a larger random
fixture; then the command end to end over a server's reranker, on a BEIR-layout dataset."""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

import pytest
from helpers.service import server_config

from prefixscore.cli import main
from prefixscore.offline import trec
from prefixscore.offline.evaluation import measure
from prefixscore.service.process import ServerThread

# q1: d2 and d3 tie at 2.0; trec_eval breaks ties by document id descending: d1, d3, d2, d4.
# d5 is relevant (3) and never retrieved, d1 judged 0.
RUN = {"q1": {"d1": 3.0, "d2": 2.0, "d3": 2.0, "d4": 1.0}, "q2": {"e1": 0.9, "e2": 0.8, "e3": 0.7}}
QRELS = {"q1": {"d1": 0, "d2": 2, "d3": 1, "d5": 3}, "q2": {"e3": 1}}


def test_hand_computed_ndcg_and_mrr():
    report = measure(RUN, QRELS, recall_at=(2, 100))
    # q1: DCG = 0/log2(2) + 1/log2(3) + 2/log2(4) + 0; ideal 3/1 + 2/log2(3) + 1/log2(4)
    ndcg_q1 = (1 / math.log2(3) + 2 / 2) / (3 + 2 / math.log2(3) + 1 / 2)
    ndcg_q2 = (1 / 2) / 1  # e3 at rank 3: 1/log2(4)
    assert report.per_query["q1"]["nDCG@10"] == pytest.approx(ndcg_q1, abs=1e-4)
    assert report.per_query["q2"]["nDCG@10"] == pytest.approx(ndcg_q2, abs=1e-4)
    assert report.mean["nDCG@10"] == pytest.approx((ndcg_q1 + ndcg_q2) / 2, abs=1e-4)
    assert report.per_query["q1"]["MRR@10"] == pytest.approx(1 / 2)  # d3, ranked second by the tie
    assert report.mean["MRR@10"] == pytest.approx((1 / 2 + 1 / 3) / 2)
    assert report.per_query["q1"]["R@2"] == pytest.approx(1 / 3)  # d3 of d2, d3, d5
    assert report.per_query["q1"]["R@100"] == pytest.approx(2 / 3)
    assert report.per_query["q2"]["R@2"] == 0.0


def reference(run: trec.Run, qrels: trec.Qrels, k: int) -> tuple[float, float, float]:
    """Mean nDCG@10, MRR@10 and recall@k written out from trec_eval's definitions."""
    ndcg = mrr = recall = 0.0
    measured = [q for q in run if q in qrels]
    for q in measured:
        order = sorted(run[q].items(), key=lambda kv: (kv[1], kv[0]), reverse=True)
        rels = [qrels[q].get(d, 0) for d, _ in order]
        dcg = sum(r / math.log2(i + 2) for i, r in enumerate(rels[:10]))
        ideal = sorted(qrels[q].values(), reverse=True)[:10]
        idcg = sum(r / math.log2(i + 2) for i, r in enumerate(ideal))
        ndcg += dcg / idcg if idcg else 0.0
        mrr += next((1 / (i + 1) for i, r in enumerate(rels[:10]) if r > 0), 0.0)
        relevant = sum(1 for r in qrels[q].values() if r > 0)
        recall += sum(1 for r in rels[:k] if r > 0) / relevant if relevant else 0.0
    n = len(measured)
    return ndcg / n, mrr / n, recall / n


def test_agrees_with_the_definitions_on_a_larger_run():
    rng = random.Random(7)
    run: trec.Run = {}
    qrels: trec.Qrels = {}
    for q in range(60):
        docs = [f"doc{rng.randrange(400)}" for _ in range(50)]
        run[f"q{q}"] = {d: float(rng.randrange(8)) for d in docs}  # 8 score levels: many ties
        qrels[f"q{q}"] = {f"doc{rng.randrange(400)}": rng.randrange(4) for _ in range(15)}
    qrels["q0"] = {"doc1": 0}  # judged, nothing relevant: counts as 0
    run["unjudged"] = {"doc1": 1.0}  # not in the qrels: not measured
    report = measure(run, qrels, recall_at=(20,))
    ndcg, mrr, recall = reference(run, qrels, 20)
    assert len(report.per_query) == 60
    assert report.mean["nDCG@10"] == pytest.approx(ndcg, abs=1e-4)
    assert report.mean["MRR@10"] == pytest.approx(mrr, abs=1e-9)
    assert report.mean["R@20"] == pytest.approx(recall, abs=1e-9)


def test_eval_command_reranks_a_beir_dataset_over_a_server(tmp_path, tiny_scorer, capsys):
    beir = tmp_path / "beir"
    (beir / "qrels").mkdir(parents=True)
    corpus = {
        "p1": ("Paris", "Paris is the capital and largest city of France."),
        "p2": ("", "Bananas are a yellow fruit."),
        "p3": ("Lyon", "Lyon is a city in France."),
        "p4": ("", "The Eiffel Tower is in Paris, France."),
        "p5": ("Berlin", "Berlin is the capital of Germany."),
    }
    (beir / "corpus.jsonl").write_text(
        "".join(json.dumps({"_id": k, "title": t, "text": x}) + "\n" for k, (t, x) in corpus.items())
    )
    queries = {"1": "What is the capital of France?", "2": "Which fruit is yellow?"}
    (beir / "queries.jsonl").write_text("".join(json.dumps({"_id": k, "text": t}) + "\n" for k, t in queries.items()))
    (beir / "qrels" / "test.tsv").write_text("query-id\tcorpus-id\tscore\n1\tp1\t2\n1\tp4\t1\n2\tp2\t1\n")
    first = tmp_path / "bm25.trec"
    first.write_text(
        "".join(f"1 Q0 {d} {i + 1} {5 - i} bm25\n" for i, d in enumerate(["p5", "p3", "p4", "p1", "p2"]))
        + "".join(f"2 Q0 {d} {i + 1} {5 - i} bm25\n" for i, d in enumerate(["p1", "p5", "p2", "p3"]))
    )
    out = tmp_path / "reranked.trec"
    with ServerThread(server_config(tiny_scorer)) as srv:
        args = ["eval", "--beir", str(beir), "--run", str(first), "--target", srv.target, "--depth", "4"]
        assert main([*args, "--recall-at", "2", "4", "--per-query", "-o", str(out)]) == 0
    report = capsys.readouterr().out
    reranked = trec.read_run(str(out))
    assert {q: set(d) for q, d in reranked.items()} == {"1": {"p5", "p3", "p4", "p1"}, "2": {"p1", "p5", "p2", "p3"}}
    for qid, scores in reranked.items():  # the server's relevance for each reranked document
        ids = list(scores)
        docs = [f"{corpus[d][0]} {corpus[d][1]}" if corpus[d][0] else corpus[d][1] for d in ids]
        for r in tiny_scorer.rerank(queries[qid], docs):
            assert scores[ids[r.index]] == pytest.approx(r.relevance_score, rel=1e-6)
        ranks = [int(line.split()[3]) for line in out.read_text().splitlines() if line.startswith(f"{qid} ")]
        assert ranks == list(range(1, len(ids) + 1))
    before = measure(trec.read_run(str(first)), trec.read_qrels(str(beir / "qrels" / "test.tsv")), (2, 4))
    after = measure(reranked, trec.read_qrels(str(beir / "qrels" / "test.tsv")), (2, 4))
    mean = next(line for line in report.splitlines() if line.startswith("mean (2)") and "nDCG@10" in line)
    assert mean.split()[3:5] == [f"{before.mean['nDCG@10']:.4f}", f"{after.mean['nDCG@10']:.4f}"]
    assert sum(line.startswith("1 ") for line in report.splitlines()) == 4  # per query: 4 measures


def test_eval_and_batch_in_process_load_with_quantize(tmp_path, monkeypatch, capsys):
    """--quantize and --activations of `eval` and `batch` reach Scorer.load (in process)."""
    from conftest import SMALL_BUCKETS

    from prefixscore.cli import build_parser
    from prefixscore.engine.scorer import Scorer
    from prefixscore.offline.commands import backend_from

    loads = []
    load = Scorer.load.__func__

    def recorded(cls, model, dtype="float32", **kwargs):
        loads.append(kwargs)
        return load(cls, model, dtype, **{"buckets": SMALL_BUCKETS, **kwargs})

    monkeypatch.setattr(Scorer, "load", classmethod(recorded))
    parser = build_parser()
    for argv in (["eval", "--run", "r"], ["batch", "i", "-o", "o"]):
        defaults = parser.parse_args(argv)
        assert (defaults.quantize, defaults.activations) == ("auto", "auto")
    beir = Path(__file__).resolve().parent.parent / "docs" / "examples" / "beir-mini"
    args = ["eval", "--beir", str(beir), "--run", str(beir / "bm25.trec"), "--model", "tiny-qwen3", "--depth", "2"]
    args += ["--template", "qwen3-reranker"]  # a random model: `auto` would serve no rerank
    assert main([*args, "--quantize", "int8", "--activations", "none"]) == 0
    assert (loads[-1]["quantize"], loads[-1]["activations"]) == ("int8", "none")
    assert "nDCG@10" in capsys.readouterr().out
    batch = parser.parse_args(
        ["batch", "in.jsonl", "-o", str(tmp_path / "out"), "--model", "tiny-qwen3", "--quantize", "fp8"]
    )
    backend = backend_from(batch)
    assert backend.scorer.model.quantization["weights"] == "fp8"
    assert backend.scorer.model.quantization["activations"] == "dynamic"  # auto: dynamic for --quantize fp8
    with pytest.raises(SystemExit):
        parser.parse_args(["eval", "--run", "r", "--activations", "static"])
