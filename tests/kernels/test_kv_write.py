"""Writing keys and values into KV pages (write_kv, rope_write_kv) against the torch references, in every format."""

from kv_cases import DEV, interpret  # noqa: F401 (first: it sets TRITON_INTERPRET)
from kv_cases import dequantized, pools

import pytest
import torch

from localpd.kernels.fused_dispatch import rope_ref
from localpd.kvcache.dispatch import rope_write_kv, rope_write_kv_ref, write_kv, write_kv_ref
from localpd.kvcache.formats import kv_formats, new_kv_pool


@pytest.mark.parametrize("kv_dtype", ["fp32", "bf16", "int8", "int4", "int8/int4", "int4/bf16"])
@pytest.mark.parametrize("D", [32, 64, 96, 128, 160, 256])
def test_write_kv_matches_the_reference(kv_dtype, D):
    g = torch.Generator().manual_seed(3)
    ps, H, T = 16, 2, 37
    tri, ref = pools(kv_dtype, 6, ps, H, D)
    slots = torch.randperm(6 * ps, generator=g)[:T].to(DEV)  # scattered, crossing pages
    k, v = (torch.randn(2, T, H, D, generator=g) * 2).to(DEV)
    k[4] = 0.0  # constant rows: no NaN
    write_kv(tri.layer(0), k, v, slots)
    write_kv_ref(ref.layer(0), k, v, slots)
    for a, b, fmt in zip(dequantized(tri.layer(0)), dequantized(ref.layer(0)), kv_formats(kv_dtype)):
        assert torch.isfinite(a).all()
        if fmt in ("fp32", "bf16"):  # the interpreter truncates to bf16 where torch rounds: 1 ulp
            ulp = {"fp32": 0, "bf16": 2**-7}[fmt]
            assert ((a - b).abs() <= b.abs() * ulp + b.abs().amax() * 2**-9).all()
            continue
        step = (b.abs().amax() / (7 if fmt == "int4" else 127)).item()
        diff = (a - b).abs()
        # identical up to a rounding tie or a scale's last float16 bit (at most one quantum, rarely)
        assert diff.max().item() <= step * 1.01 + 1e-6
        assert (diff > 1e-6).float().mean().item() < 0.01


@pytest.mark.parametrize("kv_dtype", ["fp32", "bf16", "int8", "int4", "int8/int4", "int4/bf16", "fp8/int8",
                                      "int4ch/int4", "int4ch"])
@pytest.mark.parametrize("D,Hq,H,ps,T,dtype", [(64, 9, 3, 16, 37, torch.float32), (128, 4, 4, 32, 5, torch.bfloat16),
                                                (64, 7, 1, 16, 1, torch.float16), (256, 4, 1, 16, 19, torch.bfloat16),
                                                (96, 3, 3, 16, 21, torch.bfloat16)])
