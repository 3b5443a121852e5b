"""A Hugging Face directory's tokenizer.json -> the GGUF tokenizer metadata (tokenizer.*) llama.cpp reads, for
the two kinds of BPE vocabulary it runs:

- byte-level BPE (GPT-2, Llama 3, Qwen, SmolLM: tokenizer.ggml.model "gpt2") whose text-splitting rule is one
  localpd's own GGUF tokenizer knows by its tokenizer.ggml.pre name (text.tokenizer): llama.cpp picks its
  splitting regex by that name; the merges as they are.
- SentencePiece BPE with byte fallback (Llama 2, Mistral, Gemma: "llama"): spaces written as U+2581, bytes no
  piece holds as <0xNN> tokens, no pre-splitting. llama.cpp merges the adjacent pair whose joined text scores
  highest, so each token's score is minus the rank of the merge that makes it (the merges' order is the
  SentencePiece model's piece order), and the byte tokens are typed as bytes.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from localpd.errors import LocalpdError
from localpd.text.tokenizer import (BYTE, CONTROL, DIGIT_SPLIT_PRES, NORMAL, SPLITS, UNKNOWN, UNUSED, USER_DEFINED,
                                   Tokenizer)

BYTE_PIECE = re.compile(r"<0x[0-9A-F]{2}>")  # a SentencePiece byte-fallback token
SPACE = "\u2581"  # SentencePiece's space
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


def space_prefix(spec: dict) -> bool | None:
    """For a SentencePiece-style tokenizer.json (spaces as U+2581, by a Metaspace pre-tokenizer or by a normalizer
    that replaces them, as Llama 2's does): whether a leading U+2581 is added to the text; None for any other kind."""
    def steps(part: dict | None, key: str) -> list[dict]:  # a Sequence's steps, or the one step
        return part.get(key) or [part] if part else []

    pre = steps(spec.get("pre_tokenizer"), "pretokenizers")
    norm = steps(spec.get("normalizer"), "normalizers")
    meta = next((s for s in pre if s.get("type") == "Metaspace"), None)
    if meta is not None:
        return meta.get("prepend_scheme", "always") != "never" and meta.get("add_prefix_space", True)
    if any(s.get("type") == "Replace" and s.get("content") == SPACE for s in norm):
        return any(s.get("type") == "Prepend" and s.get("prepend") == SPACE for s in norm)
    return None


def vocab_meta(hf_dir: Path, vocab_size: int) -> dict:
    """The tokenizer.* keys for the directory's tokenizer.json, its token list padded with unused [PADn] tokens to
    the model's vocab_size (the embedding's rows), as llama.cpp checks them against each other."""
    spec = json.loads((Path(hf_dir) / "tokenizer.json").read_text())
    model = spec.get("model") or {}
    prefix = space_prefix(spec)
    sentencepiece = model.get("type") == "BPE" and model.get("byte_fallback") and prefix is not None
    if not sentencepiece and (model.get("type") != "BPE" or "ByteLevel" not in json.dumps(spec.get("pre_tokenizer"))):
        raise LocalpdError(f"this tokenizer.json is neither a byte-level BPE nor a SentencePiece BPE vocabulary with "
                           f"byte fallback, the kinds localpd writes to GGUF; {CONVERT}")
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
    if sentencepiece:
        unk = model.get("unk_token")
        meta = {"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": tokens,
                "tokenizer.ggml.scores": piece_scores(tokens, merges),
                "tokenizer.ggml.token_type": [BYTE if BYTE_PIECE.fullmatch(t) else UNKNOWN if t == unk else ty
                                              for t, ty in zip(tokens, types)],
                "tokenizer.ggml.add_space_prefix": prefix}
    else:
        meta = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": pre_name(spec.get("pre_tokenizer")),
                "tokenizer.ggml.tokens": tokens, "tokenizer.ggml.token_type": types, "tokenizer.ggml.merges": merges}
    meta["tokenizer.ggml.add_bos_token"] = tok.add_bos
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


def piece_scores(tokens: list[str], merges: list[str]) -> list[float]:
    """Each token's score for llama.cpp's SentencePiece merging: minus the rank of the merge that makes it (the
    first merge scores highest), and below every merged token for the rest (characters, bytes, specials: never
    the result of a merge)."""
    made = {}
    for rank, merge in enumerate(merges):
        made.setdefault(merge.replace(" ", ""), rank)
    floor = -float(len(merges))
    return [-float(made[t]) if t in made else floor for t in tokens]
