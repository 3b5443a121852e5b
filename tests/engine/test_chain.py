"""Chained decode steps (Engine._chain, DecodeGraphs.run_chain): where every running sequence decodes greedily, one
step runs several decode steps, each step's argmax the next step's input token. On a GPU the chain is one CUDA
graph replay; here it runs eagerly from the same static inputs. Replies must be plain decoding's, token for token,
the accounting must count every pass over the weights, and no page may be left behind."""

import numpy as np
import pytest
import torch

import localpd.engine.engine as engine_module
from localpd.engine import Engine
from localpd.engine.sampling import SamplingParams
from localpd.errors import LocalpdError
from localpd.kvcache.formats import new_kv_pool
from tests.engine.test_speculate_engine import PROMPTS, idle, tokens

CHAIN = 4


@pytest.fixture(scope="module", params=["fp16", "int8", "int4ch/int4"])
def engines(request, default_gguf):
    """A plain engine and a chaining one over the same pages' format: float16 (the CPU's default), per-token int8,
    and int4ch, whose open page is staged (a chain's later steps take stage slots of their own). Chains of any
    length in time: a CPU step of this model takes about 10 ms, more on a busy machine."""
    bound, engine_module.CHAIN_SECONDS = engine_module.CHAIN_SECONDS, float("inf")
    plain = Engine(default_gguf, device="cpu", max_context=1024, kv=request.param)
    chained = Engine(default_gguf, device="cpu", max_context=1024, kv=request.param, decode_chain=CHAIN)
    yield plain, chained
    plain.close()
    chained.close()
    engine_module.CHAIN_SECONDS = bound


def run_all(engine, requests):
    """(messages, params) pairs submitted together: each one's events and stats, in order. The engine's lock is
    held while they are queued, so that both engines start them in the same step (a batch of other rows sums in
    another order, which can flip a greedy token over rounded pages)."""
    prompts = [engine.encode_chat(m) for m, _ in requests]
    with engine._wake:
        handles = [engine.submit(ids, p) for ids, (_, p) in zip(prompts, requests)]
    return [(list(h), h.stats) for h in handles]


def test_chained_replies_are_plain_decodings(engines):
    """Four requests at once, of budgets that end inside a chain, by an end token, and by a stop string: the same
    tokens and texts, and chains were taken (a chain's events carry its CHAIN passes)."""
    plain, chained = engines
    budgets = [45, 37, 30, 23]
    requests = [(m, SamplingParams(temperature=0, max_tokens=n)) for m, n in zip(PROMPTS, budgets)]
    requests.append(([{"role": "user", "content": "What is the capital of France?"}],
                     SamplingParams(temperature=0, max_tokens=40, stop=["."])))
    want, got = run_all(plain, requests), run_all(chained, requests)
    for (w_events, _), (g_events, g_stats) in zip(want, got):
        assert tokens(g_events) == tokens(w_events)
        assert "".join(e.text for e in g_events) == "".join(e.text for e in w_events)
        assert g_events[-1].finish_reason == w_events[-1].finish_reason
    assert any(e.stats is not None and e.stats.passes == CHAIN for events, _ in got for e in events)
    assert {events[-1].finish_reason for events, _ in want} == {"length", "stop"}
    assert idle(plain) and idle(chained)


def test_a_chain_counts_every_pass_over_the_weights(engines):
    """A reply of 1 + 8 x CHAIN tokens (the first from the prompt's step, the rest in eight chains, none computed
    past the end): the same decode steps, bytes and tokens per pass (1.0) as plain decoding's."""
    plain, chained = engines
    params = SamplingParams(temperature=0, max_tokens=1 + 8 * CHAIN, ignore_eos=True)
    (w_events, w), = run_all(plain, [(PROMPTS[2], params)])
    (g_events, g), = run_all(chained, [(PROMPTS[2], params)])
    assert tokens(g_events) == tokens(w_events) and len(tokens(g_events)) == 1 + 8 * CHAIN
    assert g.decode_steps == w.decode_steps == 8 * CHAIN and g.tokens_per_pass == 1.0
    assert g.decode_bytes == w.decode_bytes and g.bytes_moved == w.bytes_moved
    assert g.drafted_tokens == g.accepted_tokens == 0
    assert sum(e.stats.passes == CHAIN for e in g_events if e.stats) == 8 * CHAIN  # each chain's tokens
    assert idle(chained)


def test_a_row_that_needs_its_logits_keeps_the_steps_plain(engines):
    """A request with logprobs beside a greedy one: no step chains while it runs (every event one pass), and both
    replies are plain decoding's."""
    plain, chained = engines
    requests = [(PROMPTS[0], SamplingParams(temperature=0, max_tokens=24, logprobs=2)),
                (PROMPTS[3], SamplingParams(temperature=0, max_tokens=24))]
    want, got = run_all(plain, requests), run_all(chained, requests)
    for (w_events, _), (g_events, _) in zip(want, got):
        assert tokens(g_events) == tokens(w_events)
        assert all(e.stats.passes == 1 for e in g_events if e.stats)
    assert idle(chained)


