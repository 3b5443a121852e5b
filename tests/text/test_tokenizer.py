"""Tokenizer, chat template and detokenizer on the real vocabulary, against transformers."""

import json

import gguf
import pytest

from localpd.text.chat_template import render
from localpd.errors import LocalpdError
from localpd.text.tokenizer import IncrementalDetokenizer, Tokenizer

TEXTS = [
    "Hello, world!",
    "def f(x):\n\treturn x ** 2  # square\n\n\nclass A:\n    def g(self):\n        pass\n",
    "Numbers: 12345 3.14159 -42 1,000,000 0x1F",
    "Emoji 🙂🚀👩‍💻 and CJK 你好世界 こんにちは 안녕하세요",
    "Accents: café naïve Zürich Ångström São Paulo",
    "  multiple   spaces\n\n\nand newlines  \t\t tabs ",
    "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n",
    "text<|endoftext|>more",
    "",
    " ",
    "don't won't I'm they're we've",
]

CHATS = [
    [{"role": "user", "content": "Hi"}],
    [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "What is 2+2?"}],
    [{"role": "user", "content": "Name a fruit."}, {"role": "assistant", "content": "Apple."},
     {"role": "user", "content": "Another one? 🍐"}],
]


@pytest.fixture(scope="session")
def meta(default_gguf):
    return {k: f.contents() for k, f in gguf.GGUFReader(default_gguf).fields.items()}


@pytest.fixture(scope="session")
def tok(meta):
    return Tokenizer.from_gguf_metadata(meta)


@pytest.fixture(scope="session")
def hf_tok(default_gguf):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(default_gguf.parent, gguf_file=default_gguf.name)


@pytest.mark.parametrize("text", TEXTS)
def test_encode_matches_transformers_and_round_trips(tok, hf_tok, text):
    ids = tok.encode(text)
    assert ids == hf_tok(text, add_special_tokens=False).input_ids
    assert tok.decode(ids, skip_special=False) == text
    assert tok.decode(ids) == hf_tok.decode(ids, skip_special_tokens=True)


def test_special_tokens(tok):
    assert tok.bos_id == 1 and 2 in tok.eos_ids and not tok.add_bos
    im_end = tok.encode("<|im_end|>")
    assert len(im_end) == 1 and im_end[0] in tok.eos_ids
    assert tok.encode("<|im_start|>") == [1] and tok.encode("hi", add_bos=True)[0] == 1
    assert tok.decode(tok.encode("<|im_start|>user"), skip_special=True) == "user"
    assert tok.vocab_size == 49152 and tok.id_to_token(2) == "<|im_end|>"


@pytest.mark.parametrize("pre", ["qwen2", "llama-bpe", "gpt-2"])
def test_split_regex_per_pre_tokenizer_matches_transformers(meta, pre):
    """The same vocabulary under other pre-tokenizer names: each one's split regex, as transformers builds it."""
    from transformers.integrations.gguf.gguf_tokenizer_mapping import (
        convert_gguf_tokenizer,
    )

    ours = Tokenizer.from_gguf_metadata({**meta, "tokenizer.ggml.pre": pre})
    ref, _ = convert_gguf_tokenizer("llama", {
        "tokenizer_type": "gpt2", "pre_tokenizer_type": pre, "tokens": meta["tokenizer.ggml.tokens"],
        "merges": meta["tokenizer.ggml.merges"], "token_type": meta["tokenizer.ggml.token_type"]})
    for text in TEXTS + ["I'M HERE's  \r\n x 123456789 (foo)...!!\n"]:
        assert ours.encode(text) == ref.encode(text, add_special_tokens=False).ids, text


@pytest.mark.parametrize("messages", CHATS)
@pytest.mark.parametrize("gen", [True, False])
def test_chat_template_matches_transformers(tok, hf_tok, messages, gen):
    assert tok.render_chat(messages, add_generation_prompt=gen) == hf_tok.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=gen)


def test_chatml_fallback_without_template(meta):
    tok = Tokenizer.from_gguf_metadata({k: v for k, v in meta.items() if k != "tokenizer.chat_template"})
    assert tok.chat_template is None
    assert tok.render_chat([{"role": "user", "content": "Hi"}]) == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"


def test_from_dir_matches_gguf(tok, hf_tok, tmp_path):
    hf_tok.save_pretrained(tmp_path)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0]}))
    d = Tokenizer.from_dir(tmp_path)
    for text in TEXTS:
        assert d.encode(text) == tok.encode(text)
    assert d.bos_id == 1 and {0, 2} <= d.eos_ids and not d.add_bos
    assert d.render_chat(CHATS[1]) == tok.render_chat(CHATS[1])
    with pytest.raises(LocalpdError):
        Tokenizer.from_dir(tmp_path / "missing")


