"""The model an export starts from: loaded in its scheme, with the formats that can hold that scheme."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from localpd.errors import LocalpdError
from localpd.load.loader import LoadedModel, load_model
from localpd.load.registry import resolve_model
from localpd.quant.codebook import CodebookWeight
from localpd.quant.schemes import BNB, check_scheme, compute_dtype
from localpd.quant.store import is_quantized_dir, read_meta
from localpd.quant.weights import Weight

FORMATS = ("gguf", "compressed-tensors")
# schemes a format cannot hold: compressed-tensors has no NF4 codebook nor LLM.int8's layout (GGUF re-quantizes them)
CANNOT_HOLD = {"gguf": set(), "compressed-tensors": set(BNB)}
ARCHS = {"gguf": ("llama", "qwen2", "qwen3"), "compressed-tensors": ("llama", "qwen2", "qwen3")}


@dataclass
class Source:
    name: str
    path: Path
    scheme: str  # the scheme the weights are in: the quantized directory's, or --quant (native: the file's own)
    loaded: LoadedModel


def formats_for(scheme: str) -> list[str]:
    return [f for f in FORMATS if scheme not in CANNOT_HOLD[f]]


def check_format(fmt: str, scheme: str) -> None:
    """One line naming the formats that can, where `fmt` cannot hold the scheme."""
    if fmt not in FORMATS:
        raise LocalpdError(f"unknown export format '{fmt}'; formats: {', '.join(FORMATS)}")
    if scheme in CANNOT_HOLD[fmt]:
        raise LocalpdError(f"{fmt} cannot hold {scheme} weights; formats that can: "
                           f"{', '.join(formats_for(scheme)) or 'none'}")


def load_source(model: str, fmt: str, quant: str | None = None) -> Source:
    """The model (registry name, .gguf file, HF or `localpd quantize` directory) in the scheme it is exported in,
    checked against the format before the weights are read."""
    resolved = resolve_model(model, pull=True, progress=True)
    path = Path(resolved.path)
    if is_quantized_dir(path):
        stored = read_meta(path)["scheme"]
        if quant not in (None, "native", stored):
            raise LocalpdError(f"{path} holds {stored} weights; export it as they are (no --quant) or export the "
                               f"original model with --quant {quant}")
        scheme = stored
    else:
        scheme = check_scheme(quant or "native")
    check_format(fmt, scheme)
    cpu = torch.device("cpu")
    dtype = torch.float32 if scheme == "native" else compute_dtype(scheme, cpu)
    loaded = load_model(path, dtype=dtype, device=cpu, scheme="native" if is_quantized_dir(path) else scheme)
    if loaded.config.arch not in ARCHS[fmt] or loaded.config.proj_head_dim or loaded.config.nope_layers:
        raise LocalpdError(f"export to {fmt} takes the {', '.join(ARCHS[fmt])} architectures; {resolved.name} is "
                           f"{loaded.config.arch}")
    loaded.weights = {key: exported_weight(w) for key, w in loaded.weights.items()}
    return Source(resolved.name, path, scheme, loaded)


def exported_weight(w: Weight) -> Weight:
    """A weight as the formats take it: a codebook weight (IQ4_NL, IQ4_XS, MXFP4, held as 4-bit codes into the
    type's grid) as the int8 values it stands for with its scales, which GGUF's Q8_0 and compressed-tensors' int8
    hold exactly; any other as it is."""
    return w.to_int8() if isinstance(w, CodebookWeight) else w


def tokenizer_meta(loaded: LoadedModel) -> dict | None:
    """The GGUF tokenizer metadata (tokenizer.*) the model came with: its GGUF file's, or the copy `localpd quantize`
    kept; None for a model whose tokenizer is a tokenizer.json."""
    if loaded.gguf is not None:
        return {k: v for k, v in loaded.gguf.metadata.items() if k.startswith("tokenizer.")}
    return loaded.tokenizer_meta
