"""Step accounting against independent counts: the sizes of the tensors the model holds, and FLOPs from the
config's shapes."""

import pytest
import torch

from localpd.model.linear import QuantLinear, StackedLinear
from localpd.kvcache.formats import KVTraffic, new_kv_pool
from localpd.measure.roofline import decode_ceiling_tps, step_cost, utilisation
from localpd.engine.sampling import SamplingParams


def tensor_bytes(obj) -> int:
    """Bytes of every tensor reachable from a weight (a tensor, an Int4/Int8Weight, a QuantLinear...; None, an
    absent optional weight such as a Llama layer's q_norm, has none)."""
    if obj is None:
        return 0
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, StackedLinear):
        return sum(tensor_bytes(p) for p in obj.parts)
    if isinstance(obj, QuantLinear):
        return tensor_bytes(obj.weight) + (tensor_bytes(obj.bias) if obj.bias is not None else 0)
    return sum(tensor_bytes(getattr(obj, f)) for f in obj.__dataclass_fields__)


def matmul_params(c) -> int:
    q, kv = c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim
    per_layer = c.dim * (q + 2 * kv) + q * c.dim + 3 * c.dim * c.ffn_dim
    return c.n_layers * per_layer


@pytest.mark.parametrize("ctx", [0, 100])
def test_decode_step_bytes_and_flops_match_an_independent_count(engine, ctx):
    m, c = engine.model, engine.config
    layers = sum(tensor_bytes(getattr(L, f)) for L in m.layers for f in L.__dataclass_fields__)
    head = tensor_bytes(m.lm_head)
    row = tensor_bytes(m.embed) // c.vocab_size
    kv_token = engine.kv.bytes_per_token()
    cost = step_cost(m, [(ctx, 1)], engine.kv_traffic, logit_rows=1)
    assert cost.weight_bytes == layers + tensor_bytes(m.norm) + head + row
    assert cost.kv_read_bytes == (ctx + 1) * kv_token and cost.kv_write_bytes == kv_token
    attention = 4 * c.n_layers * c.n_heads * c.head_dim * (ctx + 1)
    assert cost.flops == 2 * matmul_params(c) + 2 * c.vocab_size * c.dim + attention


def test_prefill_chunk_counts_causal_pairs_and_skips_the_head_without_logits(engine):
    m, c = engine.model, engine.config
    kv_token = engine.kv.bytes_per_token()
    full = step_cost(m, [(32, 10)], engine.kv_traffic, logit_rows=1)
    no_head = step_cost(m, [(32, 10)], engine.kv_traffic, logit_rows=0)
    assert full.weight_bytes - no_head.weight_bytes == tensor_bytes(m.lm_head)
    pairs = sum(32 + j + 1 for j in range(10))
    assert no_head.flops == 2 * 10 * matmul_params(c) + 4 * c.n_layers * c.n_heads * c.head_dim * pairs
    batch = step_cost(m, [(32, 10), (5, 1)], engine.kv_traffic, logit_rows=2)
    assert batch.kv_read_bytes == (42 + 6) * kv_token and batch.kv_write_bytes == 11 * kv_token
    assert batch.weight_bytes == full.weight_bytes + m.embed_row_bytes  # weights are read once for the batch


