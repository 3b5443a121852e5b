"""Tokenizer from a GGUF vocabulary or a tokenizer.json, on the `tokenizers` library; incremental detokenizer."""

from __future__ import annotations

import codecs
import json
import re
from pathlib import Path

from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

from localpd.text.chat_template import check_template_vars, render
from localpd.errors import LocalpdError
from localpd.constrain.tools import template_messages

# GGUF token types (llama.cpp's llama_token_type)
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

# Split regexes of the byte-level BPE vocabularies, by tokenizer.ggml.pre (the ones of their tokenizer.json files).
LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                r"|\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
               r"|\s*[\r\n]+|\s+(?!\S)|\s+")
SPLITS = {"llama-bpe": LLAMA3_SPLIT, "llama3": LLAMA3_SPLIT, "llama-v3": LLAMA3_SPLIT, "smaug-bpe": LLAMA3_SPLIT,
          "falcon3": LLAMA3_SPLIT, "qwen2": QWEN2_SPLIT, "deepseek-r1-qwen": QWEN2_SPLIT}
DIGIT_SPLIT_PRES = ("smollm", "starcoder", "refact")  # GPT-2's regex after splitting every digit apart
IGNORE_MERGES_PRES = ("llama-bpe", "llama3", "llama-v3", "smaug-bpe", "falcon3")  # whole-word vocab hits win

# Tokens that end a turn besides eos, when the vocabulary has them.
END_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|end_of_text|>", "<|endoftext|>", "<end_of_turn>",
              "<|end|>")
# fill-in-the-middle: (prefix, suffix, middle) tokens as code models spell them: Qwen2.5-Coder, StarCoder and
# SantaCoder, DeepSeek-Coder, Code Llama (with and without SentencePiece's space)
FIM_TOKENS = (("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"), ("<fim_prefix>", "<fim_suffix>", "<fim_middle>"),
              ("<｜fim▁begin｜>", "<｜fim▁hole｜>", "<｜fim▁end｜>"), ("▁<PRE>", "▁<SUF>", "▁<MID>"),
              ("<PRE>", "<SUF>", "<MID>"))
FIM_ENDS = ("▁<EOT>", "<EOT>", "<|fim_pad|>", "<|file_sep|>")  # what code models end an infill with, beside eos


