"""Programmatic dependent launch (kernels/pdl.py): off on the CPU and under the interpreter; compiled for sm_90,
the integer GEMV waits for the kernel before it (griddepcontrol.wait) only after its first weight loads are out,
and launches the next kernel early. Compiled in a process of its own (the test process interprets kernels)."""

import os
import subprocess
import sys

import pytest
import torch

from localpd.kernels import pdl

COMPILE = """
import sys, torch
from localpd.kernels import gemv_dp4a as dp, gemv_kmajor as km
from localpd.measure.sass import compile_launch
n, k, bits = 4096, 4096, 4
out, ws, cnt = torch.empty(1, n, dtype=torch.bfloat16), torch.empty(1), torch.empty(1, dtype=torch.int32)
q, s = torch.empty(1, k // 2, dtype=torch.int32), torch.empty(1, k // 16)
words, factors = torch.empty(k * bits // 32, n, dtype=torch.int32), torch.empty(k // 128, n, dtype=torch.int32)
args = (q, s, out, words, factors, 1, n, k, q.stride(0), s.stride(0), out.stride(0), words.stride(0),
        factors.stride(0), ws, cnt, 2, out)
nb = dp.blocks_a_trip(k)
for flag in (False, True):
    kw = dict(BITS=bits, GROUP=128, BLOCK_N=km.BLOCK_N, NB=nb, BLOCK_M=1, OUT_BIAS=False, ASM=True,
              PREFETCH=dp.DEFAULT_TILE["PREFETCH"], num_warps=min(nb, dp.DEFAULT_TILE["num_warps"]), num_stages=1,
              PDL=flag)
    ptx = compile_launch(dp._gemv_dp4a_kernel, args, kw, 90).asm["ptx"]
    lines = [l.strip() for l in ptx.splitlines()]
    wait = next((i for i, l in enumerate(lines) if l.startswith("griddepcontrol.wait")), -1)
    before = sum(l.split()[1 if l.startswith("@") else 0].startswith("ld.global") for l in lines[:wait] if l)
    before = before if wait >= 0 else 0
    print(flag, wait >= 0, any(l.startswith("griddepcontrol.launch_dependents") for l in lines), before)
"""


def test_pdl_is_off_without_a_gpu():
    assert not pdl.pdl(torch.empty(1)) and pdl.launch_args(torch.empty(1)) == {"PDL": False, "launch_pdl": False}


@pytest.mark.slow  # compiles a kernel for a GPU
def test_the_gemv_loads_its_first_weights_before_it_waits():
    pytest.importorskip("triton.backends.nvidia")
    if not pdl.AVAILABLE:
        pytest.skip("this Triton has no grid dependency control")
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "LOCALPD_TRITON_INTERPRET")}
    done = subprocess.run([sys.executable, "-c", COMPILE], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    plain, with_pdl = (line.split() for line in done.stdout.splitlines()[-2:])
    assert plain == ["False", "False", "False", "0"]
    assert with_pdl[:3] == ["True", "True", "True"] and int(with_pdl[3]) >= 5, with_pdl  # a trip: 4 words, factors


def test_the_cpu_path_does_not_import_triton():
    """The modules a CPU chat imports leave Triton unimported (it is imported with the first GPU or interpreter
    launch): importing it costs startup time, and at exit its bindings print leak warnings (5f65cac imported it
    through this module at the top of fused_dispatch and kvcache.dispatch)."""
    code = ("import sys, localpd.cli.main, localpd.engine, localpd.model.transformer, localpd.kvcache.dispatch; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] == 'triton'))")
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "LOCALPD_TRITON_INTERPRET")}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "[]", done.stdout + done.stderr[-1000:]
