"""`localpd quantize MODEL --scheme SCHEME`: quantize once, save, and load fast (memory-mapped) from then on."""

from __future__ import annotations

import hashlib
import sys
from pathlib import Path

import torch

from localpd.loader import load_model
from localpd.quant.store import save_quantized
from localpd.registry import cache_dir, resolve_model
from localpd.schemes import check_scheme, compute_dtype, group_notes


def source_hash(path: Path) -> str:
    """sha256 of a model file; of a directory, of its files' names and contents."""
    h = hashlib.sha256()
    files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
    for p in files:
        if path.is_dir():
            h.update(str(p.relative_to(path)).encode())
        with open(p, "rb") as f:
            for block in iter(lambda: f.read(1 << 24), b""):
                h.update(block)
    return h.hexdigest()


def quantize_model(model: str, scheme: str, out: Path | None = None, progress: bool = False) -> Path:
    check_scheme(scheme)
    resolved = resolve_model(model, pull=True, progress=progress)
    cpu = torch.device("cpu")
    loaded = load_model(resolved.path, dtype=compute_dtype(scheme, cpu), device=cpu, scheme=scheme)
    if progress:
        for note in group_notes(loaded.weights, scheme):
            print(note, file=sys.stderr)
    out = Path(out) if out else Path(cache_dir()) / "quantized" / f"{resolved.name}-{scheme}"
    source = {"name": resolved.name, "path": str(resolved.path), "sha256": source_hash(Path(resolved.path))}
    tokenizer = None
    if loaded.gguf is not None:
        tokenizer = {k: v for k, v in loaded.gguf.metadata.items() if k.startswith("tokenizer.")}
    return save_quantized(out, loaded.weights, loaded.config, scheme, source, tokenizer_meta=tokenizer,
                          tokenizer_dir=loaded.hf_dir)


def run_quantize(args) -> int:
    out = quantize_model(args.model, args.scheme, args.out, progress=True)
    size = sum(p.stat().st_size for p in out.iterdir())
    print(f"{out}  ({size / 2**20:.0f} MiB; run it with: localpd chat {out})")
    return 0
