"""What the machine's C compiler builds of kernels/cpu_kernels.c for an AVX2 (haswell) and an AVX-512 (icelake-server)
processor, read from its assembly: decode's products prefetch the weight bytes they are about to read. gcc 12 deleted
the calls to prefetch helpers it did not inline (it found them free of effects), and AVX2's one-row products read
every weight byte unprefetched: the default model's decode 1.6x slower on a Zen 3 (docs/PERF.md), with every result
bit for bit the same, so no test of values could see it."""

import os
import re
import shutil
import subprocess

import pytest

from localpd.kernels import cpu

PRODUCT = re.compile(r"\s(vpmaddwd|vpdpbusd|vpdpwssd|vpmaddubsw)\s")
# the functions of decode's products on each: one input row (gemv4; AVX-512's gemv1, and gemv1_sub16 for Q6_K and
# Q3_K), 2 to 15 (gemm16x; gemm1x and gemm4x)
DECODE = {"haswell": ("gemv4", "gemm16x"), "icelake-server": ("gemv1", "gemv1_sub16", "gemm1x", "gemm4x")}
# the one-row products' loops, a loop a format they are compiled for (LPD_FORMATS' list or LPD_BY_BLOCK's, and a's
# own flags): AVX2's gemv4 all seven; AVX-512's gemv1 the four formats with a factor a block and any other, whose
# loops over sixteen blocks (eight pairs unrolled) gcc 12 lays out as 2 innermost loops with products (416 vpdpbusd;
# with a's flags tested in the loop instead, 1 and 160), and its gemv1_sub16 Q6_K and Q3_K
ONE_ROW = {"haswell": (("gemv4", 7),), "icelake-server": (("gemv1", 2), ("gemv1_sub16", 2))}
ONE_ROW_NAMES = {march: tuple(name for name, _ in fns) for march, fns in ONE_ROW.items()}


def _compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")


@pytest.fixture(scope="module", params=sorted(DECODE))
def assembly(request, tmp_path_factory) -> tuple[str, str]:
    cc = _compiler()
    if cc is None:
        pytest.skip("no C compiler")
    out = tmp_path_factory.mktemp("asm") / f"{request.param}.s"
    flags = [f for f in cpu.FLAGS if f != "-shared"]
    run = subprocess.run([cc, *flags, f"-march={request.param}", "-S", "-o", str(out), str(cpu.SOURCE)],
                         capture_output=True, text=True)
    if run.returncode:
        pytest.skip(f"{cc} cannot build for {request.param}: {run.stderr.strip()[:200]}")
    return request.param, out.read_text()


def functions(asm: str) -> dict[str, list[str]]:
    """Each function's lines (gcc's clones, gemv4.constprop.0 and the like, under their own names)."""
    out, name = {}, None
    for line in asm.splitlines():
        m = re.match(r"^([A-Za-z_][\w.$]*):", line)
        if m and not m.group(1).startswith((".L", "L")):
            name = m.group(1)
            out.setdefault(name, [])
        elif name:
            out[name].append(line)
    return out


JUMP = re.compile(r"^\s+(j\w+)\s+(\.?L\w+)\s*$")
LABEL = re.compile(r"^(\.?L\w+):")


def blocks(body: list[str]) -> tuple[list[list[str]], dict[int, set[int]]]:
    """The function's basic blocks (lines) and each one's successors."""
    starts, out = [], []
    for i, line in enumerate(body):
        if LABEL.match(line) or (i and (JUMP.match(body[i - 1]) or re.match(r"^\s+ret", body[i - 1]))):
            starts.append(i)
    starts = sorted(set([0] + starts))
    spans = list(zip(starts, starts[1:] + [len(body)]))
    at = {LABEL.match(body[s]).group(1): k for k, (s, _) in enumerate(spans) if LABEL.match(body[s])}
    succ = {}
    for k, (s, e) in enumerate(spans):
        lines = [l for l in body[s:e] if l.strip() and not l.lstrip().startswith(".")]
        last = lines[-1] if lines else ""
        m = JUMP.match(last)
        nxt = set()
        if m and m.group(2) in at:
            nxt.add(at[m.group(2)])
        if not (re.match(r"^\s+(jmp|ret)", last)) and k + 1 < len(spans):
            nxt.add(k + 1)
        succ[k] = nxt
        out.append(body[s:e])
    return out, succ


