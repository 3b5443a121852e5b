"""Weight quantization formats (installed as localpd.quant; the KV cache's formats are localpd.kvcache.formats).
GGUF block types whose groups of 32 map onto the int4/int8 formats are decoded in gguf_blocks; localpd.load.gguf
dequantizes the rest."""