def _byte_alphabet() -> dict[int, str]:
    """GPT-2's spelling of each byte as a printable character."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    spelled, extra = {}, 0
    for b in range(256):
        if b in printable:
            spelled[b] = chr(b)
        else:
            spelled[b] = chr(256 + extra)
            extra += 1
    return spelled


UNSPELLED = {c: b for b, c in _byte_alphabet().items()}


def _bpe_from_gguf(tokens: list[str], types: list[int], meta: dict) -> HFTokenizer:
    pre = meta.get("tokenizer.ggml.pre", "default")
    spelled = _byte_alphabet()
    alphabet = set(spelled.values())
    # Some converters store a normal token as raw UTF-8 instead of in the byte alphabet: respell it.
    vocab = {}
    for i, (t, ty) in enumerate(zip(tokens, types)):
        if ty in (NORMAL, UNUSED) and not set(t) <= alphabet:
            t = "".join(spelled[b] for b in t.encode("utf-8"))
        vocab.setdefault(t, i)
    merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges", [])]
    tok = HFTokenizer(models.BPE(vocab, merges, ignore_merges=pre in IGNORE_MERGES_PRES))
    if pre in SPLITS:
        tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(SPLITS[pre]), behavior="isolated"),
                                                     pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    else:  # "default", "gpt-2" and other GPT-2 style vocabularies: GPT-2's own regex
        steps = [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)]
        if pre in DIGIT_SPLIT_PRES:
            steps.insert(0, pre_tokenizers.Digits(individual_digits=True))
        tok.pre_tokenizer = pre_tokenizers.Sequence(steps)
    tok.decoder = decoders.ByteLevel()
    return tok


def _spm_from_gguf(tokens: list[str], types: list[int], meta: dict) -> HFTokenizer:
    """SentencePiece BPE as llama.cpp runs it: merge the best-scoring adjacent pair first; bytes as <0xNN>."""
    scores = meta.get("tokenizer.ggml.scores") or [-float(i) for i in range(len(tokens))]
    vocab = {}
    for i, t in enumerate(tokens):
        vocab.setdefault(t, i)
    mergeable = {t for t, ty in zip(tokens, types) if ty in (NORMAL, USER_DEFINED, UNUSED)}
    merges = []  # (score, left id, right id, left, right): every split of a token into two tokens
    for t, score in zip(tokens, scores):
        if t not in mergeable or len(t) < 2:
            continue
        for k in range(1, len(t)):
            left, right = t[:k], t[k:]
            if left in mergeable and right in mergeable:
                merges.append((-score, vocab[left], vocab[right], left, right))
    merges.sort()
    unk_id = meta.get("tokenizer.ggml.unknown_token_id", 0)
    tok = HFTokenizer(models.BPE(vocab, [(m[3], m[4]) for m in merges], unk_token=tokens[unk_id],
                                 fuse_unk=True, byte_fallback=True))
    prefix = bool(meta.get("tokenizer.ggml.add_space_prefix", True))
    # spaces as U+2581 and, with the prefix, one more in front of each run of text (the first, and each after a
    # special token, whatever it starts with): llama.cpp's rule, and SentencePiece's, as Llama 2's tokenizer.json
    # writes it; transformers' GGUF conversion (a Metaspace) adds none after a special token or before a space
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁")] * prefix + [normalizers.Replace(" ", "▁")])
    steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    tok.decoder = decoders.Sequence(steps + ([decoders.Strip(" ", 1, 0)] if prefix else []))
    return tok


class Tokenizer:
    """Text <-> token ids, the model's special ids, and its chat template."""

    def __init__(self, tok: HFTokenizer, bos_id: int | None, eos_ids: frozenset[int], add_bos: bool,
                 chat_template: str | None, bos_token: str = "", eos_token: str = ""):
        self.tok = tok
        self.bos_id = bos_id
        self.eos_ids = eos_ids
        self.add_bos = add_bos
        self.chat_template = chat_template
        self.bos_token, self.eos_token = bos_token, eos_token

    @classmethod
    def from_gguf_metadata(cls, meta: dict) -> Tokenizer:
        kind = meta.get("tokenizer.ggml.model")
        tokens = list(meta.get("tokenizer.ggml.tokens") or [])
        if not tokens:
            raise LocalpdError("the GGUF file has no tokenizer vocabulary")
        types = list(meta.get("tokenizer.ggml.token_type") or [NORMAL] * len(tokens))
        if kind == "gpt2":
            tok = _bpe_from_gguf(tokens, types, meta)
        elif kind == "llama":
            tok = _spm_from_gguf(tokens, types, meta)
        else:
            raise LocalpdError(f"unsupported GGUF tokenizer model '{kind}'; supported: gpt2 (BPE), llama (SentencePiece)")
        # Control tokens are special (skipped when decoding); user-defined ones (like <think>) are kept in the text.
        # Both are matched whole in the input text.
        tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                                for t, ty in zip(tokens, types) if ty == CONTROL])
        tok.add_tokens([AddedToken(t, special=False, normalized=False)
                        for t, ty in zip(tokens, types) if ty == USER_DEFINED])

        def token_id(key):
            i = meta.get(f"tokenizer.ggml.{key}")
            return int(i) if i is not None and 0 <= int(i) < len(tokens) else None

        bos, eos = token_id("bos_token_id"), token_id("eos_token_id")
        ends = {i for i, t in enumerate(tokens) if t in END_TOKENS and types[i] in (CONTROL, USER_DEFINED)}
        ends |= {i for i in (eos, token_id("eot_token_id"), token_id("eom_token_id")) if i is not None}
        add_bos = meta.get("tokenizer.ggml.add_bos_token", kind == "llama")
        return cls(tok, bos, frozenset(ends), bool(add_bos) and bos is not None, meta.get("tokenizer.chat_template"),
                   tokens[bos] if bos is not None else "", tokens[eos] if eos is not None else "")

    @classmethod
    def from_dir(cls, path: str | Path) -> Tokenizer:
        path = Path(path)
        if not (path / "tokenizer.json").exists():
            raise LocalpdError(f"{path} has no tokenizer.json")
        tok = HFTokenizer.from_file(str(path / "tokenizer.json"))
        cfg = _read_json(path / "tokenizer_config.json")
        gen = _read_json(path / "generation_config.json")

        def text_of(v):
            return v.get("content", "") if isinstance(v, dict) else (v or "")

        bos_t, eos_t = text_of(cfg.get("bos_token")), text_of(cfg.get("eos_token"))
        bos_id = tok.token_to_id(bos_t) if bos_t else None
        ends = {tok.token_to_id(t) for t in (eos_t, *END_TOKENS) if t}
        gen_eos = gen.get("eos_token_id")
        ends |= set(gen_eos if isinstance(gen_eos, list) else [gen_eos])
        ends.discard(None)
        add_bos = cfg.get("add_bos_token")
        if add_bos is None:  # no flag: does the tokenizer.json's post-processor put bos in front?
            add_bos = bos_id is not None and tok.encode("a", add_special_tokens=True).ids[:1] == [bos_id]
        template = cfg.get("chat_template")
        if isinstance(template, list):  # named templates: take the default one
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
        if template is None and (path / "chat_template.jinja").exists():
            template = (path / "chat_template.jinja").read_text()
        return cls(tok, bos_id, frozenset(ends), bool(add_bos) and bos_id is not None, template, bos_t, eos_t)

    @property
    def vocab_size(self) -> int:
        return self.tok.get_vocab_size()

    def id_to_token(self, i: int) -> str | None:
        return self.tok.id_to_token(i)

    def token_bytes(self, i: int) -> bytes | None:
        """The bytes token i stands for, where its vocabulary spells them out (GPT-2's byte alphabet,
        SentencePiece's <0xNN> byte tokens and its pieces); None where it does not (a special token)."""
        piece = self.tok.id_to_token(i)
        if piece is None:
            return None
        if m := re.fullmatch(r"<0x([0-9A-Fa-f]{2})>", piece):
            return bytes([int(m[1], 16)])
        if type(self.tok.decoder).__name__ != "ByteLevel":
            return piece.replace("\u2581", " ").encode()
        try:
            return bytes(UNSPELLED[c] for c in piece)
        except KeyError:
            return None

    def encode(self, text: str, add_bos: bool | None = None) -> list[int]:
        ids = self.tok.encode(text, add_special_tokens=False).ids
        if (self.add_bos if add_bos is None else add_bos) and self.bos_id is not None:
            ids = [self.bos_id] + ids
        return ids

    def decode(self, ids: list[int], skip_special: bool = True) -> str:
        return self.tok.decode(list(ids), skip_special_tokens=skip_special)

    @property
    def fim_ids(self) -> tuple[int, int, int] | None:
        """The model's fill-in-the-middle tokens (prefix, suffix, middle), or None for a model without them."""
        for spelling in FIM_TOKENS:
            ids = tuple(self.tok.token_to_id(t) for t in spelling)
            if None not in ids:
                return ids
        return None

    @property
    def fim_end_ids(self) -> set[int]:
        """Tokens beside eos that end an infill (Code Llama's <EOT>, Qwen2.5-Coder's <|fim_pad|>)."""
        return {i for t in FIM_ENDS if (i := self.tok.token_to_id(t)) is not None}

    def fim_prompt(self, prefix: str, suffix: str) -> list[int]:
        """The tokens that ask a code model for what goes between prefix and suffix (prefix, suffix, middle order,
        as llama.cpp's server builds it; bos first where the model takes one)."""
        if self.fim_ids is None:
            raise LocalpdError("this model has no fill-in-the-middle tokens (a code model such as Qwen2.5-Coder has "
                               "them); send the prompt without a suffix", param="suffix")
        pre, suf, mid = self.fim_ids
        bos = [self.bos_id] if self.add_bos and self.bos_id is not None else []
        return bos + [pre] + self.encode(prefix, add_bos=False) + [suf] + self.encode(suffix, add_bos=False) + [mid]

    def render_chat(self, messages: list[dict], add_generation_prompt: bool = True, tools: list[dict] | None = None,
                    **template_vars) -> str:
        """The prompt text of a conversation; tools: functions the model may call (localpd.constrain.tools);
        template_vars (enable_thinking=False, ...) go to the model's template, which may or may not read them."""
        check_template_vars(template_vars)
        messages, tool_vars = template_messages(messages, tools, self.chat_template)
        if not self.chat_template:  # no template in the model: plain ChatML
            text = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)
            return text + ("<|im_start|>assistant\n" if add_generation_prompt else "")
        return render(self.chat_template, messages, add_generation_prompt, self.bos_token, self.eos_token,
                      **tool_vars, **template_vars)


