"""`localpd bench kernels --predict --step`: a whole batch-1 decode token of Llama-3-8B on an H100, predicted from
the compiled code (no GPU): its bytes are the model's, its launches the engine's, its time the sum of its parts,
and the MBU issue 32 asks of the GPU stands beside it. Run as a command (the test process has Triton's
interpreter on)."""

from predict_cli import predict_rows

import pytest

from localpd.kvcache.formats import kv_bytes_per_token
from localpd.load.synthetic import SYNTHETIC, synthetic_nbytes
from localpd.measure.predict_step import small_launches

pytestmark = pytest.mark.slow  # compiles kernels for a GPU


@pytest.fixture(scope="module")
def rows(tmp_path_factory):
    got = predict_rows(tmp_path_factory, "--step", "--context", "128,4096", printed="MBU")
    return {(r["kernel"], r["format"], r["context"]): r for r in got}


def test_a_tokens_bytes_are_the_models_weights_and_its_kv_cache(rows):
    """Every weight and factor once (the embedding table's one row aside), the context's KV pages, a few MB of
    outputs and small launches' rows."""
    c = SYNTHETIC["llama3-8b"]
    for fmt in ("int4-g128", "int8"):
        weights = synthetic_nbytes("llama3-8b", fmt) - 2 * c.vocab_size * c.dim  # the bf16 embedding not read
        for context in (128, 4096):
            kv = c.n_layers * context * kv_bytes_per_token("bf16", 1, c.n_kv_heads, c.head_dim, 16)
            got = rows[("strip", fmt, context)]["bytes"]
            assert weights + kv < got < (weights + kv) * 1.01, (fmt, context, got, weights + kv)
            assert got == rows[("dp4a", fmt, context)]["bytes"]


def test_a_token_launches_ten_kernels_a_layer_and_its_time_is_their_sum(rows):
    c = SYNTHETIC["llama3-8b"]
    assert [n for *_, n in small_launches("llama3-8b")] == [2 * c.n_layers, c.n_layers, c.n_layers, 1]
    for r in rows.values():
        assert r["launches"] == 10 * c.n_layers + 2  # and the final norm and the head
        parts = r["gemv_us"] + r["head_us"] + r["attention_us"] + r["small_us"]
        assert r["token_us"] == pytest.approx(parts) and r["tok_s"] == pytest.approx(1e6 / parts)
        assert r["mbu"] == pytest.approx(r["bytes"] / 2950e9 / (parts * 1e-6))


def test_the_strip_gemv_is_predicted_faster_and_a_longer_context_slower(rows):
    """The strip GEMV's step is predicted ahead of the K-major one's (H100, Llama-3-8B int4-g128: about 74% of copy
    bandwidth against 64% at 128 tokens; the K-major step measured 56% there on 2026-11-26, docs/PERF.md), and
    4096 tokens of bf16 KV cost the attention 0.5 GB more a token to read."""
    for fmt in ("int4-g128", "int8"):
        for context in (128, 4096):
            assert rows[("strip", fmt, context)]["token_us"] < rows[("dp4a", fmt, context)]["token_us"]
        assert rows[("strip", fmt, 4096)]["attention_us"] > rows[("strip", fmt, 128)]["attention_us"]
    assert rows[("strip", "int4-g128", 128)]["mbu"] > 0.7 > rows[("dp4a", "int4-g128", 128)]["mbu"] > 0.6


def test_a_model_of_another_layout_is_refused_in_one_line():
    """Gemma 3's and Qwen3's layers launch more than a Llama's (extra norms, qk-norm): refused, not mispredicted."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-m", "localpd.cli.main", "bench", "kernels", "--predict", "--step",
                           "--model", "gemma3-1b"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 1 and done.stdout == "", (done.stdout, done.stderr)
    assert done.stderr.strip() == ("localpd: error: --predict --step models the layers of llama, qwen2, phi3 "
                                   "decoders; gemma3-1b is gemma3")
