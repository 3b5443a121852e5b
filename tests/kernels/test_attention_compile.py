"""The attention kernels compiled for NVIDIA cards on this CPU (no GPU, no interpreter): what the decode kernel's
loads compile to, and every prefill launch the model makes fitting each card."""

import os

import pytest

from localpd.kvcache.dispatch import DECODE_PROGRAMS_PER_SM, DECODE_WARPS


def test_decode_attention_compiles_to_whole_tile_loads(sass_table):
    """The decode kernel's sm_90 code for Llama-3-8B heads, built on this CPU from the launch paged_attention makes
    (scripts/attention_sass.py): int4 pages are read as whole tiles of bytes, scales and zeros (16-byte loads, a
    few load instructions per tile) where every element loaded its byte, scale and zero alone (grouped int4: 385-433
    loads per 64-token tile, registers spilled; int4ch keys: 99), and per-token scales cost no multiply per
    element, so int8 stays under the H100's budget of 45 instructions per 4-byte word. int8 and int4 values go into
    their dot as float16 made from their codes' bits (decode_kernel's HALF_VALUES): int8's 128-token tiles, which
    spilled 64 bytes in 255 registers with the values converted to bfloat16 (Triton 3.9), take 175 and spill
    nothing (1466 -> 1252 loop instructions); int4 255 -> 188 registers and 2146 -> 1864 instructions (its keys
    against float16 query halves too), int8/int4 248 -> 168 registers (docs/PERF.md). The scales (and int4's
    zeros) are loaded a trip ahead, so a trip waits on no load of its own (the last column: round trips in turn;
    int8 took 2, grouped int4 4), except int4 values' factors, packed in pairs at the very end of their trip.
    Offsets into the pages are int32 (kvcache.dispatch.wide_offsets): bf16's 64-bit address pairs had taken it to
    146 registers and 9.6 instructions a word, now 105 and 7.1 (int8/int4's instructions fell too, 21.2 -> 20.6,
    its registers rose 168 -> 210: still two programs an SM, what the splits aim at). fp8 goes into its dots as
    float16, one conversion a pair of values, where bfloat16 dots took a second one each (25.4 -> 19.7
    instructions a word). int8 and fp8 values are loaded as byte pairs (_byte_pairs), so their dot's operand goes
    through shared memory as 16-bit elements, where it was read back a byte at a time: int8 201 -> 69 shared-memory
    instructions a trip, 187 -> 174 registers, 19.6 -> 14.4 instructions a word; fp8 209 -> 77, 204 -> 141,
    19.7 -> 16.7. The values' operand is read after the scores, not held through the keys' math: int8 174 -> 139
    registers, int8/int4 210 -> 166, int4ch/int4 202 -> 167; int8 and grouped int4 codes are read unmasked (their
    factors masked), which frees the masks' predicates: int8 139 -> 124 (13.7 instructions a word), int4 160 -> 128,
    int8/int4 166 -> 160."""
    rows = {r[1]: r for r in sass_table("attention_sass.py", "--kv", "int4,int4ch/int4,int8,int8/int4,bf16,fp8")}
    assert int(rows["bf16"][8]) <= 128 and float(rows["bf16"][3]) < 8, rows
    assert float(rows["fp8"][3]) < 18 and rows["fp8"][11] == "0" and int(rows["fp8"][8]) <= 128, rows
    for kv in ("int8", "fp8"):  # no byte-at-a-time operand reads (128 LDS.U8 a trip took them over 200)
        assert int(rows[kv][5]) < 100, rows
    assert int(rows["int8"][8]) <= 128 and int(rows["int4"][8]) <= 128, rows  # issue 32's ceiling
    assert all(int(rows[kv][8]) <= 176 for kv in ("int8/int4", "int4ch/int4")), rows
    for kv in ("int4", "int4ch/int4"):
        _, _, _, per_word, _, _, loads, widest, _, spilled, _, _ = rows[kv]
        assert int(loads) < 32 and widest.endswith(".128") and spilled == "0", rows
        assert float(per_word) < 100, rows
    assert float(rows["int8"][3]) < 16, rows
    for kv in ("int8", "int4", "int8/int4", "int4ch/int4"):  # the programs an SM the splits aim at fit its registers
        assert int(rows[kv][8]) * DECODE_WARPS * 32 * DECODE_PROGRAMS_PER_SM <= 65536 and rows[kv][9] == "0", rows
    assert [rows[kv][11] for kv in ("int4", "int4ch/int4", "int8", "int8/int4")] == ["1", "1", "0", "1"], rows


@pytest.mark.parametrize("heads", ["32,8,128", "9,3,64", "32,8,96"])
def test_decode_attention_over_float_pages_reads_whole_tiles(sass_table, heads):
    """bf16, fp16 and fp8 pages on sm_90 (Llama-3-8B's, SmolLM2's and heads of 96 in tiles of 128): a tile's
    positions past the split's end (or before a sliding window) read one of the split's own tokens
    (decode_kernel's OWN), so K and V tiles are loaded without masks, as int8's and int4's codes are. With masks
    (the stale bits of a float page may be NaN) Llama-3-8B's heads took bf16 105 registers at 7.1 instructions a
    word, fp16 137 at 9.8, fp8 141 at 16.1; now 102 at 6.3, 127 at 9.0, 128 at 15.3."""
    rows = {r[1]: r for r in sass_table("attention_sass.py", "--kv", "bf16,fp16,fp8", "--heads", heads)}
    assert all(int(r[8]) <= 128 and r[9] == "0" and r[11] == "0" for r in rows.values()), rows
    if heads == "32,8,128":
        assert all(float(rows[kv][3]) < limit for kv, limit in (("bf16", 6.7), ("fp16", 9.4), ("fp8", 15.7))), rows


