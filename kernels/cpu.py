"""localpd's CPU kernels (kernels/cpu_kernels.c): int4/int8 weight-only products on activations rounded a block of
32 at a time to two int8 levels, prefill GEMMs over the same rounded rows, paged attention over fp32 pages, RoPE with
the KV write, and a decoder layer in one call. They are what the CPU runs in place of the torch references.

The C file is built on first use with the machine's C compiler (`cc`, or $CC) for this processor (-march=native:
AVX512-VNNI, AVX2 or plain C), linked to torch's own OpenMP runtime where torch ships one
(else a thread pool of its own), kept under $LOCALPD_HOME/cpu-kernels keyed by the source, the flags and the
processor, and loaded with ctypes. Where that fails (no compiler, say), or LOCALPD_CPU_KERNELS=0, the torch
references run instead and `unavailable()` says why. Each call's work is shared by torch's thread count
(torch.set_num_threads, `--threads`). The kernels trust no table: a page, slot or row outside the KV pool is a
LocalpdError.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import math
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import NamedTuple

import torch

from localpd import heap
from localpd.errors import LocalpdError
from localpd.quant.codebook import CODEBOOK_TYPES, CodebookWeight
from localpd.quant.int4k import Int4KWeight
from localpd.quant.int5 import Int5KWeight, Int5Weight
from localpd.quant.int6k import Int2KWeight, Int3KWeight, Int6KWeight
from localpd.quant.weights import Int4Weight, Int8Weight, symmetric

SOURCE = Path(__file__).with_name("cpu_kernels.c")
# fast-math's reassociation (so loops vectorize), without -ffast-math itself: linked into a library it sets the
# processor's flush-to-zero mode for the whole process (crtfastmath.o), which Python's floats would then run under
FLAGS = ("-O3", "-fno-math-errno", "-fno-trapping-math", "-fassociative-math", "-fno-signed-zeros", "-freciprocal-math",
         "-fPIC", "-shared", "-pthread")
PRE = {None: 0, "norm": 1, "silu": 2, "gelu_tanh": 3}  # lpd_linear's input steps

_P, _I, _L, _F = ctypes.c_void_p, ctypes.c_int, ctypes.c_long, ctypes.c_float
SIGNATURES = {
    "lpd_isa": ([], ctypes.c_char_p),
    "lpd_huge_pages": ([_P, ctypes.c_size_t], _I),
    "lpd_threads": ([], ctypes.c_char_p),
    "lpd_linear": ([_I, _P, _P, _P, _F, _P, _I, _I, _I, _P, _P, _P, _P, _P, _P, _P, _P, _P, _I, _I, _P, _P, _I], _I),
    "lpd_prefill_gemm": ([_I, _P, _P, _P, _F, _P, _I, _I, _I, _P, _P, _P, _P, _P, _P, _P, _P, _P, _I, _I, _P, _P, _I],
                         _I),
    "lpd_attention": ([_P, _L, _L, _I, _I, _I, _P, _P, _I, _I, _P, _L, _I, _I, _P, _P, _I, _F, _I, _P, _P, _I], _I),
    "lpd_rope_write": ([_P, _L, _I, _I, _I, _I, _P, _P, _L, _P, _P, _I, _P, _P, _L], _I),
    "lpd_half_pages": ([], _I),
    "lpd_dequantize": ([_I, _P, _P, _P, _P, _P, _P, _P, _P, _P, _I, _I, _I, _I, _P, _I], None),
    "lpd_round_input": ([_I, _P, _P, _P, _F, _P, _I, _I, _P, _I], None),
    "lpd_set_sgemm": ([_P], None),
    "lpd_set_bf16gemm": ([_P], None),
    "lpd_dequant_gemm": ([_I, _P, _P, _P, _P, _P, _P, _P, _P, _P, _I, _I, _I, _I, _P, _P, _P, _I, _I], _I),
    "lpd_decode_layers": ([_P, _P, _I, _P, _P, _I, _I, _P, _P, _P, _P, _P, _L, _P, _P, _I, _P, _L, _I, _I, _P, _P, _I,
                           _F, _I], _I),
}
NEWER = {"lpd_prefill_gemm"}  # entry points a baseline's older source may lack (open_library)
# From this many rows on (compute-bound prefill), a product takes lpd_prefill_gemm's integer GEMM (AVX512-VNNI) or
# dequantizes its weight a slice at a time into torch's GEMM, where fewer rows (decode) take lpd_linear's int8 dot
# products, each row bit for bit its one-row product.
GEMM_ROWS = 16
GEMM_SLICE = 1 << 22  # weight elements dequantized at a time (16 MiB of float32) where torch's GEMM multiplies
SLICE_BYTES = 1 << 19  # a thread's dequantized weight rows where lpd_dequant_gemm multiplies: in its core's L2


def march_flags(march: str = "native") -> list[str]:
    """The flag that builds for a processor: -march on x86, -mcpu on ARM (where gcc and clang name it so)."""
    arm = platform.machine().lower() in ("arm64", "aarch64")
    return [f"-mcpu={march}" if arm else f"-march={march}"]


def _cache_dir() -> Path:
    home = os.environ.get("LOCALPD_HOME") or str(Path.home() / ".cache" / "localpd")
    return Path(home) / "cpu-kernels"


def _processor() -> str:
    """What -march=native builds for: the processor's model and feature flags."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.processor() or platform.machine()
    keep = [l for l in lines if l.startswith(("model name", "flags", "Features", "CPU part"))]
    return "\n".join(dict.fromkeys(keep))


