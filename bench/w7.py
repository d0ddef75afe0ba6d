"""W7: k-shot multiple choice, each choice scored by its own likelihood (docs/benchmarks.md).

A header of worked examples shared by every question of a subject, each question's choices scored
by the sum of their tokens' log-probs, as lm-evaluation-harness scores MMLU. Token ids from the
bench's seed. The modes, one after another over one engine (and, for the baseline, the same
weights in transformers), each over an untimed subject of its own first (its shapes compile),
then over the timed subject (the same for every mode, none of it cached before):

- `completions`: /v1/completions as lm-eval's `local-completions` sends it: each prompt the whole
  header + question + choice as token ids, echo, logprobs 1, max_tokens 1, in lm-eval's order
  (longest first) and batches of --w7-batch prompts;
- `grpc`: per question, its choices as items over header + question (`ScoreClient.loglikelihood`);
- `hf`: lm-eval's own `hf` backend (transformers, one sequence per choice, batches of
  --w7-batch), when the model has a transformers checkpoint (smollm2-135m's GGUF, a directory);
- `llamacpp`: llama.cpp's prefix recipe (llama-cpp-python over the same GGUF, when installed):
  one sequence at a time, question by question, each choice evaluated after the longest prefix
  its KV cache already holds (a question's context once, the header once for all), with the
  logits of every evaluated token (`logits_all`, as its completions with echo and logprobs need).

Every engine mode starts from a cold prefix cache (idle prefixes evicted first).

Each row: choices/s, prompt tokens/s (every prompt whole: what a plain forward pass of each
computes), the tokens the engine prefilled and computed, the head's share of the projection
FLOPs the engine spent (attention left out), and the largest |log-likelihood - hf's| with the
greedy flags that differ (without a transformers checkpoint: against the gRPC mode's).
"""

from __future__ import annotations

import argparse
import dataclasses
import http.client
import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from prefixscore.bench import workloads as wl
from prefixscore.bench.metrics import token_share
from prefixscore.bench.session import Bench

# the modes that run on the engine (the others are baselines)
ENGINE_MODES = ("completions", "grpc")


@dataclasses.dataclass(frozen=True)
class Question:
    context: list[int]  # the header + the question
    choices: list[list[int]]


def questions(gen: wl.Generator, header_tokens: int, n: int, question_tokens: tuple[int, int]) -> list[Question]:
    """W7's questions over one header: log-uniform question lengths, 4 choices of 2-10 tokens."""
    header = gen.tokens(header_tokens)
    return [
        Question(
            header + gen.tokens(gen.log_uniform(*question_tokens)),
            [gen.tokens(gen.log_uniform(2, 10)) for _ in range(4)],
        )
        for _ in range(n)
    ]


def _pairs(qs: list[Question]) -> list[tuple[list[int], list[int]]]:
    """Every (context, choice), in lm-eval's order: longest prompt first, then by its tokens."""
    pairs = [(q.context, c) for q in qs for c in q.choices]
    return sorted(pairs, key=lambda p: (-len(p[0]) - len(p[1]), tuple(p[0] + p[1])))


def _completions(target: str, batch: int) -> Callable[[list[Question]], list[tuple[float, bool]]]:
    host, port = target.rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=3600)

    def run(qs: list[Question]) -> list[tuple[float, bool]]:
        pairs = _pairs(qs)
        out = []
        for at in range(0, len(pairs), batch):
            chunk = pairs[at : at + batch]
            body = {"prompt": [c + x for c, x in chunk], "echo": True, "logprobs": 1, "max_tokens": 1, "temperature": 0}
            conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
            response = conn.getresponse()
            answer = json.loads(response.read())
            if response.status != 200:
                raise RuntimeError(f"/v1/completions answered {response.status}: {answer}")
            for (context, _), choice in zip(chunk, answer["choices"], strict=True):
                # lm-eval's parse_logprobs: the continuation's entries, the new token's dropped
                lps = choice["logprobs"]["token_logprobs"][len(context) : -1]
                tops = choice["logprobs"]["top_logprobs"][len(context) : -1]
                out.append((sum(lps), all(lp == max(top.values()) for lp, top in zip(lps, tops, strict=True))))
        return _in_question_order(qs, pairs, out)

    return run


