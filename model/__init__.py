"""prefixscore.model: the model alone: config, weights and their loaders, tokenizer, decoder,
the device call (step) and its typed inputs, presets, FLOP counting."""
