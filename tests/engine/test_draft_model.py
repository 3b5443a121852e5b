"""Draft-model drafting on the real default model: the default model (Q4_1) drafts for itself, on the CPU's
kernels, and for its float32 copy (another scheme, the same vocabulary): replies identical to plain decoding's,
greedy and seeded, several requests at once, and no page left behind."""

import pytest
import torch

from localpd.engine import Engine
from localpd.engine.sampling import SamplingParams
from localpd.engine.speculate import SpeculateConfig
from localpd.errors import LocalpdError

from test_speculate_engine import PROMPTS, idle, reply, tokens

DRAFT = SpeculateConfig("draft", 4, adaptive=False)  # 4 tokens a step: the default model costs as much as itself


@pytest.fixture(scope="module", params=["native", "fp32"])
def drafted_engine(request, default_gguf):
    """The target in the file's scheme (fp16 pages) or float32, the default model drafting for it. One thread: with
    two, the CPU's attention splits a row's positions in parts no shorter than 16 positions of the step's shortest
    row (kernels/cpu_kernels.c attention_shape), and the first of a verification's rows is shorter than the decode
    row it checks: over a short prompt their parts differ, which moves a logprob by ~1e-3, enough to move a seeded
    draw."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    engine = Engine(default_gguf, device="cpu", max_context=1024, quant=request.param, draft=str(default_gguf),
                    speculate=DRAFT)
    yield engine
    engine.close()
    torch.set_num_threads(threads)


def test_greedy_replies_are_plain_decodings_and_drafts_are_kept(drafted_engine):
    params = SamplingParams(temperature=0, max_tokens=32, logprobs=1)
    for messages in PROMPTS:
        reply(drafted_engine, messages, SamplingParams(temperature=0, max_tokens=1))  # the prompt in the cache
        plain, _ = reply(drafted_engine, messages, params)
        spec, stats = reply(drafted_engine, messages, params, DRAFT)
        assert tokens(spec) == tokens(plain)
        assert all(abs(a.logprob - b.logprob) < 1e-2 for a, b in zip(spec, plain) if a.token_id is not None)
        # the draft is the target's own weights (rounded to Q4_1 for the float32 target): nearly every draft holds
        assert stats.drafted_tokens and stats.acceptance > 0.8 and stats.tokens_per_pass > 3
    assert idle(drafted_engine)


def test_seeded_samples_and_concurrent_requests_are_plain_decodings(drafted_engine):
    sampled = SamplingParams(temperature=0.8, seed=11, max_tokens=32)
    plain, _ = reply(drafted_engine, PROMPTS[2], sampled)
    spec, stats = reply(drafted_engine, PROMPTS[2], sampled, DRAFT)
    assert tokens(spec) == tokens(plain) and stats.drafted_tokens
    greedy = SamplingParams(temperature=0, max_tokens=24)
    expected = [tokens(reply(drafted_engine, m, greedy)[0]) for m in PROMPTS]
    drafted_engine.set_speculate(DRAFT)
    handles = [drafted_engine.submit(drafted_engine.encode_chat(m), greedy) for m in PROMPTS]
    assert [tokens(list(h)) for h in handles] == expected
    assert idle(drafted_engine)


def test_draft_mode_needs_a_draft_model_and_rounded_pages_refuse_one(default_gguf):
    engine = Engine(default_gguf, device="cpu", max_context=256)
    try:
        with pytest.raises(LocalpdError, match="--draft"):
            engine.set_speculate(DRAFT)
    finally:
        engine.close()
    with pytest.raises(LocalpdError, match="int4ch"):
        Engine(default_gguf, device="cpu", max_context=256, kv="int4ch/int4", draft=str(default_gguf))


def test_the_kv_memory_holds_the_draft_models_pages_too(default_gguf):
    """--kv-memory is the budget of both pools: the target's pages and the draft's (one for each of the target's)
    fit in it together, and a budget too small for one context says the draft's pages were counted."""
    plain = Engine(default_gguf, device="cpu", max_context=256)
    page = plain.kv_token_bytes * plain.pages.page_size
    plain.close()
    budget = 40 * page
    engine = Engine(default_gguf, device="cpu", max_context=256, kv_memory=budget, draft=str(default_gguf))
    try:
        held = sum(pool.bytes_per_token() * pool.n_pages * pool.page_size for pool in (engine.kv, engine.drafter.kv))
        assert engine.kv.n_pages == engine.drafter.kv.n_pages == 20  # half the pages of the budget without a draft
        assert budget - 2 * page < held <= budget
        assert engine.kv_token_bytes == 2 * plain.kv_token_bytes  # the draft is the target's shape
    finally:
        engine.close()
    with pytest.raises(LocalpdError, match="the draft model's included"):
        Engine(default_gguf, device="cpu", max_context=256, kv_memory=25 * page, draft=str(default_gguf))


class EagerGraphs:
    """engine.cuda_graph.DecodeGraphs' interface run eagerly: a CPU stand-in for a GPU's graph replays."""

    def __init__(self, model, kv):
        self.model, self.kv, self.runs = model, kv, 0

    def run(self, tokens, positions, slots, stage_slots, tables, lens):
        from localpd.engine.runner import batch_of

        self.runs += 1
        rows = list(range(len(tokens)))
        return self.model.forward(batch_of(tokens, positions, slots, tables, lens, rows + [len(rows)], rows, "cpu"),
                                  self.kv)


def test_with_graphs_the_draft_follows_and_drafts_through_its_own(default_gguf):
    """On a GPU the target replays its decode and verification steps from CUDA graphs, and the draft model follows
    them and drafts through graphs of its own (where it ran every step eagerly: about 9x a replayed step on an
    H100). Here both graphs are stand-ins that run the same inputs eagerly: the drafted replies are still plain
    decoding's, and both paths were taken."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    engine = Engine(default_gguf, device="cpu", max_context=1024, draft=str(default_gguf), speculate=DRAFT)
    try:
        greedy = SamplingParams(temperature=0, max_tokens=24)
        expected = [tokens(reply(engine, m, greedy)[0]) for m in PROMPTS[:2]]
        engine.runner.graphs = target = EagerGraphs(engine.model, engine.kv)
        engine.drafter.graphs = draft = EagerGraphs(engine.drafter.model, engine.drafter.kv)
        for messages, want in zip(PROMPTS[:2], expected):
            got, stats = reply(engine, messages, greedy, DRAFT)
            assert tokens(got) == want and stats.drafted_tokens and stats.acceptance > 0.8
        assert target.runs and draft.runs > target.runs  # the draft's k steps a target step, and its following
        assert idle(engine)
    finally:
        engine.close()
        torch.set_num_threads(threads)
