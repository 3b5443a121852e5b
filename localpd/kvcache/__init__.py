"""The KV cache: which pages belong to whom (pages), the pages' keys and values in their storage formats (formats),
and writing and attending over them, with the rule that picks each format's kernel (dispatch; the kernels
themselves are in localpd.kernels)."""
