"""Where a bench request goes: the in-process Scorer (any mode), a gRPC ScoreService, or the HTTP
API's /v1/rerank and /v1/classify. Each backend answers `score(request, mode)` with the scores
and the query tokens the server found in its prefix cache."""

from __future__ import annotations

import http.client
import json
import threading
from typing import Any

from prefixscore.bench import workloads as wl


class InProcess:
    """The in-process Scorer (validation, prefix cache, engine), any mode."""

    kind = "in-process"

    def __init__(self, scorer: Any) -> None:
        self.scorer = scorer

    def score(self, req: wl.Request, mode: str) -> tuple[list[list[float]], int]:
        scores = self.scorer.score(req.query, req.items, req.labels, req.apply_softmax, mode=mode)
        return scores, self.scorer.last_usage.cached_tokens


class Remote:
    """A gRPC ScoreService (the server runs its prefix path)."""

    kind = "grpc"

    def __init__(self, target: str, prefix_key: bool = True) -> None:
        from prefixscore.client import ScoreClient

        self.target = target
        self.client = ScoreClient(target, send_prefix_key=prefix_key)

    def score(self, req: wl.Request, mode: str) -> tuple[list[list[float]], int]:
        result = self.client.score(req.query, req.items, label_token_ids=req.labels, apply_softmax=req.apply_softmax)
        return result.scores, result.usage.cached_tokens

    def close(self) -> None:
        self.client.close()


class RemoteRerank:
    """HTTP POST /v1/rerank, one keep-alive connection per client thread."""

    kind = "http"

    def __init__(self, target: str) -> None:
        self.target = target
        self._local = threading.local()

    def score(self, req: wl.RerankTexts, mode: str) -> tuple[list[float], int]:
        conn = getattr(self._local, "conn", None)
        if conn is None:
            host, port = self.target.rsplit(":", 1)
            conn = self._local.conn = http.client.HTTPConnection(host, int(port), timeout=600)
        body = json.dumps({"query": req.query, "documents": req.items, "return_documents": False})
        conn.request("POST", "/v1/rerank", body, {"Content-Type": "application/json"})
        response = conn.getresponse()
        answer = json.loads(response.read())
        if response.status != 200:
            raise RuntimeError(f"/v1/rerank answered {response.status}: {answer}")
        return [r["relevance_score"] for r in answer["results"]], answer["usage"]["cached_tokens"]


class RemoteClassify:
    """HTTP POST /v1/classify (W6): each request's conversation + response inputs in one body,
    whose shared leading tokens the server prefills once; one_by_one: each input in a body of
    its own, one after another (every one a whole sequence)."""

    kind = "http"

    def __init__(self, target: str, one_by_one: bool) -> None:
        self.target = target
        self.one_by_one = one_by_one
        self._local = threading.local()

    def _post(self, inputs: list[list[int]]) -> dict[str, Any]:
        conn = getattr(self._local, "conn", None)
        if conn is None:
            host, port = self.target.rsplit(":", 1)
            conn = self._local.conn = http.client.HTTPConnection(host, int(port), timeout=600)
        conn.request("POST", "/v1/classify", json.dumps({"input": inputs}), {"Content-Type": "application/json"})
        response = conn.getresponse()
        answer = json.loads(response.read())
        if response.status != 200:
            raise RuntimeError(f"/v1/classify answered {response.status}: {answer}")
        return answer

    def score(self, req: wl.Request, mode: str) -> tuple[list[list[float]], int]:
        inputs = [req.query + item for item in req.items]
        answers = [self._post([one]) for one in inputs] if self.one_by_one else [self._post(inputs)]
        probs = [d["probs"] for a in answers for d in a["data"]]
        return probs, sum(a["usage"]["prompt_tokens_details"]["cached_tokens"] for a in answers)


# what a workload is sent to (session.Bench.target picks it)
Backend = InProcess | Remote | RemoteRerank | RemoteClassify
