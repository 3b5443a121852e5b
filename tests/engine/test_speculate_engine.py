"""Speculative decoding on the real default model, on the CPU's kernels: replies identical to plain decoding
(greedy and seeded sampling), with concurrent requests, stop strings, JSON mode and logprobs, and no page left
behind."""

import pytest

from localpd.engine import Engine
from localpd.engine.sampling import SamplingParams
from localpd.engine.speculate import MAX_DRAFT, SpeculateConfig
from localpd.errors import LocalpdError

TEXT = ("The old lighthouse stood at the edge of the harbour for more than two hundred years. Every evening the "
        "keeper climbed the narrow stairs, trimmed the wick and polished the great lens until it shone. Ships coming "
        "home from the north sea looked for its light long before they could see the coast, and the fishermen of the "
        "village said that as long as the lamp burned, no boat would be lost on the rocks below.")
CODE = "def area(width, height):\n    return width * height\n\n\ndef perimeter(width, height):\n    return 2 * (width + height)\n"
PROMPTS = [
    [{"role": "user", "content": f"Repeat this text exactly:\n\n{TEXT}"}],
    [{"role": "user", "content": f"Rename width to w and height to h in this code:\n\n{CODE}"}],
    [{"role": "user", "content": "Write a short story about a cat who learns to fly."}],
    [{"role": "user", "content": "List the days of the week, then list them again in reverse order."}],
]
# a verification step's rows take the multi-row products and attention, whose sums run in another order than a
# one-row step's (as when batch composition changes, tests/engine/test_engine.py); through 30 layers that moved a
# logprob by up to 2e-3 over these prompts with float16 pages
LOGPROB_ATOL = 1e-2
ALWAYS = SpeculateConfig("ngram", 8, adaptive=False)  # drafts wherever the text has a match: verification runs


@pytest.fixture(scope="module")
def kv_engine(default_gguf):
    """The CPU's default: its kernels with float16 pages."""
    engine = Engine(default_gguf, device="cpu", max_context=2048, kv="fp16")
    yield engine
    engine.close()


@pytest.fixture(scope="module", params=["fp32", "int8/int4", "int8", "int4ch/int4"])
def other_engine(request, default_gguf):
    """Float32 pages, quantized formats of per-token scales (a token's codes never change once written), and int4ch
    keys (a page's codes rounded again at each write while it is open, from its staged values)."""
    engine = Engine(default_gguf, device="cpu", max_context=2048, kv=request.param)
    yield engine
    engine.close()


def reply(engine, messages, params, speculate=None):
    engine.set_speculate(speculate or SpeculateConfig())  # between requests: the engine is idle
    handle = engine.submit(engine.encode_chat(messages), params)
    events = list(handle)
    return events, handle.stats


def tokens(events):
    return [e.token_id for e in events if e.token_id is not None]


def idle(engine):
    s = engine.stats()
    engine.pages.check()
    return s.running == 0 and s.waiting == 0 and s.kv_pages_used == 0


def test_greedy_replies_are_plain_decodings_token_for_token(kv_engine):
    """Over float16 pages (the default) every prompt."""
    greedy_equality(kv_engine)


def test_greedy_replies_over_other_pages_are_plain_decodings(other_engine):
    """Over float32 pages, per-token int8/int4 ones (each verification row's attention computed as a decode row's:
    kvcache.dispatch.ROWS_AS_DECODE) and int4ch keys (each row's open page rounded as its decode step rounded it,
    no draft filling a page) every prompt, drafting wherever the text has a match."""
    assert other_engine.drafts_allowed
    greedy_equality(other_engine)


def greedy_equality(engine):
    params = SamplingParams(temperature=0, max_tokens=32, logprobs=2)
    accepted = 0
    for messages in PROMPTS:
        # the prompt's pages in the prefix cache for both replies: a prompt's last page recomputed after a cache
        # hit sums in another order than the whole prompt's prefill (over int8 pages its logprobs moved by 0.1)
        reply(engine, messages, SamplingParams(temperature=0, max_tokens=1))
        plain, _ = reply(engine, messages, params)
        spec, stats = reply(engine, messages, params, ALWAYS)
        assert tokens(spec) == tokens(plain)
        assert "".join(e.text for e in spec) == "".join(e.text for e in plain)
        for a, b in zip(spec, plain):
            if a.token_id is not None:
                assert abs(a.logprob - b.logprob) < LOGPROB_ATOL
                assert [t for t, _ in a.top_logprobs] == [t for t, _ in b.top_logprobs]
        accepted += stats.accepted_tokens
        assert stats.accepted_tokens <= stats.drafted_tokens
    assert accepted > 5  # the repeated text (and the code) were drafted and confirmed
    assert idle(engine)


