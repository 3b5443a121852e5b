"""The model against transformers on the real default model (same GGUF, float32 on the CPU)."""

import copy
import gc
import weakref

import pytest
import torch

from localpd.load.loader import load_model
from localpd.model.transformer import Batch, Transformer
from localpd.kvcache.formats import new_kv_pool
from localpd.engine.sampling import SamplingParams

# Both sides dequantize the same blocks to float32 and run float32 arithmetic in a different order, so the
# logits differ by rounding only: |Δ| stays under 1e-3 on logits of magnitude ~25 (seen: ~5e-5).
LOGIT_ATOL = 1e-3

CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "user", "content": "Write a Python function that reverses a string."}],
    [{"role": "system", "content": "You answer in one short sentence."},
     {"role": "user", "content": "Why is the sky blue?"}],
    [{"role": "user", "content": "Name three fruits."},
     {"role": "assistant", "content": "Apple, banana and cherry."},
     {"role": "user", "content": "Which of them is yellow?"}],
]


def new_pool(model, tokens, kv_dtype="fp32", page_size=16):
    c = model.config
    n_pages = -(-tokens // page_size)
    return new_kv_pool(kv_dtype, c.n_layers, n_pages, page_size, c.n_kv_heads, c.head_dim, model.dtype, model.device)


def run_chunk(model, pool, ids, start, all_logits=False):
    batch = Batch.single(ids, start, pool.k.shape[1], pool.page_size, model.device, all_logits=all_logits)
    return model.forward(batch, pool)


def hf_ids(tok, messages):
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tok(text, add_special_tokens=False).input_ids


@pytest.mark.parametrize("messages", CONVERSATIONS[:2])
def test_last_position_logits_match_transformers(engine, hf_reference, messages):
    hf_model, tok = hf_reference
    ids = hf_ids(tok, messages)
    with torch.no_grad():
        ref = hf_model(torch.tensor([ids])).logits[0, -1]
    ours = run_chunk(engine.model, new_pool(engine.model, len(ids)), ids, 0)[0]
    assert (ours - ref).abs().max().item() < LOGIT_ATOL
    assert int(ours.argmax()) == int(ref.argmax())


def test_chunked_prefill_and_decode_match_one_full_pass(engine, hf_reference):
    hf_model, tok = hf_reference
    ids = hf_ids(tok, CONVERSATIONS[3])
    with torch.no_grad():
        ref = hf_model(torch.tensor([ids])).logits[0]
    model = engine.model
    pool = new_pool(model, len(ids))
    n = len(ids)
    first = run_chunk(model, pool, ids[: n // 3], 0, all_logits=True)  # odd-sized chunks
    second = run_chunk(model, pool, ids[n // 3: n - 5], n // 3, all_logits=True)
    tail = [run_chunk(model, pool, [t], i)[0] for i, t in enumerate(ids[n - 5:], start=n - 5)]
    ours = torch.cat([first, second, torch.stack(tail)])
    assert ours.shape == ref.shape
    assert (ours - ref).abs().max().item() < LOGIT_ATOL


@pytest.mark.parametrize("messages", CONVERSATIONS)
def test_greedy_48_tokens_equal_transformers_generate(engine, hf_reference, messages):
    hf_model, tok = hf_reference
    ids = hf_ids(tok, messages)
    assert engine.encode_chat(messages) == ids
    with torch.no_grad():
        out = hf_model.generate(torch.tensor([ids]), max_new_tokens=48, do_sample=False)[0, len(ids):].tolist()
    events = list(engine.generate(ids, SamplingParams(temperature=0, max_tokens=48)))
    ours = [e.token_id for e in events if e.token_id is not None]
    if out[-1] in engine.tokenizer.eos_ids and len(out) < 48:  # transformers includes the EOS it stopped at
        assert ours == out[:-1] and events[-1].finish_reason == "stop"
    else:
        assert ours == out and events[-1].finish_reason == "length"
    assert "".join(e.text for e in events) == tok.decode(ours, skip_special_tokens=True)


def test_decode_graph_inputs_pad_onto_the_scratch_page_and_stage_row(engine):
    """DecodeGraphs' static inputs (replayed as a CUDA graph on a GPU; run eagerly here): two sequences decoding
    in a bucket of four become a four-row batch whose padding rows decode on the scratch page and the scratch
    stage row, and the step writes nothing else but the two sequences' open pages and stage slots (int4ch keeps
    each sequence's open page in its stage row)."""
    from localpd.engine.cuda_graph import DecodeGraphs

    model, c, ps = engine.model, engine.config, 16
    pool = new_kv_pool("int4ch/int4", c.n_layers, 6, ps, c.n_kv_heads, c.head_dim, model.dtype, "cpu", stage_rows=3)
    g = torch.Generator().manual_seed(5)
    seqs = [([0, 1], 20, 0), ([3, 4], 7, 1)]  # (pages, prompt length, stage row); page 5 and row 2 are scratch
    for pages, n, row in seqs:
        ids = torch.randint(0, c.vocab_size, (n,), generator=g)
        pos = torch.arange(n)
        model.forward(Batch(ids, pos, torch.tensor(pages)[pos // ps] * ps + pos % ps, torch.tensor([pages],
                            dtype=torch.int32), torch.tensor([n], dtype=torch.int32),
                            torch.tensor([0, n], dtype=torch.int32), torch.tensor([n - 1]), row * ps + pos % ps), pool)
    graphs = DecodeGraphs(model, pool, 2, 5, 2, 4)
    graphs._fill(4, [11, 12], [20, 7], [1 * ps + 4, 3 * ps + 7], [4, ps + 7], [s[0] for s in seqs], [21, 8])
    batch = graphs._batch(4)
    expected = dict(tokens=[11, 12, 0, 0], positions=[20, 7, 0, 0], slots=[ps + 4, 3 * ps + 7, 5 * ps, 5 * ps],
                    stage_slots=[4, ps + 7, 2 * ps, 2 * ps], page_table=[[0, 1], [3, 4], [5, 5], [5, 5]],
                    seq_lens=[21, 8, 1, 1], q_starts=[0, 1, 2, 3, 4], logit_rows=[0, 1, 2, 3])
    assert {name: getattr(batch, name).tolist() for name in expected} == expected
    before = copy.deepcopy(pool)
    assert torch.isfinite(model.forward(batch, pool)).all()
    for name in ("k", "k_scale", "k_zero", "v", "v_scale", "v_zero"):  # pages 0, 2 and 4 take no new token
        assert torch.equal(getattr(pool, name)[:, [0, 2, 4]], getattr(before, name)[:, [0, 2, 4]]), name
    assert not torch.equal(pool.k_zero[:, 5], before.k_zero[:, 5])  # the padding rows wrote the scratch page
    changed = (pool.k_stage != before.k_stage).flatten(2).any(-1).any(0)  # by stage slot
    assert changed.nonzero().flatten().tolist() == [4, ps + 7, 2 * ps]  # A's offset 4, B's 7, the scratch row's 0


def test_an_embedding_is_the_last_positions_final_hidden_state_normalised(engine, hf_reference):
    """Engine.embed: transformers' last hidden state (after the final norm) of the prompt's last position, unit
    length; the same prompt again (now from the prefix cache, its last token recomputed) gives the same vector,
    beside generations in the same steps; another prompt another vector; and no page is left behind."""
    hf_model, tok = hf_reference
    texts = ["The capital of France is Paris. " * 12, "Bananas are yellow."]
    ids = [tok(t).input_ids for t in texts]
    vectors = []
    for i in ids:
        with torch.no_grad():
            ref = hf_model(torch.tensor([i]), output_hidden_states=True).hidden_states[-1][0, -1]
        ours = torch.tensor(engine.embedding(i))
        assert ours.shape == ref.shape and abs(ours.norm().item() - 1) < 1e-5
        assert torch.allclose(ours, ref / ref.norm(), atol=1e-4)
        vectors.append(ours)
    busy = engine.submit(ids[1], SamplingParams(temperature=0, max_tokens=8))
    again = torch.tensor(engine.embedding(ids[0]))
    assert [ev.finish_reason for ev in busy][-1] in ("stop", "length")
    assert torch.allclose(again, vectors[0], atol=1e-5) and engine.stats().prefix_hit_tokens > 0
    assert (vectors[0] @ vectors[1]).item() < 0.99
    from localpd.measure.roofline import step_cost

    fresh = tok("Plums are purple.").input_ids  # a step of this embedding alone, cold: the output head does not run
    [last] = list(engine.embed(fresh))
    assert last.stats.bytes == step_cost(engine.model, [(0, len(fresh))], engine.kv_traffic, 0).bytes
    assert torch.allclose(torch.tensor(last.embedding), torch.tensor(engine.embedding(fresh)), atol=1e-6)
    s = engine.stats()
    assert s.running == 0 and s.kv_pages_used == 0


def test_a_consuming_build_frees_the_fused_parts_and_computes_the_same(default_gguf):
    """Transformer(consume=True), the engine's build, takes each weight out of the loader's dict, so that the q/k/v
    and gate/up parts are freed as their fused matrices are made (the build holds one copy of the weights, not two);
    the model it builds computes what the copying build's does, bit for bit."""
    kept, taken = load_model(default_gguf), load_model(default_gguf)
    part = weakref.ref(taken.weights["layers.0.q_proj"])
    copied = Transformer(kept.config, kept.weights)
    consumed = Transformer(taken.config, taken.weights, consume=True)
    gc.collect()
    assert taken.weights == {} and part() is None
    assert "layers.0.q_proj" in kept.weights  # the copying build leaves the caller's dict as it was
    ids = list(range(100, 160))
    got, want = (run_chunk(m, new_pool(m, len(ids)), ids, 0, all_logits=True) for m in (consumed, copied))
    assert torch.equal(got, want)
