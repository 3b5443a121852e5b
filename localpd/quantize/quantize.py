"""`localpd quantize MODEL --scheme SCHEME`: quantize once, save, and load fast (memory-mapped) from then on."""

from __future__ import annotations

import hashlib
import sys
from dataclasses import asdict
from pathlib import Path

import torch

from localpd.quantize.calibrate import Calibration, calibrate_text
from localpd.errors import LocalpdError
from localpd.load.loader import imports_every_matrix_exactly, load_model
from localpd.model.transformer import Transformer
from localpd.quant.store import is_quantized_dir, save_quantized
from localpd.load.registry import cache_dir, resolve_model
from localpd.quant.schemes import check_scheme, compute_dtype, group_notes, is_int4


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


def calibration_for(path: Path, text: str | None, device: torch.device) -> Calibration:
    """Activation importance from the model as stored (GGUF blocks stay quantized; safetensors load in bf16 to
    halve the memory of this pass), before the weights are re-quantized with it."""
    dtype = torch.float32 if path.suffix == ".gguf" else torch.bfloat16
    loaded = load_model(path, dtype=dtype, device=device, scheme="native")
    tokenizer = loaded.tokenizer()
    if tokenizer is None:
        raise LocalpdError(f"{path} has no tokenizer to encode the calibration text; use --no-calibration")
    return calibrate_text(Transformer(loaded.config, loaded.weights), tokenizer, text)


def quantize_model(model: str, scheme: str, out: Path | None = None, progress: bool = False,
                   calibration: str | None = None, calibrate: bool = True) -> Path:
    """Quantize and save. The int4 schemes weigh their rounding error by activation importance measured on
    `calibration` (a text; None: localpd's own calibration text) unless calibrate is False."""
    check_scheme(scheme)
    resolved = resolve_model(model, pull=True, progress=progress)
    path, cpu = Path(resolved.path), torch.device("cpu")
    calib = None
    if calibrate and is_int4(scheme) and not is_quantized_dir(path) and not imports_every_matrix_exactly(path, scheme):
        calib = calibration_for(path, calibration, cpu)
        if progress:
            print(f"calibrated on {calib.tokens} tokens", file=sys.stderr)
    loaded = load_model(path, dtype=compute_dtype(scheme, cpu), device=cpu, scheme=scheme,
                        importance=calib.importance if calib else None)
    if progress:
        for note in group_notes(loaded.weights, scheme):
            print(note, file=sys.stderr)
    out = Path(out) if out else Path(cache_dir()) / "quantized" / f"{resolved.name}-{scheme}"
    source = {"name": resolved.name, "path": str(path), "sha256": source_hash(path),
              "calibration": {"tokens": calib.tokens, "text_sha256": calib.text_sha256} if calib else None}
    tokenizer = None
    if loaded.gguf is not None:
        tokenizer = {k: v for k, v in loaded.gguf.metadata.items() if k.startswith("tokenizer.")}
    return save_quantized(out, loaded.weights, asdict(loaded.config), scheme, source, tokenizer_meta=tokenizer,
                          tokenizer_dir=loaded.hf_dir)


def run_quantize(args) -> int:
    text = None
    if args.calibration:
        try:
            text = Path(args.calibration).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise LocalpdError(f"cannot read calibration text {args.calibration}: {e}") from None
    out = quantize_model(args.model, args.scheme, args.out, progress=True, calibration=text,
                         calibrate=not args.no_calibration)
    size = sum(p.stat().st_size for p in out.iterdir())
    print(f"{out}  ({size / 2**20:.0f} MiB; run it with: localpd chat {out})")
    return 0
