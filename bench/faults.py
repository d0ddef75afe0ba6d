"""`prefixscore bench --workload faults`: failure isolation as a property of the device loop.

A round is a random mix of work (seeded) run on the real device loop of an engine replica:
label scores, each item's own likelihood, embeddings (when the model serves them), prompts
scored from their own prefill (a completions prompt's rows: over a query, extending one, or a
query cached already), requests that share a query, that borrow another query's leading pages,
that hit the prefix cache, and stream opens with their batches. One or two faults are keyed on
requests, each by a marked token id the request alone carries:

- in an item: the call carrying it fails at launch (`launch`), fails when read back after
  writing garbage into the pages it wrote (`read-back`), or takes the prefix pool with it
  (`pool`); returns NaN in the item's rows (`nan`); fails planning (`planner`); or runs out of
  memory while it carries anything but that item (`oom`: no culprit, smaller calls pass);
- in a query's prefill region (`prefill`): every call prefilling it fails, so every request
  and stream open over that query is a culprit.

The round's verdict holds the rule the loop promises (engine/loop/isolation.py), whatever the call
layout: every request that is no culprit gets the answer it gets alone (a replica without
faults, one request at a time), every culprit its error; the loop still serves; pins, queue and
gauges are back at their baseline; and failed calls stay within, per fault,
ceil(log2(queries)) + ceil(log2(items)) + 2.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import json
import math
import threading
import time
from typing import Any

import numpy as np

from prefixscore.engine.loop.batcher import NonFiniteScores
from prefixscore.engine.loop.device_loop import DeviceWorker, WorkerStopped
from prefixscore.engine.loop.page_pins import StreamPin
from prefixscore.engine.loop.request import TokenizedRequest
from prefixscore.engine.loop.work_unit import Ticket, WorkUnit
from prefixscore.engine.requests.answers import LabelScores, Pooled, PromptRows, TokenLogprobs, label_scores
from prefixscore.engine.requests.pooling import PoolRows
from prefixscore.engine.runtime.scoring_engine import ScoringEngine
from prefixscore.engine.runtime.token_rows import TokenRows
from prefixscore.model.sentence_config import LAST, MEAN
from prefixscore.telemetry.metrics import ServiceMetrics

FAULTS = ("launch", "read-back", "prefill", "oom", "nan", "planner", "pool")
# log-probabilities, log-probs of token rows and hidden states of a request in a round against
# the same request alone: calls of other compositions move them by float32 rounding (under 1e-5
# measured on the suite's model); a request answered from another's rows, from garbage pages or
# from a stale epoch moves them by 1e-2 and more
TOLERANCE = 1e-4
WAIT_S = 120.0  # a round's answers, all of them; longer means the loop hung (or spins on failures)


@dataclasses.dataclass
class Job:
    """One request of a round: unary, or a batch of stream `stream`."""

    name: str
    request: TokenizedRequest
    stream: int | None = None


@dataclasses.dataclass(frozen=True)
class Fault:
    kind: str
    marker: int  # the token id that keys it
    job: int | None = None  # an item fault: the job whose item carries the marker
    query: tuple[int, ...] | None = None  # a prefill fault: the query carrying it
    item_tokens: int = 0  # oom: the marked item's tokens (a call carrying more fails)


@dataclasses.dataclass
class Round:
    seed: int
    jobs: list[Job]
    opens: list[tuple[int, ...]]  # the streams' queries
    warm: list[TokenizedRequest]  # run first, without faults: their queries are cache hits
    faults: list[Fault]
    after: TokenizedRequest  # a request without a fault, sent once the round is over

    def failing_queries(self) -> set[tuple[int, ...]]:
        """The queries whose prefill fails in every call."""
        return {f.query for f in self.faults if f.query is not None}

    def culprits(self) -> set[int]:
        """The jobs that must fail: marked by an item fault (but oom), or over a failing query."""
        out = {f.job for f in self.faults if f.job is not None and f.kind != "oom"}
        return out | {j for j, job in enumerate(self.jobs) if job.request.prefix in self.failing_queries()}

    def failing_opens(self) -> set[int]:
        return {s for s, q in enumerate(self.opens) if q in self.failing_queries()}

    def bound(self) -> int:
        """Failed calls the round may take: per fault, ceil(log2(queries)) + ceil(log2(items)) + 2."""
        queries = len({j.request.prefix or (k,) for k, j in enumerate(self.jobs)} | set(self.opens))
        items = sum(len(j.request.items) for j in self.jobs) + len(self.opens)
        per = math.ceil(math.log2(max(queries, 1))) + math.ceil(math.log2(max(items, 1))) + 2
        return per * len(self.faults)


def make_round(seed: int, vocab: int, page_tokens: int, hidden: int) -> Round:
    """A random round for a model of `vocab` ids and `hidden` columns (0: no embeddings)."""
    rng = np.random.default_rng(seed)
    lo, hi = vocab // 4, vocab // 2  # ordinary tokens; markers sit above them
    markers = iter(range(hi, hi + 64))

    def tokens(n: int) -> list[int]:
        return rng.integers(lo, hi, n).tolist()

    def query() -> tuple[int, ...]:
        return tuple(tokens(int(rng.integers(page_tokens // 2, 4 * page_tokens))))

    queries = [query() for _ in range(int(rng.integers(2, 5)))]
    for _ in range(int(rng.integers(0, 3))):  # borrowers: a lender's leading pages, then their own
        lender = queries[int(rng.integers(len(queries)))]
        pages = len(lender) // page_tokens
        if pages:
            queries.append(
                lender[: page_tokens * int(rng.integers(1, pages + 1))] + tuple(tokens(int(rng.integers(1, 20))))
            )
    warm_queries = {q for q in queries if rng.random() < 0.3}
    faults: list[Fault] = []
    kinds = list(rng.choice(FAULTS, size=int(rng.integers(1, 3)), replace=False))
    if "prefill" in kinds:  # a query of its own, the marker in its last page (no one borrows it)
        failing = query()
        failing = (*failing[:-1], next(markers), failing[-1])
        faults.append(Fault("prefill", failing[-2], query=failing))
        queries.append(failing)
    opens = [queries[int(rng.integers(len(queries)))] for _ in range(int(rng.integers(0, 3)))]
    if "prefill" in kinds and rng.random() < 0.5:
        opens.append(faults[0].query)  # type: ignore[arg-type]
    warm_queries -= {f.query for f in faults}
    jobs: list[Job] = []
    kinds_of_job = ["score", "likelihood", "prompt"] + (["embed"] if hidden else [])
    for k in range(int(rng.integers(3, 9))):
        kind = kinds_of_job[int(rng.integers(len(kinds_of_job)))]
        q = queries[int(rng.integers(len(queries)))] if rng.random() < 0.9 else ()
        if kind == "prompt" and (not q or (rng.random() < 0.5 and all(f.query != q for f in faults))):
            q = (*q, *tokens(int(rng.integers(1, 11))))  # a prompt extending a query (a choice after a question)
        jobs.append(Job(f"{kind} {k}", _request(kind, q, rng, tokens, hidden, many=k == 0 and rng.random() < 0.5)))
    for s, q in enumerate(opens):
        for b in range(int(rng.integers(1, 3))):
            jobs.append(Job(f"stream {s} batch {b}", _request("score", q, rng, tokens, hidden), stream=s))
    for kind in kinds:
        if kind == "prefill":
            continue
        marks = [k for k in range(len(jobs)) if all(f.job != k for f in faults) and len(jobs[k].request.items)]
        if not marks:  # no job with items left to mark
            continue
        j, first = int(rng.choice(marks)), False
        many = jobs[0].request
        if kind == "read-back" and len(many.items) >= 12 and many.prefix and all(0 != f.job for f in faults):
            # its first item: the call that fails then prefills its query and leaves the rest of its items
            # to the next call, launched before the failure is read (the items read a stale epoch)
            j, first = 0, True
            warm_queries.discard(many.prefix)
        jobs[j], fault = _marked(jobs[j], kind, next(markers), rng, first)
        faults.append(dataclasses.replace(fault, job=j))
    warm = [_request("score", q, rng, tokens, hidden) for q in warm_queries]
    served = [q for q in queries if all(f.query != q for f in faults)]
    after = _request("score", served[int(rng.integers(len(served)))], rng, tokens, hidden)
    return Round(seed, jobs, opens, warm, faults, after)


def _request(
    kind: str, prefix: tuple[int, ...], rng: np.random.Generator, tokens: Any, hidden: int, many: bool = False
) -> TokenizedRequest:
    """A request of `kind` over `prefix` (empty: whole sequences); `many`: more items than a
    small engine's call holds, so its work spans calls (and calls overlap on the device)."""
    if kind == "prompt":  # its rows from a random position on, its prefill's own
        first = int(rng.integers(len(prefix)))
        return TokenizedRequest(prefix, [], (), PromptRows(len(prefix) - first), False, None, first)
    count = int(rng.integers(12, 33)) if many else int(rng.integers(1, 7))
    items = [tokens(int(rng.integers(1, 11))) for _ in range(count)]
    if kind == "likelihood":  # the context's last token leads every item (its row reads the first)
        rows = TokenRows.from_lists([[prefix[-1] if prefix else 7, *it] for it in items])
        return TokenizedRequest(prefix, rows, (), TokenLogprobs(2), not prefix)
    if kind == "embed":
        mode = (LAST, MEAN)[int(rng.integers(2))]
        pool = PoolRows(mode, np.zeros(len(items), np.int64), hidden)
        return TokenizedRequest(prefix, items, (), Pooled(pool), not prefix)
    labels = tuple(int(t) for t in rng.choice(np.arange(100, 200), size=int(rng.integers(1, 4)), replace=False))
    return TokenizedRequest(prefix, items, labels, label_scores(bool(rng.random() < 0.5)), not prefix)


