"""Quantized models on disk: one safetensors file of every weight's fields plus localpd.json (format version,
scheme, source hash, model config, which weight is which format) and the tokenizer. Written under a temporary
name and renamed, so an interrupted run leaves nothing that looks finished; loaded memory-mapped, no
re-quantization."""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import fields
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from localpd.errors import LocalpdError
from localpd.quant.bnb import BnbInt8Weight, Nf4Weight, bitsandbytes
from localpd.quant.codebook import IQ4Weight, MXFP4Weight
from localpd.quant.int4k import Int4KWeight
from localpd.quant.int5 import Int5KWeight, Int5Weight
from localpd.quant.int6k import Int2KWeight, Int3KWeight, Int6KWeight
from localpd.quant.weights import Int4Weight, Int8Weight, Weight

FORMAT, VERSION = "localpd-quantized", 1
MARKER, TENSORS, TOKENIZER = "localpd.json", "model.safetensors", "tokenizer_gguf.json"
KINDS = {"int4": Int4Weight, "int8": Int8Weight, "int4-k": Int4KWeight, "int5": Int5Weight, "int5-k": Int5KWeight,
         "int6-k": Int6KWeight, "int3-k": Int3KWeight, "int2-k": Int2KWeight,
         "iq4": IQ4Weight, "mxfp4": MXFP4Weight,
         "bnb-nf4": Nf4Weight, "bnb-int8": BnbInt8Weight}


def is_quantized_dir(path: Path) -> bool:
    return (Path(path) / MARKER).is_file()


def save_quantized(out: Path, weights: dict[str, Weight], config: dict, scheme: str, source: dict,
                   tokenizer_meta: dict | None = None, tokenizer_dir: Path | None = None) -> Path:
    out = Path(out)
    tmp = out.with_name(f".{out.name}.partial-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        flat, kinds = {}, {}
        for name, w in weights.items():
            if isinstance(w, torch.Tensor):
                flat[name], kinds[name] = w.detach().contiguous().cpu(), "dense"
                continue
            kinds[name] = next(k for k, cls in KINDS.items() if isinstance(w, cls))
            for f in fields(w):
                flat[f"{name}.{f.name}"] = getattr(w, f.name).contiguous().cpu()
        save_file(flat, tmp / TENSORS)
        meta = {"format": FORMAT, "version": VERSION, "scheme": scheme, "source": source,
                "config": config, "weights": kinds,
                "tokenizer": "gguf" if tokenizer_meta is not None else "hf"}
        (tmp / MARKER).write_text(json.dumps(meta, indent=1))
        if tokenizer_meta is not None:
            (tmp / TOKENIZER).write_text(json.dumps(tokenizer_meta))
        elif tokenizer_dir is not None:
            for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
                if (Path(tokenizer_dir) / name).exists():
                    shutil.copy(Path(tokenizer_dir) / name, tmp / name)
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def read_meta(path: Path) -> dict:
    try:
        meta = json.loads((Path(path) / MARKER).read_text())
    except (OSError, ValueError) as e:
        raise LocalpdError(f"{path} is not a readable localpd quantized model: {e}") from None
    if meta.get("format") != FORMAT or meta.get("version") != VERSION:
        raise LocalpdError(f"{path}: unknown quantized format {meta.get('format')} v{meta.get('version')} "
                           f"(this localpd reads {FORMAT} v{VERSION}); quantize the model again")
    return meta


def load_quantized(path: Path, device, scheme: str = "native") -> tuple[dict, dict[str, Weight], dict]:
    """(the model config's fields, weights, metadata). scheme must be "native" or the one the directory was written
    with. The config stays a dict here (localpd.model.config.ModelConfig's fields): quant/ sits below the model."""
    path = Path(path)
    meta = read_meta(path)
    if scheme not in ("native", meta["scheme"]):
        raise LocalpdError(f"{path} holds {meta['scheme']} weights; --quant {scheme} would need the original model "
                           f"(use --quant native or {meta['scheme']}, or quantize the source again)")
    if meta["scheme"].startswith("bnb-"):
        bitsandbytes(meta["scheme"])  # its weights run only on its matmuls
    config = meta["config"]
    weights: dict[str, Weight] = {}
    try:
        with safe_open(str(path / TENSORS), framework="pt", device=str(device)) as f:
            names = set(f.keys())
            for name, kind in meta["weights"].items():
                if kind == "dense":
                    weights[name] = f.get_tensor(name)
                    continue
                cls = KINDS[kind]
                parts = [f"{name}.{fl.name}" for fl in fields(cls)]
                if cls is Int6KWeight and f"{name}.upper" not in names and f"{name}.top" in names:
                    # written before `upper` (a plane a bit, 2026-12): the same codes
                    weights[name] = Int6KWeight.from_bit_planes(*(f.get_tensor(f"{name}.{p}")
                                                                  for p in ("packed", "high", "top", "d", "sc")))
                    continue
                if cls in (Int5Weight, Int5KWeight) and f"{name}.fifth" not in names and f"{name}.high" in names:
                    # written before `fifth` (its fifth bits a block at a time, 2026-12): the same codes
                    weights[name] = cls.from_block_plane(*(f.get_tensor(f"{name}.{p}") for p in
                                                           ["packed", "high", *(fl.name for fl in fields(cls)[2:])]))
                    continue
                missing = [p for p in parts if p not in names]
                if missing:
                    raise LocalpdError(f"{path}: tensor {missing[0]} is missing; the file is damaged")
                weights[name] = cls(*(f.get_tensor(p) for p in parts))
    except (SafetensorError, OSError, RuntimeError) as e:
        raise LocalpdError(f"{path / TENSORS} is damaged or truncated ({e}); quantize the model again") from None
    return config, weights, meta


def tokenizer_meta(path: Path) -> dict | None:
    p = Path(path) / TOKENIZER
    return json.loads(p.read_text()) if p.exists() else None
