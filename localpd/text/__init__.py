"""Text <-> token ids: the tokenizer, chat templates, stop strings."""
