"""Triton kernels and their torch references (installed as localpd.kernels). Kernels arrive with the
quantization, KV-cache and roofline issues; the engine's CPU path uses plain torch until then."""
