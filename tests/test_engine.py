"""Generation behaviour on the real default model."""

import pytest

from localpd.errors import LocalpdError
from localpd.sampling import SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=24)
Q = [{"role": "user", "content": "What is the capital of France?"}]


def run(engine, ids, params=GREEDY, conversation=None):
    events = list(engine.generate(ids, params, conversation))
    return [e.token_id for e in events if e.token_id is not None], "".join(e.text for e in events), events


def test_later_turn_prefills_only_new_tokens_and_matches_a_cold_run(engine):
    conv = engine.new_conversation()
    first_ids = engine.encode_chat(Q)
    _, reply, _ = run(engine, first_ids, conversation=conv)
    turn2 = Q + [{"role": "assistant", "content": reply}, {"role": "user", "content": "And of Germany?"}]
    ids2 = engine.encode_chat(turn2)
    warm_tokens, warm_text, _ = run(engine, ids2, conversation=conv)
    stats = engine.last_stats
    assert stats.cached_tokens >= len(first_ids)  # the whole first turn came from the kept cache
    assert stats.prompt_tokens == len(ids2)
    cold_tokens, _, _ = run(engine, ids2)
    assert warm_tokens == cold_tokens
    assert engine.last_stats.cached_tokens == 0


def test_interrupted_stream_leaves_conversation_usable(engine):
    conv = engine.new_conversation()
    ids = engine.encode_chat(Q)
    stream = engine.generate(ids, SamplingParams(temperature=0, max_tokens=40), conv)
    next(stream), next(stream), next(stream)
    stream.close()  # what Ctrl+C does to the consumer
    assert conv.cache.length == len(conv.ids) and conv.ids[: len(ids)] == ids
    assert run(engine, ids, conversation=conv)[0] == run(engine, ids)[0]


def test_stop_string_cuts_the_reply(engine):
    ids = engine.encode_chat(Q)
    _, full, _ = run(engine, ids)
    assert "Paris" in full
    _, text, events = run(engine, ids, SamplingParams(temperature=0, max_tokens=24, stop=["Paris"]))
    assert text == full[: full.index("Paris")]
    assert events[-1].finish_reason == "stop"


def test_max_tokens_and_length_finish(engine):
    tokens, _, events = run(engine, engine.encode_chat(Q), SamplingParams(temperature=0, max_tokens=3))
    assert len(tokens) == 3 and events[-1].finish_reason == "length"


def test_eos_ends_the_reply_unless_ignored(engine):
    ids = engine.encode_chat(Q)
    tokens, _, events = run(engine, ids, SamplingParams(temperature=0, max_tokens=64))
    assert events[-1].finish_reason == "stop" and events[-1].token_id is None
    assert not set(tokens) & engine.tokenizer.eos_ids
    more, _, _ = run(engine, ids, SamplingParams(temperature=0, max_tokens=len(tokens) + 3, ignore_eos=True))
    assert more[: len(tokens)] == tokens and more[len(tokens)] in engine.tokenizer.eos_ids


def test_seed_gives_the_same_sample(engine):
    ids = engine.encode_chat([{"role": "user", "content": "Tell me a story about a cat."}])
    p = SamplingParams(temperature=1.0, top_p=0.95, max_tokens=16, seed=1234)
    a, _, _ = run(engine, ids, p)
    assert run(engine, ids, p)[0] == a
    others = {tuple(run(engine, ids, SamplingParams(temperature=1.0, max_tokens=16, seed=s))[0]) for s in (1, 2, 3)}
    assert len(others | {tuple(a)}) > 1


def test_event_stats_are_real(engine):
    _, _, events = run(engine, engine.encode_chat(Q), SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    assert events[0].stats.phase == "prefill" and events[0].stats.tokens == engine.last_stats.prompt_tokens
    assert all(e.stats.phase == "decode" and e.stats.tokens == 1 for e in events[1:])
    assert all(e.stats.seconds > 0 for e in events)
    s = engine.last_stats
    assert s.output_tokens == 6 and s.decode_tps > 0 and s.prefill_tps > 0


def test_bad_prompts_get_clear_errors(engine):
    with pytest.raises(LocalpdError, match="empty"):
        engine.generate([], GREEDY)
    with pytest.raises(LocalpdError, match="context"):
        engine.generate([1] * engine.max_context, GREEDY)
    with pytest.raises(LocalpdError, match="vocabulary"):
        engine.generate([10**7], GREEDY)
    with pytest.raises(LocalpdError, match="temperature"):
        engine.generate([1, 2], SamplingParams(temperature=-1))


def test_reply_is_cut_at_the_context_limit(engine):
    from localpd.engine import Engine

    small = Engine(engine.resolved.path, device="cpu", max_context=40)
    ids = small.encode_chat(Q)
    tokens, _, events = run(small, ids, SamplingParams(temperature=0, max_tokens=100, ignore_eos=True))
    assert len(ids) + len(tokens) == 40 and events[-1].finish_reason == "length"
