"""Weight and KV quantization formats (installed as localpd.quant). GGUF block types whose groups of 32 map onto
the int4/int8 formats are decoded in gguf_blocks; localpd.load.gguf dequantizes the rest."""
