"""Generation behaviour on the real default model: the request API, the prefix cache, concurrency."""

import asyncio
import subprocess
import sys
import threading
from dataclasses import replace

import pytest

from localpd.engine import Engine
from localpd.errors import LocalpdError
from localpd.engine.sampling import SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=24)
Q = [{"role": "user", "content": "What is the capital of France?"}]
LOGPROB_ATOL = 2e-3  # float32 throughout: batch composition changes only the order of additions


def run(engine, ids, params=GREEDY):
    handle = engine.submit(ids, params)
    events = list(handle)
    return [e.token_id for e in events if e.token_id is not None], "".join(e.text for e in events), events, handle


def idle(engine):
    s = engine.stats()
    return s.running == 0 and s.waiting == 0 and s.kv_pages_used == 0


def test_later_turn_is_served_by_the_prefix_cache_and_matches_a_cold_run(engine, default_gguf):
    first_ids = engine.encode_chat(Q)
    _, reply, _, _ = run(engine, first_ids)
    turn2 = Q + [{"role": "assistant", "content": reply}, {"role": "user", "content": "And of Germany?"}]
    ids2 = engine.encode_chat(turn2)
    warm_tokens, _, _, handle = run(engine, ids2)
    assert handle.stats.cached_tokens >= len(first_ids) // 16 * 16  # every full page of the first turn
    assert handle.stats.prompt_tokens == len(ids2)
    cold = Engine(default_gguf, device="cpu", max_context=2048, quant=engine.quant)
    cold_tokens, _, _, cold_handle = run(cold, ids2)
    cold.close()
    assert warm_tokens == cold_tokens and cold_handle.stats.cached_tokens == 0
    assert idle(engine)


def logprob_trace(engine, ids, n=12):
    p = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, logprobs=3)
    events = list(engine.submit(ids, p))
    return [e.token_id for e in events], [[lp for _, lp in e.top_logprobs] for e in events]


def assert_same_trace(a, b):
    assert a[0] == b[0]
    worst = max(abs(x - y) for ra, rb in zip(a[1], b[1]) for x, y in zip(ra, rb))
    assert worst < LOGPROB_ATOL, worst