def test_speculation_writes_several_tokens_a_step_on_a_repeated_text(kv_engine):
    params = SamplingParams(temperature=0, max_tokens=64)
    _, stats = reply(kv_engine, PROMPTS[0], params, ALWAYS)
    assert stats.acceptance > 0.5
    assert stats.tokens_per_pass > 1.5
    assert stats.decode_steps < stats.output_tokens - 1


def test_a_requests_draft_tokens_bound_its_drafts(kv_engine):
    """SamplingParams.draft_tokens (the APIs' speculative.n_max): at most that many drafted tokens a step, 0 none,
    the reply plain decoding's either way."""
    params = SamplingParams(temperature=0, max_tokens=48)
    plain, _ = reply(kv_engine, PROMPTS[0], params)
    for bound in (2, 0):
        bounded = SamplingParams(temperature=0, max_tokens=48, draft_tokens=bound)
        spec, stats = reply(kv_engine, PROMPTS[0], bounded, ALWAYS)
        assert tokens(spec) == tokens(plain)
        assert stats.drafted_tokens <= bound * stats.decode_steps
        assert (stats.accepted_tokens > 5) == (bound > 0)
    with pytest.raises(LocalpdError, match="draft_tokens"):
        SamplingParams(draft_tokens=MAX_DRAFT + 1).validate()


@pytest.mark.parametrize("params", [SamplingParams(temperature=0.8, seed=7, max_tokens=32),
                                    SamplingParams(temperature=1.0, top_k=20, top_p=0.9, repetition_penalty=1.1,
                                                   seed=3, max_tokens=32)])
def test_seeded_samples_are_plain_decodings_samples(kv_engine, params):
    """Each written token is one draw from its row's distribution, as in plain decoding: a seed gives the same
    reply with and without speculation (the rejection scheme keeps the target's distribution exactly)."""
    plain, _ = reply(kv_engine, PROMPTS[0], params)
    spec, stats = reply(kv_engine, PROMPTS[0], params, ALWAYS)
    assert tokens(spec) == tokens(plain) and stats.drafted_tokens
    assert idle(kv_engine)


def test_concurrent_requests_with_and_without_drafts_match_their_plain_replies(kv_engine):
    params = SamplingParams(temperature=0, max_tokens=32)
    expected = [tokens(reply(kv_engine, m, params)[0]) for m in PROMPTS]
    kv_engine.set_speculate(ALWAYS)
    handles = [kv_engine.submit(kv_engine.encode_chat(m), params) for m in PROMPTS]  # all in the engine's batch
    assert [tokens(list(h)) for h in handles] == expected  # a handle keeps its events until read
    assert idle(kv_engine)


def test_stop_strings_json_mode_and_budgets_end_a_reply_where_plain_decoding_does(kv_engine):
    cases = [
        (PROMPTS[0], SamplingParams(temperature=0, max_tokens=60, stop=["north sea"])),
        (PROMPTS[0], SamplingParams(temperature=0, max_tokens=13)),
        ([{"role": "user", "content": f"Give a JSON object with the keys title and text for: {TEXT}"}],
         SamplingParams(temperature=0, max_tokens=60, json_object=True)),
    ]
    for messages, params in cases:
        plain, _ = reply(kv_engine, messages, params)
        spec, _ = reply(kv_engine, messages, params, ALWAYS)
        assert tokens(spec) == tokens(plain)
        assert "".join(e.text for e in spec) == "".join(e.text for e in plain)
        assert spec[-1].finish_reason == plain[-1].finish_reason
    assert idle(kv_engine)