def torch_openmp() -> Path | None:
    """torch's own OpenMP runtime (libgomp) where it ships one: the kernels link to it, so that their threads are
    torch's threads (two runtimes would each spin on the cores the other needs)."""
    found = sorted((Path(torch.__file__).parent / "lib").glob("libgomp*.so*"))
    return found[0] if found else None


def _compile(cc: str, flags: list[str], openmp: Path | None, out: Path, source: Path) -> subprocess.CompletedProcess:
    if openmp is None:
        return subprocess.run([cc, *flags, "-o", str(out), str(source), "-lm"], capture_output=True, text=True)
    obj = out.with_suffix(".o")  # compiled with -fopenmp, linked to torch's runtime rather than the system's
    run = subprocess.run([cc, *flags, "-fopenmp", "-c", "-o", str(obj), str(source)], capture_output=True, text=True)
    if run.returncode != 0:
        return run
    return subprocess.run([cc, *flags, "-o", str(out), str(obj), str(openmp), f"-Wl,-rpath,{openmp.parent}", "-lm"],
                          capture_output=True, text=True)


def build(march: str = "native", out_dir: Path | None = None, openmp: bool = True, source: Path = SOURCE) -> Path:
    """The compiled library for `march` (built now unless already kept); raises RuntimeError with the reason.
    openmp: share torch's OpenMP threads where it can (else a thread pool of the library's own); source: another
    version of cpu_kernels.c (a benchmark's baseline)."""
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if not cc:
        raise RuntimeError("no C compiler (cc, gcc or clang) on PATH")
    flags = [*FLAGS, *march_flags(march)]
    runtime = torch_openmp() if openmp else None
    key = hashlib.sha256(b"\0".join([source.read_bytes(), " ".join([cc, *flags, str(runtime)]).encode(),
                                     _processor().encode()])).hexdigest()
    out_dir = out_dir or _cache_dir()
    lib = out_dir / f"localpd_cpu_{march}_{key[:16]}.so"
    if lib.exists():
        return lib
    out_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out_dir) as tmp:
        part = Path(tmp) / lib.name
        run = _compile(cc, flags, runtime, part, source)
        if run.returncode != 0 and runtime is not None:
            return build(march, out_dir, openmp=False, source=source)
        if run.returncode != 0:
            first = (run.stderr.strip().splitlines() or ["no output"])[0]
            raise RuntimeError(f"{Path(cc).name} failed to build {source.name}: {first}")
        os.replace(part, lib)  # atomic: a concurrent build of the same key writes the same file
    return lib


def open_library(path: Path) -> ctypes.CDLL:
    """The library at path with SIGNATURES' types; an entry point an older source lacks (a benchmark's baseline:
    build(source=...)) is left out, and the products that would call it take the path before it."""
    lib = ctypes.CDLL(str(path))
    for name, (args, res) in SIGNATURES.items():
        if name in NEWER and not hasattr(lib, name):
            continue
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = args, res
    lib.lpd_set_sgemm(torch_sgemm())
    lib.lpd_set_bf16gemm(torch_blas("cblas_gemm_bf16bf16f32"))
    return lib


_why_not: list[str] = []


@functools.cache
def library() -> ctypes.CDLL | None:
    """The kernels built for this processor, or None (unavailable() says why, and a line on stderr once)."""
    if os.environ.get("LOCALPD_CPU_KERNELS", "1").lower() in ("0", "false", "no"):
        _why_not.append("LOCALPD_CPU_KERNELS=0")
        return None
    try:
        return open_library(build())
    except (RuntimeError, OSError) as e:
        _why_not.append(str(e))
        print(f"localpd: CPU kernels unavailable ({e}); the torch reference path runs instead", file=sys.stderr)
        return None


