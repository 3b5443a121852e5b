"""An int4 weight in torch's tinygemm layout (quant/tinygemm.py, issue 32's per-shape fallback) against the int4
weight it was made from: on the CPU through torch's CPU kernel, on a GPU (LOCALPD_TEST_DEVICE=cuda) through the
CUDA one, whose packing only a GPU runs."""

import os

import pytest
import torch

from localpd.errors import LocalpdError
from localpd.kernels.dispatch import PreNorm, int4_matmul_ref
from localpd.model.linear import QuantLinear
from localpd.quant.tinygemm import TinyGemmInt4, takes, tinygemm_matmul, to_tinygemm
from localpd.quant.weights import Int4Weight

DEV = os.environ.get("LOCALPD_TEST_DEVICE", "cpu")
# bfloat16 scales and zeros and bfloat16 activations: about 2**-9 of each; float32 ones: only the zero's sum rounds
TOL = {torch.float32: 2e-6, torch.float16: 1e-3, torch.bfloat16: 8e-3}


def int4(n: int, k: int, group: int, seed: int) -> Int4Weight:
    g = torch.Generator().manual_seed(seed)
    w = Int4Weight.quantize_rtn(torch.randn(n, k, generator=g) * 0.1 + 0.02, group)
    return Int4Weight(w.packed.to(DEV), w.scales.to(DEV), w.biases.to(DEV))


def rel_err(a, b) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


DTYPES = [torch.bfloat16] if DEV == "cuda" else [torch.float32, torch.float16, torch.bfloat16]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n,k,group,m", [(48, 512, 32, 1), (16, 128, 128, 3), (80, 384, 64, 17), (32, 256, 128, 5)])
def test_tinygemm_products_are_the_int4_weights(dtype, n, k, group, m):
    """The fallback's product is the int4 weight's (zero = bias + 8 scale, scales and zeros [K / group, N, 2])
    for one row and several, with the same bytes as the int4 weight's in 16-bit activations."""
    w = int4(n, k, group, seed=n + k + m)
    t = to_tinygemm(w, dtype)
    assert isinstance(t, TinyGemmInt4) and t.shape == w.shape and t.group == group
    assert t.scales_zeros.shape == (k // group, n, 2) and t.scales_zeros.dtype == dtype
    if dtype != torch.float32:
        assert t.nbytes == n * k // 2 + n * (k // group) * 4
    x = (torch.randn(m, k, generator=torch.Generator().manual_seed(m)) * 2 + 0.3).to(dtype).to(DEV)
    ref = int4_matmul_ref(x.float(), w.packed, w.scales, w.biases, group)
    got = tinygemm_matmul(x, t)
    assert got.dtype == dtype and got.shape == (m, n)
    assert rel_err(got, ref) < TOL[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
def test_tinygemm_runs_the_input_steps_and_bias_as_the_model_calls_them(dtype):
    """Through QuantLinear: the bias, the RMSNorm in front (with the residual stream handed back) and SiLU * up,
    each as the int4 reference does them, in a batch of 2 x 3 rows."""
    w, bias = int4(64, 256, 64, seed=3), torch.randn(64).to(dtype).to(DEV)
    lin, g = QuantLinear(to_tinygemm(w, dtype), bias), torch.Generator().manual_seed(5)
    x = torch.randn(2, 3, 256, generator=g).to(dtype).to(DEV)
    ref = int4_matmul_ref(x.reshape(6, 256).float(), w.packed, w.scales, w.biases, 64, bias=bias.float())
    assert rel_err(lin(x), ref.reshape(2, 3, 64)) < TOL[dtype]
    residual, norm_w = torch.randn(2, 3, 256, generator=g).to(dtype).to(DEV), (1 + torch.rand(256)).to(dtype).to(DEV)
    y, s = lin.normed(x, residual, norm_w, 1e-5)
    ref, ref_s = int4_matmul_ref(x.reshape(6, 256), w.packed, w.scales, w.biases, 64, bias=bias,
                                 norm=PreNorm(residual.reshape(6, 256), norm_w, 1e-5))
    assert rel_err(y, ref.reshape(2, 3, 64)) < TOL[dtype] and torch.equal(s, ref_s.reshape(2, 3, 256))
    gate_up = torch.randn(3, 512, generator=g).to(dtype).to(DEV)
    ref = int4_matmul_ref(gate_up, w.packed, w.scales, w.biases, 64, bias=bias, gated="silu")
    assert rel_err(lin.gated(gate_up), ref) < TOL[dtype] + 2e-3 * (dtype != torch.float32)


def test_shapes_the_kernel_does_not_take_are_refused_in_one_line():
    cpu = torch.device("cpu")
    assert takes((48, 512), 32, torch.float32, cpu) and takes((8, 128), 128, torch.bfloat16, torch.device("cuda"))
    assert not takes((40, 512), 32, torch.float32, cpu)  # the CPU kernel packs outputs 16 at a time
    assert not takes((48, 96), 32, torch.float32, cpu)  # K in whole 128-input tiles
    assert not takes((48, 512), 128, torch.float16, torch.device("cuda"))  # bfloat16 activations on a GPU
    with pytest.raises(LocalpdError, match="does not take a 40x512 int4-g32 weight") as e:
        to_tinygemm(Int4Weight.quantize_rtn(torch.randn(40, 512), 32), torch.float32)
    assert "\n" not in str(e.value)
