"""Reading a Triton kernel's NVIDIA code without a GPU: compile it for an architecture with Triton's own compiler
and ptxas, disassemble the cubin (cuobjdump) and count what its main loop does. Used by scripts/gemv_sass.py and
attention_sass.py, and by `localpd bench kernels --predict` (measure/predict.py).

A streaming kernel keeps up with DRAM only if each SM issues its instructions faster than the bytes arrive: an
SM issues at most 128 thread-instructions a clock, so at full bandwidth there are SMs * 128 * clock /
(bandwidth / 4) instruction slots per 4-byte word streamed (budgets()). Static counts are not timings: they say
where to look; a GPU run decides.
"""

from __future__ import annotations

import inspect
import os
import re
import subprocess
import tempfile
from dataclasses import dataclass

import triton
from triton._C.libtriton import native_specialize_impl
from triton.backends.compiler import BaseBackend, GPUTarget
from triton.compiler import ASTSource

from localpd.measure.device import card_entry

TOOLS = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
# card -> (SMs, boost clock GHz), datasheets; bandwidth from localpd.measure.device's table, the H100's as measured here
CARDS = {"H100 SXM": (132, 1.98), "H200": (132, 1.98), "RTX 5090": (170, 2.41), "RTX 4090": (128, 2.52), "RTX 4070": (46, 2.48),
         "RTX 3090": (82, 1.70)}
H100_MEASURED = 2950  # GB/s, a 1 GiB device-to-device copy (docs/PERF.md)
MEASURED = {"H100 SXM": H100_MEASURED, "H200": 4200}  # GB/s, copies measured on the device tool's cards (PERF)


@dataclass
class LoopStats:
    instructions: int  # SASS instructions in the main loop's body
    per_word: float  # ... per 4-byte word each thread streams in one trip
    barriers: int
    shared: int  # shared-memory loads and stores (a layout change, or a pipelined load, goes through shared memory)
    global_loads: int  # global load instructions (LDG, and LDGSTS: asynchronous copies into shared memory)
    widest_load: str  # the widest global load in the loop, e.g. LDG.E.128
    registers: int
    spilled: int  # bytes of local memory (stack) per thread
    local: int  # local-memory loads and stores (LDL, STL) in the loop: spilled registers it reloads every trip


def compile_launch(kernel, args: tuple, kwargs: dict, arch: int = 90):
    """kernel compiled for sm_<arch> as a launch with these arguments would compile it: tensors and integers
    specialised the way Triton's launcher does (16-byte aligned pointers, integers divisible by 16, 1 as a
    constant), keyword arguments the constexprs plus num_warps and num_stages (a constexpr left out: its default)."""
    params = inspect.signature(kernel.fn).parameters
    names = list(params)
    options = {o: kwargs[o] for o in ("num_warps", "num_stages") if o in kwargs}
    sig, const, attrs = {}, {}, {}
    rest = tuple(kwargs[n] if n in kwargs else params[n].default for n in names[len(args):])  # defaults as launched
    for i, (name, value) in enumerate(zip(names, args + rest)):
        if kernel.params[i].is_constexpr:
            sig[name], const[name] = "constexpr", value
            continue
        ty, spec = native_specialize_impl(BaseBackend, value, False, True, True)
        if ty == "constexpr":
            sig[name], const[name] = "constexpr", value
        else:
            sig[name] = ty
            if spec == "D":
                attrs[(i,)] = [["tt.divisibility", 16]]
    return triton.compile(ASTSource(kernel, sig, const, attrs), target=GPUTarget("cuda", arch, 32), options=options)


