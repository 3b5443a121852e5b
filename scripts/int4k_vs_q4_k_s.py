"""localpd's int4-k against llama.cpp's Q4_K_S, each made from the same 4-bit file and each measured with its own
tool's perplexity on the same text (issue 28): how much each loses against its own reading of the source file.

    python scripts/int4k_vs_q4_k_s.py [--source FILE] [--text tests/data/apache-2.0.txt] [--ctx 512]

llama.cpp: `llama-quantize --allow-requantize SOURCE Q4_K_S`, then `llama-perplexity -c CTX` on both files. localpd:
`localpd eval perplexity SOURCE --quant fp32` (every block dequantized exactly) and `--quant int4-k`. Prints both
tools' perplexities, the increase of each, and the bits per weight of the matrices each decodes with.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def llama_bin() -> Path:
    out = subprocess.run(["bash", str(REPO.parent / "shared" / "peers" / "llama-cpp.sh")], capture_output=True,
                         text=True, check=True)
    return Path(out.stdout.strip().splitlines()[-1])


def llama_perplexity(tool: Path, model: Path, text: Path, ctx: int) -> float:
    out = subprocess.run([str(tool), "-m", str(model), "-f", str(text), "-c", str(ctx), "-b", str(ctx), "-t", "2"],
                         capture_output=True, text=True)
    found = re.search(r"Final estimate: PPL = ([0-9.]+)", out.stdout + out.stderr)
    if not found:
        sys.exit(f"llama-perplexity failed on {model}: {(out.stderr or out.stdout).strip()[-600:]}")
    return float(found.group(1))


def localpd_perplexity(model: Path, scheme: str, text: Path) -> float:
    out = subprocess.run([sys.executable, "-m", "localpd.cli", "eval", "perplexity", str(model), "--text", str(text),
                          "--quant", scheme, "--device", "cpu"], capture_output=True, text=True, cwd=REPO)
    found = re.search(r"perplexity ([0-9.]+)", out.stdout)
    if not found:
        sys.exit(f"localpd eval perplexity failed: {out.stderr.strip()[-600:]}")
    return float(found.group(1))


def localpd_bits(model: Path, scheme: str) -> float:
    """Bits per weight of the decoder layers' matrices as loaded (the output head and embeddings left out)."""
    from localpd.load.loader import load_model
    from localpd.quant.weights import weight_nbytes

    lm = load_model(model, scheme=scheme)
    mats = {n: w for n, w in lm.weights.items() if n.endswith("_proj")}
    elements = sum(w.shape[0] * w.shape[1] for w in mats.values())
    return 8 * sum(weight_nbytes(w) for w in mats.values()) / elements


def gguf_bits(model: Path) -> float:
    from localpd.load.gguf import GGUFFile

    tensors = [t for t in GGUFFile(model).tensors if t.name.startswith("blk.") and len(t.shape) == 2]
    return 8 * sum(int(t.n_bytes) for t in tensors) / sum(int(t.n_elements) for t in tensors)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--source", type=Path, help="the 4-bit file (default: the default model's Q4_1)")
    ap.add_argument("--text", type=Path, default=REPO / "tests" / "data" / "apache-2.0.txt")
    ap.add_argument("--ctx", type=int, default=512, help="llama-perplexity's context (default 512)")
    ap.add_argument("--llama-bin", type=Path, help="folder of llama-quantize and llama-perplexity")
    args = ap.parse_args()
    if args.source is None:
        from localpd.load.registry import resolve_model

        args.source = resolve_model("smollm2-135m").path
    tools = args.llama_bin or llama_bin()
    with tempfile.TemporaryDirectory() as tmp:
        q4ks = Path(tmp) / "Q4_K_S.gguf"
        subprocess.run([str(tools / "llama-quantize"), "--allow-requantize", str(args.source), str(q4ks), "Q4_K_S"],
                       capture_output=True, check=True)
        ppl = tools / "llama-perplexity"
        llama = (llama_perplexity(ppl, args.source, args.text, args.ctx),
                 llama_perplexity(ppl, q4ks, args.text, args.ctx))
        llama_bpw = (gguf_bits(args.source), gguf_bits(q4ks))
    ours = (localpd_perplexity(args.source, "fp32", args.text), localpd_perplexity(args.source, "int4-k", args.text))
    ours_bpw = (localpd_bits(args.source, "native"), localpd_bits(args.source, "int4-k"))
    print(f"# source {args.source.name}, text {args.text.name}")
    print("tool       source ppl  4.5-bit ppl  increase  bits/weight (source -> 4.5-bit, decoder matrices)")
    for name, (a, b), (ba, bb), kind in (("llama.cpp", llama, llama_bpw, "Q4_K_S"), ("localpd", ours, ours_bpw,
                                                                                       "int4-k")):
        print(f"{name:10} {a:10.4f}  {b:11.4f}  {100 * (b / a - 1):+7.2f}%  {ba:.3f} -> {bb:.3f} ({kind})")


if __name__ == "__main__":
    main()
