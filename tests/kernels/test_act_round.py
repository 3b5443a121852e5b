"""The activation rounding for the integer GEMV (kernels/act_round.py), standalone and inside the input steps
(kernels/fused.py: add_rms_norm, act_mul), against the torch references, in Triton's interpreter on the CPU
(LOCALPD_TEST_DEVICE=cuda runs them on a GPU)."""

import os

DEV = os.environ.get("LOCALPD_TEST_DEVICE", "cpu")
if DEV == "cpu":
    os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported

import pytest  # noqa: E402
import torch  # noqa: E402

from localpd.kernels.act_round import quantize_act, quantize_act_ref, rounded_act_ref, unpack_ref  # noqa: E402
from localpd.kernels.fused_dispatch import (act_mul, act_mul_rounded, act_mul_rounded_ref, add_rms_norm,  # noqa: E402
                                            add_rms_norm_rounded, add_rms_norm_rounded_ref)


@pytest.fixture(autouse=True)
def triton_on(monkeypatch):
    if DEV == "cpu":
        monkeypatch.setenv("LOCALPD_TRITON_INTERPRET", "1")


def within_a_level(a, b, s) -> bool:
    """a and b [M, K] no more than two lo levels (d, from s) apart in every block: a last bit of a float operation
    rounded apart can move a value at a tie of hi from one side to the other, and lo, clamped to +-127, then
    misses the 128 it needed (once in a few thousand values)."""
    d = s.reshape(a.shape[0], -1, 2)[..., :1].double()
    return bool(((a - b).reshape(d.shape[0], d.shape[1], 32).abs() <= 2.001 * d).all())


def close_blocks(a, b) -> bool:
    """Within a few bfloat16 roundings of each other, relative to each block's largest value."""
    big = b.reshape(b.shape[0], -1, 32).abs().amax(-1, keepdim=True)
    return bool(((a - b).reshape(big.shape[0], big.shape[1], 32).abs() <= 3e-2 * big).all())


def act_rows(m: int, k: int, seed: int, dtype=torch.float32) -> torch.Tensor:
    """Rows with the shapes real activations have: mostly small, a few outliers 100x larger, one block all zero."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g)
    x[:, torch.randint(0, k, (max(1, k // 64),), generator=g)] *= 100
    x[0, 32:64] = 0
    return x.to(dtype)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("m,k", [(1, 64), (3, 576), (2, 32 * 37)])
def test_activation_rounding_is_the_reference_bit_for_bit(bits, m, k):
    """quantize_act: the packed levels and each block's d and d * sum equal the torch reference's exactly (blocks
    past a program's last, an all-zero block, outliers); the levels carry ~15 bits: |x - (256 hi + lo) d| <= d."""
    x = act_rows(m, k, seed=k + bits).to(DEV)
    q, s = quantize_act(x, bits)
    q_ref, s_ref = quantize_act_ref(x, bits)
    assert torch.equal(q, q_ref) and torch.equal(s, s_ref)
    assert torch.equal(unpack_ref(q, s, bits), rounded_act_ref(x))
    d = s.reshape(m, k // 32, 2)[..., 0]
    assert (d[0, 1] == 0) and (d[:, 0] > 0).all()  # the zero block rounds to zeros with d = 0
    err = (rounded_act_ref(x) - x.double()).abs().reshape(m, k // 32, 32)
    assert (err <= d.double()[..., None] * 1.001).all()
    assert (err.amax(-1) / x.double().abs().reshape(m, k // 32, 32).amax(-1).clamp_min(1e-30)).max() < 2 ** -14



@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_input_steps_round_what_they_write(bits, dtype):
    """add_rms_norm and act_mul with the rounding inside: q and scales equal the standalone rounding of the output
    the plain step writes (bit for bit), the residual stream as add_rms_norm's; rows of 576 (SmolLM2) and 1056
    (act_mul's 1024-wide programs plus a partial one)."""
    m, k = 3, 576
    x, r = act_rows(m, k, seed=1, dtype=dtype).to(DEV), act_rows(m, k, seed=2, dtype=dtype).to(DEV)
    g = (torch.rand(k, generator=torch.Generator().manual_seed(3)) + 0.5).to(dtype).to(DEV)
    q, sq, s = add_rms_norm_rounded(x, r, g, 1e-5, bits)
    h, s_plain = add_rms_norm(x, r, g, 1e-5)
    assert torch.equal(s, s_plain)
    if dtype == torch.bfloat16:  # float32 rows: the plain launch may fuse a multiply-add the rounding one does not
        assert all(torch.equal(a, b) for a, b in zip((q, sq), quantize_act(h, bits)))
    assert within_a_level(unpack_ref(q, sq, bits), rounded_act_ref(h), sq)
    # the reference's bfloat16 sums and norm may round a bit or two apart (here up to 1.5% of an element, its
    # row's norm moved by the outliers), and the rounding follows
    ref = add_rms_norm_rounded_ref(x, r, g, 1e-5, bits)
    assert close_blocks(unpack_ref(q, sq, bits), unpack_ref(ref[0], ref[1], bits))
    gate_up = act_rows(m, 2 * 1056, seed=4, dtype=dtype).to(DEV) / 10
    q, sq = act_mul_rounded(gate_up, "silu", bits)
    y = act_mul(gate_up, "silu")
    if dtype == torch.bfloat16:
        assert all(torch.equal(a, b) for a, b in zip((q, sq), quantize_act(y, bits)))
    assert within_a_level(unpack_ref(q, sq, bits), rounded_act_ref(y), sq)
    ref = act_mul_rounded_ref(gate_up, "silu", bits)
    assert close_blocks(unpack_ref(q, sq, bits), unpack_ref(ref[0], ref[1], bits))