def loops(body: list[str]) -> tuple[list[list[str]], list[frozenset]]:
    """Each natural loop's blocks (a back edge's: to a block that dominates its source), by blocks()'s numbers."""
    code, succ = blocks(body)
    n = len(code)
    pred = {k: set() for k in range(n)}
    for k, nxt in succ.items():
        for j in nxt:
            pred[j].add(k)
    reached, stack = {0}, [0]  # an alignment's padding after a jump is a block no path reaches: not a way in
    while stack:
        for j in succ[stack.pop()] - reached:
            reached.add(j)
            stack.append(j)
    dom = {k: set(range(n)) for k in range(n)}
    dom[0] = {0}
    changed = True
    while changed:
        changed = False
        for k in range(1, n):
            ways_in = [dom[p] for p in pred[k] if p in reached]
            new = ({k} | set.intersection(*ways_in)) if ways_in else {k}
            if new != dom[k]:
                dom[k], changed = new, True
    found = []
    for t in range(n):
        for h in succ[t]:
            if h in dom[t]:  # t -> h is a back edge: h and what reaches t without passing h
                body_, stack = {h, t}, [t]
                while stack:
                    for p in pred[stack.pop()]:
                        if p not in body_:
                            body_.add(p)
                            stack.append(p)
                found.append(frozenset(body_))
    return code, list(dict.fromkeys(found))


PREFETCH = re.compile(r"prefetcht[01]\b")  # into L1, or L2 (plan_run: where L1 would not keep them until read)


def product_loops(body: list[str]) -> tuple[list[list[str]], list[frozenset], list[frozenset]]:
    """loops()' blocks and loops, and the innermost loops with an integer product."""
    code, all_loops = loops(body)
    product = [s for s in all_loops if any(PRODUCT.search(l) for k in s for l in code[k])]
    return code, all_loops, [s for s in product if not any(o < s for o in product)]


def product_loop_lines(body: list[str]) -> list[list[str]]:
    """The lines of each innermost loop with an integer product (product_loops')."""
    code, _, inner = product_loops(body)
    return [[l for k in s for l in code[k]] for s in inner]


def unprefetched(body: list[str]) -> tuple[int, list[frozenset]]:
    """The innermost loops with an integer product, and those of them where neither the loop nor the one around it
    holds a prefetch."""
    code, all_loops, inner = product_loops(body)
    has = lambda loop, pat: any(pat(l) for k in loop for l in code[k])
    bad = []
    for s in inner:
        around = sorted((o for o in all_loops if s < o), key=len)
        if not has(s, PREFETCH.search) and not (around and has(around[0], PREFETCH.search)):
            bad.append(s)
    return len(inner), bad


def _named(fns: dict[str, list[str]], name: str) -> list[str]:
    return [f for f in fns if f == name or f.startswith(name + ".")]


def test_decode_products_prefetch_their_weights(assembly):
    march, asm = assembly
    fns = functions(asm)
    for name in DECODE[march]:
        found = _named(fns, name)
        assert found, f"{name} is not a function of its own in the {march} build (inlined?)"
        for f in found:
            count, bad = unprefetched(fns[f])
            assert count, f"{march} {f}: no product loop found"
            assert not bad, f"{march} {f}: {len(bad)} of {count} product loops read weights unprefetched"


def test_one_row_products_can_prefetch_into_l2(assembly):
    """The one-row products (AVX-512's gemv1 and gemv1_sub16, AVX2's gemv4) request long rows' runs into L2
    (plan_run): every product loop holds a prefetcht1 beside its prefetcht0, where L1 alone left SmolLM2-1.7B's down
    (K = 8192) at 0.7x the bandwidth of its other products."""
    march, asm = assembly
    fns = functions(asm)
    for name in ONE_ROW_NAMES[march]:
        for f in _named(fns, name):
            inner = product_loop_lines(fns[f])
            assert inner, f"{f}: no product loop found"
            for lines in inner:
                assert any("prefetcht1" in l for l in lines), f"{f}: a product loop without an L2 prefetch"
                assert any("prefetcht0" in l for l in lines), f"{f}: a product loop without an L1 prefetch"