def _read_json(path: Path) -> dict:
    return json.loads(path.read_text()) if path.exists() else {}


class IncrementalDetokenizer:
    """Turns a stream of token ids into text deltas that never end inside a UTF-8 sequence.

    It decodes a short window of earlier tokens together with the new ones and emits what was added, so that
    tokenizers whose pieces depend on their neighbours (SentencePiece's leading space) come out right:
    ids[prefix:read] is the window whose text is already out, ids[read:] is not out yet."""

    def __init__(self, tokenizer: Tokenizer, skip_special: bool = True):
        self.tokenizer = tokenizer
        self.skip_special = skip_special
        self.ids: list[int] = []
        self.prefix = 0
        self.read = 0

    def _decode(self, start: int, end: int) -> str:
        return self.tokenizer.decode(self.ids[start:end], self.skip_special)

    def push(self, token_id: int) -> str:
        self.ids.append(token_id)
        done = self._decode(self.prefix, self.read)
        text = self._decode(self.prefix, len(self.ids))
        if text.endswith("\ufffd") or len(text) <= len(done):
            return ""  # an incomplete UTF-8 sequence (or nothing visible yet): wait for more
        self.prefix, self.read = self.read, len(self.ids)
        return text[len(done):]

    def flush(self) -> str:
        done = self._decode(self.prefix, self.read)
        text = self._decode(self.prefix, len(self.ids))
        self.prefix = self.read = len(self.ids)
        return text[len(done):]