def _marked(job: Job, kind: str, marker: int, rng: np.random.Generator, first: bool) -> tuple[Job, Fault]:
    """The job with `marker` in one of its items (`first`: its first; never a likelihood item's
    leading token)."""
    req = job.request
    rows = [list(map(int, req.items[i])) for i in range(len(req.items))]
    i = 0 if first else int(rng.integers(len(rows)))
    lead = req.answer.lead
    rows[i][int(rng.integers(lead, len(rows[i])))] = marker  # a likelihood item has a token past its lead
    marked = dataclasses.replace(req, items=TokenRows.from_lists(rows))
    return Job(job.name, marked, job.stream), Fault(kind, marker, item_tokens=len(rows[i]))


# ---- the faults, injected into an engine replica -------------------------------------------------
class _FailedReadBack:
    """A call that failed on the device: reading it raises."""

    def __array__(self, *args: Any, **kwargs: Any) -> np.ndarray:
        raise RuntimeError("injected fault: the call failed on the device")


class Injector:
    """The round's faults on `engine` (its launch and its call builder), while armed."""

    def __init__(self, engine: ScoringEngine, faults: list[Fault]) -> None:
        self.engine, self.faults, self.armed = engine, faults, False
        self._launch, self._builder = engine.launch, engine.builder
        engine.launch = self.launch  # type: ignore[method-assign]
        engine.builder = self.builder  # type: ignore[method-assign]

    def remove(self) -> None:
        del self.engine.launch, self.engine.builder  # the instance's own attributes: the class's again

    def launch(self, plan: Any) -> Any:
        if not self.armed:
            return self._launch(plan)
        inputs = plan.inputs
        prefill, items = np.asarray(inputs.prefill.tokens), np.asarray(inputs.items.tokens)
        hit = [f for f in self.faults if ((prefill if f.kind == "prefill" else items) == f.marker).any()]
        kinds = {f.kind for f in hit}
        if "launch" in kinds or "prefill" in kinds:
            raise RuntimeError("injected fault: the call failed to launch")
        if any(f.kind == "oom" and plan.item_tokens > f.item_tokens for f in hit):
            raise RuntimeError("RESOURCE_EXHAUSTED: injected out of memory on the call's shape")
        out = self._launch(plan)
        if "read-back" in kinds:
            write_garbage(self.engine, np.asarray(inputs.prefill.write_pages))
            return _FailedReadBack()
        if "pool" in kinds:
            for part in self.engine._pool:
                part.delete()
            return _FailedReadBack()
        nan = [f.marker for f in hit if f.kind == "nan"]
        if nan:
            out = out.at[self._rows(inputs, plan.shape.prefill_tokens, nan)].set(np.nan)
        return out

    def builder(self) -> Any:
        builder = self._builder()
        add_items = builder.add_items
        planner = [f.marker for f in self.faults if f.kind == "planner"]

        def faulty(key, pages, prefix_len, rows, first, count, *rest, **kw):  # noqa: ANN001, ANN202
            taken = rows.flat[rows.offsets[first] : rows.offsets[first + count]] if count > 0 else rows.flat[:0]
            if self.armed and np.isin(taken, planner).any():
                raise ValueError("injected fault: the planner failed on these items")
            return add_items(key, pages, prefix_len, rows, first, count, *rest, **kw)

        builder.add_items = faulty
        return builder

    @staticmethod
    def _rows(inputs: Any, prefill_tokens: int, markers: list[int]) -> np.ndarray:
        """The output rows of the items carrying a marker: [devices * R] indices."""
        tokens, item_ids = np.asarray(inputs.items.tokens), np.asarray(inputs.items.item_ids)
        read_at, n_rows = np.asarray(inputs.items.read_at), np.asarray(inputs.items.n_rows)
        out = []
        for d in range(tokens.shape[0]):
            marked = set(item_ids[d][np.isin(tokens[d], markers)].tolist())
            at = read_at[d, : n_rows[d]] - prefill_tokens
            rows = np.flatnonzero((at >= 0) & np.isin(item_ids[d][np.maximum(at, 0)], list(marked)))
            out.append(rows + d * read_at.shape[1])
        return np.concatenate(out)