def _in_question_order(qs: list[Question], pairs: list, results: list) -> list:
    where = {(tuple(c), tuple(x)): r for (c, x), r in zip(pairs, results, strict=True)}
    return [where[(tuple(q.context), tuple(c))] for q in qs for c in q.choices]


def _grpc(client: Any) -> Callable[[list[Question]], list[tuple[float, bool]]]:
    def run(qs: list[Question]) -> list[tuple[float, bool]]:
        out = []
        for q in qs:
            result = client.loglikelihood(q.context, q.choices)
            out += [(lk.logprob, lk.is_greedy) for lk in result.likelihoods]
        return out

    return run


def _hf(model: str, batch: int) -> Callable[[list[Question]], list[tuple[float, bool]]] | None:
    """lm-eval's `hf` backend over the model's transformers checkpoint; None when it has none."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if model == "smollm2-135m":
        from prefixscore.model.presets import smollm2_gguf_path

        path = smollm2_gguf_path()
        where, extra = str(path.parent), {"gguf_file": path.name}
    elif Path(model).is_dir():
        where, extra = model, {}
    else:
        return None
    from lm_eval.models.huggingface import HFLM

    torch_model = AutoModelForCausalLM.from_pretrained(where, local_files_only=True, **extra).eval()
    tokenizer = AutoTokenizer.from_pretrained(where, local_files_only=True, **extra)
    lm = HFLM(pretrained=torch_model, tokenizer=tokenizer, batch_size=batch, device="cpu")

    def run(qs: list[Question]) -> list[tuple[float, bool]]:
        requests = [(("", ""), q.context, c) for q in qs for c in q.choices]
        return lm._loglikelihood_tokens(requests, disable_tqdm=True)

    return run


def _llamacpp(model: str) -> Callable[[list[Question]], list[tuple[float, bool]]] | None:
    """llama.cpp's prefix recipe over the model's GGUF (see the module doc); None without a GGUF
    or without llama-cpp-python."""
    if model == "smollm2-135m":
        from prefixscore.model.presets import smollm2_gguf_path

        path = smollm2_gguf_path()
    elif model.endswith(".gguf") and Path(model).is_file():
        path = Path(model)
    else:
        return None
    try:
        from llama_cpp import Llama
    except ImportError:
        return None
    llm = Llama(str(path), n_ctx=4096, n_batch=512, logits_all=True, n_threads=os.cpu_count(), verbose=False)

    def score(context: list[int], choice: list[int]) -> tuple[float, bool]:
        tokens = context + choice
        held = llm.input_ids[: llm.n_tokens].tolist()
        reuse = next(
            (i for i, (a, b) in enumerate(zip(held, tokens, strict=False)) if a != b), min(len(held), len(tokens))
        )
        llm.n_tokens = min(reuse, len(tokens) - 1)  # eval() drops the KV cache past it
        llm.eval(tokens[llm.n_tokens :])
        logits = llm.scores[len(context) - 1 : len(tokens) - 1].astype(np.float64)
        top = logits.max(axis=1)
        lse = top + np.log(np.exp(logits - top[:, None]).sum(axis=1))
        own = logits[np.arange(len(choice)), choice]
        return float((own - lse).sum()), bool((logits.argmax(axis=1) == choice).all())

    def run(qs: list[Question]) -> list[tuple[float, bool]]:
        return [score(q.context, c) for q in qs for c in q.choices]

    return run


def run(args: argparse.Namespace) -> int:
    """`prefixscore bench --workload w7`: every mode's row printed, and written to --json."""
    from prefixscore.model import flops
    from prefixscore.telemetry.compiles import CompileCounter

    bench = Bench(args)
    try:
        if bench.scorer is None:
            raise SystemExit("w7 runs the engine in process (no --target): it reads the engine's token counts")
        gen = wl.Generator(bench.vocab, args.seed)
        sizes = (args.w7_header, args.w7_questions, (args.w7_min_question, args.w7_max_question))
        # each mode runs a subject of its own first, untimed (its shapes compile), then the timed
        # one: new token ids, so nothing of the timed subject is in the prefix cache before it
        warmups = [questions(gen, *sizes) for _ in wl.W7_MODES]
        qs = questions(gen, *sizes)
        bench.target("w4")  # serves this engine on free ports (gRPC and HTTP)
        makers: dict[str, Callable[[], Callable[[list[Question]], list[tuple[float, bool]]] | None]] = {
            "completions": lambda: _completions(bench.http_target, args.w7_batch),
            "grpc": lambda: _grpc(bench.local_remote.client),
            "hf": lambda: _hf(args.model, args.w7_batch),
            "llamacpp": lambda: _llamacpp(args.model),
        }
        modes = {mode: makers[mode]() for mode in wl.W7_MODES if mode in args.w7_modes}
        engine, cfg = bench.scorer.engine, bench.cfg
        prompt_tokens = sum(len(q.context) + len(c) for q in qs for c in q.choices)
        records, results = [], {}
        for (mode, fn), warmup in zip(modes.items(), warmups, strict=False):
            if fn is None:
                why = "no transformers checkpoint" if mode == "hf" else "no GGUF, or llama-cpp-python not installed"
                print(f"w7 {mode}: skipped ({why})", file=sys.stderr)
                continue
            fn(warmup if mode in ENGINE_MODES else warmup[:2])  # untimed (the baselines compile nothing)
            engine.prefix_cache.evict_idle()  # nothing of another mode's run is cached
            before, tokens0, compiles = dict(engine.stats), bench.token_counts(), CompileCounter.count()
            start = time.perf_counter()
            results[mode] = fn(qs)
            seconds = time.perf_counter() - start
            tokens1 = bench.token_counts()
            record: dict[str, Any] = {
                "workload": "w7",
                "mode": mode,
                "choices": 4 * len(qs),
                "seconds": round(seconds, 3),
                "choices_per_s": round(4 * len(qs) / seconds, 2),
                "prompt_tokens_per_s": round(prompt_tokens / seconds, 1),
            }
            if mode in ENGINE_MODES:
                prefilled = engine.stats["prefill_tokens"] - before["prefill_tokens"]
                computed = engine.stats["tokens"] - before["tokens"]
                rows = engine.stats["rows"] - before["rows"]  # each a vocabulary head's
                head = rows * flops.token_row_head(cfg)
                record |= {
                    "prefill_tokens": prefilled,
                    "item_tokens": computed - prefilled,
                    "head_rows": rows,
                    "head_flop_share": round(head / (head + computed * flops.linear_per_token(cfg)), 3),
                    **token_share(tokens0, tokens1),
                    "compilations_while_timed": CompileCounter.count() - compiles,
                }
            records.append(record)
        if not results:
            raise SystemExit(f"w7: none of {', '.join(args.w7_modes)} could run here")
        # every mode against the baseline (transformers) where there is one, else against gRPC's
        reference = next(m for m in ("hf", "grpc", *results) if m in results)
        want = results[reference]
        for record in records:
            got = results[record["mode"]]
            diff = np.abs(np.array([ll for ll, _ in got]) - np.array([ll for ll, _ in want]))
            record[f"max_abs_diff_vs_{reference}"] = float(diff.max())
            record[f"greedy_differs_vs_{reference}"] = sum(a[1] != b[1] for a, b in zip(got, want, strict=True))
        header = {
            "header_tokens": args.w7_header,
            "questions": len(qs),
            "context_tokens": sum(len(q.context) for q in qs),  # each question's header + question
            "prompt_tokens": prompt_tokens,
        }
        print(json.dumps({**bench.context(), **header}), file=sys.stderr)
        for record in records:
            print(json.dumps(record))
        if args.json_path:
            Path(args.json_path).write_text(json.dumps([{**bench.context(), **header, **r} for r in records], indent=1))
    finally:
        bench.close()
    return 0