def test_cold_warm_chunked_and_concurrent_runs_give_the_same_tokens_and_logprobs(engine, default_gguf):
    ids = engine.encode_chat([{"role": "system", "content": "You are a careful assistant. " * 8}] + Q)
    alone = logprob_trace(engine, ids)  # may be warm from earlier tests: compared with a cold engine below
    cold_engine = Engine(default_gguf, device="cpu", max_context=2048, quant=engine.quant)  # the same path
    assert_same_trace(logprob_trace(cold_engine, ids), alone)
    assert_same_trace(logprob_trace(cold_engine, ids), alone)  # now warm: the prompt's full pages are cached
    cold_engine.close()
    for chunk in (7, 16, 33):  # prompts spread over several steps, cut mid-page and at page boundaries
        chunked = Engine(default_gguf, device="cpu", max_context=2048, max_step_tokens=chunk, quant=engine.quant)
        assert_same_trace(logprob_trace(chunked, ids), alone)
        chunked.close()
    others = [engine.encode_chat([{"role": "user", "content": f"Count to {n}."}]) for n in (3, 5, 7)]
    results = {}

    def go(key, prompt):
        results[key] = logprob_trace(engine, prompt)

    threads = [threading.Thread(target=go, args=(i, p)) for i, p in enumerate([ids] + others)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert_same_trace(results[0], alone)
    for i, p in enumerate(others, start=1):
        assert_same_trace(results[i], logprob_trace(engine, p))
    assert idle(engine)


def test_async_stream_and_cancel_free_pages(engine):
    ids = engine.encode_chat([{"role": "user", "content": "Tell me a long story about a dragon."}])

    async def consume():
        handle = engine.submit(ids, SamplingParams(temperature=0, max_tokens=200, ignore_eos=True))
        got = []
        async for event in handle:
            got.append(event)
            if len(got) == 3:
                handle.cancel()
        return got

    events = asyncio.run(consume())
    assert events[-1].finish_reason == "cancelled" and len(events) < 20
    assert idle(engine)


def test_abandoned_iterator_cancels_the_request(engine):
    ids = engine.encode_chat(Q)
    stream = engine.generate(ids, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
    next(stream), next(stream), next(stream)
    stream.close()  # what Ctrl+C does to the consumer
    for _ in range(200):
        if idle(engine):
            break
        threading.Event().wait(0.01)
    assert idle(engine)
    assert run(engine, ids)[0] == run(engine, ids)[0]


LEAVE_MID_STREAM = """
import sys
from localpd.engine import Engine
from localpd.engine.sampling import SamplingParams
e = Engine(sys.argv[1], device="cpu", max_context=512)
stream = iter(e.submit([1, 2, 3, 4], SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)))
next(stream), next(stream)
print("left mid-stream")
"""


def test_a_script_that_exits_mid_stream_without_closing_its_engine_exits_cleanly(default_gguf):
    """The engine thread is mid-step when the interpreter shuts down; unclosed, that aborted the process
    ("terminate called without an active exception", exit 134) two runs in three."""
    for _ in range(2):
        r = subprocess.run([sys.executable, "-c", LEAVE_MID_STREAM, str(default_gguf)], capture_output=True,
                           text=True, timeout=120)
        assert (r.returncode, r.stdout) == (0, "left mid-stream\n"), r.stderr[-2000:]


def test_stop_string_cuts_the_reply(engine):
    ids = engine.encode_chat(Q)
    _, full, _, _ = run(engine, ids)
    assert "Paris" in full
    _, text, events, _ = run(engine, ids, SamplingParams(temperature=0, max_tokens=24, stop=["Paris"]))
    assert text == full[: full.index("Paris")]
    assert events[-1].finish_reason == "stop"


def test_max_tokens_and_length_finish(engine):
    tokens, _, events, _ = run(engine, engine.encode_chat(Q), SamplingParams(temperature=0, max_tokens=3))
    assert len(tokens) == 3 and events[-1].finish_reason == "length"


def test_eos_ends_the_reply_unless_ignored(engine):
    ids = engine.encode_chat(Q)
    tokens, _, events, _ = run(engine, ids, SamplingParams(temperature=0, max_tokens=64))
    assert events[-1].finish_reason == "stop" and events[-1].token_id is None
    assert not set(tokens) & engine.tokenizer.eos_ids
    more, _, _, _ = run(engine, ids, SamplingParams(temperature=0, max_tokens=len(tokens) + 3, ignore_eos=True))
    assert more[: len(tokens)] == tokens and more[len(tokens)] in engine.tokenizer.eos_ids


def test_seed_gives_the_same_sample(engine):
    ids = engine.encode_chat([{"role": "user", "content": "Tell me a story about a cat."}])
    p = SamplingParams(temperature=1.0, top_p=0.95, max_tokens=16, seed=1234)
    a = run(engine, ids, p)[0]
    assert run(engine, ids, p)[0] == a
    others = {tuple(run(engine, ids, SamplingParams(temperature=1.0, max_tokens=16, seed=s))[0]) for s in (1, 2, 3)}
    assert len(others | {tuple(a)}) > 1


def test_logprobs_are_log_softmax_of_the_chosen_and_top_tokens(engine):
    _, _, events, _ = run(engine, engine.encode_chat(Q), SamplingParams(temperature=0, max_tokens=4, logprobs=5))
    for e in events:
        if e.token_id is None:
            continue
        top = e.top_logprobs
        assert len(top) == 5 and top[0][0] == e.token_id  # greedy picks the most likely
        assert abs(top[0][1] - e.logprob) < 1e-6
        assert all(a[1] >= b[1] for a, b in zip(top, top[1:])) and top[0][1] <= 0


def test_event_stats_are_real(engine):
    ids = engine.encode_chat([{"role": "user", "content": "Say something new about stats."}])
    _, _, events, handle = run(engine, ids, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    s = handle.stats
    assert events[0].stats.phase == "prefill"
    assert events[0].stats.tokens == s.prompt_tokens - s.cached_tokens
    assert all(e.stats.phase == "decode" and e.stats.tokens == 1 and e.stats.batch == 1 for e in events[1:])
    assert all(e.stats.seconds > 0 for e in events)
    # device time never exceeds the step's wall time (on the CPU they are the same clock)
    assert all(0 < e.stats.seconds <= e.stats.wall_seconds for e in events)
    assert s.output_tokens == 6 and s.decode_tps > 0 and s.prefill_tps > 0


def test_bad_prompts_get_clear_errors(engine):
    with pytest.raises(LocalpdError, match="empty"):
        engine.submit([], GREEDY)
    with pytest.raises(LocalpdError, match="context"):
        engine.submit([1] * engine.max_context, GREEDY)
    with pytest.raises(LocalpdError, match="vocabulary"):
        engine.submit([10**7], GREEDY)
    with pytest.raises(LocalpdError, match="temperature"):
        engine.submit([1, 2], SamplingParams(temperature=-1))
    with pytest.raises(LocalpdError, match="role"):
        engine.submit_chat([{"role": "wizard", "content": "hi"}], GREEDY)
    assert idle(engine)


def test_reply_is_cut_at_the_context_limit(engine):
    small = Engine(engine.resolved.path, device="cpu", max_context=40)
    ids = small.encode_chat(Q)
    tokens, _, events, _ = run(small, ids, SamplingParams(temperature=0, max_tokens=100, ignore_eos=True))
    assert len(ids) + len(tokens) == 40 and events[-1].finish_reason == "length"
    small.close()


def test_kv_budget_too_small_for_one_context_is_refused(default_gguf):
    with pytest.raises(LocalpdError, match="KV cache budget"):
        Engine(default_gguf, device="cpu", max_context=2048, kv_memory="1MiB")


def test_preemption_under_page_pressure_keeps_outputs_exact(default_gguf):
    """Six streams in a cache that holds about three of them: preempted ones are recomputed and still produce
    what they produce alone."""
    tight = Engine(default_gguf, device="cpu", max_context=160, kv="fp32", kv_memory=tight_bytes(default_gguf))
    prompts = [tight.encode_chat([{"role": "user", "content": f"List {n} colours."}]) for n in range(2, 8)]
    p = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    alone = [run(tight, ids, p)[0] for ids in prompts]
    handles = [tight.submit(ids, p) for ids in prompts]
    outs = [[e.token_id for e in h if e.token_id is not None] for h in handles]
    assert outs == alone
    assert tight.stats().preemptions > 0
    assert idle(tight)
    tight.close()


def tight_bytes(path):
    from localpd.kvcache.formats import kv_bytes_per_token
    from localpd.load.loader import load_model

    c = load_model(path).config
    return kv_bytes_per_token("fp32", c.n_layers, c.n_kv_heads, c.head_dim) * 16 * 16  # 16 pages of 16 tokens


@pytest.mark.parametrize("kv", ["int8", "fp8", "int4", "int8/int4", "int4ch/int4"])
def test_quantized_kv_cache_still_answers(default_gguf, kv):
    e = Engine(default_gguf, device="cpu", max_context=512, kv=kv)
    _, text, _, handle = run(e, e.encode_chat(Q))
    assert "Paris" in text
    s = e.stats()
    assert s.kv_dtype == kv and e.kv.bytes_per_token() == e.kv_token_bytes < kv_fp32_bytes(e)
    e.close()


def kv_fp32_bytes(e):
    c = e.config
    return 2 * c.n_layers * c.n_kv_heads * c.head_dim * 4


def test_int4ch_pages_the_engine_fills_while_decoding_are_the_ones_a_lone_sequence_writes(default_gguf):
    """int4ch/int4 KV: a running sequence keeps its open page in its stage row, so the engine's pages, filled a
    token at a time, are bit for bit those of the same steps run on the model directly (stage row 0,
    Batch.single); without the stage they come out different. (That running sequences never share a row is
    test_scheduler's; beside another request the steps' float rounding differs, so pages are not compared.)"""

    import torch

    from localpd.kvcache.pages import PageTable
    from localpd.model.transformer import Batch
    from localpd.kvcache.formats import new_kv_pool

    e = Engine(default_gguf, device="cpu", max_context=512, kv="int4ch/int4")
    ids = e.encode_chat(Q)
    p = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    tokens, _, _, _ = run(e, ids, p)
    table = PageTable()
    n_full = e.pages.match(table, ids + tokens) // 16  # the request's full pages, from the prefix cache
    assert n_full * 16 > len(ids) + 16  # at least one page written entirely by decode steps
    c, ps = e.config, 16

    def alone(staged):
        pool = new_kv_pool("int4ch/int4", c.n_layers, n_full + 1, ps, c.n_kv_heads, c.head_dim, torch.float32, "cpu")
        steps = [(ids, 0)] + [([t], len(ids) + i) for i, t in enumerate(tokens[:-1])]
        for step_tokens, start in steps:
            batch = Batch.single(step_tokens, start, n_full + 1, ps, "cpu")
            e.model.forward(batch if staged else replace(batch, stage_slots=None), pool)
        return pool.k[:, :n_full], pool.k_scale[:, :n_full]

    mine = e.kv.k[:, table.pages], e.kv.k_scale[:, table.pages]
    assert all(torch.equal(a, b) for a, b in zip(mine, alone(True)))
    assert not torch.equal(mine[0], alone(False)[0])
    e.pages.release(table)
    assert idle(e)
    e.close()


# a Qwen3-style template: an empty think block when the caller turns thinking off
THINKING_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
                     "<|im_start|>assistant\n{% if enable_thinking is defined and enable_thinking is false %}"
                     "<think>\n\n</think>\n\n{% endif %}")


def test_template_variables_reach_the_chat_template(engine, monkeypatch):
    """`localpd chat --think off` and a request's chat_template_kwargs end in the template's enable_thinking; a
    variable localpd itself passes cannot be replaced; the default model's own template ignores the variable."""
    from localpd.cli.chat import Chat

    plain = engine.encode_chat(Q)
    assert engine.encode_chat(Q, template_vars={"enable_thinking": False}) == plain
    monkeypatch.setattr(engine.tokenizer, "chat_template", THINKING_TEMPLATE)
    tok = engine.tokenizer
    thinking = tok.decode(engine.encode_chat(Q), skip_special=False)
    direct = tok.decode(engine.encode_chat(Q, template_vars={"enable_thinking": False}), skip_special=False)
    assert thinking.endswith("<|im_start|>assistant\n") and direct == thinking + "<think>\n\n</think>\n\n"
    with pytest.raises(LocalpdError, match="'bos_token' is set by localpd"):
        engine.encode_chat(Q, template_vars={"bos_token": "x"})
    chat = Chat(engine, GREEDY, None, think="off")
    assert tok.decode(chat.fit_to_context(Q[0]["content"]), skip_special=False) == direct
    chat.set("think on")
    assert tok.decode(chat.fit_to_context(Q[0]["content"]), skip_special=False) == thinking
    chat.set("think default")
    assert chat.think is None
    chat.set("think maybe")
    assert chat.think is None


def test_the_repl_shows_reasoning_apart_from_the_answer(engine, monkeypatch, capsys):
    """`localpd chat` with a thinking model: reasoning on stderr when stdout is not a terminal (stdout holds the
    answer alone); a prompt that opened the <think> block makes the reply's text reasoning until </think>."""
    from localpd.cli.chat import Chat, ReplyPrinter

    monkeypatch.setattr(engine.tokenizer, "chat_template", THINKING_TEMPLATE)
    printer = ReplyPrinter(engine, engine.encode_chat(Q))
    for piece in ["<thi", "nk>\nFrance's capital", " is Paris.\n</th", "ink>\n\nParis."]:
        printer.write(piece)
    printer.close()
    out, err = capsys.readouterr()
    assert out == "Paris." and err == "France's capital is Paris.\n"
    monkeypatch.setattr(engine.tokenizer, "chat_template", THINKING_TEMPLATE + "<think>\n")
    chat = Chat(engine, SamplingParams(temperature=0, max_tokens=8), None)
    raw = chat.reply(Q[0]["content"])
    out, err = capsys.readouterr()
    assert out == "\n" and err == raw.strip() + "\n"  # cut off while thinking: all of it is reasoning
    assert chat.messages[-1] == {"role": "assistant", "content": raw}


def test_the_repl_saves_and_loads_a_conversation(engine, tmp_path, capsys):
    """/save writes the system prompt, the turns and the settings; /load goes on from them: the next prompt is the
    one the first chat would have sent, and the prefix cache serves its earlier turns. A file that is not a saved
    conversation, or a save that cannot be written, is a one-line message that changes nothing."""
    from localpd.cli.chat import Chat

    first = Chat(engine, replace(GREEDY, max_tokens=12), "Answer in one sentence.")
    first.set("top_k 5")
    first.reply("What is the capital of France?")
    path = tmp_path / "paris.json"
    first.command(f"/save {path}")
    again = Chat(engine, SamplingParams(temperature=0.9, max_tokens=12), None)
    again.command(f"/load {path}")
    assert (again.system, again.messages, again.params) == (first.system, first.messages, first.params)
    assert again.fit_to_context("And of Spain?") == first.fit_to_context("And of Spain?")
    earlier = len(engine.encode_chat([{"role": "system", "content": first.system}] + first.messages,
                                     add_generation_prompt=False))
    again.reply("And of Spain?")
    assert again.last_stats.cached_tokens >= earlier // 16 * 16 - 16  # all but the page the reply ended in
    capsys.readouterr()
    for bad in ('{"messages": [{"role": "wizard", "content": 1}]}', "[1, 2]", "not json", '{"messages": []'):
        (tmp_path / "bad.json").write_text(bad)
        again.command(f"/load {tmp_path / 'bad.json'}")
        err = capsys.readouterr().err
        assert err.startswith("cannot load") and err.count("\n") == 1 and len(again.messages) == 4
    again.command(f"/load {tmp_path / 'missing.json'}")
    assert "No such file" in capsys.readouterr().err
    again.command(f"/save {tmp_path / 'no' / 'dir.json'}")
    assert capsys.readouterr().err.startswith("cannot save")
    assert set(tmp_path.iterdir()) == {path, tmp_path / "bad.json"}  # no temporary file left


@pytest.mark.parametrize("threaded", [True, False])
def test_a_constrained_rows_mask_is_computed_during_the_forward_and_changes_no_token(engine, threaded, monkeypatch):
    """The runner computes each constrained row's mask while the forward runs (in its mask thread on the CPU when it
    has one, else right after the forward, as on a GPU once the kernels are launched), so sampling finds it made:
    the same replies, greedy and seeded, batched, as each alone and mask-on-demand."""
    from concurrent.futures import ThreadPoolExecutor

    from localpd.constrain.grammar import GrammarConstraint

    schema = {"type": "object", "properties": {"city": {"type": "string"}, "population": {"type": "integer"}}}
    asks = [[{"role": "user", "content": f"The capital of {land} and its population, as JSON."}]
            for land in ("France", "Spain")]
    kws = [dict(temperature=0, max_tokens=24, json_object=True, json_schema=schema),
           dict(temperature=1.0, seed=3, max_tokens=24, regex=r"[A-Z][a-z ]{1,30}\.")]

    def replies() -> list[str]:
        handles = [engine.submit_chat(m, SamplingParams(**kw)) for m in asks for kw in kws]
        return ["".join(ev.text for ev in h) for h in handles]

    saved = engine.runner.mask_thread
    try:
        engine.runner.mask_thread = None
        monkeypatch.setattr(GrammarConstraint, "prepare", lambda self: None)  # each mask made when sampling asks
        on_demand = replies()
        monkeypatch.undo()
        made = []
        allowed = GrammarConstraint.allowed

        def watched(self):
            if self._allowed is None and threading.current_thread() is not threading.main_thread():
                made.append(threading.current_thread().name)  # not the first mask, which submit() checks
            return allowed(self)

        monkeypatch.setattr(GrammarConstraint, "allowed", watched)
        engine.runner.mask_thread = ThreadPoolExecutor(1, "localpd-masks") if threaded else None
        ahead = replies()
    finally:
        if engine.runner.mask_thread not in (None, saved):
            engine.runner.mask_thread.shutdown()
        engine.runner.mask_thread = saved
    assert ahead == on_demand and all(ahead)
    where = {name.startswith("localpd-masks") for name in made}
    assert where == {threaded}  # every mask made ahead: in the mask thread, or by the engine's own thread


def test_a_closed_engine_nobody_holds_is_freed_at_once(default_gguf):
    """No reference cycle keeps an engine (its weights and pages: GPU memory on a GPU) alive after close until some
    cyclic garbage collection: the last reference going frees it, a chaining one included. A benchmark that built
    one engine after another ran out of an H100's memory when chained steps made fewer objects a token and the
    collector came later."""
    import gc
    import weakref

    gc.disable()
    try:
        for chain in (1, 2):
            engine = Engine(default_gguf, device="cpu", max_context=256, decode_chain=chain)
            assert len(list(engine.submit(list(range(40, 60)), SamplingParams(temperature=0, max_tokens=6)))) >= 1
            engine.close()
            ref = weakref.ref(engine)
            del engine
            assert ref() is None, chain
    finally:
        gc.enable()