def cuobjdump(cubin: bytes) -> str:
    """The cubin's SASS and its resource usage (registers, stack), as cuobjdump prints them."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run([os.path.join(TOOLS, "cuobjdump"), "-sass", "--dump-resource-usage", f.name],
                              capture_output=True, text=True, check=True).stdout


def _loops(sass: str) -> list[list[tuple[int, str]]]:
    """Each loop body (a backward branch and everything from its target to it) as its (address, instruction)
    pairs, the instructions' predicates dropped."""
    code = [(int(a, 16), re.sub(r"^@!?U?P\w+\s+", "", op.strip()))
            for a, op in re.findall(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);", sass)]
    loops = []
    for addr, op in code:
        jump = re.search(r"\bBRA\b.*?0x([0-9a-f]+)", op)
        if jump and int(jump.group(1), 16) < addr:
            loops.append([(a, o) for a, o in code if int(jump.group(1), 16) <= a <= addr])
    return loops


def loop_body(sass: str) -> list[str]:
    """The whole instructions (opcode and operands, predicate dropped) of the largest loop body."""
    return max(([op for _, op in body] for body in _loops(sass)), key=len, default=[])


def local_in_loops(sass: str) -> int:
    """Local-memory loads and stores (LDL, STL: spilled registers) inside any loop body: the spills that cost every
    trip, where one stored before a loop and reloaded after it costs a program two accesses."""
    return len({a for body in _loops(sass) for a, op in body if op.startswith(("LDL", "STL"))})


def main_loop(sass: str) -> list[str]:
    """The opcodes of the largest loop body (loop_body's)."""
    return [op.split()[0] for op in loop_body(sass)]


_NO_DEST = ("ST", "LDGSTS", "RED", "BAR", "BRA", "EXIT", "DEPBAR", "LDGDEPBAR", "ARRIVES", "WARPSYNC", "NOP", "CCTL")


_MATRIX = ("HMMA", "IMMA", "HGMMA", "IGMMA")  # their operands are fragments the text names by their first register


def _fragments(name: str) -> tuple[int, int, int]:
    """The registers a thread holds of a warp-level matrix instruction's A, B and C fragments, from its shape and
    types (HMMA.16816.F32: m16 n8 k16 of 16-bit inputs into float32, 4, 2 and 4; IMMA.16832.S32.S8.S8: 4, 2, 4;
    HMMA.1688.F32: 2, 1, 4; IMMA.8816: 1, 1, 2; .TF32 inputs 32 bits, .S4/.U4 4, .S8/.U8 8, others 16; an .F16
    result 16 bits). A shape it cannot read (warpgroup HGMMA, whose A may be a descriptor) is taken as 4 registers
    each."""
    parts = name.split(".")
    shape = next((p for p in parts[1:] if p.isdigit() and len(p) >= 4), None)
    if parts[0] not in ("HMMA", "IMMA") or shape is None:
        return 4, 4, 4
    m = 16 if shape.startswith("16") else int(shape[0])  # 16816: m16 n8 k16; 8816: m8 n8 k16
    n, k = int(shape[len(str(m))]), int(shape[len(str(m)) + 1:])
    types = parts[parts.index(shape) + 1:]
    bits = next((b for t, b in (("TF32", 32), ("S4", 4), ("U4", 4), ("S8", 8), ("U8", 8)) if t in types), 16)
    out = 16 if types[:1] == ["F16"] else 32
    return tuple(max(1, x // 1024) for x in (m * k * bits, k * n * bits, m * n * out))


def _registers(operand: str, span: int = 1) -> set[int]:
    """The general registers an operand names: R8.64 is R8 and R9; with span n (a matrix instruction's fragment,
    _fragments) each named register is taken as the n from it."""
    regs = set()
    for base, wide in re.findall(r"\bR(\d+)(\.64)?\b", operand):
        regs.update(range(int(base), int(base) + max(span, 2 if wide else 1)))
    return regs


def _reads(op: str) -> set[int]:
    """The general registers an instruction reads (its destination, where it has one, left out)."""
    name, _, ops = op.partition(" ")
    parts = ops.split(",")
    if name.startswith(_MATRIX):
        return set().union(*(_registers(p, w) for p, w in zip(parts[1:], _fragments(name))))
    return _registers(",".join(parts if name.startswith(_NO_DEST) else parts[1:]))


def in_trip_loads(body: list[str], cover: int = 0) -> tuple[int, int]:
    """(global loads whose value the same trip uses, round trips a trip waits on in turn) of a loop body
    (loop_body's). A load (LDG) whose registers are read later in the body, before being written again, is waited
    on in its own trip; one read only by the next trip's instructions was loaded ahead (its latency hidden behind a
    whole trip); asynchronous copies (LDGSTS) are the pipeliner's, waited on stages later. Waits are counted in
    turn: a load issued after the trip has waited on an earlier one starts another round trip. cover: a load read
    at least this many instructions after its issue costs no round trip (the instructions between take as long)."""
    waited = []  # (issued at, first read at)
    for i, op in enumerate(body):
        name, _, rest = op.partition(" ")
        if not name.startswith("LDG.") and name != "LDG":
            continue
        dest = re.fullmatch(r"\s*R(\d+)", rest.split(",")[0])
        bits = int((re.findall(r"\.(\d+)$", name) or ["32"])[0])
        regs = set(range(int(dest.group(1)), int(dest.group(1)) + max(1, bits // 32))) if dest else set()
        for j in range(i + 1, len(body)):
            later, _, ops = body[j].partition(" ")
            if _reads(body[j]) & regs:
                waited.append((i, j))
                break
            if not later.startswith(_NO_DEST) and _registers(ops.split(",")[0]) >= regs:  # written again before
                break  # any read: loaded for later
    trips, last_wait = 0, -1
    for issued, read in sorted(waited, key=lambda w: w[1]):
        if issued > last_wait and (not cover or read - issued < cover):
            trips, last_wait = trips + 1, read
    return len(waited), trips


def loop_stats(kernel, words_per_thread: float) -> LoopStats:
    out = cuobjdump(kernel.asm["cubin"])
    body = main_loop(out)
    loads = [op for op in body if op.startswith(("LDG.", "LDGSTS"))]
    widest = max(loads, key=lambda op: int((re.findall(r"\d+$", op) or ["32"])[0]), default="-")  # LDG.E: 32 bits
    regs, stack = (int(re.search(rf"{field}:(\d+)", out).group(1)) for field in ("REG", "STACK"))
    return LoopStats(len(body), round(len(body) / words_per_thread, 1), sum(op.startswith("BAR") for op in body),
                     sum(op.startswith(("LDS", "STS", "LDSM")) for op in body), len(loads), widest, regs, stack,
                     sum(op.startswith(("LDL", "STL")) for op in body))


def budgets() -> dict[str, float]:
    """Instruction slots per 4-byte word at full bandwidth, per card."""
    slots = {}
    for card, (sms, ghz) in CARDS.items():
        gbs = MEASURED.get(card) or card_entry(card)[0]
        slots[f"{card} ({gbs} GB/s)"] = sms * 128 * ghz * 1e9 / (gbs * 1e9 / 4)
    return slots


def print_budgets() -> None:
    print("\n# instruction slots per 4-byte word at full bandwidth (SMs x 128 x clock / (bandwidth / 4 bytes)):")
    for card, slots in budgets().items():
        print(f"#   {card:<32} {slots:6.0f}")
