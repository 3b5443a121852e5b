"""Tokenizer from a GGUF vocabulary or a tokenizer.json, on the `tokenizers` library; incremental detokenizer."""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

from localpd.chat_template import render
from localpd.errors import LocalpdError

GPT2_SPLIT = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                r"|\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
               r"|\s*[\r\n]+|\s+(?!\S)|\s+")
END_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|end_of_text|>", "<|endoftext|>", "<end_of_turn>", "</s>", "<|end|>")


def _bpe_pre_tokenizer(pre: str):
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    if pre in ("llama-bpe", "llama3", "smaug-bpe"):
        split = LLAMA3_SPLIT
    elif pre == "qwen2":
        split = QWEN2_SPLIT
    else:
        split = None
    if split is None:
        steps = [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)]
        if pre in ("smollm", "default", "starcoder", "refact"):
            steps.insert(0, pre_tokenizers.Digits(individual_digits=True))
        return pre_tokenizers.Sequence(steps)
    return pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(split), behavior="isolated"), byte_level])


class Tokenizer:
    def __init__(self, tok: HFTokenizer, bos_id: int | None, eos_ids: frozenset[int], add_bos: bool,
                 chat_template: str | None, bos_token: str = "", eos_token: str = ""):
        self.tok = tok
        self.bos_id = bos_id
        self.eos_ids = eos_ids
        self.add_bos = add_bos
        self.chat_template = chat_template
        self.bos_token, self.eos_token = bos_token, eos_token

    @classmethod
    def from_gguf_metadata(cls, meta: dict) -> "Tokenizer":
        kind = meta.get("tokenizer.ggml.model")
        tokens = meta.get("tokenizer.ggml.tokens")
        if not tokens:
            raise LocalpdError("the GGUF file has no tokenizer vocabulary")
        types = meta.get("tokenizer.ggml.token_type") or [1] * len(tokens)
        if kind == "gpt2":
            merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges", [])]
            vocab = {t: i for i, t in enumerate(tokens)}
            tok = HFTokenizer(models.BPE(vocab, merges, ignore_merges=meta.get("tokenizer.ggml.pre") in ("llama-bpe", "llama3")))
            tok.pre_tokenizer = _bpe_pre_tokenizer(meta.get("tokenizer.ggml.pre", "default"))
            tok.decoder = decoders.ByteLevel()
        elif kind == "llama":
            scores = meta.get("tokenizer.ggml.scores") or [0.0] * len(tokens)
            unk = meta.get("tokenizer.ggml.unknown_token_id", 0)
            tok = HFTokenizer(models.Unigram(list(zip(tokens, scores)), unk_id=unk, byte_fallback=True))
            prefix = meta.get("tokenizer.ggml.add_space_prefix", True)
            tok.normalizer = normalizers.Sequence(
                ([normalizers.Prepend("▁")] if prefix else []) + [normalizers.Replace(" ", "▁")])
            tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
                                            + ([decoders.Strip(" ", 1, 0)] if prefix else []))
        else:
            raise LocalpdError(f"unsupported GGUF tokenizer model '{kind}'; supported: gpt2 (BPE), llama (SentencePiece)")
        specials = [AddedToken(t, special=True, normalized=False) for t, ty in zip(tokens, types) if ty in (3, 4)]
        tok.add_special_tokens(specials)
        bos = meta.get("tokenizer.ggml.bos_token_id")
        eos = meta.get("tokenizer.ggml.eos_token_id")
        ends = {i for i, t in enumerate(tokens) if t in END_TOKENS and types[i] in (3, 4)}
        if eos is not None:
            ends.add(int(eos))
        return cls(tok, bos, frozenset(ends), bool(meta.get("tokenizer.ggml.add_bos_token", kind == "llama")),
                   meta.get("tokenizer.chat_template"),
                   tokens[bos] if bos is not None else "", tokens[eos] if eos is not None else "")

    @classmethod
    def from_dir(cls, path: Path) -> "Tokenizer":
        path = Path(path)
        if not (path / "tokenizer.json").exists():
            raise LocalpdError(f"{path} has no tokenizer.json")
        tok = HFTokenizer.from_file(str(path / "tokenizer.json"))
        cfg = _read_json(path / "tokenizer_config.json")
        gen = _read_json(path / "generation_config.json")

        def token_text(v):
            return v.get("content", "") if isinstance(v, dict) else (v or "")

        bos_t, eos_t = token_text(cfg.get("bos_token")), token_text(cfg.get("eos_token"))
        ends = {tok.token_to_id(t) for t in (eos_t, *END_TOKENS) if t and tok.token_to_id(t) is not None}
        gen_eos = gen.get("eos_token_id")
        ends |= set(gen_eos if isinstance(gen_eos, list) else [gen_eos] if gen_eos is not None else [])
        template = cfg.get("chat_template")
        if isinstance(template, list):  # named templates: take the default one
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
        if template is None and (path / "chat_template.jinja").exists():
            template = (path / "chat_template.jinja").read_text()
        bos_id = tok.token_to_id(bos_t) if bos_t else None
        return cls(tok, bos_id, frozenset(ends), bool(cfg.get("add_bos_token", False)) and bos_id is not None,
                   template, bos_t, eos_t)

    @property
    def vocab_size(self) -> int:
        return self.tok.get_vocab_size()

    def id_to_token(self, i: int) -> str | None:
        return self.tok.id_to_token(i)

    def encode(self, text: str, add_bos: bool | None = None) -> list[int]:
        ids = self.tok.encode(text, add_special_tokens=False).ids
        if (self.add_bos if add_bos is None else add_bos) and self.bos_id is not None:
            ids = [self.bos_id] + ids
        return ids

    def decode(self, ids: list[int], skip_special: bool = True) -> str:
        return self.tok.decode(list(ids), skip_special_tokens=skip_special)

    def render_chat(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        if not self.chat_template:
            text = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)
            return text + ("<|im_start|>assistant\n" if add_generation_prompt else "")
        return render(self.chat_template, messages, add_generation_prompt, self.bos_token, self.eos_token)


def _read_json(path: Path) -> dict:
    return json.loads(path.read_text()) if path.exists() else {}


class IncrementalDetokenizer:
    """Turns a stream of token ids into text deltas that never end inside a UTF-8 sequence.

    It decodes a short window of earlier tokens together with the new ones and emits what was added, so that
    tokenizers whose pieces depend on their neighbours (SentencePiece's leading space) come out right."""

    def __init__(self, tokenizer: Tokenizer, skip_special: bool = True):
        self.tokenizer = tokenizer
        self.skip_special = skip_special
        self.ids: list[int] = []
        self.prefix = 0  # start of the window whose text is already emitted up to read
        self.read = 0  # ids[:read] are fully emitted

    def push(self, token_id: int) -> str:
        self.ids.append(token_id)
        decode = lambda a, b: self.tokenizer.decode(self.ids[a:b], self.skip_special)
        done = decode(self.prefix, self.read)
        text = decode(self.prefix, len(self.ids))
        if text.endswith("\ufffd") or len(text) <= len(done):
            return ""  # an incomplete UTF-8 sequence: wait for the rest
        self.prefix, self.read = self.read, len(self.ids)
        return text[len(done):]

    def flush(self) -> str:
        done = self.tokenizer.decode(self.ids[self.prefix:self.read], self.skip_special)
        text = self.tokenizer.decode(self.ids[self.prefix:], self.skip_special)
        self.prefix = self.read = len(self.ids)
        return text[len(done):]