def test_decode_attention_prefetches_rows_into_l2(assembly):
    """Decode attention's rows ahead (load_chunk's and the one-key-at-a-time walk's) go to L2 (prefetcht1), none to
    L1: a head's rows lie a position apart (4 KiB for SmolLM2-1.7B's float16 pages), so rows requested into L1 fell
    into the same few sets and pushed each other out unread (7-10 GB/s where L2 gives 18-19)."""
    march, asm = assembly
    fns = functions(asm)
    for name in ("load_chunk", "attention_task"):
        found = _named(fns, name)
        assert found, f"{name} is not a function of its own in the {march} build (inlined?)"
        for f in found:
            assert any("prefetcht1" in l for l in fns[f]), f"{march} {f}: no row requested into L2"
            assert not any("prefetcht0" in l for l in fns[f]), f"{march} {f}: a row requested into L1"


def test_one_row_products_built_once_a_format(assembly):
    """The one-row products' loop a weight format (each a copy with its flags constant, where testing them in the
    loop cost AVX2's decode half its speed and AVX-512's one-row Q4_0 products 1.1x the time), each prefetched."""
    march, asm = assembly
    fns = functions(asm)
    for name, formats in ONE_ROW[march]:
        count = sum(unprefetched(fns[f])[0] for f in _named(fns, name))
        assert count >= formats, f"{march}: {name} has {count} product loops, one a format ({formats}) expected"


ZMM_STACK = re.compile(r"%zmm\d+,\s*-?\d*\(%rsp\)|\(%rsp\),\s*%zmm\d+")


def test_the_integer_prefill_gemm_keeps_its_sums_in_registers(assembly):
    """AVX-512's prefill GEMM (pf_task): a block of a 32 x 6 tile is one loop of one basic block, its sixteen pairs
    unrolled (192 vpdpwssd) with every sum in a register: no vector register to or from the stack and at least 0.4
    products an instruction (gcc 12: 0.43-0.46). With the loop over the pairs rolled, gcc copied each of the twelve
    sums to another register every pair (0.31: 1.5x the time); with twelve weight rows a tile it spilled them."""
    march, asm = assembly
    if march != "icelake-server":
        pytest.skip("AVX-512's GEMM")
    fns = functions(asm)
    found = _named(fns, "pf_task")
    assert found, "pf_task is not a function of its own"
    code, succ = blocks(fns[found[0]])
    count = lambda block, pat: sum(1 for l in block if pat(l))  # noqa: E731
    tiles = [b for k, b in enumerate(code) if k in succ[k] and count(b, PRODUCT.search) >= 192]
    assert tiles, "no loop of one block holds a tile's 192 products"
    for b in tiles:
        instructions = count(b, lambda l: l.strip() and not l.strip().startswith(".") and not LABEL.match(l))
        assert count(b, PRODUCT.search) / instructions >= 0.4, f"{instructions} instructions for 192 products"
        assert not count(b, ZMM_STACK.search), "the loop spills vector registers"


def test_gfni_splits_the_nibbles_in_one_operation(assembly):
    """Where the processor has GFNI (icelake-server's build; Zen 4), the one-row products split a pair's nibbles, and
    Q6_K's products move its upper bits into place, with one vgf2p8affineqb (an affine map of each byte's bits) where
    a shift and a mask (two shifts and a mask for the upper bits) were: gemv1's nibble loops hold it, and gemv1_sub16's
    (Q6_K, Q3_K: nibbles only, no codebook) one a pair of blocks and no 64-bit shift at all."""
    march, asm = assembly
    if march != "icelake-server":
        pytest.skip("a GFNI build's products")
    fns = functions(asm)
    count = lambda lines, word: sum(1 for l in lines if re.search(rf"\s{word}\s", l))  # noqa: E731
    gemv1 = [lines for f in _named(fns, "gemv1") for lines in product_loop_lines(fns[f])]
    assert any(count(lines, "vgf2p8affineqb") for lines in gemv1), "gemv1 splits no nibbles with GFNI"
    for f in _named(fns, "gemv1_sub16"):
        inner = product_loop_lines(fns[f])
        assert inner, f"{f}: no product loop found"
        for lines in inner:
            assert count(lines, "vgf2p8affineqb") * 2 >= count(lines, "vpdpbusd"), f"{f}: a pair without GFNI"
            assert not count(lines, "vpsrlvq"), f"{f}: nibbles or upper bits still shifted"
