"""W8: embeddings with an instruction (docs/benchmarks.md).

Passages of 64-256 tokens (log-uniform) embedded with no prompt, and queries of 10-30 tokens after
an instruction prompt of about 20 tokens (Qwen3-Embedding's shape), last-token pooling, normalized.
The checkpoint is a sentence-transformers directory (`--model DIR` with a modules.json), or one
written here in a preset's shapes (`--model bench-cpu`: random weights, SmolLM2's tokenizer and
vocabulary), so that sentence-transformers runs the same weights. The modes, one after another,
each over the timed set untimed first (the shapes its calls take compile; nothing it caches is
kept), then timed (the same texts for every mode):

- `http`: /v1/embeddings in batches of --w8-batch inputs (passages with no prompt, queries with
  the `query` prompt: the instruction, the prefix the engine caches);
- `grpc`: `Embed` through the Python client (`ScoreClient.embed`), the same batches;
- `inprocess`: `Scorer.embed`, the same batches, no transport;
- `whole`: the queries with the instruction written into each text and no prompt, so each input
  runs whole: what the cached instruction saves;
- `st`: sentence-transformers' `encode` on the same checkpoint (batch_size --w8-batch).

Each engine mode runs once per `--w8-clients` value: that many clients send its requests at
once (each the next request when its last came back), as TEI's users send; `st` runs once,
one caller.

Every engine mode starts from a cold prefix cache. Each row: inputs/s (passages and queries), the
tokens the engine prefilled and computed, the tokens computed against those the requests needed,
and the largest |embedding component - sentence-transformers'|.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import json
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from prefixscore.bench import workloads as wl
from prefixscore.bench.metrics import token_share
from prefixscore.bench.session import Bench

INSTRUCTION = "Instruct: Given a web search query, retrieve relevant passages that answer the query\nQuery: "
ENGINE_MODES = ("http", "grpc", "inprocess", "whole")


@dataclasses.dataclass(frozen=True)
class Texts:
    passages: list[str]
    queries: list[str]


def write_st_checkpoint(
    torch_model: Any,
    tokenizer_dir: Path,
    out: Path,
    mode: str,
    include_prompt: bool,
    normalize: bool,
    prompts: Mapping[str, str],
) -> Path:
    """A transformers causal LM with a sentence-transformers Transformer -> Pooling (-> Normalize)
    configuration beside its own weights and config.json (as Qwen3-Embedding publishes them: its
    architectures stay *ForCausalLM), `prompts` saved with `query` the default."""
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.modules import Normalize, Pooling, Transformer

    lm_dir, st_dir = out / "checkpoint", out / "saved"
    torch_model.save_pretrained(lm_dir)
    for f in tokenizer_dir.iterdir():
        if f.name != "chat_template.jinja":  # a plain text embedder: texts are not chat messages
            shutil.copy(f, lm_dir)
    hidden = torch_model.config.hidden_size
    modules = [Transformer(str(lm_dir)), Pooling(hidden, pooling_mode=mode, include_prompt=include_prompt)]
    if normalize:
        modules.append(Normalize())
    SentenceTransformer(modules=modules, prompts=dict(prompts), default_prompt_name="query", device="cpu").save(
        str(st_dir)
    )
    for entry in json.loads((st_dir / "modules.json").read_text()):
        if entry["path"]:
            shutil.copytree(st_dir / entry["path"], lm_dir / entry["path"])
    for f in ("modules.json", "config_sentence_transformers.json", "sentence_bert_config.json"):
        shutil.copy(st_dir / f, lm_dir / f)
    return lm_dir


def preset_checkpoint(preset: str, out: Path, seed: int) -> Path:
    """A random Qwen3 in the preset's shapes (SmolLM2's vocabulary and tokenizer), as a
    sentence-transformers checkpoint: last-token pooling, normalized, the instruction as `query`."""
    import torch
    import transformers

    from prefixscore.model import presets

    cfg = presets.RANDOM_PRESETS[preset][0]
    config = transformers.Qwen3Config(
        vocab_size=49152,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim,
        max_position_embeddings=cfg.max_position_embeddings,
        rope_theta=cfg.rope_theta,
        rms_norm_eps=cfg.rms_norm_eps,
        tie_word_embeddings=True,
        pad_token_id=2,  # SmolLM2's <|im_end|>: sentence-transformers pads batches with it
    )
    torch.manual_seed(seed)
    model = transformers.Qwen3ForCausalLM(config).eval()
    prompts = {"query": INSTRUCTION, "document": ""}
    return write_st_checkpoint(model, presets.smollm2_tokenizer_dir(), out, "lasttoken", True, True, prompts)


def texts(tokenizer: Any, gen: wl.Generator, passages: int, queries: int) -> Texts:
    """Texts decoded from random ids of the tokenizer's ordinary vocabulary (ids past its
    special tokens), passages of 64-256 tokens and queries of 10-30, log-uniform."""
    low = 1000  # past SmolLM2's special and byte tokens

    def text(n: int) -> str:
        return tokenizer.decode(gen.rng.integers(low, gen.vocab, n).tolist())

    return Texts(
        [text(gen.log_uniform(64, 256)) for _ in range(passages)],
        [text(gen.log_uniform(10, 30)) for _ in range(queries)],
    )


Embed = Callable[[list[str], str], np.ndarray]  # (texts, prompt name) -> [texts, dimensions]


def _batched(embed: Embed, batch: int) -> Callable[[Texts, int], np.ndarray]:
    """The passages (no prompt) then the queries (the `query` prompt), `batch` inputs a request,
    sent by `clients` threads at once (each takes the next request when its last came back, as
    TEI's users send), answers in the inputs' order."""

    def run(t: Texts, clients: int) -> np.ndarray:
        requests = [(t.passages[at : at + batch], "document") for at in range(0, len(t.passages), batch)]
        requests += [(t.queries[at : at + batch], "query") for at in range(0, len(t.queries), batch)]
        if clients == 1:
            return np.concatenate([embed(*r) for r in requests])
        with concurrent.futures.ThreadPoolExecutor(clients) as pool:
            return np.concatenate(list(pool.map(lambda r: embed(*r), requests)))

    return run


def _http(target: str) -> Embed:
    import httpx

    client = httpx.Client(base_url=f"http://{target}", timeout=3600)

    def embed(inputs: list[str], prompt_name: str) -> np.ndarray:
        r = client.post("/v1/embeddings", json={"input": inputs, "prompt_name": prompt_name})
        r.raise_for_status()
        return np.asarray([d["embedding"] for d in r.json()["data"]], np.float32)

    return embed


def _grpc(client: Any) -> Embed:
    def embed(inputs: list[str], prompt_name: str) -> np.ndarray:
        return np.asarray(client.embed(inputs, prompt_name=prompt_name).embeddings, np.float32)

    return embed


def _whole(scorer: Any, batch: int) -> Callable[[Texts, int], np.ndarray]:
    """The queries with the instruction in each text and no prompt: each runs whole."""
    inner = _batched(lambda inputs, _: scorer.embed(inputs, prompt=""), batch)
    return lambda t, clients: inner(Texts(t.passages, [INSTRUCTION + q for q in t.queries]), clients)


def run(args: argparse.Namespace) -> int:
    """`prefixscore bench --workload w8`: every mode's row printed, and written to --json."""
    from sentence_transformers import SentenceTransformer

    from prefixscore.telemetry.compiles import CompileCounter

    with tempfile.TemporaryDirectory(prefix="prefixscore-w8-") as scratch:
        if not (Path(args.model) / "modules.json").is_file():
            args.model = str(preset_checkpoint(args.model, Path(scratch), args.seed))
        bench = Bench(args)
        try:
            if bench.scorer is None:
                raise SystemExit("w8 runs the engine in process (no --target): it reads the engine's token counts")
            scorer, batch = bench.scorer, args.w8_batch
            st_model = SentenceTransformer(args.model, device="cpu")
            gen = wl.Generator(bench.vocab, args.seed)
            sizes = (args.w8_passages, args.w8_queries)
            timed = texts(scorer.model.tokenizer, gen, *sizes)
            bench.target("w4")  # serves this engine on free ports (gRPC and HTTP)
            makers: dict[str, Callable[[], Callable[[Texts, int], np.ndarray]]] = {
                "http": lambda: _batched(_http(bench.http_target), batch),
                "grpc": lambda: _batched(_grpc(bench.local_remote.client), batch),
                "inprocess": lambda: _batched(lambda inputs, name: scorer.embed(inputs, prompt_name=name), batch),
                "whole": lambda: _whole(scorer, batch),
                "st": lambda: _batched(
                    lambda inputs, name: st_model.encode(inputs, prompt_name=name, batch_size=batch), batch
                ),
            }
            engine = scorer.engine
            records, results = [], []
            for mode in wl.W8_MODES:
                if mode not in args.w8_modes:
                    continue
                fn = makers[mode]()
                # the engine's calls compile by their shapes: warmed up on the timed texts themselves
                # (another set's calls can take a shape the timed set's do not); a few batches warm
                # sentence-transformers up
                warmup = timed if mode in ENGINE_MODES else Texts(timed.passages[:batch], timed.queries[:batch])
                # sentence-transformers' encode is one caller's: its row is sequential
                for clients in args.w8_clients if mode in ENGINE_MODES else [1]:
                    # untimed, at the timed run's concurrency: the calls it batches together compile
                    fn(warmup, clients)
                    engine.prefix_cache.evict_idle()  # nothing the warm-up or another run cached
                    before, tokens0, compiles = dict(engine.stats), bench.token_counts(), CompileCounter.count()
                    start = time.perf_counter()
                    results.append(fn(timed, clients))
                    seconds = time.perf_counter() - start
                    tokens1 = bench.token_counts()
                    n = len(timed.passages) + len(timed.queries)
                    record: dict[str, Any] = {
                        "workload": "w8",
                        "mode": mode,
                        "clients": clients,
                        "inputs": n,
                        "seconds": round(seconds, 3),
                        "inputs_per_s": round(n / seconds, 2),
                    }
                    if mode in ENGINE_MODES:
                        record |= {
                            "prefill_tokens": engine.stats["prefill_tokens"] - before["prefill_tokens"],
                            "tokens": engine.stats["tokens"] - before["tokens"],
                            **token_share(tokens0, tokens1),
                            "compilations_while_timed": CompileCounter.count() - compiles,
                        }
                    records.append(record)
            modes = [r["mode"] for r in records]
            reference = results[modes.index("st")] if "st" in modes else results[0]
            name = "st" if "st" in modes else modes[0]
            for record, got in zip(records, results, strict=True):
                record[f"max_abs_diff_vs_{name}"] = float(np.abs(got - reference).max())
            tokenizer = scorer.model.tokenizer
            header = {
                "passages": len(timed.passages),
                "queries": len(timed.queries),
                "passage_tokens": sum(len(tokenizer.encode_whole(p)) for p in timed.passages),
                "query_tokens": sum(len(tokenizer.encode_whole(INSTRUCTION + q)) for q in timed.queries),
                "instruction_tokens": len(tokenizer.encode_whole(INSTRUCTION)),
                "batch": batch,
            }
            print(json.dumps({**bench.context(), **header}), file=sys.stderr)
            for record in records:
                print(json.dumps(record))
            if args.json_path:
                rows = [{**bench.context(), **header, **r} for r in records]
                Path(args.json_path).write_text(json.dumps(rows, indent=1))
        finally:
            bench.close()
    return 0
