"""Tiny sentence-transformers checkpoints, written by sentence-transformers itself: a random Qwen3
causal LM (SmolLM2's tokenizer) with a Transformer -> Pooling (-> Normalize) configuration saved
beside it, as published decoder embedders (Qwen3-Embedding, gte-Qwen2) ship them."""

from __future__ import annotations

import json
import shutil

QUERY_PROMPT = "Instruct: Given a web search query, retrieve relevant passages\nQuery: "


def batch_and_alone(st_model, scorer, texts: list[str]):
    """(each text's embedding alone by sentence-transformers; its batch padded right, then left;
    prefixscore's batch; prefixscore's each alone): all four equal when a batch does not change
    an input's embedding."""
    import numpy as np

    alone = np.concatenate([st_model.encode([t], convert_to_numpy=True) for t in texts])
    padded = []
    for side in ("right", "left"):
        st_model.tokenizer.padding_side = side
        padded.append(st_model.encode(texts, convert_to_numpy=True))
    st_model.tokenizer.padding_side = "right"
    return alone, padded, scorer.embed(texts), np.concatenate([scorer.embed([t]) for t in texts])


def st_checkpoint(path, mode: str, include_prompt: bool, normalize: bool, chat: dict | None = None) -> str:
    """A tiny causal LM with sentence-transformers' module configuration saved beside it. `chat`:
    the tokenizer keeps SmolLM2's chat template, so sentence-transformers 6 saves the `message`
    modality (every text rendered through it), with these chat_template arguments; None: a plain
    text embedder (the template removed)."""
    import sentence_transformers as st
    from conftest import make_torch_model
    from sentence_transformers.sentence_transformer.modules import Normalize, Pooling, Transformer

    from prefixscore.model.presets import smollm2_tokenizer_dir

    lm_dir, st_dir = path / "lm", path / "st"
    make_torch_model("qwen3", seed=3, vocab_size=49152, pad_token_id=2).save_pretrained(lm_dir)
    for f in smollm2_tokenizer_dir().iterdir():
        if chat is not None or f.name != "chat_template.jinja":  # a plain text embedder: texts are not chat messages
            shutil.copy(f, lm_dir)
    processing = {"processing_kwargs": {"chat_template": chat}} if chat else {}
    transformer = Transformer(str(lm_dir), **processing)
    modules = [transformer, Pooling(64, pooling_mode=mode, include_prompt=include_prompt)]
    if normalize:
        modules.append(Normalize())
    model = st.SentenceTransformer(
        modules=modules, prompts={"query": QUERY_PROMPT, "document": ""}, default_prompt_name="query", device="cpu"
    )
    model.save(str(st_dir))
    # the module configuration beside the causal LM's own weights and config (architectures
    # Qwen3ForCausalLM, as Qwen3-Embedding publishes them)
    for name in json.loads((st_dir / "modules.json").read_text()):
        if name["path"]:
            shutil.copytree(st_dir / name["path"], lm_dir / name["path"])
    for f in ("modules.json", "config_sentence_transformers.json", "sentence_bert_config.json"):
        shutil.copy(st_dir / f, lm_dir / f)
    return str(lm_dir)