def test_engine_events_carry_the_step_cost(engine):
    ids = engine.encode_chat([{"role": "user", "content": "Count the bytes, please."}])
    handle = engine.submit(ids, SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    events = list(handle)
    cached = handle.stats.cached_tokens
    first = step_cost(engine.model, [(cached, len(ids) - cached)], engine.kv_traffic, 1)
    assert events[0].stats.bytes == first.bytes and events[0].stats.flops == first.flops
    second = step_cost(engine.model, [(len(ids), 1)], engine.kv_traffic, 1)
    assert events[1].stats.bytes == second.bytes
    assert handle.stats.decode_bytes == sum(e.stats.bytes for e in events[1:])


def one(t: torch.Tensor) -> int:
    """Bytes of one entry along every leading dimension but the last: a token's head, or a page's."""
    return t[(0,) * (t.dim() - 1)].nbytes


@pytest.mark.parametrize("compute", [torch.float32, torch.bfloat16])
def test_int4ch_writes_count_the_pages_they_rewrite(compute):
    """A per-page format's write re-quantizes each page it touches whole (kernels.paged_attention._write_page_run):
    it reads the page's earlier tokens from the stage, writes every code up to the last new token and the page's
    scales and zeros, and stages the new tokens of a page it leaves open. Counted from the pool's own tensors."""
    layers, heads, d, ps = 3, 2, 64, 16
    pool = new_kv_pool("int4ch/int4", layers, 8, ps, heads, d, compute, "cpu")
    kv = KVTraffic("int4ch/int4", layers, heads, d, ps, compute.itemsize)
    key_code, key_page = one(pool.k), one(pool.k_scale) + one(pool.k_zero)  # per token, per page (one head)
    staged = one(pool.k_stage)
    value = one(pool.v) + one(pool.v_scale) + one(pool.v_zero)  # int4 per token
    per_layer = layers * heads
    # a decode token at offset 4 of page 1: four staged tokens read, five tokens' codes, the page's scales, one staged
    assert kv.written(20, 1) == per_layer * (4 * staged + 5 * key_code + key_page + staged + value)
    # the token that fills page 1: its codes and scales, nothing staged (a full page is final)
    assert kv.written(31, 1) == per_layer * (15 * staged + 16 * key_code + key_page + value)
    # a chunk of 30 from offset 4 of page 1: page 1 finished, page 2 whole, page 3 left open with two tokens
    pages = ((4 * staged + 16 * key_code + key_page) + (16 * key_code + key_page)
             + (2 * key_code + key_page + 2 * staged))
    assert kv.written(20, 30) == per_layer * (pages + 30 * value)
    assert kv.written(20, 0) == 0
    # reads: a page's scales once, however few of its tokens there are; the storage per token when pages are full
    assert kv.read(17) == per_layer * (17 * key_code + 2 * key_page + 17 * value)
    assert kv.read(32) == 32 * kv.per_token == 32 * pool.bytes_per_token()
    # per-token formats write what they store
    plain = KVTraffic("int8/int4", layers, heads, d, ps, compute.itemsize)
    assert plain.written(20, 30) == 30 * plain.per_token and plain.read(17) == 17 * plain.per_token


def test_sliding_window_layers_read_only_their_window():
    """Gemma 3: five layers in six attend to the last `window` keys of each query, so a decode step reads that many
    tokens there, and a prefill chunk the keys from its first query's window on; a per-page format the scales of
    each page those tokens touch."""
    from localpd.kvcache.formats import KVTraffic

    per_head = KVTraffic("int8", 1, 1, 64).per_token  # int8: 64 codes and a scale, keys and values
    gemma = KVTraffic("int8", 6, 2, 64, 16, 2, sliding_layers=5, window=10)
    assert gemma.read(100) == 2 * per_head * (100 + 5 * 10)
    assert gemma.read(100, 20) == 2 * per_head * (100 + 5 * 29)  # queries 80..99: keys 71..99
    assert gemma.read(7) == 2 * per_head * 6 * 7 and gemma.read(100) < KVTraffic("int8", 6, 2, 64).read(100)
    from localpd.kvcache.formats import _head_bytes, kv_formats

    per_page = KVTraffic("int4ch", 2, 1, 64, 16, 2, sliding_layers=1, window=10)
    whole = KVTraffic("int4ch", 1, 1, 64, 16, 2)  # the global layer alone
    # the sliding layer's keys 90..99 touch pages 5 and 6: ten tokens' codes, two pages' scales and zeros
    sides = [_head_bytes(f, 64) for f in kv_formats("int4ch")]
    assert per_page.read(100) - whole.read(100) == sum(codes * 10 + scales * 2 for codes, scales in sides)


def test_ceiling_and_utilisation_arithmetic(engine):
    m = engine.model
    kv = engine.kv_traffic
    step = step_cost(m, [(1000, 1)], kv, 1).bytes
    assert decode_ceiling_tps(m, 1000, kv, 1e12) == pytest.approx(1e12 / step)
    assert decode_ceiling_tps(m, 4000, kv, 1e12) < decode_ceiling_tps(m, 1000, kv, 1e12)
    assert utilisation(5e11, 1.0, 1e12) == 0.5
    assert utilisation(1.0, 1.0, None) is None


def test_chat_stats_show_the_decode_bandwidth_against_the_ceiling(engine):
    from localpd.cli.chat import format_stats
    from localpd.measure.device import DeviceInfo

    ids = engine.encode_chat([{"role": "user", "content": "Name a colour."}])
    handle = engine.submit(ids, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    list(handle)
    s = handle.stats
    rate = s.decode_bytes / s.decode_step_seconds
    info = DeviceInfo("test", "cpu", None, "unknown", 4 * rate, "measured", None, "unknown")
    lines = format_stats(s, engine, info).splitlines()
    assert lines[-2] == f"decode bandwidth:     {rate / 1e9:.1f} GB/s (25% of {4 * rate / 1e9:.0f} GB/s, measured copy)"
    ceiling = decode_ceiling_tps(engine.model, len(ids) + 4, engine.kv_traffic, 4 * rate)
    assert lines[-1] == f"decode ceiling:       {ceiling:.1f} tokens/s at {len(ids) + 4} tokens of context"
    datasheet = DeviceInfo("test", "cuda", 2 * rate, "table", None, "not measured", None, "unknown")
    line = format_stats(s, engine, datasheet).splitlines()[-2]
    assert line.endswith(f"(50% of {2 * rate / 1e9:.0f} GB/s, table peak)")
    assert "bandwidth" not in format_stats(type(s)(), engine, info)  # no decode step yet: no rate to show
