"""Loading: a model spec (embedded, checkpoint folder, GGUF) into config, weights and tokenizer."""