def torch_sgemm() -> int | None:
    """The address of the BLAS sgemm_ (Fortran interface) in torch's own library (MKL's on x86-64 builds), or None
    where it exports none: prefill then multiplies with torch.mm over a dequantized slice."""
    return torch_blas("sgemm_")


@functools.cache
def torch_blas(symbol: str) -> int | None:
    """The address of a BLAS function in torch's own library (MKL's on x86-64 builds), or None where it exports
    none."""
    for name in ("libtorch_cpu.so", "libtorch_cpu.dylib"):
        path = Path(torch.__file__).parent / "lib" / name
        if path.exists():
            try:
                return ctypes.cast(getattr(ctypes.CDLL(str(path)), symbol), ctypes.c_void_p).value
            except (OSError, AttributeError):
                return None
    return None


@functools.cache
def prefill_bf16() -> bool:
    """Whether prefill's GEMMs take bfloat16 operands (MKL's cblas_gemm_bf16bf16f32: the weight's slice and the
    rounded input rounded to bfloat16, as a GPU's prefill multiplies; float32 sums): where the processor multiplies
    bfloat16 on AMX tiles (amx_bf16) and torch's MKL has the GEMM. On the 2-core AMX Xeon it took a 1.7B model's
    128-token prefill from 49 to 112 tok/s (llama.cpp's 68) at +0.05% perplexity, moving the default model's
    logits from the float32 reference's by up to 0.19 where the float32 GEMM's move 0.01 (docs/PERF.md).
    LOCALPD_PREFILL_BF16=0 keeps float32, =1 takes bfloat16 on any processor MKL runs it on."""
    env = os.environ.get("LOCALPD_PREFILL_BF16", "")
    if torch_blas("cblas_gemm_bf16bf16f32") is None or env == "0":
        return False
    return env == "1" or "amx_bf16" in _processor().split()


@functools.cache
def integer_prefill() -> bool:
    """Whether prefill's GEMMs try lpd_prefill_gemm's integer products first (AVX512-VNNI builds take them, others
    say no): the rows rounded as decode rounds them, each value the int16 256 hi + lo, exact integer sums a block,
    twice float32's multiplies a cycle (on the 2-core Zen 4 a 1.7B model's products at 2.0-2.5x the float32 GEMM's
    speed, docs/PERF.md). An AMX processor's bfloat16 GEMMs (prefill_bf16) come first. LOCALPD_PREFILL_INT=0 keeps
    the float32 GEMMs."""
    return os.environ.get("LOCALPD_PREFILL_INT", "1") != "0"


def unavailable() -> str | None:
    """Why the CPU kernels do not run (None when they do)."""
    return None if library() is not None else _why_not[-1]


def describe() -> str:
    """Which CPU path runs, in words (chat --verbose, bench)."""
    lib = library()
    if lib is None:
        return f"CPU path: torch references ({unavailable()})"
    return (f"CPU path: localpd kernels ({lib.lpd_isa().decode()}, {threads()} threads, "
            f"{lib.lpd_threads().decode()})")


def _check(rc: int, name: str) -> None:
    """A kernel's return code: -1 out of memory, -2 a page table, slot, stage slot or query row outside the KV pool
    (or an int4ch write without stage slots)."""
    if rc == -1:
        raise MemoryError(f"{name} could not allocate its scratch")
    if rc:
        raise LocalpdError(f"{name}: the step's page table, slots or rows lie outside the KV pool or its stage")


def threads() -> int:
    """How many threads share a call's work: torch's (torch.set_num_threads, `--threads`)."""
    return torch.get_num_threads()


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def _f32(t: torch.Tensor | None) -> bool:
    return t is None or (t.dtype == torch.float32 and t.is_contiguous() and t.device.type == "cpu")


class Plan(NamedTuple):
    """What lpd_linear needs of a weight, worked out once per weight (kept on it: weight_plan)."""

    bits: int
    data: int
    scales: int  # int4-k: each super-block's d
    biases: int | None  # int4-k: each super-block's dmin
    sub: int | None  # int4-k: each group's scale and minimum bytes (quant/int4k.py); else None
    lut: int | None  # a codebook weight's 16 values (quant/codebook.py); else None
    high: int | None  # a 5-bit weight's fifth bits (quant/int5.py: bits 4, its low four bits int4's); else None
    top: int | None  # Q6_K's two upper bits (quant/int6k.py's `upper`; scales: its d); else None
    sc16: int | None  # Q6_K's, Q3_K's and Q2_K's int8 scale a sub-block of 16 (scales: their d); else None
    mn16: int | None  # Q2_K's int8 minimum a sub-block of 16 (biases: its dmin); else None
    group: int
    n: int
    k: int