def write_garbage(engine: ScoringEngine, pages: np.ndarray) -> None:
    """What a call that failed on the device may leave in the pool pages it wrote (`pages`: a
    call's write_pages, padding included): random K/V, far from any the model computes."""
    import jax
    import jax.numpy as jnp

    written = np.unique(pages[pages < engine.pool_pages])
    if written.size == 0:
        return
    parts = []
    for k, part in enumerate(engine._pool):
        noise = jax.random.normal(jax.random.key(k), part[:, :, written].shape, jnp.float32) * 4.0
        parts.append(part.at[:, :, written].set(noise.astype(part.dtype)))
    engine._pool = tuple(parts)


# ---- running a round and judging it --------------------------------------------------------------
@dataclasses.dataclass
class Verdict:
    seed: int
    failures: list[str]
    failed_calls: int
    bound: int
    drift: float  # the largest difference of an answer from its request alone

    @property
    def ok(self) -> bool:
        return not self.failures

    def report(self) -> str:
        head = f"seed {self.seed}: {self.failed_calls} failed calls (bound {self.bound}), drift {self.drift:.2e}"
        return "\n  ".join([head, *self.failures])


def _answer(unit: WorkUnit) -> np.ndarray:
    """A request's answer, its label probabilities in log space (the others as they are)."""
    answer = unit.reply.answer.astype(np.float64)
    return np.log(np.maximum(answer, 1e-45)) if isinstance(unit.payload.answer, LabelScores) else answer


