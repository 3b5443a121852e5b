"""Measurement: bandwidth and FLOP ceilings, a step's bytes, benchmarks, perplexity."""
