"""What may be sampled: JSON mode, patterns, tool calls, reasoning."""
