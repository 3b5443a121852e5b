"""A model as localpd holds it -> one GGUF file that llama.cpp loads: each matrix in the block type that holds its
format (int4 groups as Q4_1, int8 as Q8_0, int4-k as Q4_K, 5-bit codes as Q5_1 and Q5_K, 6-bit as Q6_K), the tokenizer (a GGUF source's own, or built from a
Hugging Face directory's tokenizer.json: gguf_vocab), chat template and hyper-parameters.

Exact where the format fits: an int4 group of 32, 64 or 128 is one, two or four Q4_1 blocks with its float16 scale
(d) and bias (m); an int8 row's or group's float16 scale is each of its Q8_0 blocks' d. int4-k is Q4_K where its
scales fit Q4_K's six bits and its biases are minus six-bit mins over whole super-blocks of 256 (a Q4_K import);
otherwise its groups are fitted to Q4_K (rows of whole super-blocks) or written as Q4_1 with their scales and
biases rounded to float16, and the error is reported; 5-bit int4-k (a Q5_K import) likewise as Q5_K or Q5_1, and
5-bit groups (Q5_0, Q5_1 imports) as Q5_1, exactly (Q5_0's bias -16 d is a float16 m); 6-bit codes (a Q6_K import)
as Q6_K, exactly. Other formats (bitsandbytes') are re-quantized to Q8_0.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from localpd.errors import LocalpdError
from localpd.export.report import ExportReport
from localpd.export.gguf_vocab import vocab_meta
from localpd.export.source import Source, tokenizer_meta
from localpd.load.loader import GGUF_NAMES, GGUF_TOP, qk_order, rows
from localpd.model.config import ModelConfig
from localpd.quant.int4k import GROUP, PER_SUPER, Int4KWeight, super_blocks
from localpd.quant.int5 import Int5KWeight, Int5Weight
from localpd.quant.int6k import Int2KWeight, Int3KWeight, Int6KWeight
from localpd.quant.weights import Int4Weight, Int8Weight, Weight, pack_int4, unpack_int4

BLOCK = 32
SUPER = GROUP * PER_SUPER  # 256: a Q4_K block
DENSE = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16"}
FILE_TYPES = {"Q4_1": "MOSTLY_Q4_1", "Q8_0": "MOSTLY_Q8_0", "Q4_K": "MOSTLY_Q4_K_S", "Q5_1": "MOSTLY_Q5_1",
              "Q5_K": "MOSTLY_Q5_K_S", "Q6_K": "MOSTLY_Q6_K", "Q2_K": "MOSTLY_Q2_K", "F16": "MOSTLY_F16",
              "BF16": "MOSTLY_BF16", "F32": "ALL_F32"}  # gguf.LlamaFileType, by the matrices' most common type
GGUF_PART = {hf: g for g, hf in GGUF_NAMES.items() if hf != "qkv_proj"}
GGUF_TOP_NAME = {hf: g for g, hf in GGUF_TOP.items()}


def tensor_name(key: str) -> str:
    """layers.3.q_proj -> blk.3.attn_q.weight, layers.3.q_proj.bias -> blk.3.attn_q.bias, norm -> output_norm.weight."""
    base, suffix = (key[:-5], "bias") if key.endswith(".bias") else (key, "weight")
    if base.startswith("layers."):
        _, i, part = base.split(".", 2)
        return f"blk.{i}.{GGUF_PART[part]}.{suffix}"
    return f"{GGUF_TOP_NAME[base]}.{suffix}"


def _half_bytes(x: torch.Tensor) -> torch.Tensor:
    """float values -> their float16 bytes, [..., 2] uint8."""
    return x.half().contiguous().view(torch.uint8).reshape(*x.shape, 2)


def q4_1_blocks(codes: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """codes uint8 [N, K] (0..15), float16 scale and bias per 32 columns [N, K // 32] -> Q4_1 blocks
    [N, K // 32 * 20]: d, m, then byte j holding values j (low nibble) and j + 16 (high)."""
    n, k = codes.shape
    q = codes.reshape(n, k // BLOCK, BLOCK)
    qs = q[..., :16] | (q[..., 16:] << 4)
    return torch.cat([_half_bytes(scale), _half_bytes(bias), qs], dim=-1).reshape(n, -1)


def _fifth_word(fifth: torch.Tensor) -> torch.Tensor:
    """[..., 32] bits (0/1) -> their little-endian uint32 as 4 bytes [..., 4]: bit j the j-th."""
    weights = 1 << torch.arange(8, dtype=torch.int32)
    return (fifth.reshape(*fifth.shape[:-1], 4, 8).int() * weights).sum(-1).to(torch.uint8)


def q5_1_blocks(codes: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """codes uint8 [N, K] (0..31), float16 scale and bias per 32 columns -> Q5_1 blocks [N, K // 32 * 24]: d, m, the
    fifth bits (bit j: value j's), then byte j holding values j and j + 16's low four bits."""
    n, k = codes.shape
    q = codes.reshape(n, k // BLOCK, BLOCK)
    qs = (q[..., :16] & 15) | ((q[..., 16:] & 15) << 4)
    return torch.cat([_half_bytes(scale), _half_bytes(bias), _fifth_word(q >> 4), qs], dim=-1).reshape(n, -1)


def q5_k_blocks(w: Int5KWeight) -> torch.Tensor:
    """q4_k_blocks' for 5-bit int4-k (fits_q4_k of its int4-k part) -> Q5_K blocks [N, K // 256 * 176]: d, dmin,
    the packed scales, then qh (byte l: bit 2c the fifth bit of value 64c + l, bit 2c + 1 of 64c + 32 + l) and
    Q4_K's nibbles (the inverse of Int5KWeight.from_q5_k)."""
    n, _ = w.shape
    head = q4_k_blocks(Int4KWeight(w.packed, w.d, w.dmin, w.sub)).reshape(-1, 144)
    fifth = (w.codes().reshape(-1, 8, 32) >> 4).int()  # per super-block: 8 groups (2c, 2c + 1) of 32 values
    qh = (fifth << torch.arange(8, dtype=torch.int32)[None, :, None]).sum(1).to(torch.uint8)
    return torch.cat([head[:, :16], qh, head[:, 16:]], 1).reshape(n, -1)


def q6_k_blocks(w: Int6KWeight) -> torch.Tensor:
    """A 6-bit weight -> Q6_K blocks [N, K // 256 * 210] (the inverse of Int6KWeight.from_q6_k): per half of 128
    values, ql (byte l: the low four bits of values l and l + 64, byte 32 + l those of l + 32 and l + 96) and qh
    (byte l: value l + 32 i's two high bits at bits 2i, 2i + 1); then the sixteen int8 scales and d."""
    n, _ = w.shape
    c = w.codes().reshape(-1, 2, 4, 32)  # per super-block: 2 halves of 4 runs of 32 values
    low, two = c & 15, c >> 4
    ql = torch.cat([low[:, :, 0] | (low[:, :, 2] << 4), low[:, :, 1] | (low[:, :, 3] << 4)], dim=2)
    qh = two[:, :, 0] | (two[:, :, 1] << 2) | (two[:, :, 2] << 4) | (two[:, :, 3] << 6)
    sc = w.sc.reshape(-1, 16).view(torch.uint8)
    return torch.cat([ql.reshape(-1, 128), qh.reshape(-1, 64), sc, _half_bytes(w.d.reshape(-1))], 1).reshape(n, -1)


def q8_0_blocks(codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """int8 codes [N, K], float16 scale per 32 columns [N, K // 32] -> Q8_0 blocks [N, K // 32 * 34]."""
    n, k = codes.shape
    qs = codes.reshape(n, k // BLOCK, BLOCK).view(torch.uint8)
    return torch.cat([_half_bytes(scale), qs], dim=-1).reshape(n, -1)


def q4_k_blocks(w: Int4KWeight) -> torch.Tensor:
    """An int4-k weight whose scales are six-bit (sc < 64) and biases minus six-bit mins (-63 <= mn <= 0), over
    rows of whole super-blocks -> Q4_K blocks [N, K // 256 * 144] (the inverse of its import, Int4KWeight.from_q4_k)."""
    n, k = w.shape
    nb = k // GROUP
    sc = w.sub[:, :nb].reshape(-1, PER_SUPER).int()
    m = (-w.sub[:, nb:].contiguous().view(torch.int8).int()).reshape(-1, PER_SUPER)
    packed = torch.cat([sc[:, :4] | ((sc[:, 4:] >> 4) << 6), m[:, :4] | ((m[:, 4:] >> 4) << 6),
                        (sc[:, 4:] & 15) | ((m[:, 4:] & 15) << 4)], dim=1).to(torch.uint8)
    q = unpack_int4(w.packed).reshape(-1, 4, 2, 32)  # per super-block: 4 chunks of 64 values, low then high nibble
    qs = (q[:, :, 0] | (q[:, :, 1] << 4)).reshape(-1, 128)
    return torch.cat([_half_bytes(w.d.reshape(-1)), _half_bytes(w.dmin.reshape(-1)), packed, qs], 1).reshape(n, -1)


def fits_q4_k(w: Int4KWeight) -> bool:
    nb = w.shape[1] // GROUP
    mn = w.sub[:, nb:].contiguous().view(torch.int8)
    return w.shape[1] % SUPER == 0 and bool((w.sub[:, :nb] < 64).all() and (mn <= 0).all() and (mn >= -63).all())


def fit_q4_k(w: Int4KWeight) -> Int4KWeight:
    """int4-k's groups with Q4_K's ranges: d = the super-block's largest scale / 63, dmin = its largest -bias / 63
    (a positive bias becomes 0), six-bit sc and m rounded to them, then each value's code re-rounded to the new scale
    and bias against the values w held."""
    n, k = w.shape
    nb, ns = k // GROUP, super_blocks(k)
    scale, bias = (t.reshape(n, ns, PER_SUPER) for t in w.group_scales())
    d = (scale.amax(-1) / 63).half()
    dmin = ((-bias).clamp_min(0).amax(-1) / 63).half()
    df, dminf = d.float()[..., None], dmin.float()[..., None]
    sc = torch.round(scale / torch.where(df > 0, df, torch.ones_like(df))).clamp(0, 63)
    m = torch.round((-bias).clamp_min(0) / torch.where(dminf > 0, dminf, torch.ones_like(dminf))).clamp(0, 63)
    s_new, b_new = (sc * df).reshape(n, nb, 1), (-(m * dminf)).reshape(n, nb, 1)
    target = w.dequantize().reshape(n, nb, GROUP)
    q = torch.round((target - b_new) / torch.where(s_new > 0, s_new, torch.ones_like(s_new))).clamp(0, 15)
    sub = torch.cat([sc.reshape(n, nb).to(torch.uint8), (-m).reshape(n, nb).to(torch.int8).view(torch.uint8)], 1)
    return Int4KWeight(pack_int4(q.to(torch.uint8).reshape(n, k)), d, dmin, sub.contiguous())


def per_block(x: torch.Tensor, group: int) -> torch.Tensor:
    """A value per group of `group` columns [N, K // group] -> the same value per block of 32 [N, K // 32]."""
    return x.repeat_interleave(group // BLOCK, dim=1)


def encode(w: Weight) -> tuple[str, np.ndarray, Weight]:
    """(GGUF type, the tensor's data as the writer takes it, the weight those blocks hold: w itself where they hold
    it as it is, whose dequantize() is what llama.cpp decodes)."""
    if isinstance(w, torch.Tensor):
        if w.dtype not in DENSE:
            raise LocalpdError(f"a {w.dtype} tensor has no GGUF type")
        data = w.contiguous()
        raw = data.numpy() if w.dtype != torch.bfloat16 else data.view(torch.uint8).reshape(*w.shape[:-1], -1).numpy()
        return DENSE[w.dtype], raw, w
    if w.shape[1] % BLOCK:
        raise LocalpdError(f"a {w.shape[0]}x{w.shape[1]} matrix is not whole blocks of {BLOCK} along its input")
    if isinstance(w, Int2KWeight):
        return "Q2_K", w.to_q2_k().numpy(), w  # a Q2_K import's own blocks
    if isinstance(w, Int3KWeight):
        w = w.as_6_bit()  # the same values (a Q3_K import's; its own blocks are not written)
    if isinstance(w, Int6KWeight):
        return "Q6_K", q6_k_blocks(w).numpy(), w
    if isinstance(w, Int5KWeight):
        low = w.low()
        if w.shape[1] % SUPER == 0 and fits_q4_k(low):
            return "Q5_K", q5_k_blocks(w).numpy(), w
        scale, bias = (t.half() for t in low.group_scales())  # Q5_1 in float16 (a refit to Q5_K's ranges: not made)
        w = Int5Weight(w.packed, w.fifth, scale, bias)
    if isinstance(w, Int5Weight):
        return "Q5_1", q5_1_blocks(w.codes(), w.scales, w.biases).numpy(), w
    if isinstance(w, Int4KWeight):
        if w.shape[1] % SUPER == 0:
            w = w if fits_q4_k(w) else fit_q4_k(w)
            return "Q4_K", q4_k_blocks(w).numpy(), w
        scale, bias = (t.half() for t in w.group_scales())
        w = Int4Weight(w.packed, scale, bias)
    if isinstance(w, Int4Weight):
        scale, bias = per_block(w.scales, w.group), per_block(w.biases, w.group)
        return "Q4_1", q4_1_blocks(w.unpack(), scale, bias).numpy(), w
    if not isinstance(w, Int8Weight) or w.group % BLOCK:
        w = Int8Weight.quantize(w.dequantize(), BLOCK)  # bitsandbytes' formats
    return "Q8_0", q8_0_blocks(w.data, per_block(w.scales, w.group)).numpy(), w


def values(w: Weight) -> torch.Tensor:
    return w.float() if isinstance(w, torch.Tensor) else w.dequantize()


def gguf_order(key: str, w: Weight, config: ModelConfig) -> Weight:
    """llama.cpp's llama architecture stores q and k with each head's rotated pairs interleaved (loader.qk_order)."""
    part = key.removesuffix(".bias").rsplit(".", 1)[-1]
    heads = {"q_proj": config.n_heads, "k_proj": config.n_kv_heads}.get(part)
    if config.arch != "llama" or heads is None:
        return w
    return rows(w, torch.argsort(qk_order(w.shape[0], heads)))


def hyper_parameters(config: ModelConfig) -> dict[str, tuple]:
    """{arch}.* keys as llama.cpp reads them: (value, gguf value type name)."""
    a = config.arch
    keys = {"block_count": (config.n_layers, "UINT32"), "context_length": (config.max_context, "UINT32"),
            "embedding_length": (config.dim, "UINT32"), "feed_forward_length": (config.ffn_dim, "UINT32"),
            "attention.head_count": (config.n_heads, "UINT32"),
            "attention.head_count_kv": (config.n_kv_heads, "UINT32"),
            "attention.key_length": (config.head_dim, "UINT32"), "attention.value_length": (config.head_dim, "UINT32"),
            "rope.freq_base": (config.rope_theta, "FLOAT32"),
            "attention.layer_norm_rms_epsilon": (config.norm_eps, "FLOAT32"),
            "rope.dimension_count": (config.rotary_dim or config.head_dim, "UINT32"),
            "vocab_size": (config.vocab_size, "UINT32")}
    return {f"{a}.{k}": v for k, v in keys.items()}


def value_type(value) -> tuple[str, str | None]:
    """The GGUF types (value, array item) of a tokenizer.* value read back as plain Python: ids UINT32, token types
    INT32, scores FLOAT32, as llama.cpp's converter writes them."""
    if isinstance(value, bool):
        return "BOOL", None
    if isinstance(value, int):
        return "UINT32", None
    if isinstance(value, float):
        return "FLOAT32", None
    if isinstance(value, str):
        return "STRING", None
    if isinstance(value, list):
        first = value[0] if value else ""
        return "ARRAY", ("STRING" if isinstance(first, str) else "INT32" if isinstance(first, int) else "FLOAT32")
    raise LocalpdError(f"tokenizer metadata value {value!r} has no GGUF type")


def export_gguf(source: Source, tmp: Path, report: ExportReport) -> None:
    """Write the model as a GGUF file at tmp; each tensor's loss goes to the report."""
    import gguf

    loaded, config = source.loaded, source.loaded.config
    tokenizer = tokenizer_meta(loaded)
    if not tokenizer:
        if loaded.hf_dir is None:
            raise LocalpdError(f"{source.name} has no tokenizer to write to GGUF")
        tokenizer = vocab_meta(loaded.hf_dir, config.vocab_size)
    writer = gguf.GGUFWriter(str(tmp), config.arch)
    writer.add_name(config.name or source.name)
    for key, (value, kind) in hyper_parameters(config).items():
        writer.add_key_value(key, value, gguf.GGUFValueType[kind])
    for key, value in tokenizer.items():
        kind, item = value_type(value)
        writer.add_key_value(key, value, gguf.GGUFValueType[kind], None if item is None else gguf.GGUFValueType[item])
    types: dict[str, int] = {}
    for key, w in loaded.weights.items():
        name = tensor_name(key)
        ordered = gguf_order(key, w, config)
        kind, data, stored = encode(ordered)
        decoded = values(stored)
        report.add(name, kind, decoded if stored is ordered else values(ordered), decoded)
        if data.ndim == 2 and kind != "F32":
            types[kind] = types.get(kind, 0) + 1
        raw = None if kind in ("F32", "F16") else gguf.GGMLQuantizationType[kind]
        writer.add_tensor(name, data, raw_dtype=raw)
    if types:
        writer.add_file_type(gguf.LlamaFileType[FILE_TYPES[max(types, key=types.get)]])
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
