"""`--quant native` against the same file dequantized exactly (`--quant fp32`), for GGUF files of each type that
llama.cpp's llama-quantize makes from one source file (issue 28).

    python scripts/perplexity_by_gguf_type.py Q4_K_M pure:Q2_K IQ2_XXS ... [--text tests/data/apache-2.0.txt]

A type written `pure:T` is made with `--pure` (every tensor in T where its row width allows); IQ1/IQ2 types need an
importance matrix, for which a uniform one is written. Prints one row per file: its tensor types, bits per weight,
both perplexities and the difference.
"""

from __future__ import annotations

import argparse
import re
import struct
import subprocess
import sys
import tempfile
from pathlib import Path

from localpd.load.gguf import GGUFFile

REPO = Path(__file__).resolve().parent.parent
NEEDS_IMATRIX = ("IQ1_", "IQ2_XXS", "IQ2_XS")


def uniform_imatrix(source: Path, out: Path) -> Path:
    """llama.cpp's legacy imatrix format with every column's importance 1, for every 2-D tensor of the layers."""
    tensors = [t for t in GGUFFile(source).tensors if t.name.startswith("blk.") and len(t.shape) == 2]
    with open(out, "wb") as f:
        f.write(struct.pack("<i", len(tensors)))
        for t in tensors:
            name = t.name.encode()
            f.write(struct.pack("<i", len(name)) + name + struct.pack("<ii", 1, t.shape[0]))
            f.write(struct.pack(f"<{t.shape[0]}f", *[1.0] * t.shape[0]))
        f.write(struct.pack("<i", 1) + struct.pack("<i", 7) + b"uniform")
    return out


def make(tool: Path, source: Path, spec: str, folder: Path) -> Path:
    pure, kind = spec.startswith("pure:"), spec.removeprefix("pure:")
    out = folder / f"{spec.replace(':', '-')}.gguf"
    args = [str(tool), "--allow-requantize", *(["--pure"] if pure else [])]
    if kind.startswith(NEEDS_IMATRIX):
        args += ["--imatrix", str(uniform_imatrix(source, folder / "uniform.imatrix"))]
    done = subprocess.run([*args, str(source), str(out), kind], capture_output=True, text=True)
    if done.returncode:
        sys.exit(f"llama-quantize {spec} failed: {done.stderr.strip().splitlines()[-1]}")
    return out


def perplexity(path: Path, scheme: str, text: Path, max_tokens: int | None) -> float:
    args = [sys.executable, "-m", "localpd.cli", "eval", "perplexity", str(path), "--text", str(text), "--quant", scheme,
            "--device", "cpu", *(["--max-tokens", str(max_tokens)] if max_tokens else [])]
    out = subprocess.run(args, capture_output=True, text=True)
    found = re.search(r"perplexity ([0-9.]+)", out.stdout + out.stderr)
    if out.returncode or not found:
        sys.exit(f"{path.name} --quant {scheme} failed: {(out.stderr or out.stdout).strip()[-500:]}")
    return float(found.group(1))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("types", nargs="+", help="llama-quantize types, pure:TYPE for --pure")
    ap.add_argument("--source", type=Path, help="the file to quantize (default: the default model's)")
    ap.add_argument("--text", type=Path, default=REPO / "tests" / "data" / "apache-2.0.txt")
    ap.add_argument("--max-tokens", type=int)
    ap.add_argument("--llama-bin", type=Path, help="folder holding llama-quantize (default: ../shared/peers/llama-cpp.sh)")
    args = ap.parse_args()
    if args.source is None:
        from localpd.load.registry import resolve_model

        args.source = resolve_model("smollm2-135m").path
    bin_dir = args.llama_bin or Path(subprocess.run(["bash", str(REPO.parent / "shared" / "peers" / "llama-cpp.sh")],
                                                    capture_output=True, text=True, check=True).stdout.strip())
    print("| file | tensor types | bits/weight | fp32 (exact) | native | native vs exact |")
    print("| --- | --- | --- | --- | --- | --- |")
    with tempfile.TemporaryDirectory() as tmp:
        for spec in args.types:
            path = make(bin_dir / "llama-quantize", args.source, spec, Path(tmp))
            g = GGUFFile(path)
            types = ", ".join(f"{k} {n}" for k, n in g.type_counts().items() if k != "F32")
            exact, native = (perplexity(path, s, args.text, args.max_tokens) for s in ("fp32", "native"))
            print(f"| {spec} | {types} | {g.bits_per_weight():.2f} | {exact:.4f} | {native:.4f} | "
                  f"{100 * (native / exact - 1):+.2f}% |", flush=True)
            path.unlink()


if __name__ == "__main__":
    main()
