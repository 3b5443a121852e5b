"""`localpd export`: a model as localpd holds it, written in a format other engines load (GGUF for llama.cpp and
Ollama, compressed-tensors for vLLM and SGLang)."""
