"""Triton KV kernels against their torch references: on the CPU through Triton's interpreter, or compiled on a
GPU with LOCALPD_TEST_DEVICE=cuda.

LOCALPD_TRITON_INTERPRET makes the dispatcher launch Triton on CPU tensors (and sets TRITON_INTERPRET); it must
be set before triton is imported."""

import os

DEV = os.environ.get("LOCALPD_TEST_DEVICE", "cpu")
if DEV == "cpu":
    os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402

from localpd.kernels.fused_dispatch import rope_ref  # noqa: E402
from localpd.engine.speculate import MAX_DRAFT  # noqa: E402
from localpd.kvcache.dispatch import (ROWS_AS_DECODE, decode_block_t, decode_span, decode_splits,  # noqa: E402
                                         paged_attention, paged_attention_ref, rope_write_kv, rope_write_kv_ref,
                                         rows_as_decode, write_kv, write_kv_ref)
from localpd.kvcache.formats import dequantize_kv, kv_formats, new_kv_pool  # noqa: E402

DTYPES = ["fp32", "bf16", "int8", "fp8", "int4", "int8/int4", "int4ch/int4", "int4ch"]


@pytest.fixture(autouse=True)
def interpret(monkeypatch):
    if DEV == "cpu":
        monkeypatch.setenv("LOCALPD_TRITON_INTERPRET", "1")


def pools(kv_dtype, n_pages, page_size, H, D, compute=torch.float32):
    return [new_kv_pool(kv_dtype, 1, n_pages, page_size, H, D, compute, DEV) for _ in range(2)]


def dequantized(layer):
    return [dequantize_kv(d, s, z, f, torch.float32)
            for d, s, z, f in ((layer.k, layer.k_scale, layer.k_zero, layer.k_format),
                               (layer.v, layer.v_scale, layer.v_zero, layer.v_format))]


@pytest.mark.parametrize("kv_dtype", ["fp32", "bf16", "int8", "int4", "int8/int4", "int4/bf16"])
@pytest.mark.parametrize("D", [32, 64, 96, 128, 160, 256])
def test_write_kv_matches_the_reference(kv_dtype, D):
    g = torch.Generator().manual_seed(3)
    ps, H, T = 16, 2, 37
    tri, ref = pools(kv_dtype, 6, ps, H, D)
    slots = torch.randperm(6 * ps, generator=g)[:T].to(DEV)  # scattered, crossing pages
    k, v = (torch.randn(2, T, H, D, generator=g) * 2).to(DEV)
    k[4] = 0.0  # constant rows: no NaN
    write_kv(tri.layer(0), k, v, slots)
    write_kv_ref(ref.layer(0), k, v, slots)
    for a, b, fmt in zip(dequantized(tri.layer(0)), dequantized(ref.layer(0)), kv_formats(kv_dtype)):
        assert torch.isfinite(a).all()
        if fmt in ("fp32", "bf16"):  # the interpreter truncates to bf16 where torch rounds: 1 ulp
            ulp = {"fp32": 0, "bf16": 2**-7}[fmt]
            assert ((a - b).abs() <= b.abs() * ulp + b.abs().amax() * 2**-9).all()
            continue
        step = (b.abs().amax() / (7 if fmt == "int4" else 127)).item()
        diff = (a - b).abs()
        # identical up to a rounding tie or a scale's last float16 bit (at most one quantum, rarely)
        assert diff.max().item() <= step * 1.01 + 1e-6
        assert (diff > 1e-6).float().mean().item() < 0.01


@pytest.mark.parametrize("kv_dtype", ["fp32", "bf16", "int8", "int4", "int8/int4", "int4/bf16", "fp8/int8",
                                      "int4ch/int4", "int4ch"])
@pytest.mark.parametrize("D,Hq,H,ps,T,dtype", [(64, 9, 3, 16, 37, torch.float32), (128, 4, 4, 32, 5, torch.bfloat16),
                                                (64, 7, 1, 16, 1, torch.float16), (256, 4, 1, 16, 19, torch.bfloat16),
                                                (96, 3, 3, 16, 21, torch.bfloat16)])