def test_int4ch_codes_compile_to_word_unpacking(sass_table):
    """int4ch codes read 4 bytes a word and made float16 two a mask-and-or (paged_attention._int4ch_halves' WORDS,
    as grouped int4's are), where each byte was loaded as its own int32 and each nibble converted alone. Decode on
    sm_90, Llama-3-8B heads: int4ch/int4 44.9 -> 40.8 instructions a word, 167 -> 156 registers; int4ch 47.2 ->
    38.0, 176 -> 137. Prefill on an RTX 30 card (sm_86): int4ch/int4 828 -> 528 instructions a page, 255 -> 182
    registers."""
    rows = {r[1]: r for r in sass_table("attention_sass.py", "--kv", "int4ch/int4,int4ch")}
    assert float(rows["int4ch/int4"][3]) < 42 and float(rows["int4ch"][3]) < 40, rows
    assert all(int(r[8]) <= 160 and r[9] == "0" for r in rows.values()), rows
    (row,) = sass_table("attention_sass.py", "--arch", "86", "--kernel", "prefill", "--kv", "int4ch/int4")
    assert int(row[2]) < 600 and int(row[8]) < 200 and row[9] == "0", row


def test_decode_attention_over_8_bit_keys_at_heads_of_64_keeps_its_registers(sass_table):
    """SmolLM2's heads (9 query / 3 KV x 64) over int8 and fp8 pages on sm_90: 128-token tiles
    (kvcache.dispatch.DECODE_8BIT_TILE_TOKENS) spill nothing and wait on no load of their own trip, where 256-token
    tiles took 255 registers, spilled 24-72 bytes and waited a round trip every trip. With their values loaded as
    byte pairs (_byte_pairs) they fit 128 registers: int8 143 -> 122, fp8 154 -> 116."""
    for row in sass_table("attention_sass.py", "--kv", "int8,fp8", "--heads", "9,3,64"):
        assert row[9] == "0" and row[11] == "0" and int(row[8]) <= 128, row


def test_decode_attention_over_8_bit_pages_at_heads_of_256_spills_nothing(sass_table):
    """Gemma 3's heads (8 query / 4 KV x 256) over int8 and fp8 pages on sm_90: with the values' dot operand read a
    byte at a time from shared memory they took all 255 registers and spilled 112 and 104 bytes (22.9 and 23.8
    instructions a word); loaded as byte pairs (_byte_pairs), 174 and 179 registers, nothing spilled (16.3 and
    19.6)."""
    for row in sass_table("attention_sass.py", "--kv", "int8,fp8", "--heads", "8,4,256"):
        assert row[9] == "0" and int(row[8]) < 255, row


def test_prefill_attention_waits_on_one_round_trip_a_page(sass_table):
    """The prefill kernel's sm_90 code for Llama-3-8B heads over rounded pages: a page's factors (int8's and fp8's
    per-token scales, grouped int4's scales and zeros) are loaded together, as 16-bit patterns converted where they
    are used (paged_attention._page_factors), where each was loaded at its use and a trip waited on DRAM round
    trips in turn: int8 and fp8 4, int4 2. Instructions a page fell too (int8 462 -> 452, int4 478 -> 462)."""
    rows = sass_table("attention_sass.py", "--kernel", "prefill", "--kv", "int8,fp8,int4,int8/int4,int4ch/int4")
    assert len(rows) == 5 and all(row[11] == "1" and row[9] == "0" for row in rows), rows


def test_prefill_attention_on_an_rtx_30_takes_8_bit_values_as_byte_pairs(sass_table):
    """The prefill kernel for an RTX 30 card (sm_86; RTX 40, sm_89, compiles alike) over int8 pages: its values'
    operand went through mma.sync's shared-memory reads a byte at a time (113 shared-memory instructions and 974
    instructions a page); as byte pairs (kvcache.dispatch.prefill_value_pairs) 26 and 697."""
    (row,) = sass_table("attention_sass.py", "--arch", "86", "--kernel", "prefill", "--kv", "int8")
    assert int(row[2]) < 800 and int(row[5]) < 50 and row[9] == "0", row


def test_prefill_attention_compiles_without_spills_for_every_model_and_kv_format():
    """Every prefill-attention launch the model makes (the head layouts of Llama-3-8B, Qwen2.5-7B, Llama-3.2-1B,
    SmolLM2, Qwen3-8B, Gemma 3 and Phi-3.5-mini, every KV format), compiled on this CPU for an RTX 30 card (sm_86) and the H100 (sm_90) by
    scripts/compile_check.py: each compiles, fits the card's shared memory per block and keeps its registers in
    its loops (a value ptxas stores before the page loop and reloads after it, two accesses a program, passes:
    Phi-3.5-mini's int8 pages on sm_90 keep 8 bytes so, at the 128 registers ptxas aims at there).
    At 4 warps, Qwen2.5-7B's programs (a group of 7 padded to 8 heads x 16 rows x 128) spilled up to 496 bytes."""
    import subprocess
    import sys
    from pathlib import Path

    pytest.importorskip("triton.backends.nvidia")
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "LOCALPD_TRITON_INTERPRET")}
    script = Path(__file__).parents[2] / "scripts" / "compile_check.py"
    import torch

    jobs = str(torch.get_num_threads())  # compiling processes: this process's share of the cores (tests/conftest.py)
    out = subprocess.run([sys.executable, str(script), "--arch", "86,90", "--kernels", "prefill", "--strict",
                          "--jobs", jobs], capture_output=True, text=True, env=env, timeout=900)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-2000:]
    rows = [line for line in out.stdout.splitlines() if line.startswith("prefill_kernel")]
    assert len(rows) >= 20 and all("GROUP=7" not in r or '"num_warps": 8' in r for r in rows), out.stdout
