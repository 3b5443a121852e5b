"""`localpd bench kernels --predict --attention`: decode attention over paged KV compiled for an H100's sm_90 at
Llama-3-8B's heads, 4k and 32k tokens under a CUDA graph's 131072-token page table: its loop waits on no load of
its own trip (each format's factors loaded a trip ahead), so the rounded formats are predicted to stream their
fewer bytes. Run as a command (the test process has Triton's interpreter on)."""

from predict_cli import predict_rows

import pytest

pytestmark = pytest.mark.slow  # compiles kernels for a GPU


@pytest.fixture(scope="module")
def rows(tmp_path_factory):
    return {(r["kv"], r["context"]): r for r in predict_rows(tmp_path_factory, "--attention", printed="x bf16")}


def test_no_format_waits_on_a_dram_round_trip_inside_its_trips(rows):
    """int8's and fp8's per-token scales (2 bytes a token, too narrow for the pipeliner's copies) were loaded in the
    trip that used them: 2 round trips a trip in turn; grouped int4's scales, zeros and value codes 4. Now a trip
    ahead: none. (Grouped int4 values' factors are packed in pairs at the end of the trip that loads them, 1000 and
    more instructions after their loads: read then, they wait no more.)"""
    for (kv, context), r in rows.items():
        assert r["spilled"] == 0 and r["waits"] == 0, r
    assert rows[("int4", 4096)]["waited"] > 0 and rows[("int8", 4096)]["waited"] == 0


def test_the_splits_follow_the_sequence_and_fill_the_sms(rows):
    """256-264 programs (2 an SM on 132 SMs) at both lengths, however wide the table; a 32k sequence walks 8 tiles
    of 128 int8 tokens a program, 16 of 64 bf16 ones."""
    assert all(256 <= r["programs"] <= 264 for r in rows.values()), rows
    assert rows[("int8", 32768)]["trips"] == 8 and rows[("bf16", 32768)]["trips"] == 16


def test_rounded_kv_is_predicted_faster_in_proportion_to_its_bytes(rows):
    """At 32k tokens int8 moves 0.51x bf16's bytes and is predicted 1.86x faster (1.25x with its scales waited on
    in each trip, 1.19x measured so on the H100), grouped int4 0.31x and 2.8x (its 4-byte words of codes made two
    float16 a mask); at 4k the two launches' floor takes most of it."""
    for kv in ("int8", "fp8", "int4", "int8/int4"):
        ratio = rows[("bf16", 32768)]["predicted_us"] / rows[(kv, 32768)]["predicted_us"]
        assert ratio > 1.8, (kv, ratio)
    assert rows[("int8", 4096)]["predicted_us"] < rows[("bf16", 4096)]["predicted_us"]