@pytest.mark.parametrize("text", [
    "Emoji 🙂🚀👩‍💻, CJK 你好世界, café — and ₿ symbols ✓ done",
    "<|im_start|>assistant\n日本語のテキスト🎉<|im_end|>",
])
def test_incremental_detokenizer_never_splits_utf8(tok, text):
    ids = tok.encode(text)
    detok = IncrementalDetokenizer(tok)
    deltas = [detok.push(i) for i in ids] + [detok.flush()]
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == tok.decode(ids)
    assert any(d == "" for d in deltas[:-1])  # multi-byte characters span several tokens here
    detok = IncrementalDetokenizer(tok, skip_special=False)
    assert "".join([detok.push(i) for i in ids] + [detok.flush()]) == tok.decode(ids, skip_special=False)


def test_incremental_detokenizer_flush_emits_held_bytes(tok):
    ids = tok.encode("🙂")
    assert len(ids) > 1
    detok = IncrementalDetokenizer(tok)
    assert detok.push(ids[0]) == ""
    assert detok.flush() == tok.decode(ids[:1])  # the stream ended mid-character: out it goes, as decode() has it


@pytest.mark.parametrize("evil", [
    "{{ ''.__class__.__mro__[1].__subclasses__() }}",
    "{{ messages.__class__.__init__.__globals__ }}",
    "{% set x = messages.append(1) %}{{ x }}",
    "{{ cycler.__init__.__globals__.os.popen('echo pwned').read() }}",
])
def test_sandbox_blocks_python_internals(evil):
    with pytest.raises(LocalpdError, match="chat template error"):
        render(evil, [{"role": "user", "content": "x"}], True, "", "")


def test_raise_exception_and_syntax_errors_are_clear():
    with pytest.raises(LocalpdError, match="roles must alternate"):
        render("{{ raise_exception('roles must alternate') }}", [], True, "", "")
    with pytest.raises(LocalpdError, match="chat template error"):
        render("{% for %}", [], True, "", "")
    with pytest.raises(LocalpdError, match="chat template error"):
        render("{{ messages[0]['content'] }}", [], True, "", "")


def test_template_helpers():
    msgs = [{"role": "user", "content": "é"}]
    assert render("{{ messages | tojson }}", msgs, True, "", "") == '[{"role": "user", "content": "é"}]'
    assert render("{{ messages[0] | tojson(indent=2) }}", msgs, True, "", "") == json.dumps(
        msgs[0], indent=2, ensure_ascii=False)
    assert render("{{ strftime_now('%Y') | length }}", [], True, "", "") == "4"
    text = "{% for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}{{ m.content }}{% endfor %}"
    assert render(text, [{"content": "a"}, {"content": "b"}], True, "", "") == "a"
    assert render("{% generation %}{{ bos_token }}x{% endgeneration %}", [], True, "<s>", "") == "<s>x"
    assert render("{{ extra }}", [], True, "", "", extra="y") == "y"


def _tiny_spm(**over):
    # pieces in merge order (best score first), then the single characters
    words = ["ll", "▁h", "▁he", "llo", "▁hello", "▁w", "▁wo", "▁wor", "ld", "▁world", "▁", "h", "e", "l", "o", "w",
             "r", "d"]
    pieces = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + words
    meta = {
        "tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": pieces,
        "tokenizer.ggml.token_type": [2, 3, 3] + [6] * 256 + [1] * len(words),
        "tokenizer.ggml.scores": [0.0] * 259 + [-float(i) for i in range(len(words))],
        "tokenizer.ggml.bos_token_id": 1, "tokenizer.ggml.eos_token_id": 2, "tokenizer.ggml.unknown_token_id": 0,
    }
    return pieces, Tokenizer.from_gguf_metadata({**meta, **over})


def test_sentencepiece_vocabulary_with_byte_fallback():
    pieces, tok = _tiny_spm()
    ids = tok.encode("hello world")
    assert ids == [1, pieces.index("▁hello"), pieces.index("▁world")]  # bos added by default, space prefix
    assert tok.decode(ids) == "hello world" and tok.eos_ids == {2}
    ids = tok.encode("hello é", add_bos=False)  # é is not in the vocabulary: its two UTF-8 bytes as tokens
    assert ids == [pieces.index("▁hello"), pieces.index("▁"), pieces.index("<0xC3>"), pieces.index("<0xA9>")]
    assert tok.decode(ids) == "hello é"
    ids = tok.encode("</s>hello", add_bos=False)  # the space prefix after a special token too, as llama.cpp's
    assert ids == [2, pieces.index("▁hello")] and tok.decode(ids) == "hello"
    detok = IncrementalDetokenizer(tok)  # SentencePiece's leading spaces survive token-by-token decoding
    ids = tok.encode("hello world hello é world")
    assert "".join([detok.push(i) for i in ids] + [detok.flush()]) == tok.decode(ids) == "hello world hello é world"


