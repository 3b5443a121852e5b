"""Weight schemes (`--quant`): how each matrix of a model is stored once loaded."""

from __future__ import annotations

import torch

from localpd.errors import LocalpdError
from localpd.quant.gguf_blocks import DECODERS
from localpd.quant.bnb import BnbInt8Weight, Nf4Weight, bitsandbytes
from localpd.quant.int4k import Int4KWeight
from localpd.quant.weights import INT4_GROUPS, SUB16_TYPES, Int4Weight, Int8Weight, Weight

DENSE = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
# int4 in groups (Int4Weight, a float16 scale and bias a group); the -zp schemes keep each bias a whole number of
# scales, an integer zero point, as GPTQ, AWQ and compressed-tensors store asymmetric int4 (so they export exactly)
INT4 = {"int4-g32": 32, "int4-g64": 64, "int4-g128": 128, "int4-zp-g32": 32, "int4-zp-g64": 64, "int4-zp-g128": 128}
INT4_ZP = ("int4-zp-g32", "int4-zp-g64", "int4-zp-g128")
BNB = {"bnb-nf4": Nf4Weight, "bnb-int8": BnbInt8Weight}  # bitsandbytes' formats and matmuls (optional)
INT4_K = "int4-k"  # 4-bit codes, groups of 32, scales quantized within super-blocks of 256 (quant/int4k.py)
SCHEMES = ("native", *DENSE, "int8", *INT4, INT4_K, *BNB)
# GGUF block types that map onto our formats with group 32 (quant.gguf_blocks), and those with a scale a sub-block of
# 16 (quant/int6k.py); under "native" every other quantized type is re-quantized to int8 with a scale per
# NATIVE_INT8_GROUP values (native_weight)
GGUF_NATIVE = set(DECODERS) | set(SUB16_TYPES)
GGUF_DENSE = {"F32", "F16", "BF16"}
NATIVE_INT8_GROUP = 32


def check_scheme(scheme: str) -> str:
    if scheme not in SCHEMES:
        raise LocalpdError(f"unknown weight scheme '{scheme}'; schemes: {', '.join(SCHEMES)}")
    if scheme in BNB:
        bitsandbytes(scheme)  # fail now, with how to install it, rather than at the first matrix
    return scheme


def default_scheme(device: torch.device, prequantized: bool = False) -> str:
    """The file's own format ("native"), on the GPU's kernels or the CPU's (localpd.kernels.cpu); on a CPU where
    those could not be built, float32 (the int4/int8 references dequantize every matrix at every step), unless
    the model is a `localpd quantize` directory, which runs as stored."""
    if device.type == "cpu" and not prequantized:
        from localpd.kernels import cpu

        if cpu.unavailable():
            return "fp32"
    return "native"


def compute_dtype(scheme: str, device: torch.device) -> torch.dtype:
    """The dtype of activations (and of dense weights): a dense scheme's own, else fp32 on CPU, bf16 on GPU."""
    if scheme in DENSE:
        return DENSE[scheme]
    return torch.float32 if device.type == "cpu" else torch.bfloat16


def is_matrix(name: str, tied: bool) -> bool:
    """Weights that a scheme quantizes: the projections, the output head, and the embeddings when they double
    as the output head."""
    return name.endswith("_proj") or name == "lm_head" or (tied and name == "embed_tokens")


def head_scheme(name: str, scheme: str, tied: bool) -> str:
    """The output head (lm_head, or the embeddings tied to it) stays at int8 under the int4 and bitsandbytes
    schemes: its error lands directly on the logits, and it is one matrix of many (llama.cpp's Q4 files keep it at
    6-8 bits too). Under bnb-int8 too: LLM.int8 also rounds the head's input to 8 bits, which flips greedy answers of
    small models (SmolLM2-135M's), and transformers leaves lm_head out of bitsandbytes as well."""
    head = name == "lm_head" or (tied and name == "embed_tokens")
    return "int8" if head and (is_int4(scheme) or scheme in BNB) else scheme


def is_int4(scheme: str) -> bool:
    """The 4-bit schemes of localpd's own (int4-gN, int4-k): their output head stays int8 and `localpd quantize`
    calibrates their rounding."""
    return scheme in INT4 or scheme == INT4_K


