"""Weights in: the model registry, GGUF and safetensors files, synthetic models."""