def code_range(pending: bytes) -> tuple[int, int]:
    """The code points a character whose UTF-8 starts with `pending` (a lead byte and maybe continuations) may be."""
    n = 2 + (pending[0] >= 0xE0) + (pending[0] >= 0xF0)
    value = pending[0] & (0x7F >> n)
    for b in pending[1:]:
        value = value << 6 | b & 0x3F
    free = 6 * (n - len(pending))
    shortest = {2: 0x80, 3: 0x800, 4: 0x10000}[n]  # fewer would be an overlong encoding, which is not UTF-8
    return max(value << free, shortest), min((value << free) | ((1 << free) - 1), 0x10FFFF)


class TokenText:
    """A reply's text token by token, for constraints that judge each candidate token by the characters it adds.
    A candidate is decoded after the last WINDOW tokens, so pieces that depend on their neighbours come out right.
    Where the vocabulary spells out its tokens' bytes, a token that would make them invalid UTF-8 (a stray
    continuation byte, a character cut short) adds nothing, and a constraint refuses it: byte tokens cannot run on
    as replacement characters."""

    WINDOW = 4

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.tail = ""  # decode(ids[-WINDOW:]) less any incomplete character
        self.pending = b""  # the bytes of an incomplete character at the end

    def added(self, token: int) -> tuple[str, tuple[int, int] | None]:
        """The whole characters `token` would add, and if it would leave bytes of one more pending, the range of
        code points they may still become."""
        whole, pending, _ = self._read(token)
        return whole, pending

    def _read(self, token: int) -> tuple[str, tuple[int, int] | None, bytes]:
        """added(token), and the bytes of the incomplete character it would leave (b"" for none)."""
        text = self.tokenizer.decode(self.ids[-self.WINDOW:] + [token])
        if not text.startswith(self.tail):
            return "", None, b""
        added = text[len(self.tail):]
        if not (self.pending or "\ufffd" in added):
            return added, None, b""
        after = self._pending_after(token)
        if after is None:  # not UTF-8: it adds nothing a constraint takes
            return "", None, b""
        if after:  # the pending bytes decode as replacement characters (one, or one a byte)
            return added.rstrip("\ufffd"), code_range(after), after
        if self.tokenizer.token_bytes(token) is None:  # bytes unknown: as the text shows it
            whole = added.rstrip("\ufffd")
            return whole, (0x80, 0x10FFFF) if whole != added else None, b""
        return added, None, b""  # complete (a replacement character written as such included)

    def _pending_after(self, token: int) -> bytes | None:
        """The incomplete character's bytes after token (b"" for none), or None if its bytes are not UTF-8 (or
        unknown: a special token after bytes of a character)."""
        raw = self.tokenizer.token_bytes(token)
        if raw is None:
            return None if self.pending else b""
        decoder = codecs.getincrementaldecoder("utf-8")("strict")
        try:
            decoder.decode(self.pending + raw)
        except UnicodeDecodeError:
            return None
        return decoder.getstate()[0]

    def push(self, token: int) -> str:
        """Take `token` as the reply's next; the whole characters it added."""
        whole, _, self.pending = self._read(token)
        self.ids.append(token)
        self.tail = self.tokenizer.decode(self.ids[-self.WINDOW:]).rstrip("\ufffd")
        return whole
