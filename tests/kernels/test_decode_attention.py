"""Decode attention over KV pages (a query row a sequence: tiles, splits, sliding windows) against the torch
reference."""

from kv_cases import DEV, interpret  # noqa: F401 (first: it sets TRITON_INTERPRET)
from kv_cases import DTYPES, build_case, check

import pytest
import torch
import triton
import triton.language as tl

from localpd.engine.speculate import MAX_DRAFT
from localpd.kvcache.dispatch import (ROWS_AS_DECODE, decode_block_t, decode_span, decode_splits, paged_attention,
                                     paged_attention_ref, rows_as_decode, write_kv_ref)
from localpd.kvcache.formats import kv_formats, new_kv_pool
from localpd.kernels.paged_attention import _codes_as_half, _word_halves


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
    padded); the pool starts as NaN/inf garbage. int4 keys take tiles of twice the tokens here (heads of 64)."""
    bt = decode_block_t(page_size, 64, kv_formats(kv_dtype)[0])
    assert bt == decode_block_t(page_size, 64) * (2 if kv_formats(kv_dtype)[0] == "int4" else 1)
    assert bt // page_size > 1
    for group, lens in ((1, [bt, 3]), (4, [2 * bt + page_size + 3, 1, bt - 1]), (7, [bt + 1, bt + bt // 2])):
        check(build_case(kv_dtype, page_size, 2, group, lens, [1] * len(lens), seed=group, poison=True), 1e-4)
    check(build_case(kv_dtype, page_size, 2, 3, [70, 33], [6, 33], seed=8, poison=True), 1e-4)  # prefill too


def test_decode_tiles_hold_twice_the_tokens_over_rounded_keys_up_to_128_over_8_bits():
    """int8, fp8 and int4 keys take tiles of twice bf16's tokens (the same 16 KB of int8 a trip), but int8 and fp8
    at most 128 tokens: at heads of 64 their 256-token tiles spilled and waited a round trip a trip (sm_90)."""
    for k in ("int8", "fp8", "int4"):
        assert decode_block_t(16, 128, k) == 2 * decode_block_t(16, 128) == 128
        assert decode_block_t(16, 256, k) == 2 * decode_block_t(16, 256) == 64
    assert decode_block_t(16, 64, "int4") == 256
    assert decode_block_t(16, 64, "int8") == decode_block_t(16, 64, "fp8") == 128


@pytest.mark.parametrize("kv_dtype", DTYPES)
@pytest.mark.parametrize("group, batch, splits, per_split", [(4, 1, 4, 1), (7, 2, 2, 2)])
def test_decode_splits_including_empty_partitions(kv_dtype, group, batch, splits, per_split):
    """A sequence of 4 tiles, alone (a tile per split) or beside one of 5 tokens (two splits of two tiles, the short
    sequence's second split empty); one KV head, so batch x kv heads is the batch. The pool starts as garbage."""
    assert decode_splits(batch, 4, torch.device("cpu")) == (splits, per_split)
    lens = [3 * decode_block_t(16, 64) + 5, 5][:batch]
    check(build_case(kv_dtype, 16, 1, group, lens, [1] * batch, seed=5, poison=True), 1e-4)


@pytest.mark.parametrize("kv_dtype", ["int8", "fp8", "int4", "int8/int4", "int4ch/int4"])
@pytest.mark.parametrize("D", [96, 64])
def test_a_splits_trips_take_the_factors_loaded_the_trip_before(kv_dtype, D):
    """Each trip's factors (per-token scales, int4 groups' scales and zeros) are loaded a trip ahead, from pages
    loaded two trips ahead: splits of 1-4 tiles, the last ending mid-tile, the next trip's past the sequence's end
    (masked), heads of 96 in tiles of 128 (3 groups of 4 in a tile) and of 64; the pool starts as garbage."""
    bt = decode_block_t(16, D, kv_formats(kv_dtype)[0])
    assert decode_splits(2, 4, torch.device("cpu")) == (2, 2)
    check(build_case(kv_dtype, 16, 1, 4, [4 * bt - 5, bt + 9], [1, 1], D=D, seed=D, poison=True), 1e-4)


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


@pytest.mark.skipif(DEV == "cpu", reason="long contexts need a GPU")
@pytest.mark.parametrize("kv_dtype", ["bf16", "int8", "fp8", "int4", "int8/int4", "int4ch/int4"])
def test_long_contexts_on_the_gpu(kv_dtype):
    """Llama-3-8B heads (8 KV heads, GQA 4, D 128) at thousands of tokens, decode and a prefill chunk."""
    check(build_case(kv_dtype, 16, 8, 4, [4099, 1, 777], [1, 1, 1], D=128, dtype=torch.bfloat16, seed=9), 2e-2)
    check(build_case(kv_dtype, 16, 8, 4, [2100, 300], [64, 300], D=128, dtype=torch.bfloat16, seed=10), 2e-2)


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
    assert rows_as_decode(kv_formats("int4ch/int4"), cpu) and not rows_as_decode(kv_formats("int4ch"), gpu)


@pytest.mark.parametrize("kv_dtype, D, group, bits", [("bf16", 64, 4, 4), ("int8", 128, 2, 8),
                                                     ("int4ch/int4", 96, 3, 4)])
def test_the_reduce_rounds_its_output_as_quantize_act_would(kv_dtype, D, group, bits):
    """round_into: the decode reduce rounds each output row for the o projection's integer GEMV (kernels/act_round)
    as it writes it, bit for bit what quantize_act makes of the output it writes; heads of 64, 128 and 96 (three
    blocks of a head padded to four), GQA groups, a sequence beside one of a single token; the prefill path takes
    none."""
    from localpd.kernels.act_round import Rounded, quantize_act
    from localpd.kvcache.dispatch import rounds_output

    q, layer, table, lens, starts = build_case(kv_dtype, 16, 2, group, [40, 1, 17], [1, 1, 1], D=D,
                                               dtype=torch.bfloat16, seed=11, poison=True)
    assert rounds_output(q, layer, lens)
    T, Hq, _ = q.shape
    into = Rounded.empty(T, Hq * D, bits, q.device)
    out = paged_attention(q, layer, table, lens, starts, D ** -0.5, round_into=into)
    q_ref, s_ref = quantize_act(out.reshape(T, Hq * D), bits)
    assert torch.equal(into.q, q_ref) and torch.equal(into.s, s_ref)
    prefill = build_case(kv_dtype, 16, 2, group, [40, 17], [3, 17], D=D, dtype=torch.bfloat16, seed=12)
    assert not rounds_output(prefill[0], prefill[1], prefill[3])


@pytest.mark.parametrize("start", [3, 15])
def test_a_verifications_rows_see_an_int4ch_page_as_their_decode_steps_did(start):
    """int4ch keys: a page's codes are rounded again over its tokens at each write while it is open, so a
    verification's rows, written together, would see their page rounded over the later rows' keys; the reference
    rounds it again for each row from the staged values, and each row is its decode step's bit for bit: 9 rows
    from offset 3 of a page, or the first row closing one (offset 15) and 8 in the next. A draft never fills a page
    (verification_room)."""
    from localpd.kvcache.dispatch import verification_room

    g = torch.Generator().manual_seed(7)
    ps, H, group, D, t = 16, 2, 3, 64, 9
    n0 = ps + start  # tokens before the step: one whole page and `start` of the next
    k, v = torch.randn(2, n0 + t, H, D, generator=g)
    q = torch.randn(t, H * group, D, generator=g)
    pages = torch.tensor([[4, 1, 6]], dtype=torch.int32)

    def slots(pos):
        return pages[0, pos // ps].long() * ps + pos % ps

    def staged(pos):
        return 2 * ps + pos % ps  # the sequence's stage row: 2

    def pool_before():
        layer = new_kv_pool("int4ch/int4", 1, 8, ps, H, D, torch.float32, "cpu", stage_rows=3).layer(0)
        for p in range(n0):  # written a token a step, as a sequence decodes
            write_kv_ref(layer, k[p:p + 1], v[p:p + 1], slots(torch.tensor([p])), torch.tensor([staged(p)]))
        return layer

    decode, layer = [], pool_before()
    for i in range(t):
        p = torch.tensor([n0 + i])
        write_kv_ref(layer, k[n0 + i:n0 + i + 1], v[n0 + i:n0 + i + 1], slots(p), torch.tensor([staged(n0 + i)]))
        decode.append(paged_attention_ref(q[i:i + 1], layer, pages, torch.tensor([n0 + i + 1], dtype=torch.int32),
                                          torch.tensor([0, 1], dtype=torch.int32), D ** -0.5)[0])
    layer = pool_before()
    pos = torch.arange(n0, n0 + t)
    stage_slots = torch.tensor([staged(p) for p in pos.tolist()])
    write_kv_ref(layer, k[n0:], v[n0:], slots(pos), stage_slots)
    lens, starts = torch.tensor([n0 + t], dtype=torch.int32), torch.tensor([0, t], dtype=torch.int32)
    rows = paged_attention_ref(q, layer, pages, lens, starts, D ** -0.5, stage_slots=stage_slots)
    assert all(torch.equal(rows[i], decode[i]) for i in range(t))
    unstaged = paged_attention_ref(q, layer, pages, lens, starts, D ** -0.5)  # the page as the write left it
    assert not all(torch.equal(unstaged[i], decode[i]) for i in range(t - 1))
    assert verification_room(n0 + 1, ps, ("int4ch", "int4")) >= t - 1  # these drafts fit the rule
    # a first drafted token at offset 14 may be verified alone, at 15 (it would fill the page) not at all
    assert [verification_room(p, ps, ("int4ch", "int4")) for p in (ps - 2, ps - 1, ps, 2 * ps + 5)] == [1, 0, 15, 10]
    assert verification_room(7, ps, ("fp16", "fp16")) is None and verification_room(7, ps, ("int8", "int4")) is None


@pytest.mark.parametrize("kv_dtype", ["int8", "fp8", "int4", "int8/int4", "int4ch/int4", "int4ch", "bf16/int8"])
def test_quantized_values_meet_half_precision_weights(kv_dtype):
    """Where the dots take a 16-bit type, int8 and int4 values go into the softmax weights' dot in float16, their
    codes made float16 in the load's registers without an int-to-float conversion (int4: code * scale + zero in
    float16; paged_attention.decode_kernel's V_HALF, and int4 keys against float16 query halves), and so do int4
    keys and values in the prefill kernel: float16 queries here, as bfloat16 ones on a GPU. Within float16's
    rounding of the reference (the tests above hold float32 to 1e-4): 3e-3, and 6e-3 for the prefill rows, whose
    float16 outputs near 3 lie 2e-3 apart."""
    if "bf16" in kv_dtype and DEV == "cpu":
        pytest.skip("bfloat16 pages beside float16 queries: the interpreter's dots")
    check(build_case(kv_dtype, 16, 2, 4, [300, 37, 1], [1, 1, 1], D=64, dtype=torch.float16, seed=12, poison=True),
          3e-3)
    check(build_case(kv_dtype, 16, 2, 4, [70, 33], [6, 33], D=64, dtype=torch.float16, seed=13, poison=True), 6e-3)


@pytest.mark.parametrize("kv_dtype", ["int8", "fp8", "bf16/int8"])
def test_byte_pair_values_in_a_wider_tile(kv_dtype):
    """int8 and fp8 values loaded as byte pairs (paged_attention._byte_pairs: even and odd channels in two
    accumulators) for heads of 96 in tiles of 128, the pairs past the head's 48 masked, over a pool of garbage; a
    split of several trips beside a one-token sequence."""
    if "bf16" in kv_dtype and DEV == "cpu":
        pytest.skip("bfloat16 pages beside float16 queries: the interpreter's dots")
    bt = decode_block_t(16, 96, kv_formats(kv_dtype)[0])
    check(build_case(kv_dtype, 16, 2, 3, [3 * bt + 11, 1], [1, 1], D=96, dtype=torch.float16, seed=16, poison=True),
          3e-3)


@pytest.mark.parametrize("kv_dtype", ["int4ch/int4", "int4ch"])
@pytest.mark.parametrize("D", [96, 64])
def test_int4ch_codes_read_a_word_at_a_time(kv_dtype, D):
    """int4ch codes in float16 (paged_attention._int4ch_halves' WORDS: 4 bytes a word, two codes made float16 a
    mask-and-or, as grouped int4's), decode rows over several trips and prefill chunks after a cached prefix, at
    heads of 96 in tiles of 128 (the words past the head's 12 masked) and of 64, over a pool of garbage."""
    bt = decode_block_t(16, D, kv_formats(kv_dtype)[0])
    check(build_case(kv_dtype, 16, 2, 4, [3 * bt + 11, 1], [1, 1], D=D, dtype=torch.float16, seed=D, poison=True),
          3e-3)
    check(build_case(kv_dtype, 16, 2, 4, [70, 33], [6, 33], D=D, dtype=torch.float16, seed=D + 1, poison=True),
          6e-3)


@pytest.mark.parametrize("pairs", [True, False])
@pytest.mark.parametrize("kv_dtype", ["int8", "fp8"])
def test_prefill_values_as_byte_pairs_or_as_stored(kv_dtype, pairs, monkeypatch):
    """The prefill kernel's int8 and fp8 values: as byte pairs in float16 (kvcache.dispatch.prefill_value_pairs:
    cards before sm_90, and the interpreter) or as stored in the dots' type (sm_90), both within float16's
    rounding of the reference; heads of 96 in tiles of 128 and of 64, chunks after a cached prefix, a garbage
    pool."""
    import localpd.kvcache.dispatch as dispatch

    monkeypatch.setattr(dispatch, "prefill_value_pairs", lambda arch: pairs)
    for D, seed in ((96, 17), (64, 18)):
        check(build_case(kv_dtype, 16, 2, 4, [70, 33], [6, 33], D=D, dtype=torch.float16, seed=seed, poison=True),
              6e-3)


def test_fp8_pages_meet_bfloat16_queries_in_float16_dots(monkeypatch):
    """fp8 e4m3 keys and values go into their dots as float16 (exact: e4m3 lies inside float16), with the
    queries and softmax weights in float16, where bfloat16 dots took a second conversion of every value; decode
    rows, and prefill rows (the prefill kernel's V_HALF and KDOT) after them. The
    GPU's dot type for bfloat16 queries, here too: no bfloat16 dot is left to the interpreter (which multiplies
    them wrongly, kvcache.dispatch.attention_dot), so this failed while fp8 took bfloat16 dots."""
    import localpd.kvcache.dispatch as dispatch

    gpu_dot = dispatch.attention_dot
    monkeypatch.setattr(dispatch, "attention_dot", lambda dtype, interpreted: gpu_dot(dtype, interpreted=False))
    check(build_case("fp8", 16, 2, 4, [300, 37, 1], [1, 1, 1], D=64, dtype=torch.bfloat16, seed=14, poison=True),
          2e-2)  # a bfloat16 step of the outputs, up to 3.5 here
    check(build_case("fp8", 16, 2, 4, [70, 33], [6, 33], D=64, dtype=torch.bfloat16, seed=15, poison=True), 2e-2)


def test_codes_become_half_precision_exactly():
    """Every int8 code -128..127 as float16 by its bits alone (the magic number 1024.0 with the code in its low
    mantissa bits), and int4 codes two a mask-and-or from 4-byte words (_word_halves: each byte's low nibble, then
    its high one, in the bytes' order), exactly the codes."""
    c8 = torch.arange(-128, 128, dtype=torch.int8, device=DEV)
    words = torch.randint(-2**31, 2**31, (16, 8), dtype=torch.int64).to(torch.int32).to(DEV)
    words[0] = torch.tensor([0x76543210, 0xFEDCBA98] * 4, dtype=torch.int64).to(torch.int32)  # every nibble
    o8 = torch.empty(256, dtype=torch.float16, device=DEV)
    lo, hi = (torch.empty(16, 32, dtype=torch.float16, device=DEV) for _ in range(2))
    _codes_kernel[(1,)](c8, words, o8, lo, hi, N=256, T=16, DP=64)
    assert torch.equal(o8, c8.half())
    codes = words.cpu().view(torch.uint8).view(16, 32)  # a token's bytes in order (little-endian words)
    assert torch.equal(lo.cpu(), (codes & 15).half()) and torch.equal(hi.cpu(), (codes >> 4).half())
    assert set(lo[0].tolist()) == set(range(0, 16, 2)) and set(hi[0].tolist()) == set(range(1, 16, 2))


@triton.jit
def _codes_kernel(c8, words, o8, lo, hi, N: tl.constexpr, T: tl.constexpr, DP: tl.constexpr):
    i = tl.arange(0, N)
    tl.store(o8 + i, _codes_as_half(tl.load(c8 + i)))
    w = tl.load(words + tl.arange(0, T)[:, None] * (DP // 8) + tl.arange(0, DP // 8)[None, :])
    out = tl.arange(0, T)[:, None] * (DP // 2) + tl.arange(0, DP // 2)[None, :]
    tl.store(lo + out, _word_halves(w & 0x000F000F, (w >> 8) & 0x000F000F, T, DP) - 1024.0)
    tl.store(hi + out, _word_halves((w >> 4) & 0x000F000F, (w >> 12) & 0x000F000F, T, DP) - 1024.0)


@pytest.mark.parametrize("kv_dtype", ["bf16", "int8", "int4", "int8/int4", "int4ch/int4"])
def test_64_bit_offsets_read_what_32_bit_ones_do(monkeypatch, kv_dtype):
    """Layers past int32's reach (kvcache.dispatch.wide_offsets) take the decode kernel's int64 offsets; forced
    here on a small pool, splits of several tiles (the pool starts as garbage)."""
    import localpd.kvcache.dispatch as dispatch

    monkeypatch.setattr(dispatch, "wide_offsets", lambda layer: True)
    bt = decode_block_t(16, 64, kv_formats(kv_dtype)[0])
    check(build_case(kv_dtype, 16, 2, 4, [2 * bt + 7, 40], [1, 1], seed=11, poison=True), 1e-4)