# The tensors of each format lpd_linear takes, in its argument order: codes, scales, biases, int4-k's group bytes,
# a codebook's values, a 5-bit weight's fifth bits, Q6_K's upper bits, a scale a sub-block of 16, a minimum a
# sub-block of 16 (Q2_K's)
FIELDS = {Int4Weight: ("packed", "scales", "biases"), Int8Weight: ("data", "scales"),
          Int4KWeight: ("packed", "d", "dmin", "sub"),
          Int5Weight: ("packed", "scales", "biases", None, None, "fifth"),
          Int5KWeight: ("packed", "d", "dmin", "sub", None, "fifth"),
          Int6KWeight: ("packed", "d", None, None, None, None, "upper", "sc"),
          Int3KWeight: ("packed", "d", None, None, None, None, None, "sc"),
          Int2KWeight: ("packed", "d", "dmin", None, None, None, None, "sc", "mn"),
          **{cls: ("packed", "scales", None, None, "table") for cls in set(CODEBOOK_TYPES.values())}}
PLAN_FIELDS = 9


def weight_plan(w) -> Plan | None:
    """The weight's Plan, or None where lpd_linear cannot take it (not int4/int8, a width or group not in blocks
    of 32, tensors not contiguous, or no kernels). A symmetric weight's plan has no biases."""
    plan = w.__dict__.get("_cpu_plan", False) if type(w) in FIELDS else None
    if plan is False:
        n, k = w.shape
        parts = [None if f == "biases" and symmetric(w) else f and getattr(w, f) for f in FIELDS[type(w)]]
        if k % 32 or w.group % 32 or library() is None or not all(t is None or t.is_contiguous() for t in parts):
            plan = None
        else:
            ptrs = [_ptr(t) for t in parts] + [None] * (PLAN_FIELDS - len(parts))
            plan = Plan(8 if isinstance(w, Int8Weight) else 4, *ptrs, w.group, n, k)
        w.__dict__["_cpu_plan"] = plan
    return plan


HUGE_PAGE = 2 << 20