def test_rope_and_kv_write_in_one_kernel(kv_dtype, D, Hq, H, ps, T, dtype):
    """rope_write_kv (one launch) writes what RoPE then write_kv write as separate kernels, bit for bit, and the
    torch reference within the formats' rounding; the query heads come back rotated."""
    g = torch.Generator().manual_seed(T + D)
    qkv = (torch.randn(T, (Hq + 2 * H) * D, generator=g) * 2).to(dtype).to(DEV)
    angles = torch.outer(torch.randint(0, 5000, (T,), generator=g).float(), torch.rand(D // 2, generator=g))
    cos, sin = angles.cos().to(DEV), angles.sin().to(DEV)
    slots = torch.randperm(4 * 64, generator=g)[:T].to(DEV)
    if "int4ch" in kv_dtype:  # a page is filled in order by its sequence: consecutive slots, from mid-page
        slots = torch.arange(3, 3 + T, device=DEV)
    fused, separate, torch_ref = [new_kv_pool(kv_dtype, 1, 4 * 64 // ps, ps, H, D, dtype, DEV) for _ in range(3)]
    q = rope_write_kv(qkv.clone(), cos, sin, fused.layer(0), slots, Hq, H)
    q_sep = rope_write_kv_ref(qkv.clone(), cos, sin, separate.layer(0), slots, Hq, H)
    assert q.shape == (T, Hq, D)
    if DEV == "cpu":  # compiled, the two may contract multiply-adds differently; the checks below still hold
        assert torch.equal(q, q_sep)
        for a, b in zip(dequantized(fused.layer(0)), dequantized(separate.layer(0))):
            assert torch.equal(a, b)
    heads = qkv.clone().view(T, -1, D)  # the torch references, on any device
    rope_ref(heads[:, :Hq + H], cos, sin)
    write_kv_ref(torch_ref.layer(0), heads[:, Hq:Hq + H], heads[:, Hq + H:], slots)
    q_ref = heads[:, :Hq]
    assert (q.float() - q_ref.float()).abs().max() <= q_ref.float().abs().max() * 2**-7
    k_rot = heads[:, Hq:Hq + H].float()
    for a, b, x, fmt in zip(dequantized(fused.layer(0)), dequantized(torch_ref.layer(0)),
                            (k_rot, qkv.view(T, -1, D)[:, Hq + H:].float()), kv_formats(kv_dtype)):
        a, b = a.flatten(0, 1)[slots.long()], b.flatten(0, 1)[slots.long()]
        # one quantum of the format, plus (half precision) the interpreter's truncating where torch rounds
        amax = x.abs().amax().item()
        tol = {"int4": 1 / 7, "int4ch": 1 / 7, "int8": 1 / 127, "fp8": 1 / 8}.get(fmt, 2**-7) * amax * 1.01
        tol += 0 if dtype == torch.float32 else amax * 2**-6
        assert (a - b).abs().max() <= tol and (a - x).abs().max() <= tol


@pytest.mark.parametrize("staged", [False, True])
@pytest.mark.parametrize("D,ps", [(64, 16), (128, 32), (96, 16)])
def test_per_channel_keys_rewrite_their_page_as_it_fills(D, ps, staged):
    """int4ch: a prefill that ends mid-page, then decode steps of two sequences (one starting on a fresh page of a
    pool full of garbage), a chunk that continues a page: the kernel writes what the reference writes (pages and,
    staged, each sequence's stage row). Every token so far stays within half a quantum of its channel's range on
    that page where the page is re-quantized from its staged values (one rounding), and within one and a half
    where it is re-quantized from its codes (each widening rounds the rounded values again: up to 1.25 quanta over
    seeds)."""
    g = torch.Generator().manual_seed(D)
    tri, ref = [new_kv_pool("int4ch/int4", 1, 8, ps, 2, D, torch.float32, DEV, stage_rows=3) for _ in range(2)]
    for t in (tri.k, tri.k_scale, tri.k_zero, ref.k, ref.k_scale, ref.k_zero, tri.k_stage, ref.k_stage):
        t.view(torch.uint8).fill_(0xFF)  # NaN scales and staged keys, codes 15: nothing a new page may read
    a = [3 * ps + i for i in range(ps + 5)]  # sequence A: page 3 full, page 4 up to offset 4
    a[ps:] = [4 * ps + i for i in range(5)]
    steps = [a, [4 * ps + 5], [4 * ps + 6, 6 * ps], [4 * ps + 7, 6 * ps + 1], [6 * ps + 2 + i for i in range(9)]]
    row = {3: 2, 4: 2, 6: 0}  # stage rows: A's is 2, B's (page 6) 0
    written = {}
    for slots in steps:
        k, v = torch.randn(2, len(slots), 2, D, generator=g) * 2
        k[..., 5] *= 30  # an outlier channel
        stage_slots = torch.tensor([row[s // ps] * ps + s % ps for s in slots], device=DEV) if staged else None
        slots = torch.tensor(slots, device=DEV)
        write_kv(tri.layer(0), k.to(DEV), v.to(DEV), slots, stage_slots)
        write_kv_ref(ref.layer(0), k.to(DEV), v.to(DEV), slots, stage_slots)
        written.update(zip(slots.tolist(), k))
        for name in ("k", "k_scale", "k_zero", "v", "v_scale", "v_zero", "k_stage"):  # bit for bit, garbage too
            assert torch.equal(getattr(tri, name).view(torch.uint8), getattr(ref, name).view(torch.uint8)), name
    keys = dequantized(tri.layer(0))[0].flatten(0, 1).cpu()
    for page in {slot // ps for slot in written}:
        slots = sorted(s for s in written if s // ps == page)
        x = torch.stack([written[s] for s in slots])
        quantum = (x.amax(0) - x.amin(0)) / 15
        assert ((keys[slots] - x).abs() <= quantum * (0.505 if staged else 1.5) + 1e-3).all()


@pytest.mark.parametrize("kv_dtype,D,ps,dtype", [("int4ch", 64, 16, torch.float32),
                                                 ("int4ch/int4", 128, 32, torch.bfloat16),
                                                 ("int4ch/int4", 96, 16, torch.bfloat16)])
def test_a_page_written_token_by_token_through_its_stage_equals_one_written_whole(kv_dtype, D, ps, dtype):
    """Decode fills a page a token at a time and re-quantizes it each time its range widens. With the stage, the
    page it ends up with is bit for bit the page a prefill writes in one go (kernel and reference, RoPE fused or
    not); without it, re-rounding already rounded codes leaves a different page."""
    g = torch.Generator().manual_seed(D + ps)
    Hq, H, T = 2, 2, ps + 3  # a full page and an open one
    qkv = (torch.randn(T, (Hq + 2 * H) * D, generator=g) * 2).to(dtype).to(DEV)
    qkv.view(T, -1, D)[..., 7] *= 20  # an outlier channel
    angles = torch.outer(torch.arange(T).float(), torch.rand(D // 2, generator=g))
    cos, sin = angles.cos().to(DEV), angles.sin().to(DEV)
    slots = torch.arange(ps, ps + T, device=DEV)  # pages 1 and 2
    stage_slots = ps + slots % ps  # stage row 1

    def written(write, token_by_token, stage):
        pool = new_kv_pool(kv_dtype, 1, 3, ps, H, D, dtype, DEV, stage_rows=2)
        tensors = [t for t in (pool.k, pool.k_scale, pool.k_zero, pool.v, pool.v_scale, pool.v_zero) if t is not None]
        for t in tensors + [pool.k_stage]:
            t.view(torch.uint8).fill_(0xFF)
        steps = [slice(t, t + 1) for t in range(T)] if token_by_token else [slice(0, T)]
        for s in steps:
            write(qkv[s].clone(), cos[s], sin[s], pool.layer(0), slots[s], Hq, H, stage_slots[s] if stage else None)
        return [t[:, 1:].view(torch.uint8).clone() for t in tensors]  # pages 1 and 2, keys first

    for write in (rope_write_kv, rope_write_kv_ref):
        whole = written(write, False, True)
        assert all(torch.equal(a, b) for a, b in zip(written(write, True, True), whole))
    assert all(torch.equal(a, b) for a, b in zip(whole, written(rope_write_kv_ref, False, False)))  # reads no stage
    assert not torch.equal(written(rope_write_kv_ref, True, False)[0], whole[0])
    if DEV == "cpu":  # compiled, the kernel may contract RoPE's multiply-adds differently from torch
        assert all(torch.equal(a, b) for a, b in zip(whole, written(rope_write_kv, False, True)))