def _start(engine: ScoringEngine) -> tuple[DeviceWorker, ServiceMetrics]:
    metrics, started = ServiceMetrics(), concurrent.futures.Future()
    worker = DeviceWorker(
        lambda: engine,
        metrics,
        max_queue_items=1 << 20,
        on_ready=lambda err: started.set_exception(err) if err else started.set_result(None),
    )
    worker.start()
    started.result()
    return worker, metrics


def _run(worker: DeviceWorker, requests: list[TokenizedRequest]) -> list[WorkUnit]:
    """The requests queued together, then answered (errors in their replies)."""
    units = [WorkUnit(r, Ticket(method="Faults", request_id=f"r{k}")) for k, r in enumerate(requests)]
    done = threading.Semaphore(0)
    for unit in units:
        unit.reply.on_done = lambda _: done.release()
    with worker.paused():
        for unit in units:
            worker.submit(unit)
    for _ in units:
        if not done.acquire(timeout=WAIT_S):
            raise TimeoutError("the device loop answered no request within the wait")
    return units


class FaultRounds:
    """Rounds over replicas of `engine`: one that takes the faults, one without any that
    answers each request alone (the reference). Both share the engine's executables."""

    def __init__(self, engine: ScoringEngine) -> None:
        self.engine = engine
        self.target = engine.replica()
        self.reference, _ = _start(engine.replica())

    def close(self) -> None:
        self.reference.stop(30)

    def round(self, seed: int) -> Verdict:
        engine = self.target
        rnd = make_round(seed, engine.cfg.vocab_size, engine.buckets.page_tokens, engine.buckets.hidden)
        alone = [_answer(_run(self.reference, [job.request])[0]) for job in rnd.jobs]
        after_alone = _answer(_run(self.reference, [rnd.after])[0])
        injector = Injector(engine, rnd.faults)
        worker, metrics = _start(engine)
        failures: list[str] = []
        drift = 0.0
        try:
            _run(worker, rnd.warm)
            baseline = _gauges(metrics)
            injector.armed = True
            units, pins, answered = self._submit(worker, rnd)
            deadline = time.monotonic() + WAIT_S
            culprits, failing_opens = rnd.culprits(), rnd.failing_opens()
            failing = rnd.failing_queries()
            for s, pin in enumerate(pins):
                try:
                    pin.ready.result(max(0.0, deadline - time.monotonic()))
                    if s in failing_opens:
                        failures.append(f"stream {s}: its open's prefill failed in every call, yet it opened")
                except Exception as err:
                    if s not in failing_opens:
                        failures.append(f"stream {s}: its open failed: {type(err).__name__}: {err}")
            for k, (job, unit, done) in enumerate(zip(rnd.jobs, units, answered, strict=True)):
                if not done.wait(max(0.0, deadline - time.monotonic())):
                    failures.append(f"{job.name}: never answered")
                    continue
                error = unit.reply.error
                if k in culprits:
                    # NaN alone: its precise error (over a failing query, its prefill fails first)
                    nan = any(f.kind == "nan" and f.job == k for f in rnd.faults) and job.request.prefix not in failing
                    if error is None or (nan and not isinstance(error, NonFiniteScores)):
                        failures.append(f"{job.name}: a culprit, answered with {error!r}")
                    continue
                if error is not None:
                    failures.append(f"{job.name}: no culprit, failed: {type(error).__name__}: {error}")
                    continue
                got = _answer(unit)
                gap = float(np.max(np.abs(got - alone[k]))) if got.size else 0.0
                drift = max(drift, gap)
                if not gap <= TOLERANCE:
                    failures.append(f"{job.name}: differs from the request alone by {gap:.3g}")
            injector.armed = False
            for pin in pins:
                worker.release(pin)
            if worker.failure is not None:
                failures.append(f"the device loop broke: {worker.failure!r}")
            else:
                (after,) = _run(worker, [rnd.after])
                if after.reply.error is not None:
                    failures.append(f"a request after the round failed: {after.reply.error!r}")
                elif not np.max(np.abs(_answer(after) - after_alone)) <= TOLERANCE:
                    failures.append("a request after the round differs from the request alone")
            gauges = _gauges(metrics)
            if gauges != baseline:
                failures.append(f"not back at the baseline: {gauges} (before the round {baseline})")
            cache = engine.prefix_cache
            cache.evict_idle()  # every page held by no one is free again: none leaked
            if cache.free_pages != cache.total_pages:
                failures.append(f"{cache.total_pages - cache.free_pages} pages held by no request or stream")
            failed_calls = int(metrics.registry.get_sample_value("prefixscore_failed_calls_total") or 0)
            if failed_calls > rnd.bound():
                failures.append(f"{failed_calls} failed calls, over the bound of {rnd.bound()}")
        except TimeoutError as err:
            failures.append(f"hung: {err}")
            failed_calls = -1
        finally:
            injector.remove()
            if failures:  # what is left (a loop spinning on failures) fails now, not in the background
                worker.abandon(WorkerStopped("the fault round failed"))
            worker.stop(30)
        faults = ", ".join(
            f"{f.kind} on {rnd.jobs[f.job].name if f.job is not None else 'a query'}" for f in rnd.faults
        )
        if failures:
            failures.insert(0, f"faults: {faults}; jobs: {[j.name for j in rnd.jobs]}; streams: {len(rnd.opens)}")
        return Verdict(seed, failures, failed_calls, rnd.bound(), drift)

    @staticmethod
    def _submit(worker: DeviceWorker, rnd: Round) -> tuple[list[WorkUnit], list[StreamPin], list[threading.Event]]:
        """Every stream opened and every job queued before the loop plans (the opens' prefills
        may start: a paused loop still runs them); the jobs' units, the streams' pins, and an
        event per unit, set when it is answered."""
        units = [WorkUnit(job.request, Ticket(method="Faults", request_id=job.name)) for job in rnd.jobs]
        answered = [threading.Event() for _ in units]
        for unit, done in zip(units, answered, strict=True):
            unit.reply.on_done = lambda _, done=done: done.set()
        with worker.paused():
            pins = [worker.open_prefix(q, f"open {s}") for s, q in enumerate(rnd.opens)]
            for unit in units:
                worker.submit(unit)
        return units, pins, answered