def test_rope_and_kv_write_in_one_kernel(kv_dtype, D, Hq, H, ps, T, dtype):
    """rope_write_kv (one launch) writes what RoPE then write_kv write as separate kernels, bit for bit, and the
    torch reference within the formats' rounding; the query heads come back rotated."""
    g = torch.Generator().manual_seed(T + D)
    qkv = (torch.randn(T, (Hq + 2 * H) * D, generator=g) * 2).to(dtype).to(DEV)
    angles = torch.outer(torch.randint(0, 5000, (T,), generator=g).float(), torch.rand(D // 2, generator=g))
    cos, sin = angles.cos().to(DEV), angles.sin().to(DEV)
    slots = torch.randperm(4 * 64, generator=g)[:T].to(DEV)
    if "int4ch" in kv_dtype:  # a page is filled in order by its sequence: consecutive slots, from mid-page
        slots = torch.arange(3, 3 + T, device=DEV)
    fused, separate, torch_ref = [new_kv_pool(kv_dtype, 1, 4 * 64 // ps, ps, H, D, dtype, DEV) for _ in range(3)]
    q = rope_write_kv(qkv.clone(), cos, sin, fused.layer(0), slots, Hq, H)
    q_sep = rope_write_kv_ref(qkv.clone(), cos, sin, separate.layer(0), slots, Hq, H)
    assert q.shape == (T, Hq, D)
    if DEV == "cpu":  # compiled, the two may contract multiply-adds differently; the checks below still hold
        assert torch.equal(q, q_sep)
        for a, b in zip(dequantized(fused.layer(0)), dequantized(separate.layer(0))):
            assert torch.equal(a, b)
    heads = qkv.clone().view(T, -1, D)  # the torch references, on any device
    rope_ref(heads[:, :Hq + H], cos, sin)
    write_kv_ref(torch_ref.layer(0), heads[:, Hq:Hq + H], heads[:, Hq + H:], slots)
    q_ref = heads[:, :Hq]
    assert (q.float() - q_ref.float()).abs().max() <= q_ref.float().abs().max() * 2**-7
    k_rot = heads[:, Hq:Hq + H].float()
    for a, b, x, fmt in zip(dequantized(fused.layer(0)), dequantized(torch_ref.layer(0)),
                            (k_rot, qkv.view(T, -1, D)[:, Hq + H:].float()), kv_formats(kv_dtype)):
        a, b = a.flatten(0, 1)[slots.long()], b.flatten(0, 1)[slots.long()]
        # one quantum of the format, plus (half precision) the interpreter's truncating where torch rounds
        amax = x.abs().amax().item()
        tol = {"int4": 1 / 7, "int4ch": 1 / 7, "int8": 1 / 127, "fp8": 1 / 8}.get(fmt, 2**-7) * amax * 1.01
        tol += 0 if dtype == torch.float32 else amax * 2**-6
        assert (a - b).abs().max() <= tol and (a - x).abs().max() <= tol


@pytest.mark.parametrize("staged", [False, True])
@pytest.mark.parametrize("D,ps", [(64, 16), (128, 32), (96, 16)])
def test_per_channel_keys_rewrite_their_page_as_it_fills(D, ps, staged):
    """int4ch: a prefill that ends mid-page, then decode steps of two sequences (one starting on a fresh page of a
    pool full of garbage), a chunk that continues a page: the kernel writes what the reference writes (pages and,
    staged, each sequence's stage row). Every token so far stays within half a quantum of its channel's range on
    that page where the page is re-quantized from its staged values (one rounding), and within one and a half
    where it is re-quantized from its codes (each widening rounds the rounded values again: up to 1.25 quanta over
    seeds)."""
    g = torch.Generator().manual_seed(D)
    tri, ref = [new_kv_pool("int4ch/int4", 1, 8, ps, 2, D, torch.float32, DEV, stage_rows=3) for _ in range(2)]
    for t in (tri.k, tri.k_scale, tri.k_zero, ref.k, ref.k_scale, ref.k_zero, tri.k_stage, ref.k_stage):
        t.view(torch.uint8).fill_(0xFF)  # NaN scales and staged keys, codes 15: nothing a new page may read
    a = [3 * ps + i for i in range(ps + 5)]  # sequence A: page 3 full, page 4 up to offset 4
    a[ps:] = [4 * ps + i for i in range(5)]
    steps = [a, [4 * ps + 5], [4 * ps + 6, 6 * ps], [4 * ps + 7, 6 * ps + 1], [6 * ps + 2 + i for i in range(9)]]
    row = {3: 2, 4: 2, 6: 0}  # stage rows: A's is 2, B's (page 6) 0
    written = {}
    for slots in steps:
        k, v = torch.randn(2, len(slots), 2, D, generator=g) * 2
        k[..., 5] *= 30  # an outlier channel
        stage_slots = torch.tensor([row[s // ps] * ps + s % ps for s in slots], device=DEV) if staged else None
        slots = torch.tensor(slots, device=DEV)
        write_kv(tri.layer(0), k.to(DEV), v.to(DEV), slots, stage_slots)
        write_kv_ref(ref.layer(0), k.to(DEV), v.to(DEV), slots, stage_slots)
        written.update(zip(slots.tolist(), k))
        for name in ("k", "k_scale", "k_zero", "v", "v_scale", "v_zero", "k_stage"):  # bit for bit, garbage too
            assert torch.equal(getattr(tri, name).view(torch.uint8), getattr(ref, name).view(torch.uint8)), name
    keys = dequantized(tri.layer(0))[0].flatten(0, 1).cpu()
    for page in {slot // ps for slot in written}:
        slots = sorted(s for s in written if s // ps == page)
        x = torch.stack([written[s] for s in slots])
        quantum = (x.amax(0) - x.amin(0)) / 15
        assert ((keys[slots] - x).abs() <= quantum * (0.505 if staged else 1.5) + 1e-3).all()


@pytest.mark.parametrize("kv_dtype,D,ps,dtype", [("int4ch", 64, 16, torch.float32),
                                                 ("int4ch/int4", 128, 32, torch.bfloat16),
                                                 ("int4ch/int4", 96, 16, torch.bfloat16)])
def test_a_page_written_token_by_token_through_its_stage_equals_one_written_whole(kv_dtype, D, ps, dtype):
    """Decode fills a page a token at a time and re-quantizes it each time its range widens. With the stage, the
    page it ends up with is bit for bit the page a prefill writes in one go (kernel and reference, RoPE fused or
    not); without it, re-rounding already rounded codes leaves a different page."""
    g = torch.Generator().manual_seed(D + ps)
    Hq, H, T = 2, 2, ps + 3  # a full page and an open one
    qkv = (torch.randn(T, (Hq + 2 * H) * D, generator=g) * 2).to(dtype).to(DEV)
    qkv.view(T, -1, D)[..., 7] *= 20  # an outlier channel
    angles = torch.outer(torch.arange(T).float(), torch.rand(D // 2, generator=g))
    cos, sin = angles.cos().to(DEV), angles.sin().to(DEV)
    slots = torch.arange(ps, ps + T, device=DEV)  # pages 1 and 2
    stage_slots = ps + slots % ps  # stage row 1

    def written(write, token_by_token, stage):
        pool = new_kv_pool(kv_dtype, 1, 3, ps, H, D, dtype, DEV, stage_rows=2)
        tensors = [t for t in (pool.k, pool.k_scale, pool.k_zero, pool.v, pool.v_scale, pool.v_zero) if t is not None]
        for t in tensors + [pool.k_stage]:
            t.view(torch.uint8).fill_(0xFF)
        steps = [slice(t, t + 1) for t in range(T)] if token_by_token else [slice(0, T)]
        for s in steps:
            write(qkv[s].clone(), cos[s], sin[s], pool.layer(0), slots[s], Hq, H, stage_slots[s] if stage else None)
        return [t[:, 1:].view(torch.uint8).clone() for t in tensors]  # pages 1 and 2, keys first

    for write in (rope_write_kv, rope_write_kv_ref):
        whole = written(write, False, True)
        assert all(torch.equal(a, b) for a, b in zip(written(write, True, True), whole))
    assert all(torch.equal(a, b) for a, b in zip(whole, written(rope_write_kv_ref, False, False)))  # reads no stage
    assert not torch.equal(written(rope_write_kv_ref, True, False)[0], whole[0])
    if DEV == "cpu":  # compiled, the kernel may contract RoPE's multiply-adds differently from torch
        assert all(torch.equal(a, b) for a, b in zip(whole, written(rope_write_kv, False, True)))


def build_case(kv_dtype, page_size, H, group, lens, q_lens, D=64, dtype=torch.float32, seed=0, poison=False):
    """Sequences of the given lengths on shuffled pages. No sequence owns page 0, which pads the page table (and is
    where masked page-id loads point); poison fills the pool first with NaN, inf and -inf (all bits set for integer
    storage), so that reading past a sequence's end shows up in the output."""
    g = torch.Generator().manual_seed(seed)
    n_pages = sum(-(-n // page_size) for n in lens) + 1
    pool = new_kv_pool(kv_dtype, 1, n_pages, page_size, H, D, dtype, DEV)
    layer = pool.layer(0)
    for t in (layer.k, layer.v, layer.k_scale, layer.v_scale, layer.k_zero, layer.v_zero) if poison else ():
        if t is not None and t.stride(1) == 0:  # a page's scales (int4ch), seen per token
            t = t[:, :1]
        if t is not None and t.is_floating_point():
            bad = torch.tensor([float("nan"), float("inf"), float("-inf")]).repeat(-(-t.numel() // 3))
            t.copy_(bad[:t.numel()].view(t.shape))
        elif t is not None:
            t.view(torch.uint8).fill_(0xFF)
    order = (torch.randperm(n_pages - 1, generator=g) + 1).tolist()
    tables, starts = [], [0]
    for n, t in zip(lens, q_lens):
        pages = [order.pop() for _ in range(-(-n // page_size))]
        tables.append(pages)
        k, v = torch.randn(2, n, H, D, generator=g).to(DEV)
        slots = torch.tensor([pages[p // page_size] * page_size + p % page_size for p in range(n)], device=DEV)
        write_kv_ref(layer, k, v, slots)
        starts.append(starts[-1] + t)
    width = max(map(len, tables))
    table = torch.tensor([p + [0] * (width - len(p)) for p in tables], dtype=torch.int32, device=DEV)
    q = torch.randn(starts[-1], H * group, D, generator=g).to(dtype).to(DEV)
    return (q, layer, table, torch.tensor(lens, dtype=torch.int32, device=DEV),
            torch.tensor(starts, dtype=torch.int32, device=DEV))


def check(case, atol, window=0):
    if DEV != "cpu":  # the kernels' tl.dot takes float32 as tf32 on the GPU
        atol = max(atol, 5e-3)
    q, layer, table, lens, starts = case
    out = paged_attention(q, layer, table, lens, starts, q.shape[-1] ** -0.5, window)
    ref = paged_attention_ref(q, layer, table, lens, starts, q.shape[-1] ** -0.5, window)
    assert out.dtype == q.dtype and torch.isfinite(out.float()).all()
    assert (out.float() - ref.float()).abs().max().item() < atol


@pytest.mark.parametrize("kv_dtype", DTYPES)
@pytest.mark.parametrize("page_size, group", [(16, 1), (32, 3), (16, 4)])
def test_decode_batches_match_the_reference(kv_dtype, page_size, group):
    lens = [1, 15, 16, 17, 100]  # odd lengths, page boundaries
    check(build_case(kv_dtype, page_size, 2, group, lens, [1] * len(lens)), 1e-4)


@pytest.mark.parametrize("kv_dtype", ["fp32", "fp16", "bf16", "int8", "fp8", "int4", "int8/int4", "int4/bf16",
                                      "int4ch/int4"])
@pytest.mark.parametrize("page_size", [16, 32])
def test_decode_tiles_across_pages_with_garbage_past_the_end(kv_dtype, page_size):
    """Tiles span several pages (8 or 4 here): lengths of exactly one tile, under one page, ending mid-tile and
    mid-page or mid-tile on a page boundary, very different lengths in one batch, GQA groups of 1, 4 and 7 (odd,
    padded); the pool starts as NaN/inf garbage."""
    bt = decode_block_t(page_size, 64)
    assert bt // page_size > 1
    for group, lens in ((1, [bt, 3]), (4, [2 * bt + page_size + 3, 1, bt - 1]), (7, [bt + 1, bt + bt // 2])):
        check(build_case(kv_dtype, page_size, 2, group, lens, [1] * len(lens), seed=group, poison=True), 1e-4)
    check(build_case(kv_dtype, page_size, 2, 3, [70, 33], [6, 33], seed=8, poison=True), 1e-4)  # prefill too


@pytest.mark.parametrize("kv_dtype", DTYPES)
def test_prefill_chunks_after_a_cached_prefix_and_mixed_batches(kv_dtype):
    # a chunk after a prefix, a whole prompt, a decode row and a 40-row chunk in one step
    check(build_case(kv_dtype, 16, 2, 3, [33, 17, 50, 97], [7, 17, 1, 40]), 1e-4)


@pytest.mark.parametrize("kv_dtype", ["bf16", "int8", "int4", "int4ch/int4"])
def test_heads_of_256(kv_dtype):
    """Gemma 3's head size: decode across tiles and a prefill chunk after a prefix, its sliding window too (GQA 4
    as in the 1B, 2 as in the 4B)."""
    for group, window in ((4, 0), (2, 0), (4, 20)):
        check(build_case(kv_dtype, 16, 1, group, [70, 1, 33], [1, 1, 1], D=256, seed=group, poison=True), 1e-4,
              window)
        check(build_case(kv_dtype, 16, 2, group, [50, 40], [21, 40], D=256, seed=group + 1), 1e-4, window)


@pytest.mark.parametrize("kv_dtype", ["fp32", "bf16", "int8", "fp8", "int4", "int8/int4", "int4ch/int4"])
def test_heads_that_are_not_a_power_of_two(kv_dtype):
    """Phi-3-mini's heads of 96 (no query groups) and heads of 32 and 160, taken as they are in tiles of 128, 32
    and 256 whose last columns are masked: decode across tiles over a pool of garbage (what lies past a head's
    last column, the next head's or page's elements or NaN, must not reach the output) and prefill chunks after a
    cached prefix."""
    bt = decode_block_t(16, 96)
    assert bt == decode_block_t(16, 128)  # the tile's tokens follow its width, not the head's
    for D, group in ((96, 1), (96, 3), (32, 4), (160, 2)):
        check(build_case(kv_dtype, 16, 2, group, [bt + 5, 1, 40], [1, 1, 1], D=D, seed=D, poison=True), 1e-4)
        check(build_case(kv_dtype, 16, 2, group, [50, 33], [21, 33], D=D, seed=D + 1, poison=True), 1e-4)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_queries(dtype):
    kv = "fp16" if dtype == torch.float16 else "bf16"
    check(build_case(kv, 16, 2, 2, [20, 45], [1, 1], dtype=dtype), 2e-2)
    check(build_case(kv, 32, 1, 4, [45, 9], [20, 9], D=128, dtype=dtype), 2e-2)


@pytest.mark.parametrize("kv_dtype", DTYPES)
@pytest.mark.parametrize("group, batch, splits, per_split", [(4, 1, 4, 1), (7, 2, 2, 2)])
def test_decode_splits_including_empty_partitions(kv_dtype, group, batch, splits, per_split):
    """A sequence of 4 tiles, alone (a tile per split) or beside one of 5 tokens (two splits of two tiles, the short
    sequence's second split empty); one KV head, so batch x kv heads is the batch. The pool starts as garbage."""
    assert decode_splits(batch, 4, torch.device("cpu")) == (splits, per_split)
    lens = [3 * decode_block_t(16, 64) + 5, 5][:batch]
    check(build_case(kv_dtype, 16, 1, group, lens, [1] * batch, seed=5, poison=True), 1e-4)


@pytest.mark.parametrize("kv_dtype", ["fp32", "bf16", "int8", "int4", "int4ch/int4"])
def test_a_sliding_window_sees_only_the_last_keys(kv_dtype):
    """Windows of 5 (inside a page), 16 (a page), 37 (across pages) and longer than any sequence, over decode rows
    (one past several tiles, so that whole splits lie before the window) and prefill chunks whose first queries'
    windows start mid-page, a 97-row chunk spanning several query blocks. The pool starts as garbage."""
    bt = decode_block_t(16, 64)
    for window in (5, 16, 37, 1000):
        check(build_case(kv_dtype, 16, 2, 3, [1, 15, 2 * bt + 7, 100], [1] * 4, seed=window, poison=True), 1e-4,
              window)
        check(build_case(kv_dtype, 16, 2, 3, [33, 70, 97], [7, 40, 97], seed=window + 1, poison=True), 1e-4, window)


@pytest.mark.parametrize("kv_dtype", ["bf16", "int8", "int4ch/int4"])
def test_a_sliding_windows_splits_share_out_the_window(kv_dtype):
    """A decode's splits cover a sliding layer's window, from the page it starts in, not the whole page table: far
    into a long sequence, several splits each take part of a window of 2 tiles and 20 tokens (one that starts
    mid-page); a sequence shorter than the window, beside it, is attended whole. The pool starts as garbage."""
    bt = decode_block_t(16, 64)
    window, lens = 2 * bt + 20, [9 * bt + 7, bt + 3]
    span = decode_span(-(-lens[0] // 16) * 16, window, 16)
    assert span == window + 15 and decode_splits(2, -(-span // bt), torch.device("cpu")) == (2, 2)
    assert decode_span(64, window, 16) == 64 and decode_span(1024, 0, 16) == 1024
    check(build_case(kv_dtype, 16, 1, 4, lens, [1, 1], seed=3, poison=True), 1e-4, window)


def test_the_references_window_is_attention_over_the_last_keys():
    """The reference's window against softmax attention written out over keys (p - window, p] of each query p."""
    from localpd.kvcache.dispatch import gather_kv

    q, layer, table, lens, starts = build_case("fp32", 16, 2, 3, [40, 29], [1, 12], seed=3)
    window, scale = 9, 64 ** -0.5
    out = paged_attention_ref(q, layer, table, lens, starts, scale, window)
    for b, n in enumerate(lens.tolist()):
        k, v = gather_kv(layer, table[b, :-(-n // 16)].long(), n, torch.float32)
        rows = range(starts[b].item(), starts[b + 1].item())
        for r, p in zip(rows, range(n - len(rows), n)):
            keep = slice(max(0, p - window + 1), p + 1)
            for h in range(6):
                w = torch.softmax(k[keep, h // 3] @ q[r, h] * scale, dim=0)
                assert torch.allclose(out[r, h], w @ v[keep, h // 3], atol=1e-5)


@pytest.mark.skipif(DEV == "cpu", reason="long contexts need a GPU")
@pytest.mark.parametrize("kv_dtype", ["bf16", "int8", "fp8", "int4", "int8/int4", "int4ch/int4"])
def test_long_contexts_on_the_gpu(kv_dtype):
    """Llama-3-8B heads (8 KV heads, GQA 4, D 128) at thousands of tokens, decode and a prefill chunk."""
    check(build_case(kv_dtype, 16, 8, 4, [4099, 1, 777], [1, 1, 1], D=128, dtype=torch.bfloat16, seed=9), 2e-2)
    check(build_case(kv_dtype, 16, 8, 4, [2100, 300], [64, 300], D=128, dtype=torch.bfloat16, seed=10), 2e-2)


def test_decode_attention_compiles_to_whole_tile_loads(sass_table):
    """The decode kernel's sm_90 code for Llama-3-8B heads, built on this CPU from the launch paged_attention makes
    (scripts/attention_sass.py): int4 pages are read as whole tiles of bytes, scales and zeros (16-byte loads, a
    few load instructions per tile) where every element loaded its byte, scale and zero alone (grouped int4: 385-433
    loads per 64-token tile, registers spilled; int4ch keys: 99), and per-token scales cost no multiply per
    element, so int8 stays under the H100's budget of 45 instructions per 4-byte word."""
    rows = {r[1]: r for r in sass_table("attention_sass.py", "--kv", "int4,int4ch/int4,int8")}
    for kv in ("int4", "int4ch/int4"):
        _, _, _, per_word, _, _, loads, widest, _, spilled = rows[kv]
        assert int(loads) < 32 and widest.endswith(".128") and spilled == "0", rows
        assert float(per_word) < 100, rows
    assert float(rows["int8"][3]) < 45 and rows["int8"][9] == "0", rows


def test_prefill_attention_compiles_without_spills_for_every_model_and_kv_format():
    """Every prefill-attention launch the model makes (the head layouts of Llama-3-8B, Qwen2.5-7B, Llama-3.2-1B,
    SmolLM2, Qwen3-8B, Gemma 3 and Phi-3.5-mini, every KV format), compiled on this CPU for an RTX 30 card (sm_86) and the H100 (sm_90) by
    scripts/compile_check.py: each compiles, fits the card's shared memory per block and keeps its registers.
    At 4 warps, Qwen2.5-7B's programs (a group of 7 padded to 8 heads x 16 rows x 128) spilled up to 496 bytes."""
    import subprocess
    import sys
    from pathlib import Path

    pytest.importorskip("triton.backends.nvidia")
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "LOCALPD_TRITON_INTERPRET")}
    script = Path(__file__).parents[2] / "scripts" / "compile_check.py"
    out = subprocess.run([sys.executable, str(script), "--arch", "86,90", "--kernels", "prefill", "--strict"],
                         capture_output=True, text=True, env=env, timeout=900)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-2000:]
    rows = [line for line in out.stdout.splitlines() if line.startswith("prefill_kernel")]
    assert len(rows) >= 20 and all("GROUP=7" not in r or '"num_warps": 8' in r for r in rows), out.stdout


@pytest.mark.skipif(DEV != "cpu", reason="counts the interpreter's partial results")
@pytest.mark.parametrize("n,H", [(4096, 8), (32768, 2)])
def test_decode_splits_follow_the_sequence_not_the_graph_width_table(monkeypatch, n, H):
    """Under a CUDA graph the page table spans the whole context (here 128k tokens); the splits are sized for an
    H100 (2 programs an SM over its 132), and a sequence of 4k tokens (Llama-3-8B's 8 kv heads: 32 splits) or 32k
    (2 kv heads, for the interpreter's time: 64 splits) keeps nearly all of them busy: counted from the decode
    kernel's partial results (a split with work has a softmax sum above 0). Before, a split was a share of the
    table's width: the 4k sequence had work for 1 of 32 splits (8 of 256 programs), the 32k one for 16 of 64."""
    import localpd.kvcache.dispatch as kd
    import localpd.kernels.paged_attention as pa

    monkeypatch.setattr(kd, "INTERPRETER_DECODE_PROGRAMS", kd.DECODE_PROGRAMS_PER_SM * 132)
    ps, group, D = 16, 4, 64
    g = torch.Generator().manual_seed(n)
    pool = new_kv_pool("bf16", 1, n // ps + 1, ps, H, D, torch.float32, DEV)
    layer = pool.layer(0)
    for t in (layer.k, layer.v):  # random keys and values, written straight into the pages
        t.copy_(torch.randn(t.shape, generator=g))
    table = torch.zeros(1, 131072 // ps, dtype=torch.int32)
    table[0, :n // ps] = torch.arange(n // ps, dtype=torch.int32)
    q = torch.randn(1, H * group, D, generator=g)
    seen = []
    real = pa.decode_reduce_kernel

    class Spy:
        def __getitem__(self, grid):
            def launch(part_acc, part_ml, *args, **kwargs):
                seen.append(part_ml.clone())
                return real[grid](part_acc, part_ml, *args, **kwargs)
            return launch

    monkeypatch.setattr(pa, "decode_reduce_kernel", Spy())
    out = paged_attention(q, layer, table, torch.tensor([n]), torch.tensor([0, 1]), D ** -0.5)
    splits = kd.decode_splits(H, -(-131072 // kd.decode_block_t(ps, D)), torch.device("cpu"))[0]
    assert splits == {8: 32, 2: 64}[H]
    sums = seen[0].view(H, group, splits, 2)[:, 0, :, 1]  # each kv head's splits, through its first query head
    busy = int((sums > 0).sum())
    assert busy >= 0.9 * H * splits, (busy, H * splits)
    if n <= 4096:  # the sums are right too (at 32k the reference alone takes half a minute)
        ref = paged_attention_ref(q, layer, table, torch.tensor([n]), torch.tensor([0, 1]), D ** -0.5)
        assert ((out - ref).norm() / ref.norm()).item() < 1e-4


@pytest.mark.parametrize("kv_dtype", ["fp32", "int8", "int8/int4"])
@pytest.mark.parametrize("window", [0, 20])
def test_a_few_rows_of_a_sequence_attend_as_decode_rows_bit_for_bit(kv_dtype, window):
    """The reference's rows of a verification step (a sequence's up to ROWS_AS_DECODE rows) are what decode steps
    at those positions compute, exactly, alongside a longer prefill row set in the same batch."""
    g = torch.Generator().manual_seed(5)
    ps, H, group, D, n, t = 16, 2, 3, 64, 70, 9
    pool = new_kv_pool(kv_dtype, 1, 12, ps, H, D, torch.float32, "cpu")
    layer = pool.layer(0)
    k, v = torch.randn(2, 2 * n, H, D, generator=g)
    write_kv_ref(layer, k, v, torch.arange(2 * n))  # sequence 0 on pages 0-4, sequence 1 on pages 5-9
    table = torch.tensor([[0, 1, 2, 3, 4], [5, 6, 7, 8, 9]], dtype=torch.int32)
    q = torch.randn(t + 40, H * group, D, generator=g)
    scale = D ** -0.5
    rows = paged_attention_ref(q, layer, table, torch.tensor([n, n], dtype=torch.int32),
                               torch.tensor([0, t, t + 40], dtype=torch.int32), scale, window)
    for i in range(t):
        one = paged_attention_ref(q[i:i + 1], layer, table[:1], torch.tensor([n - t + i + 1], dtype=torch.int32),
                                  torch.tensor([0, 1], dtype=torch.int32), scale, window)
        assert torch.equal(rows[i], one[0])
    assert ROWS_AS_DECODE >= MAX_DRAFT + 1
    prefill = paged_attention_ref(q[t:], layer, table[1:], torch.tensor([n], dtype=torch.int32),
                                  torch.tensor([0, 40], dtype=torch.int32), scale, window)
    assert torch.equal(rows[t:], prefill)  # the long row set: one masked call, as before


def test_drafts_are_verified_where_rows_compute_what_decode_steps_do():
    cpu, gpu = torch.device("cpu"), torch.device("cuda")
    assert rows_as_decode(kv_formats("fp16"), cpu) and rows_as_decode(kv_formats("bf16"), gpu)
    assert rows_as_decode(kv_formats("int8/int4"), cpu) and rows_as_decode(kv_formats("fp8"), cpu)
    assert not rows_as_decode(kv_formats("int8"), gpu)
    assert not rows_as_decode(kv_formats("int4ch/int4"), cpu) and not rows_as_decode(kv_formats("int4ch"), gpu)
