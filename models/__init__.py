"""Model definitions: config presets, weight loading, tokenizer, and lowering to IR."""
