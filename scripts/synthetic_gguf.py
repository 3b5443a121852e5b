"""A GGUF file of random weights in a real model's shapes, for CPU decode benchmarks against llama.cpp on the same
file at sizes whose weights do not fit in the caches (decode speed depends on the bytes moved, not on their values).

The vocabulary, chat template and tokenizer settings are the default model's (SmolLM2's 49,152 tokens), so the
shapes default to SmolLM2-1.7B's, a real model of that vocabulary: 24 layers of 2048, 32 heads, an FFN of 8192, the
embedding tied to the head. Matrices are written as Q4_0, Q4_1 or Q8_0 blocks of random codes with small random
scales, the embedding as Q8_0 and the norms as float32; `llama-quantize --allow-requantize` makes the other types.

    python scripts/synthetic_gguf.py -o /tmp/smollm2-1.7b-q4_0.gguf [--type Q4_0] [--layers 24] [--dim 2048] ...
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import gguf

from localpd.load.registry import resolve_model  # the default model's file, fetched on first use

CHANGED = ("llama.block_count", "llama.embedding_length", "llama.feed_forward_length", "llama.attention.head_count",
           "llama.attention.head_count_kv", "llama.rope.dimension_count", "general.file_type", "general.name",
           "general.size_label")
FILE_TYPES = {"Q4_0": 2, "Q4_1": 3, "Q8_0": 7}  # llama.cpp's LLAMA_FTYPE_MOSTLY_*


def blocks(rng: np.random.Generator, rows: int, cols: int, kind: str) -> np.ndarray:
    """rows x cols weights as `kind` blocks of 32 (uint8 [rows, cols / 32 * block bytes]): random codes, scales in
    0.002-0.01 (Q4_1's minimum about -8 scales, as a symmetric fit gives)."""
    n = rows * cols // 32
    d = rng.uniform(0.002, 0.01, n).astype(np.float16).view(np.uint8).reshape(n, 2)
    if kind == "Q4_0":
        parts = [d, rng.integers(0, 256, (n, 16), dtype=np.uint8)]
    elif kind == "Q4_1":
        m = (-8 * d.view(np.float16).astype(np.float32)).astype(np.float16).view(np.uint8).reshape(n, 2)
        parts = [d, m, rng.integers(0, 256, (n, 16), dtype=np.uint8)]
    else:  # Q8_0
        parts = [d, rng.integers(-127, 128, (n, 32), dtype=np.int8).view(np.uint8)]
    return np.concatenate(parts, axis=1).reshape(rows, -1)


def copy_metadata(reader: gguf.GGUFReader, writer: gguf.GGUFWriter) -> None:
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key in CHANGED or key == "general.architecture":
            continue
        vtype = field.types[0]
        sub = field.types[1] if vtype == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(key, field.contents(), vtype, sub_type=sub)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-o", "--out", required=True)
    ap.add_argument("--type", default="Q4_0", choices=sorted(FILE_TYPES))
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--dim", type=int, default=2048)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=32)
    ap.add_argument("--ffn", type=int, default=8192)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    src = gguf.GGUFReader(resolve_model("smollm2-135m").path)
    vocab = int(src.fields["llama.vocab_size"].contents())
    head_dim = args.dim // args.heads
    rng = np.random.default_rng(args.seed)
    writer = gguf.GGUFWriter(args.out, "llama")
    copy_metadata(src, writer)
    writer.add_name(f"synthetic {args.layers}x{args.dim}")
    writer.add_block_count(args.layers)
    writer.add_embedding_length(args.dim)
    writer.add_feed_forward_length(args.ffn)
    writer.add_head_count(args.heads)
    writer.add_head_count_kv(args.kv_heads)
    writer.add_rope_dimension_count(head_dim)
    writer.add_file_type(FILE_TYPES[args.type])
    q8 = gguf.GGMLQuantizationType.Q8_0
    kind = getattr(gguf.GGMLQuantizationType, args.type)
    writer.add_tensor("token_embd.weight", blocks(rng, vocab, args.dim, "Q8_0"), raw_dtype=q8)
    writer.add_tensor("output_norm.weight", rng.uniform(0.5, 1.5, args.dim).astype(np.float32))
    kv = args.kv_heads * head_dim
    for i in range(args.layers):
        for name, (rows, cols) in (("attn_q", (args.dim, args.dim)), ("attn_k", (kv, args.dim)),
                                   ("attn_v", (kv, args.dim)), ("attn_output", (args.dim, args.dim)),
                                   ("ffn_gate", (args.ffn, args.dim)), ("ffn_up", (args.ffn, args.dim)),
                                   ("ffn_down", (args.dim, args.ffn))):
            writer.add_tensor(f"blk.{i}.{name}.weight", blocks(rng, rows, cols, args.type), raw_dtype=kind)
        for name in ("attn_norm", "ffn_norm"):
            writer.add_tensor(f"blk.{i}.{name}.weight", rng.uniform(0.5, 1.5, args.dim).astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    print(f"{args.out}: {Path(args.out).stat().st_size / 2**30:.2f} GiB, {args.layers} layers of {args.dim}, {args.type}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