def imports_exactly(gguf_type: str, scheme: str) -> bool:
    """Whether a GGUF block type is imported from its blocks as stored (quant.weights.from_gguf), not re-quantized
    from its float values."""
    return gguf_type in GGUF_NATIVE and (scheme == "native" or (scheme == "int8" and gguf_type == "Q8_0")
                                         or (scheme == "int4-g32" and gguf_type in ("Q4_0", "Q4_1"))
                                         or (scheme == "int4-zp-g32" and gguf_type == "Q4_0")  # zero point 8
                                         or (scheme == INT4_K and gguf_type == "Q4_K"))


def imports_codes(gguf_type: str, scheme: str) -> bool:
    """Whether a GGUF type's 4-bit codes carry over into the scheme, with only its scales re-quantized
    (from_blocks): Q4_0 and Q4_1 under int4-k."""
    return scheme == INT4_K and gguf_type in ("Q4_0", "Q4_1")


def from_blocks(w: Weight, scheme: str) -> Weight:
    """A matrix that from_gguf imported, in the scheme: int4-k takes an int4-g32 import's codes (imports_codes)."""
    return Int4KWeight.from_int4(w) if scheme == INT4_K and isinstance(w, Int4Weight) else w


def native_weight(dense: torch.Tensor, gguf_type: str, dtype: torch.dtype) -> Weight:
    """A GGUF matrix under "native" whose type has no import of its own (imports_exactly): a float type stays dense;
    a quantized one (the 1-3 bit IQ types, TQ1_0/TQ2_0, NVFP4) becomes int8 with a float16 scale
    per 32 values. Each group of 32 spans one or two of the type's sub-blocks, so its rounding step is at most 1/127
    of the group's largest value, a small fraction of the step of the type's own 1-6 bit codes (docs/PERF.md)."""
    if gguf_type in GGUF_DENSE:
        return dense.to(dtype)
    return Int8Weight.quantize(dense, NATIVE_INT8_GROUP)


def int4_group(scheme: str, k: int) -> int:
    """The group an int4 scheme uses for a matrix with k inputs: the scheme's own, or, where k is not a multiple of
    it, the largest smaller group that divides k (as llama.cpp falls back to another type for rows its blocks do not
    divide). SmolLM2-135M's hidden size 576 = 4.5 x 128 takes int4-g128 as g64 there, and g128 in down_proj."""
    for group in sorted((g for g in INT4_GROUPS if g <= INT4[scheme]), reverse=True):
        if k % group == 0:
            return group
    raise LocalpdError(f"{scheme} needs the input dimension ({k}) to be a multiple of {min(INT4_GROUPS)}")


def group_notes(weights: dict[str, Weight], scheme: str) -> list[str]:
    """One line per fallback group that an int4 scheme had to take (see int4_group), naming the matrices."""
    if scheme not in INT4:
        return []
    fell_back: dict[int, set[str]] = {}
    for name, w in weights.items():
        if isinstance(w, Int4Weight) and w.group != INT4[scheme]:
            fell_back.setdefault(w.group, set()).add(name.rsplit(".", 1)[-1])
    return [f"{scheme}: {', '.join(sorted(names))} use groups of {group} (input dimension not a multiple of "
            f"{INT4[scheme]})" for group, names in sorted(fell_back.items())]


def quantize(dense: torch.Tensor, scheme: str, dtype: torch.dtype, importance: torch.Tensor | None = None) -> Weight:
    """A dense matrix in the given scheme ("native" keeps it dense). importance: per input column, from
    localpd.quantize.calibrate; the int4 schemes weigh their rounding error by it, the others do not use it."""
    if scheme == "int8":
        return Int8Weight.quantize(dense)
    if scheme in INT4:
        return Int4Weight.quantize(dense, int4_group(scheme, dense.shape[1]), importance, scheme in INT4_ZP)
    if scheme == INT4_K:
        return Int4KWeight.quantize(dense, importance)
    if scheme in BNB:
        return BNB[scheme].quantize(dense)
    return dense.to(dtype)