def _gauges(metrics: ServiceMetrics) -> dict[str, float]:
    """The loop's gauges of held work: queued items and requests, running requests, pinned prefixes."""
    names = ("queue_depth", "queued_requests", "running_requests", "prefix_cache_pinned")
    return {n: metrics.registry.get_sample_value(f"prefixscore_{n}") or 0.0 for n in names}


def run_round(engine: ScoringEngine, seed: int) -> Verdict:
    """One round over replicas of `engine` (see FaultRounds)."""
    rounds = FaultRounds(engine)
    try:
        return rounds.round(seed)
    finally:
        rounds.close()


def run(args: argparse.Namespace) -> int:
    """`bench --workload faults`: --fault-seeds rounds from --seed on, in process on the engine
    the options build; each round's line, then the seeds that failed (replay one with
    `--seed S --fault-seeds 1`). Non-zero when any failed."""
    from prefixscore.engine.build import EngineSpec, build_engine

    engine = build_engine(EngineSpec.from_options(vars(args), devices=args.devices)).engine
    rounds = FaultRounds(engine)
    verdicts = []
    try:
        for seed in range(args.seed, args.seed + args.fault_seeds):
            verdict = rounds.round(seed)
            verdicts.append(verdict)
            print(
                verdict.report()
                if not verdict.ok
                else f"seed {seed}: ok, {verdict.failed_calls} failed calls (bound {verdict.bound})",
                flush=True,
            )
    finally:
        rounds.close()
    failed = [v.seed for v in verdicts if not v.ok]
    print(
        f"faults: {len(verdicts) - len(failed)} of {len(verdicts)} rounds held on {engine.n_devices} device(s); "
        f"failed seeds: {failed or 'none'}"
    )
    if args.json_path:
        record = {
            "workload": "faults",
            "devices": engine.n_devices,
            "seeds": len(verdicts),
            "first_seed": args.seed,
            "failed": failed,
            "failed_calls": sum(v.failed_calls for v in verdicts),
            "max_drift": max((v.drift for v in verdicts), default=0.0),
            "reports": [v.report() for v in verdicts if not v.ok],
        }
        with open(args.json_path, "w") as f:
            json.dump(record, f, indent=2)
    return 1 if failed else 0
