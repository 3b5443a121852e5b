"""Programmatic dependent launch (PDL; sm_90 and later) for a decode step's kernels.

A batch-1 decode step runs about 11 kernels a layer (352 on Llama-3-8B), most of them a few microseconds long, one
after another. Launched plainly, each waits for the one before it to finish before its programs start. With PDL a
kernel's programs start while the one before it is finishing: each calls `wait_prior` (griddepcontrol.wait, which
waits until the kernel before has completed and its writes are visible) before it reads what that kernel wrote,
and then lets the next kernel launch early (griddepcontrol.launch_dependents). The integer GEMV loads its first
weights before the wait (weights are never written by a step), so the launch and the first bytes of a product
overlap the kernel before it. Nothing before the wait may write memory.

A kernel launched with PDL must call wait_prior before touching data an earlier kernel writes: every kernel of
this module's users takes PDL as a constexpr and the launch's `launch_pdl` together (`launch_args`), so the two
cannot disagree. Off on older cards, under Triton's interpreter, and where this Triton has no GDC instructions.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

from localpd.kernels.dispatch import device_arch, triton_interpreting

try:
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
    AVAILABLE = True
except ImportError:  # an older Triton: launches stay plain
    gdc_launch_dependents = gdc_wait = None
    AVAILABLE = False
ENABLED = os.environ.get("LOCALPD_PDL", "1") != "0"  # LOCALPD_PDL=0: every kernel launched plainly (benchmarks)


def arch_has_pdl(arch: int) -> bool:
    """Whether a card of compute capability `arch` (90 for sm_90) takes PDL: sm_90 and later."""
    return arch >= 90


@functools.lru_cache(maxsize=None)
def _capable(index: int) -> bool:
    return arch_has_pdl(device_arch(torch.device("cuda", index)))


def pdl(t: torch.Tensor) -> bool:
    """Whether kernels launched over t's device take programmatic dependent launch."""
    return ENABLED and AVAILABLE and t.is_cuda and not triton_interpreting() and _capable(t.device.index or 0)


def launch_args(t: torch.Tensor) -> dict:
    """The keywords of a launch over t's device: the kernel's PDL constexpr and Triton's launch_pdl, one choice."""
    on = pdl(t)
    return {"PDL": on, "launch_pdl": on}


@triton.jit
def wait_prior(PDL: tl.constexpr):
    """Wait for the kernel before to complete (its writes visible), then let the next kernel launch."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