def test_a_later_turn_finds_the_speculated_reply_in_the_prefix_cache(kv_engine, default_gguf):
    params = SamplingParams(temperature=0, max_tokens=32)
    first, _ = reply(kv_engine, PROMPTS[0], params, ALWAYS)
    turn = PROMPTS[0] + [{"role": "assistant", "content": "".join(e.text for e in first)},
                         {"role": "user", "content": "Now say it shorter."}]
    warm, stats = reply(kv_engine, turn, params, ALWAYS)
    assert stats.cached_tokens >= len(kv_engine.encode_chat(PROMPTS[0])) // 16 * 16
    cold_engine = Engine(default_gguf, device="cpu", max_context=2048, kv=kv_engine.kv_dtype)
    cold, cold_stats = reply(cold_engine, turn, params)
    cold_engine.close()
    assert cold_stats.cached_tokens == 0
    assert tokens(warm) == tokens(cold)
    assert idle(kv_engine)


def test_a_draft_is_cut_where_the_json_grammar_refuses_a_token(kv_engine):
    from localpd.constrain.grammar import GrammarConstraint, Vocabulary, json_grammar
    from localpd.engine.speculate import allowed_prefix

    tok = kv_engine.tokenizer
    eos = set(tok.eos_ids)
    constraint = GrammarConstraint(Vocabulary(tok, kv_engine.config.vocab_size, eos), json_grammar(None), eos)
    whole = tok.encode('{"a": 1, "b": [2, 3]}', add_bos=False)
    assert allowed_prefix(constraint, whole + tok.encode(" and more", add_bos=False)) == len(whole)
    assert allowed_prefix(constraint, tok.encode("hello", add_bos=False)) == 0
    constraint.advance(whole[0])  # checking did not advance it; advancing does
    assert allowed_prefix(constraint, whole[1:]) == len(whole) - 1


def test_a_verification_laid_out_as_decode_rows_computes_plain_decodings_logits(kv_engine):
    """A CUDA graph replays a verification as decode rows (ModelRunner._decode_inputs: each drafted row a sequence
    of its own over the same pages, its length its position + 1; the step writes every row's key and value before
    any row attends, so row i sees the drafted rows before it and none after). Those rows give the logits of plain
    decoding's one-row steps, up to the multi-row products' order of sums (LOGPROB_ATOL)."""
    from types import SimpleNamespace

    import torch

    from localpd.engine.runner import ModelRunner, batch_of
    from localpd.engine.scheduler import Work
    from localpd.kvcache.formats import new_kv_pool
    from localpd.model.transformer import Batch

    model, c, ps = kv_engine.model, kv_engine.config, kv_engine.kv.page_size
    prompt = kv_engine.encode_chat(PROMPTS[0])
    n, draft = len(prompt) - 1, [prompt[5], prompt[9], prompt[2], prompt[7]]  # the prompt's last token verifies 4
    pages = list(range(-(-(n + 1 + len(draft)) // ps)))
    kv = new_kv_pool("fp16", c.n_layers, len(pages), ps, c.n_kv_heads, c.head_dim, torch.float32, "cpu")
    with torch.inference_mode():
        model.forward(Batch.single(prompt[:n], 0, len(pages), ps, "cpu"), kv)
        want = []
        for i, token in enumerate([prompt[n]] + draft):  # plain decoding: one row a step
            step = Batch.single([token], n + i, len(pages), ps, "cpu")
            step.stage_slots = None
            want.append(model.forward(step, kv)[0].clone())
        seq = SimpleNamespace(prompt=prompt, output=[], table=SimpleNamespace(pages=pages), stage_row=0)
        work = Work(seq, n, 1 + len(draft), True, draft)
        tokens, positions, slots, _, tables, lens = ModelRunner._decode_inputs(SimpleNamespace(kv=kv), [work])
        assert tokens == [prompt[n]] + draft and lens == list(range(n + 1, n + 2 + len(draft)))
        rows = list(range(len(tokens)))
        got = model.forward(batch_of(tokens, positions, slots, tables, lens, rows + [len(rows)], rows, "cpu"), kv)
    want = torch.stack(want)
    assert torch.equal(got.argmax(-1), want.argmax(-1))
    assert (got.log_softmax(-1) - want.log_softmax(-1)).abs().max() < LOGPROB_ATOL
