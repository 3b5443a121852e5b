"""A Hugging Face directory's tokenizer.json -> the GGUF tokenizer metadata (tokenizer.*) llama.cpp reads, for
byte-level BPE vocabularies whose text-splitting rule is one localpd's own GGUF tokenizer knows by its
tokenizer.ggml.pre name (text.tokenizer): llama.cpp picks its splitting regex by that name."""

from __future__ import annotations

import json
from pathlib import Path

from localpd.errors import LocalpdError
from localpd.text.tokenizer import CONTROL, DIGIT_SPLIT_PRES, NORMAL, SPLITS, UNUSED, USER_DEFINED, Tokenizer

CONVERT = "convert it with llama.cpp's convert_hf_to_gguf.py, or export it --format compressed-tensors"


def pre_name(pre_tokenizer: dict | None) -> str:
    """tokenizer.ggml.pre for a tokenizer.json's pre_tokenizer: GPT-2's regex ("gpt-2"), GPT-2's after splitting
    digits apart ("smollm"), or a Split by one of SPLITS' regexes before the byte alphabet (its first name)."""
    steps = (pre_tokenizer or {}).get("pretokenizers") if (pre_tokenizer or {}).get("type") == "Sequence" \
        else [pre_tokenizer] if pre_tokenizer else []
    kinds = [s.get("type") for s in steps]
    if kinds == ["ByteLevel"] and steps[0].get("use_regex", True):
        return "gpt-2"
    if kinds == ["Digits", "ByteLevel"] and steps[0].get("individual_digits") and steps[1].get("use_regex", True):
        return DIGIT_SPLIT_PRES[0]
    if kinds == ["Split", "ByteLevel"] and not steps[1].get("use_regex", True):
        regex = (steps[0].get("pattern") or {}).get("Regex")
        for name, split in SPLITS.items():
            if regex == split:
                return name
    raise LocalpdError(f"this tokenizer.json splits text before BPE in a way localpd cannot name to llama.cpp "
                       f"({' + '.join(map(str, kinds)) or 'no pre-tokenizer'}); {CONVERT}")


def vocab_meta(hf_dir: Path, vocab_size: int) -> dict:
    """The tokenizer.* keys for the directory's tokenizer.json, its token list padded with unused [PADn] tokens to
    the model's vocab_size (the embedding's rows), as llama.cpp checks them against each other."""
    spec = json.loads((Path(hf_dir) / "tokenizer.json").read_text())
    model = spec.get("model") or {}
    if model.get("type") != "BPE" or "ByteLevel" not in json.dumps(spec.get("pre_tokenizer")):
        raise LocalpdError(f"this tokenizer.json is not a byte-level BPE vocabulary, the kind localpd writes to "
                           f"GGUF; {CONVERT}")
    pre = pre_name(spec.get("pre_tokenizer"))
    tok = Tokenizer.from_dir(hf_dir)
    by_id = {i: t for t, i in model["vocab"].items()}
    kinds = {i: NORMAL for i in by_id}
    for added in spec.get("added_tokens", []):
        by_id[added["id"]] = added["content"]
        kinds[added["id"]] = CONTROL if added.get("special") else USER_DEFINED
    size = max(vocab_size, max(by_id) + 1)
    tokens = [by_id.get(i, f"[PAD{i}]") for i in range(size)]
    types = [kinds.get(i, UNUSED) for i in range(size)]
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]
    meta = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": pre, "tokenizer.ggml.tokens": tokens,
            "tokenizer.ggml.token_type": types, "tokenizer.ggml.merges": merges,
            "tokenizer.ggml.add_bos_token": tok.add_bos}
    cfg = json.loads((Path(hf_dir) / "tokenizer_config.json").read_text()) \
        if (Path(hf_dir) / "tokenizer_config.json").exists() else {}

    def token_id(spelling) -> int | None:  # tokenizer_config.json spells a token as text or {"content": text}
        text = spelling.get("content", "") if isinstance(spelling, dict) else spelling or ""
        return tok.tok.token_to_id(text) if text else None

    ids = {"bos": tok.bos_id, "eos": token_id(tok.eos_token),
           "unknown": token_id(model.get("unk_token") or cfg.get("unk_token")),
           "padding": token_id(cfg.get("pad_token"))}
    meta.update({f"tokenizer.ggml.{k}_token_id": i for k, i in ids.items() if i is not None})
    if tok.chat_template:
        meta["tokenizer.chat_template"] = tok.chat_template
    return meta