class Arena:
    """One buffer whose pages are 2 MiB where the system allows (lpd_huge_pages), in which a load makes its CPU
    weights' fields one after another (`empty`), so that gather_weights has none of them to move. A request past
    its end gets a tensor of its own (which gather_weights then moves)."""

    def __init__(self, nbytes: int):
        self.buf = torch.empty(nbytes + HUGE_PAGE, dtype=torch.uint8)  # pages are taken as they are written
        self.at = -self.buf.data_ptr() % HUGE_PAGE
        self.end = self.at + nbytes
        lib = library()
        if lib is not None:
            lib.lpd_huge_pages(self.buf.data_ptr() + self.at, -(-nbytes // HUGE_PAGE) * HUGE_PAGE)  # advice only
        _ARENAS[self.buf.data_ptr()] = self.buf.nbytes

    def empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        n = math.prod(shape) * dtype.itemsize
        if self.at + n > self.end:
            return torch.empty(shape, dtype=dtype)
        t = self.buf[self.at:self.at + n].view(dtype).view(shape)
        self.at += (n + 63) // 64 * 64
        return t


_ARENAS: dict[int, int] = {}  # every Arena's buffer: its address -> its size (a storage of both is the buffer)


def in_arena(t: torch.Tensor) -> bool:
    storage = t.untyped_storage()
    return _ARENAS.get(storage.data_ptr()) == storage.nbytes()


def gather_weights(weights: list) -> int:
    """Moves the tensors of these int4/int8 weights (each once, however often listed) into one buffer whose pages
    are 2 MiB where the system allows (lpd_huge_pages), as llama.cpp's one mapped file is: the products stream them
    with a TLB entry per 2 MiB instead of per 4 KiB. The weights' fields then view that buffer; returns its size in
    bytes (0 without kernels or weights). A tensor at a time: each first copy is dropped once moved (the buffer's
    pages are taken as they are written), and the C heap's free memory goes back to the system as it goes
    (heap.Trimmer), so the move needs little more memory than the weights (where a copy of them all took twice as
    much). Fields an Arena made stay where they are."""
    lib = library()
    if lib is None:
        return 0
    todo = {id(w): w for w in weights if type(w) in FIELDS and getattr(w, FIELDS[type(w)][0]).device.type == "cpu"}
    fields = [(w, f) for w in todo.values() for f in FIELDS[type(w)]
              if f in w.__dataclass_fields__ and not in_arena(getattr(w, f))]
    sizes = [(getattr(w, f).nbytes + 63) // 64 * 64 for w, f in fields]
    if not fields:
        return 0
    heap.trim()  # what the build freed so far (a fused matrix's parts)
    buf = torch.empty(sum(sizes) + HUGE_PAGE, dtype=torch.uint8)
    start = -buf.data_ptr() % HUGE_PAGE
    lib.lpd_huge_pages(buf.data_ptr() + start, sum(sizes) // HUGE_PAGE * HUGE_PAGE)  # advice only: fine if refused
    at, trimmer = start, heap.Trimmer()
    for (w, f), n in zip(fields, sizes):
        t = getattr(w, f)
        setattr(w, f, buf[at:at + t.nbytes].view(t.dtype).view(t.shape).copy_(t))
        del t  # the weight held the only reference: its first copy is freed here
        at += n
        trimmer.add(n)
    for w in todo.values():
        w.__dict__.pop("_cpu_plan", None)  # weight_plan's pointers were the first copies'
    heap.trim()
    return sum(sizes)


def takes_linear(x: torch.Tensor, w, bias, norm) -> bool:
    """Whether lpd_linear takes this product: fp32 rows on the CPU, a weight with a Plan, fp32 bias and norm."""
    return (x.device.type == "cpu" and x.dtype == torch.float32 and weight_plan(w) is not None and _f32(bias)
            and (norm is None or (_f32(norm.weight) and (norm.residual is None
                                                          or norm.residual.dtype == torch.float32))))


def linear(x: torch.Tensor, w: Int4Weight | Int8Weight | Int4KWeight | CodebookWeight, bias=None,
           gated: str | None = None, norm=None, lib=None):
    """int4_matmul_ref / int8_matmul_ref (kernels/dispatch.py) with the same arguments, on x [..., K or 2K]
    (takes_linear said yes). lib: a library other than library() (tests build one per instruction set)."""
    lib = lib or library()
    p = weight_plan(w)
    lead = x.shape[:-1]
    x = x.reshape(-1, x.shape[-1]).contiguous()
    m = x.shape[0]
    y = torch.empty(m, p.n, dtype=torch.float32)
    s = res = nw = None
    eps = 0.0
    if norm is not None:
        s = torch.empty(m, p.k, dtype=torch.float32)
        res = None if norm.residual is None else norm.residual.reshape(m, p.k).contiguous()
        nw, eps = norm.weight, norm.eps
    pre = PRE["norm" if norm is not None else gated]
    if m >= GEMM_ROWS:
        if prefill_bf16() or not integer_prefill() or not _integer_gemm(lib, p, pre, x, res, nw, eps, s, bias, y):
            _gemm(lib, p, pre, x, res, nw, eps, s, bias, y)
    elif m and lib.lpd_linear(pre, x.data_ptr(), _ptr(res), _ptr(nw), eps, _ptr(s), m, p.k, p.bits, p.data, p.scales,
                              p.biases, p.sub, p.lut, p.high, p.top, p.sc16, p.mn16, p.group, p.n, _ptr(bias),
                              y.data_ptr(), threads()):
        raise MemoryError("lpd_linear could not allocate its scratch")  # its only failure
    y = y.reshape(*lead, p.n)
    return y if norm is None else (y, s.reshape(*lead, p.k))


def _integer_gemm(lib, p: Plan, pre: int, x, res, nw, eps: float, s, bias, y) -> bool:
    """lpd_linear's arguments for many rows, into y, by lpd_prefill_gemm (AVX512-VNNI): the same rounded rows, each
    value the int16 256 hi + lo, against the weight's codes widened to int16, exact integer sums a block (vpdpwssd:
    twice float32's multiplies a cycle). False where the build or the weight's shape has no such path (then
    _gemm's float GEMMs multiply)."""
    if not hasattr(lib, "lpd_prefill_gemm"):
        return False
    rc = lib.lpd_prefill_gemm(pre, x.data_ptr(), _ptr(res), _ptr(nw), eps, _ptr(s), x.shape[0], p.k, p.bits, p.data,
                              p.scales, p.biases, p.sub, p.lut, p.high, p.top, p.sc16, p.mn16, p.group, p.n, _ptr(bias),
                              y.data_ptr(), threads())
    if rc == -1:
        raise MemoryError("lpd_prefill_gemm could not allocate its scratch")
    return rc == 0


def _gemm(lib, p: Plan, pre: int, x, res, nw, eps: float, s, bias, y) -> None:
    """lpd_linear's arguments for many rows, into y: its input step and rounding (lpd_round_input: the same code,
    so the rows multiplied are bit for bit those a decode step multiplies, whatever else shares the step), then
    float32 GEMMs against the weight dequantized a slice of rows at a time: lpd_dequant_gemm's slices, a thread's
    own in its L2 cache, with torch's BLAS (bfloat16 operands where prefill_bf16: the rows and slices rounded to
    it); without one, torch.mm over larger slices (the slice is all the extra memory)."""
    m = x.shape[0]
    h = torch.empty(m, p.k, dtype=torch.float32)
    nth = threads()
    lib.lpd_round_input(pre, x.data_ptr(), _ptr(res), _ptr(nw), eps, _ptr(s), m, p.k, h.data_ptr(), nth)
    h16 = h.to(torch.bfloat16) if prefill_bf16() else None
    rows = gemm_slice(p.n, p.k, nth, 4 if h16 is not None else 1)
    rc = lib.lpd_dequant_gemm(p.bits, p.data, p.scales, p.biases, p.sub, p.lut, p.high, p.top, p.sc16, p.mn16, p.group,
                              p.k, p.n, m, h.data_ptr(), _ptr(h16), y.data_ptr(), rows, nth)
    if rc == -3:  # no BLAS in torch's library
        rows = max(1, min(p.n, GEMM_SLICE // p.k))
        part = torch.empty(rows, p.k, dtype=torch.float32)
        for n0 in range(0, p.n, rows):
            n1 = min(p.n, n0 + rows)
            lib.lpd_dequantize(p.bits, p.data, p.scales, p.biases, p.sub, p.lut, p.high, p.top, p.sc16, p.mn16, p.group,
                               p.k, n0, n1, part.data_ptr(), nth)
            torch.mm(h, part[:n1 - n0].T, out=y[:, n0:n1]) if rows == p.n else y[:, n0:n1].copy_(h @ part[:n1 - n0].T)
    else:
        _check(rc, "lpd_dequant_gemm")
    if bias is not None:
        y += bias


def gemm_slice(n: int, k: int, nth: int, times: int = 1) -> int:
    """Weight rows a thread dequantizes and multiplies at a time: what fits `times` SLICE_BYTES as float32 (bfloat16
    GEMMs: 4 times, half that in their bfloat16 slice; on the AMX Xeon 1.5x faster than once for an 8B model's
    down_proj, K = 14336, at 32 rows), and at most a quarter of a thread's share so that the threads end together; a
    multiple of 8 (the BLAS's register tile)."""
    rows = min(times * SLICE_BYTES // (4 * k), -(-n // (4 * nth)))
    return max(8, rows // 8 * 8)


def _fp32_rows(t: torch.Tensor) -> bool:
    """fp32 rows on the CPU with unit stride along the last dimension (a strided view of qkv's heads is fine)."""
    return t.device.type == "cpu" and t.dtype == torch.float32 and t.stride(-1) == 1


# the KV formats the library reads and writes, each side (keys, values) its own (cpu_kernels.c's kv_side)
SIDE_FORMATS = {"fp32": 0, "fp16": 1, "int8": 2, "int4": 3, "int4ch": 4}


class KVSide(ctypes.Structure):
    """kv_side in cpu_kernels.c: one side's pages (keys or values), their float16 scales and zeros, the format;
    int4ch's tokens a page, heads and stage (its rows and their count)."""

    _fields_ = [("data", _P), ("scale", _P), ("zero", _P), ("fmt", _I), ("ps", _I), ("heads", _I), ("stage", _P),
                ("n_stage", _L)]


def kv_sides(layer) -> tuple[KVSide, KVSide] | None:
    """A KVLayer's keys and values as the library's sides: fp32, fp16, int8 (a scale a token and head), int4 (a
    scale and zero a group of 32) or int4ch pages (a scale and zero a page, head and channel, with a float32 stage
    of the open pages; heads up to 256 wide), each side its own (SIDE_FORMATS, kvcache/formats.py), contiguous
    with their scales and zeros, where the library converts float16 (every x86 and ARM build); None where its
    kernels do not read them (bf16, fp8). The tensors must outlive the sides (the KV pool holds them)."""
    lib = library()
    if lib is None or layer.k.device.type != "cpu":
        return None
    sides = []
    for data, scale, zero, stage, fmt in ((layer.k, layer.k_scale, layer.k_zero, layer.k_stage, layer.k_format),
                                          (layer.v, layer.v_scale, layer.v_zero, layer.v_stage, layer.v_format)):
        code = SIDE_FORMATS.get(fmt)
        per_page = fmt == "int4ch"
        if per_page:  # the storage behind the per-token view: [n_pages, heads, head_dim]
            scale, zero = (None if t is None else t[:, 0] for t in (scale, zero))
        extra = (scale,) if fmt == "int8" else (scale, zero) if fmt in ("int4", "int4ch") else ()
        if code is None or not data.is_contiguous() or (code and not lib.lpd_half_pages()) or not all(
                t is not None and t.dtype == torch.float16 and t.is_contiguous() for t in extra):
            return None
        if per_page and (stage is None or stage.dtype != torch.float32 or not stage.is_contiguous()
                         or stage.shape[-1] > 256):
            return None
        sides.append(KVSide(data.data_ptr(), _ptr(scale) if extra else None, _ptr(zero) if len(extra) > 1 else None,
                            code, layer.page_size, data.shape[2], _ptr(stage) if per_page else None,
                            stage.shape[0] if per_page else 0))
    return sides[0], sides[1]


def takes_attention(q: torch.Tensor, layer) -> bool:
    """fp32 queries (unit stride along head_dim) over keys and values the library reads (kv_sides)."""
    return _fp32_rows(q) and kv_sides(layer) is not None


def attention(q, layer, page_table, seq_lens, q_starts, scale: float, window: int = 0, stage_slots=None,
              lib=None) -> torch.Tensor:
    """paged_attention_ref (localpd/kvcache/dispatch.py) with the same arguments: over int4ch pages with
    stage_slots, a sequence's few rows each see their own open page as their decode steps did."""
    lib = lib or library()
    T, Hq, D = q.shape
    out = torch.empty(T, Hq, D, dtype=torch.float32)
    pt, lens, starts = (t.to(torch.int32).contiguous() for t in (page_table, seq_lens, q_starts))
    if T:
        k, v = kv_sides(layer)
        stage = _stage_slots(layer, stage_slots)
        _check(lib.lpd_attention(_ptr(q), q.stride(0), q.stride(1), T, Hq, D, ctypes.byref(k), ctypes.byref(v),
                                 layer.page_size, layer.k.shape[2], _ptr(pt), pt.stride(0), pt.shape[1],
                                 layer.k.shape[0], _ptr(lens), _ptr(starts), lens.shape[0], scale, window,
                                 _ptr(stage), _ptr(out), threads()), "lpd_attention")
    return out


def _stage_slots(layer, stage_slots):
    """stage_slots as the library takes them (int64, contiguous) where a side is in a per-page format, else None."""
    if stage_slots is None or (layer.k_stage is None and layer.v_stage is None):
        return None
    return stage_slots.to(torch.int64).contiguous()


def takes_rope_write(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, layer, stage_slots=None) -> bool:
    """fp32 rows, pages the library writes (kv_sides; a per-page format's with the tokens' stage slots)."""
    return (_fp32_rows(qkv) and _fp32_rows(cos) and sin.stride() == cos.stride() and sin.dtype == torch.float32
            and (stage_slots is not None or (layer.k_stage is None and layer.v_stage is None))
            and kv_sides(layer) is not None)


def rope_write(qkv, cos, sin, layer, slots, n_heads: int, n_kv_heads: int, stage_slots=None,
               lib=None) -> torch.Tensor:
    """rope_write_kv_ref (localpd/kvcache/dispatch.py) with the same arguments."""
    lib = lib or library()
    T = qkv.shape[0]
    D = qkv.shape[1] // (n_heads + 2 * n_kv_heads)
    slots = slots.to(torch.int64).contiguous()
    if T:
        k, v = kv_sides(layer)
        stage = _stage_slots(layer, stage_slots)
        _check(lib.lpd_rope_write(_ptr(qkv), qkv.stride(0), T, n_heads, n_kv_heads, D, _ptr(cos), _ptr(sin),
                                  cos.stride(0), _ptr(slots), _ptr(stage),
                                  layer.page_size, ctypes.byref(k), ctypes.byref(v),
                                  layer.k.shape[0] * layer.page_size), "lpd_rope_write")
    return qkv.view(T, -1, D)[:, :n_heads]


class LinPlan(ctypes.Structure):
    """lin_plan in cpu_kernels.c: one projection's weight (a Plan) and bias."""

    _fields_ = [("bits", _I), ("w", _P), ("scales", _P), ("biases", _P), ("sub", _P), ("group", _I), ("N", _I),
                ("K", _I), ("bias", _P), ("lut", _P), ("high", _P), ("top", _P), ("sc16", _P), ("mn16", _P)]


QKV_PARTS = 3  # cpu_kernels.c's: qkv in up to three weights of different formats (model.linear.StackedLinear)


class LayerPlan(ctypes.Structure):
    """layer_plan in cpu_kernels.c: what lpd_decode_layer needs of a decoder layer, built once (layer_plan)."""

    _fields_ = [("n_heads", _I), ("n_kv", _I), ("head_dim", _I), ("act", _I), ("eps", _F), ("attn_norm", _P),
                ("mlp_norm", _P), ("qkv", LinPlan), ("o", LinPlan), ("gate_up", LinPlan), ("down", LinPlan),
                ("parts", _I), ("more", LinPlan * (QKV_PARTS - 1))]


def _lin_plan(lin) -> LinPlan | None:
    plan = weight_plan(getattr(lin, "weight", None))
    if plan is None or not _f32(lin.bias):
        return None
    return LinPlan(plan.bits, plan.data, plan.scales, plan.biases, plan.sub, plan.group, plan.n, plan.k,
                   _ptr(lin.bias), plan.lut, plan.high, plan.top, plan.sc16, plan.mn16)


def layer_plan(linears: list, attn_norm: torch.Tensor, mlp_norm: torch.Tensor, n_heads: int, n_kv_heads: int,
               head_dim: int, act: str, eps: float) -> LayerPlan | None:
    """The plan of a layer whose qkv, o, gate_up and down (QuantLinear-like: .weight, .bias) lpd_linear takes, with
    fp32 norms; qkv may be up to QKV_PARTS such parts of different formats (.parts: a GGUF's Q4_K q and k beside a
    Q6_K v), their outputs side by side. None otherwise. The tensors must outlive the plan (the model holds
    them)."""
    qkv = getattr(linears[0], "parts", [linears[0]])
    plans = [_lin_plan(lin) for lin in [*qkv, *linears[1:]]]
    if None in plans or len(qkv) > QKV_PARTS or not (_f32(attn_norm) and _f32(mlp_norm)) or act not in PRE:
        return None
    first, more, rest = plans[0], plans[1:len(qkv)], plans[len(qkv):]
    more += [LinPlan()] * (QKV_PARTS - 1 - len(more))
    return LayerPlan(n_heads, n_kv_heads, head_dim, PRE[act], eps, attn_norm.data_ptr(), mlp_norm.data_ptr(), first,
                     *rest, len(qkv), (LinPlan * (QKV_PARTS - 1))(*more))


class LayerCache(ctypes.Structure):
    """layer_cache in cpu_kernels.c: a layer's keys and values (kv_sides), its sliding window, and which rotation
    it takes (0 the step's, 1 the local one of sliding-window layers, 2 none)."""

    _fields_ = [("k", KVSide), ("v", KVSide), ("window", _I), ("rope", _I)]


def layer_caches(layers: list, windows: list[int], ropes: list[int]):
    """The layers' LayerCache array from their KVLayers (the pages must outlive it: the KV pool holds them); None
    where the library does not read a layer's pages (kv_sides)."""
    sides = [kv_sides(layer) for layer in layers]
    if None in sides:
        return None
    return (LayerCache * len(layers))(*(LayerCache(*s, w, r) for s, w, r in zip(sides, windows, ropes)))


def decode_layers(plans, caches, out: torch.Tensor, x: torch.Tensor, has_residual: bool, scratch: tuple,
                  rotations: tuple, page_size: int, n_pages: int, slots, page_table, seq_lens, q_starts, scale: float,
                  stage_slots=None, lib=None) -> None:
    """The decoder layers of plans (a LayerPlan array) in one call (lpd_decode_layers), in place on out and x: the
    model's op-by-op forward for those layers, with the same kernels in the same order, in one parallel region.
    caches: their layer_caches; scratch: (qkv, attn, gate_up) rows; rotations: ((cos, sin), (local cos, local sin)),
    fp32 [T, head_dim / 2] with one row stride; slots int64, page_table/seq_lens/q_starts int32, all contiguous;
    stage_slots (int64, contiguous): the rows' stage slots where a layer's pages are int4ch, else None."""
    lib = lib or library()
    qkv, attn, gate_up = scratch
    (cos, sin), (lcos, lsin) = rotations
    _check(lib.lpd_decode_layers(ctypes.byref(plans), ctypes.byref(caches), len(plans), out.data_ptr(), x.data_ptr(),
                                 int(has_residual), out.shape[0], qkv.data_ptr(), attn.data_ptr(), gate_up.data_ptr(),
                                 (_P * 2)(cos.data_ptr(), lcos.data_ptr()), (_P * 2)(sin.data_ptr(), lsin.data_ptr()),
                                 cos.stride(0), slots.data_ptr(), _ptr(stage_slots), page_size, page_table.data_ptr(),
                                 page_table.stride(0), page_table.shape[1], n_pages, seq_lens.data_ptr(),
                                 q_starts.data_ptr(), seq_lens.shape[0], scale, threads()), "lpd_decode_layers")
