"""prefixscore.model: config, weights, tokenizer, the decoder, prefill and item scoring."""