def test_no_chain_takes_longer_than_chain_seconds(engines, monkeypatch):
    """By the last decode step's time, a chain that would take over CHAIN_SECONDS (here 0) is not run: a request
    arriving meanwhile would wait for it to start."""
    plain, chained = engines
    monkeypatch.setattr(engine_module, "CHAIN_SECONDS", 0.0)
    params = SamplingParams(temperature=0, max_tokens=20)
    (w_events, _), = run_all(plain, [(PROMPTS[3], params)])
    (g_events, _), = run_all(chained, [(PROMPTS[3], params)])
    assert tokens(g_events) == tokens(w_events)
    assert all(e.stats.passes == 1 for e in g_events if e.stats)


def test_a_chains_inputs_step_through_the_pages_and_stage_rows(engine):
    """DecodeGraphs._fill of a three-step chain: step s's positions, lengths, slots (across a page boundary) and
    stage slots s tokens on from the first step's, padding rows on the scratch page and stage row in every step,
    and tokens beyond the first step's left for the steps' argmaxes."""
    from localpd.engine.cuda_graph import DecodeGraphs

    model, c, ps = engine.model, engine.config, 16
    pool = new_kv_pool("int4ch/int4", c.n_layers, 6, ps, c.n_kv_heads, c.head_dim, model.dtype, "cpu", stage_rows=3)
    graphs = DecodeGraphs(model, pool, 2, 5, 2, 4, chain=3)
    # sequence A at position 14 over pages [0, 1] (steps 1 and 2 cross into page 1), B at 7 over [3, 4]
    graphs._fill(4, [11, 12], [14, 7], [14, 3 * ps + 7], [14, ps + 7], [[0, 1], [3, 4]], [15, 8], steps=3)
    batches = [graphs._batch(4, s) for s in range(3)]
    assert [b.positions.tolist() for b in batches] == [[14, 7, 0, 0], [15, 8, 0, 0], [16, 9, 0, 0]]
    assert [b.seq_lens.tolist() for b in batches] == [[15, 8, 1, 1], [16, 9, 1, 1], [17, 10, 1, 1]]
    assert [b.slots.tolist() for b in batches] == [[14, 3 * ps + 7, 5 * ps, 5 * ps], [15, 3 * ps + 8, 5 * ps, 5 * ps],
                                                   [ps + 0, 3 * ps + 9, 5 * ps, 5 * ps]]
    assert [b.stage_slots.tolist() for b in batches] == [[14, ps + 7, 2 * ps, 2 * ps], [15, ps + 8, 2 * ps, 2 * ps],
                                                         [0, ps + 9, 2 * ps, 2 * ps]]
    assert batches[0].tokens.tolist() == [11, 12, 0, 0]
    assert batches[2].page_table.tolist() == [[0, 1], [3, 4], [5, 5], [5, 5]]
    # the eager chain writes each step's argmax as the next step's token and returns the steps' tokens
    ids = torch.randint(0, c.vocab_size, (20,), generator=torch.Generator().manual_seed(3))
    pos = torch.arange(20)
    for pages, row in (([0, 1], 0), ([3, 4], 1)):
        model.forward(batch_of_prompt(ids, pos, pages, row, ps), pool)
    out = graphs.run_chain(3, [11, 12], [14, 7], [14, 3 * ps + 7], [14, ps + 7], [[0, 1], [3, 4]], [15, 8]).tolist()
    assert np.array(out).shape == (3, 2) and graphs.tokens[1:4, :2].tolist() == out


def batch_of_prompt(ids, pos, pages, row, ps):
    from localpd.model.transformer import Batch

    n = len(ids)
    return Batch(ids, pos, torch.tensor(pages)[pos // ps] * ps + pos % ps, torch.tensor([pages], dtype=torch.int32),
                 torch.tensor([n], dtype=torch.int32), torch.tensor([0, n], dtype=torch.int32), torch.tensor([n - 1]),
                 row * ps + pos % ps)


def test_chain_lengths_out_of_bounds_are_errors(default_gguf):
    with pytest.raises(LocalpdError, match="decode_chain must be 1 to"):
        Engine(default_gguf, device="cpu", max_context=256, decode_chain=0)
    engine = Engine(default_gguf, device="cpu", max_context=256)
    try:
        assert engine.decode_chain == 1 and engine.runner.chain is None  # the CPU's default: plain steps
    finally:
        engine.close()
