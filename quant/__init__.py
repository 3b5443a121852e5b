"""Weight and KV quantization formats (installed as localpd.quant). GGUF block layouts are decoded in
localpd.load.gguf today; the quantized formats themselves arrive with the quantization issue."""
