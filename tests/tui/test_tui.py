"""The Textual app driven by Pilot with the real default model: replies stream and persist, stop, switch,
reopen, and the panel's numbers are the engine's own."""

import asyncio
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from localpd.engine import Engine
from localpd.engine.sampling import SamplingParams
from localpd.tui.app import LocalpdApp, MessageView, SettingsScreen
from localpd.tui.panel import BandwidthPanel
from localpd.tui.store import Store

SIZE = (140, 40)


def make_app(default_gguf, db, **kw):
    def load(name):
        return Engine(default_gguf, device="cpu", max_context=1024)

    return LocalpdApp(load, db, params=SamplingParams(temperature=0, max_tokens=kw.pop("max_tokens", 24)), **kw)


async def until(pilot, condition, timeout=60.0):
    end = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > end:
            raise AssertionError("timed out waiting for the app")
        await pilot.pause(0.05)


async def send(pilot, app, text):
    await until(pilot, lambda: app.engine is not None)
    prompt = app.query_one("#prompt")
    prompt.value = text
    await pilot.press("enter")
    await until(pilot, lambda: app.last_handle is not None and app.handle is None)


def test_reply_streams_persists_and_panel_matches_the_engine(default_gguf, tmp_path):
    db = tmp_path / "c.db"

    async def scenario():
        app = make_app(default_gguf, db)
        async with app.run_test(size=SIZE) as pilot:
            await send(pilot, app, "What is the capital of France?")
            views = app.query(MessageView)
            assert [v.role for v in views] == ["user", "assistant"] and "Paris" in views[-1].text
            panel = app.query_one(BandwidthPanel)
            s = app.last_handle.stats
            assert panel.data.decode_bytes == s.decode_bytes and panel.data.decode_seconds == pytest.approx(
                s.decode_step_seconds)
            decode_steps = s.output_tokens - 1 + (s.finish_reason == "stop")  # the step that sampled EOS counts
            assert len(panel.data.token_gbs) == decode_steps
            assert panel.data.prompt_tokens == s.prompt_tokens and panel.data.ttft == s.ttft
            assert panel.data.pct_measured is not None and panel.data.ceiling_tps > 0
        store = Store(db)
        [conv] = store.conversations()
        msgs = store.messages(conv.id)
        assert [m.role for m in msgs] == ["user", "assistant"] and "Paris" in msgs[1].content
        assert msgs[1].stats["finish_reason"] == "stop" and conv.title.startswith("What is the capital")
        store.close()

    asyncio.run(scenario())


def test_stop_switch_and_reopen(default_gguf, tmp_path):
    db = tmp_path / "c.db"

    async def first_session():
        app = make_app(default_gguf, db, max_tokens=400)
        async with app.run_test(size=SIZE) as pilot:
            await until(pilot, lambda: app.engine is not None)
            app.query_one("#prompt").value = "Write a very long essay about the history of rivers."
            await pilot.press("enter")
            await until(pilot, lambda: len(app.query_one(BandwidthPanel).data.token_gbs) >= 3)
            await pilot.press("escape")
            await until(pilot, lambda: app.handle is None)
            assert app.last_handle.stats.finish_reason == "cancelled"
            assert app.last_handle.stats.output_tokens < 400
            engine = app.engine
            await until(pilot, lambda: engine.stats().kv_pages_used == 0)
            await pilot.press("ctrl+n")
            await send(pilot, app, "Name a colour.")
            items = app.query_one("#conversations").children
            assert len(items) == 2
            app.query_one("#conversations").index = 1  # the older conversation
            app.query_one("#conversations").action_select_cursor()
            await until(pilot, lambda: any("rivers" in v.text for v in app.query(MessageView)))

    async def second_session():
        app = make_app(default_gguf, db)
        async with app.run_test(size=SIZE) as pilot:
            await pilot.pause(0.2)
            titles = [c.title for c in app.store.conversations()]
            assert len(titles) == 2 and any(t.startswith("Write a very long essay") for t in titles)
            assert any(v.role == "assistant" for v in app.query(MessageView))

    asyncio.run(first_session())
    store = Store(db)
    stopped = [m for c in store.conversations() for m in store.messages(c.id) if m.role == "assistant"
               and m.stats["finish_reason"] == "cancelled"]
    assert len(stopped) == 1 and stopped[0].content
    store.close()
    asyncio.run(second_session())


def test_a_corrupt_database_is_moved_aside(default_gguf, tmp_path):
    db = tmp_path / "c.db"
    db.write_bytes(b"this is not a database" * 100)

    async def scenario():
        app = make_app(default_gguf, db)
        async with app.run_test(size=SIZE) as pilot:
            await pilot.pause(0.2)
            assert app.store.recovered_from is not None and app.store.recovered_from.exists()
            assert app.store.conversations()

    asyncio.run(scenario())


@pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux is not installed")
def test_real_terminal_capture_after_one_reply(default_gguf, tmp_path):
    out = tmp_path / "screen.txt"
    script = Path(__file__).parents[2] / "scripts" / "tui_tmux_capture.sh"
    done = subprocess.run([str(script), str(default_gguf), str(out)], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHON": sys.executable})
    screen = out.read_text()
    assert done.returncode == 0, done.stderr + screen
    assert "What is the capital of France?" in screen and "Paris" in screen
    assert "GB/s" in screen and "pages" in screen  # the panel is on screen with live numbers


def test_settings_turn_thinking_off_for_a_conversation(default_gguf, tmp_path):
    """Ctrl+O's think field becomes the chat template's enable_thinking for this conversation's prompts (a
    Qwen3-style template swapped into the real model's tokenizer); a value other than on/off is refused."""
    from textual.widgets import Input

    from tests.engine.test_engine import THINKING_TEMPLATE

    async def scenario():
        app = make_app(default_gguf, tmp_path / "c.db")
        async with app.run_test(size=SIZE) as pilot:
            await send(pilot, app, "Name a colour.")
            app.engine.tokenizer.chat_template = THINKING_TEMPLATE
            tok = app.engine.tokenizer
            assert tok.decode(app.prompt_ids(), skip_special=False).endswith("<|im_start|>assistant\n")
            await pilot.press("ctrl+o")
            await pilot.pause(0.2)
            app.screen.query_one("#think", Input).value = "maybe"
            await pilot.press("ctrl+s")
            await pilot.pause(0.2)
            assert isinstance(app.screen, SettingsScreen) and "think" not in app.conversation.settings  # refused
            app.screen.query_one("#think", Input).value = "off"
            await pilot.press("ctrl+s")
            await pilot.pause(0.2)
            assert not isinstance(app.screen, SettingsScreen) and app.conversation.settings == {"think": "off"}
            assert tok.decode(app.prompt_ids(), skip_special=False).endswith("assistant\n<think>\n\n</think>\n\n")
            assert app.params().temperature == 0  # the think setting is not a sampling parameter
        store = Store(tmp_path / "c.db")
        assert store.conversations()[0].settings == {"think": "off"}
        store.close()

    asyncio.run(scenario())


def test_a_thinking_models_reasoning_is_quoted_above_its_answer(default_gguf, tmp_path):
    """A template that opens the <think> block in the prompt (as the DeepSeek-R1 distills' do): the streamed reply is
    shown as a quoted block of reasoning and saved as the model wrote it, shown so again when reloaded though it was
    cut off before </think>; a saved reply with both parts shows the reasoning quoted, and copying it copies the
    answer alone."""
    from tests.engine.test_engine import THINKING_TEMPLATE

    async def scenario():
        app = make_app(default_gguf, tmp_path / "c.db", max_tokens=8)
        async with app.run_test(size=SIZE) as pilot:
            await until(pilot, lambda: app.engine is not None)
            app.engine.tokenizer.chat_template = THINKING_TEMPLATE + "<think>\n"
            await send(pilot, app, "What is the capital of France?")
            view = app.query(MessageView)[-1]
            raw = app.store.messages(app.conversation.id)[-1].content
            assert view.text == raw and "<think>" not in raw
            assert view.source == "> " + raw.strip().replace("\n", "\n> ")
            app.show_conversation()  # reloaded: cut off inside the block the prompt opened, it is still reasoning
            await pilot.pause(0.2)
            assert app.query(MessageView)[-1].source == view.source
            app.store.add(app.conversation.id, "assistant", "<think>\nIt is Paris.\nSure.\n</think>\n\nParis.", {})
            app.show_conversation()
            await pilot.pause(0.2)
            assert app.query(MessageView)[-1].source == "> It is Paris.\n> Sure.\n\nParis."
            app.action_copy_reply()
            assert app.clipboard == "Paris."

    asyncio.run(scenario())


def test_panel_says_when_the_weights_fit_in_the_last_level_cache():
    from localpd.measure.device import DeviceInfo
    from localpd.tui.panel import cache_lines

    info = DeviceInfo("Intel(R) Xeon(R) Processor", "cpu", None, "unknown", 14e9, "cache", None, "unknown",
                      llc_bytes=480 * 2**20)
    lines = cache_lines(92 * 2**20, info)  # the default model's Q4_1 weights
    assert lines[0].startswith("LLC      480 MiB: weights fit") and "MBU may pass 100%" in lines[-1]
    assert all(len(line) <= 31 for line in lines)  # the panel's 34 columns less its border and padding
    assert cache_lines(540 * 2**20, info) == [] and cache_lines(92 * 2**20, None) == []
