"""Tokenizer, chat template and detokenizer on the real vocabulary, against transformers."""

import pytest

from localpd.chat_template import render
from localpd.errors import LocalpdError
from localpd.loader import GGUFFile
from localpd.tokenizer import IncrementalDetokenizer, Tokenizer

TEXTS = [
    "Hello, world!",
    "def f(x):\n\treturn x ** 2  # square\n\n\nprint(f(3))",
    "Numbers: 12345 3.14159 -42 1,000,000",
    "Emoji 🙂🚀 and CJK 你好世界 and accents: café naïve Zürich",
    "  multiple   spaces\n\n\nand newlines  ",
    "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n",
    "",
    "don't won't I'm they're we've",
]

CHATS = [
    [{"role": "user", "content": "Hi"}],
    [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "What is 2+2?"}],
    [{"role": "user", "content": "Name a fruit."}, {"role": "assistant", "content": "Apple."},
     {"role": "user", "content": "Another one?"}],
]


@pytest.fixture(scope="module")
def tok(default_gguf):
    return Tokenizer.from_gguf_metadata(GGUFFile.open(default_gguf).metadata)


@pytest.fixture(scope="module")
def hf_tok(default_gguf):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(default_gguf.parent, gguf_file=default_gguf.name)


@pytest.mark.parametrize("text", TEXTS)
def test_encode_matches_transformers_and_round_trips(tok, hf_tok, text):
    ids = tok.encode(text)
    assert ids == hf_tok(text, add_special_tokens=False).input_ids
    assert tok.decode(ids, skip_special=False) == text


def test_special_tokens(tok):
    assert tok.bos_id == 1 and 2 in tok.eos_ids
    im_end = tok.encode("<|im_end|>")
    assert len(im_end) == 1 and im_end[0] in tok.eos_ids
    assert tok.decode(tok.encode("<|im_start|>user"), skip_special=True) == "user"
    assert tok.vocab_size == 49152


@pytest.mark.parametrize("messages", CHATS)
@pytest.mark.parametrize("gen", [True, False])
def test_chat_template_matches_transformers(tok, hf_tok, messages, gen):
    assert tok.render_chat(messages, add_generation_prompt=gen) == hf_tok.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=gen)


def test_incremental_detokenizer_never_splits_utf8(tok):
    text = "Emoji 🙂🚀, CJK 你好世界, café — and ₿ symbols ✓"
    ids = tok.encode(text)
    detok = IncrementalDetokenizer(tok)
    deltas = [detok.push(i) for i in ids] + [detok.flush()]
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == tok.decode(ids)
    assert any(d == "" for d in deltas)  # multi-byte characters span several tokens here


def test_sandbox_blocks_python_internals():
    evil = "{{ ''.__class__.__mro__[1].__subclasses__() }}"
    with pytest.raises(LocalpdError):
        render(evil, [])


def test_raise_exception_and_syntax_errors_are_clear():
    with pytest.raises(LocalpdError, match="roles must alternate"):
        render("{{ raise_exception('roles must alternate') }}", [])
    with pytest.raises(LocalpdError, match="chat template error"):
        render("{% for %}", [])


def test_tojson_keeps_unicode():
    assert render("{{ messages | tojson }}", [{"content": "é"}]) == '[{"content": "é"}]'


def test_sentencepiece_vocabulary_with_byte_fallback():
    pieces = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + ["▁hello", "▁world", "▁", "h", "e"]
    types = [2, 3, 3] + [6] * 256 + [1] * 5
    scores = [0.0] * 259 + [-1.0, -1.0, -3.0, -5.0, -5.0]
    tok = Tokenizer.from_gguf_metadata({
        "tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": pieces, "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.scores": scores, "tokenizer.ggml.bos_token_id": 1, "tokenizer.ggml.eos_token_id": 2,
        "tokenizer.ggml.unknown_token_id": 0,
    })
    ids = tok.encode("hello world")
    assert ids[0] == 1 and ids[1:] == [pieces.index("▁hello"), pieces.index("▁world")]  # bos added by default
    assert tok.decode(ids) == "hello world"
    ids = tok.encode("hello é", add_bos=False)  # é is not in the vocabulary: two byte tokens
    assert pieces.index("<0xC3>") in ids and pieces.index("<0xA9>") in ids
    assert tok.decode(ids) == "hello é"