def test_sentencepiece_matches_transformers_gguf_conversion_and_llama_cpps_space_prefix():
    """transformers' conversion of the vocabulary gives the same ids, except where llama.cpp (and SentencePiece, and
    Llama 2's own tokenizer.json) add the space prefix and transformers' Metaspace does not: before text that starts
    with a space, and after a special token (llama.cpp's tokenizer is held to the same rule on an exported
    vocabulary in tests/export/test_gguf_export.py)."""
    from transformers.integrations.gguf.gguf_tokenizer_mapping import (
        convert_gguf_tokenizer,
    )

    pieces, tok = _tiny_spm()
    scores = [0.0] * 259 + [-float(i) for i in range(len(pieces) - 259)]
    ref, _ = convert_gguf_tokenizer("llama", {"tokenizer_type": "llama", "tokens": pieces, "scores": scores,
                                              "token_type": [2, 3, 3] + [6] * 256 + [1] * (len(pieces) - 259)})
    for text in ["hello world", "helloworld", "héllo wörld", "dd ll oo", "x"]:
        assert tok.encode(text, add_bos=False) == ref.encode(text, add_special_tokens=False).ids, text
    for text, want in (("  hello  ", ["▁", "▁", "▁hello", "▁", "▁"]),
                       ("</s>hello <s> world", ["</s>", "▁hello", "▁", "<s>", "▁", "▁world"])):
        assert [pieces[i] for i in tok.encode(text, add_bos=False)] == want, text


def test_sentencepiece_without_space_prefix():
    pieces, tok = _tiny_spm(**{"tokenizer.ggml.add_space_prefix": False, "tokenizer.ggml.add_bos_token": False})
    ids = tok.encode("hello world")
    assert ids[0] != pieces.index("▁hello") and pieces.index("▁world") in ids and tok.decode(ids) == "hello world"


def test_unsupported_vocabulary_is_a_clear_error():
    with pytest.raises(LocalpdError, match="unsupported"):
        Tokenizer.from_gguf_metadata({"tokenizer.ggml.model": "rwkv", "tokenizer.ggml.tokens": ["a"]})
    with pytest.raises(LocalpdError, match="no tokenizer"):
        Tokenizer.from_gguf_metadata({})


@pytest.mark.parametrize("vocab", ["gpt2 bytes", "sentencepiece"])
def test_token_text_follows_the_bytes_of_a_character_and_refuses_what_is_not_utf8(tok, vocab):
    """A token that ends inside a character adds nothing yet and says which code points it may still become; one
    that would make the bytes invalid UTF-8 (a stray continuation, a character cut short) adds nothing at all."""
    from localpd.text.tokenizer import TokenText

    if vocab == "sentencepiece":
        pieces, tok = _tiny_spm()
        byte = {b: pieces.index(f"<0x{b:02X}>") for b in range(256)}
    else:
        byte = {b: i for i in range(tok.vocab_size) if (raw := tok.token_bytes(i)) and len(raw) == 1
                for b in raw}
    assert tok.token_bytes(byte[0xF0]) == b"\xf0"
    text = TokenText(tok)
    assert text.added(byte[0x98]) == ("", None)  # a continuation byte with nothing to continue
    steps = [(0xF0, (0x10000, 0x3FFFF)), (0x9F, (0x1F000, 0x1FFFF)), (0x8D, (0x1F340, 0x1F37F))]
    for b, span in steps:  # 🍵 is F0 9F 8D B5
        assert text.added(byte[b]) == ("", span)
        text.push(byte[b])
    assert text.added(byte[0x41]) == ("", None)  # "A" would cut the character short
    assert text.push(byte[0xB5]) == "🍵" and text.pending == b""


@pytest.mark.parametrize("spelling", [("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"),
                                      ("▁<PRE>", "▁<SUF>", "▁<MID>")])
def test_fill_in_the_middle_prompt_with_the_models_own_tokens(meta, spelling):
    """A code model's FIM tokens (Qwen2.5-Coder's, Code Llama's) found in its vocabulary: prefix token, the
    prefix, suffix token, the suffix, middle token; a model without them (SmolLM2) is a clear error."""
    from tokenizers import AddedToken

    plain = Tokenizer.from_gguf_metadata(meta)
    assert plain.fim_ids is None
    with pytest.raises(LocalpdError, match="no fill-in-the-middle tokens"):
        plain.fim_prompt("def f():", "\n")
    coder = Tokenizer.from_gguf_metadata(meta)
    coder.tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in (*spelling, "<|fim_pad|>")])
    pre, suf, mid = (coder.tok.token_to_id(t) for t in spelling)
    assert coder.fim_ids == (pre, suf, mid) and coder.fim_end_ids == {coder.tok.token_to_id("<|fim_pad|>")}
    prefix, suffix = "def add(a, b):\n    return ", "\n\nprint(add(1, 2))\n"
    assert coder.fim_prompt(prefix, suffix) == [pre, *plain.encode(prefix), suf, *plain.encode(suffix), mid]
