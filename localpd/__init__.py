"""localpd: local LLM inference on one GPU, honest about bandwidth."""

__version__ = "0.1.0"
