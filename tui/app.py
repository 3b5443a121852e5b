"""`localpd tui`: a Textual chat app with saved conversations and the live bandwidth panel.

The engine runs on its own thread; replies are consumed in an async worker, so the UI never waits on the model.
Every user message and every finished or stopped reply is written to SQLite at once.
"""

from __future__ import annotations

import re
from dataclasses import replace
from pathlib import Path
from typing import Callable

from textual import on, work
from textual.app import App, ComposeResult, SystemCommand
from textual.binding import Binding
from textual.containers import Horizontal, Vertical, VerticalScroll
from textual.screen import ModalScreen
from textual.widgets import Button, Footer, Header, Input, Label, ListItem, ListView, Markdown, OptionList, TextArea
from textual.widgets.option_list import Option

from localpd.text.chat_template import think_vars
from localpd.text.prompt import fit_turns
from localpd.measure.device import device_info
from localpd.engine import Engine
from localpd.engine.requests import RequestHandle
from localpd.errors import LocalpdError
from localpd.constrain.reasoning import CLOSE as THINK_CLOSE
from localpd.constrain.reasoning import OPEN as THINK_OPEN
from localpd.constrain.reasoning import reply_split, split_reply
from localpd.engine.sampling import SamplingParams
from localpd.tui.panel import BandwidthPanel
from localpd.tui.store import Conversation, Store

MIN_SIZE = (60, 16)
SETTING_FIELDS = ("temperature", "top_p", "top_k", "max_tokens", "seed")  # SamplingParams fields
THINK = ("on", "off")  # a conversation's "think" setting: the chat template's enable_thinking (Qwen3)


def split_saved(text: str, stats: dict | None = None) -> tuple[str, str]:
    """A saved reply's reasoning and answer. Its stats say whether its prompt opened the <think> block (a reply cut
    off inside it is all reasoning); a reply saved without that note that closes a block it never opened was begun
    inside it."""
    inside = (stats or {}).get("inside_think") or THINK_CLOSE in text and not text.lstrip().startswith(THINK_OPEN)
    return split_reply(text, inside=bool(inside))


def quoted(reasoning: str) -> str:
    return "> " + reasoning.replace("\n", "\n> ")


class ReplyMarkdown:
    """A streamed reply as the Markdown it is shown as: a thinking model's reasoning quoted, then the answer."""

    def __init__(self, engine: Engine, prompt_ids: list[int]):
        self.split = reply_split(engine.tokenizer, prompt_ids)
        self.state = "start"  # -> reasoning -> answer

    def feed(self, text: str) -> str:
        return self._markdown(*(("", text) if self.split is None else self.split.feed(text)))

    def finish(self) -> str:
        return "" if self.split is None else self._markdown(*self.split.finish())

    def _markdown(self, reasoning: str, answer: str) -> str:
        out = ""
        if reasoning:
            out += quoted(reasoning) if self.state == "start" else reasoning.replace("\n", "\n> ")
            self.state = "reasoning"
        if answer:
            out += "\n\n" if self.state == "reasoning" else ""
            out, self.state = out + answer, "answer"
        return out


class MessageView(Markdown):
    def __init__(self, role: str, text: str = "", stats: dict | None = None, **kw):
        reasoning, answer = split_saved(text, stats) if role == "assistant" else ("", text)
        shown = quoted(reasoning) + ("\n\n" + answer if answer else "") if reasoning else text
        super().__init__(shown, classes=f"message {role}", **kw)
        self.role = role
        self.text = text


class ConversationItem(ListItem):
    def __init__(self, conversation: Conversation):
        super().__init__(Label(conversation.title))
        self.conversation_id = conversation.id


class TextPrompt(ModalScreen[str | None]):
    """One line of text (rename) or several (compose, system prompt); Ctrl+S accepts, Esc cancels."""

    BINDINGS = [Binding("escape", "cancel", "cancel"), Binding("ctrl+s", "accept", "accept")]

    def __init__(self, title: str, value: str = "", multiline: bool = False):
        super().__init__()
        self.title_text, self.value, self.multiline = title, value, multiline

    def compose(self) -> ComposeResult:
        with Vertical(classes="dialog"):
            yield Label(self.title_text + ("  (Ctrl+S to accept, Esc to cancel)" if self.multiline else ""))
            yield TextArea(self.value, id="text") if self.multiline else Input(self.value, id="text")

    def on_input_submitted(self, event: Input.Submitted) -> None:
        self.dismiss(event.value)

    def action_accept(self) -> None:
        widget = self.query_one("#text")
        self.dismiss(widget.text if isinstance(widget, TextArea) else widget.value)

    def action_cancel(self) -> None:
        self.dismiss(None)


class SettingsScreen(ModalScreen[dict | None]):
    """The conversation's system prompt, sampling settings and, for thinking models, whether to think first."""

    BINDINGS = [Binding("escape", "cancel", "cancel"), Binding("ctrl+s", "save", "save")]

    def __init__(self, system: str, settings: dict):
        super().__init__()
        self.system, self.settings = system, settings

    def compose(self) -> ComposeResult:
        with Vertical(classes="dialog"):
            yield Label("System prompt")
            yield TextArea(self.system, id="system")
            for name in SETTING_FIELDS:
                value = self.settings.get(name)
                yield Input("" if value is None else str(value), placeholder=f"{name} (default)", id=name)
            yield Input(self.settings.get("think", ""), placeholder="think: on or off (default: the model's choice)",
                        id="think")
            yield Button("Save (Ctrl+S)", id="save")

    @on(Button.Pressed, "#save")
    def action_save(self) -> None:
        out = {"system": self.query_one("#system", TextArea).text, "settings": {}}
        for name in SETTING_FIELDS:
            text = self.query_one(f"#{name}", Input).value.strip()
            if text:
                try:
                    out["settings"][name] = int(text) if name in ("top_k", "max_tokens", "seed") else float(text)
                except ValueError:
                    self.notify(f"{name}: '{text}' is not a number", severity="error")
                    return
        try:
            replace(SamplingParams(), **out["settings"]).validate()
        except LocalpdError as e:
            self.notify(str(e), severity="error")
            return
        think = self.query_one("#think", Input).value.strip()
        if think and think not in THINK:
            self.notify(f"think: '{think}' is neither on nor off", severity="error")
            return
        if think:
            out["settings"]["think"] = think
        self.dismiss(out)

    def action_cancel(self) -> None:
        self.dismiss(None)


class ModelPicker(ModalScreen[str | None]):
    BINDINGS = [Binding("escape", "cancel", "cancel")]

    def compose(self) -> ComposeResult:
        from localpd.load.registry import list_models

        options = []
        for entry, path, size in list_models():
            local = f"{size / 1e6:,.0f} MB on disk" if size else "not downloaded"
            options.append(Option(f"{entry.name:<18} {entry.size_hint:>8}  {local}", id=entry.name))
        with Vertical(classes="dialog"):
            yield Label("Model (Enter loads it; not downloaded ones are fetched first)")
            yield OptionList(*options, id="models")

    def on_option_list_option_selected(self, event: OptionList.OptionSelected) -> None:
        self.dismiss(event.option.id)

    def action_cancel(self) -> None:
        self.dismiss(None)


class LocalpdApp(App):
    TITLE = "localpd"
    CSS_PATH = "app.tcss"
    BINDINGS = [
        Binding("ctrl+n", "new_chat", "new"), Binding("escape", "stop", "stop"),
        Binding("ctrl+r", "regenerate", "regenerate"), Binding("ctrl+e", "edit_last", "edit"),
        Binding("ctrl+y", "copy_reply", "copy"), Binding("ctrl+k", "copy_code", "copy code", show=False),
        Binding("ctrl+j", "compose_multiline", "multi-line"), Binding("ctrl+o", "settings", "settings"),
        Binding("ctrl+l", "pick_model", "model"), Binding("f2", "rename", "rename", show=False),
        Binding("ctrl+x", "delete_chat", "delete", show=False), Binding("ctrl+t", "toggle_dark", "theme", show=False),
    ]

    def __init__(self, load_engine: Callable[[str | None], Engine], db_path: Path, model: str | None = None,
                 params: SamplingParams | None = None, system: str = ""):
        super().__init__()
        self.load_engine, self.model_name = load_engine, model
        self.store = Store(db_path)
        self.defaults = params or SamplingParams()
        self.default_system = system
        self.engine: Engine | None = None
        self.conversation: Conversation | None = None
        self.handle: RequestHandle | None = None  # the running reply
        self.last_handle: RequestHandle | None = None
        self.history: list[str] = []
        self.history_pos = 0
        self.editing_from: int | None = None  # message id an edited message replaces

    def compose(self) -> ComposeResult:
        yield Header()
        with Horizontal():
            with Vertical(id="sidebar"):
                yield Input(placeholder="search titles", id="search")
                yield ListView(id="conversations")
            with Vertical(id="main"):
                yield VerticalScroll(id="chat")
                yield Input(placeholder="Message (Enter sends, Ctrl+J multi-line, Esc stops)", id="prompt")
            yield BandwidthPanel(id="panel")
        yield Footer()

    def on_mount(self) -> None:
        if self.store.recovered_from:
            self.notify(f"the conversation database could not be read; it was moved to "
                        f"{self.store.recovered_from.name} and a new one started", severity="warning", timeout=10)
        convs = self.store.conversations()
        self.conversation = convs[0] if convs else self.store.new(system=self.default_system)
        self.refresh_sidebar()
        self.show_conversation()
        self.query_one("#prompt", Input).focus()
        self.load_model(self.model_name)

    def on_resize(self) -> None:
        w, h = self.size
        if w < MIN_SIZE[0] or h < MIN_SIZE[1]:
            self.notify(f"the terminal is {w}x{h}; localpd tui needs at least {MIN_SIZE[0]}x{MIN_SIZE[1]}",
                        severity="warning")

    # -- model loading ---------------------------------------------------------------------------------------
    @work(thread=True, exclusive=True, group="load")
    def load_model(self, name: str | None) -> None:
        self.call_from_thread(self.set_status, f"loading {name or 'the default model'} ...")
        try:
            engine = self.load_engine(name)
            info = device_info(engine.device)
        except (LocalpdError, OSError) as e:
            self.call_from_thread(self.notify, f"cannot load the model: {e}", severity="error", timeout=10)
            self.call_from_thread(self.set_status, "no model loaded (Ctrl+L picks one)")
            return
        self.call_from_thread(self.engine_ready, engine, info)

    def engine_ready(self, engine: Engine, info) -> None:
        old, self.engine = self.engine, engine
        if old is not None and old is not engine:
            old.close()
        panel = self.query_one(BandwidthPanel)
        panel.engine, panel.info = engine, info
        panel.show()
        self.set_status(f"{engine.name} on {info.name}")

    def set_status(self, text: str) -> None:
        self.sub_title = text

    # -- conversations -----------------------------------------------------------------------------------------
    def refresh_sidebar(self, search: str = "") -> None:
        lv = self.query_one("#conversations", ListView)
        lv.clear()
        for c in self.store.conversations(search):
            lv.append(ConversationItem(c))

    @on(Input.Changed, "#search")
    def search_changed(self, event: Input.Changed) -> None:
        self.refresh_sidebar(event.value)

    @on(ListView.Selected, "#conversations")
    def conversation_selected(self, event: ListView.Selected) -> None:
        if self.handle is not None:
            self.notify("stop the reply first (Esc)", severity="warning")
            return
        self.conversation = self.store.get(event.item.conversation_id)
        self.show_conversation()

    def show_conversation(self) -> None:
        chat = self.query_one("#chat", VerticalScroll)
        chat.remove_children()
        for m in self.store.messages(self.conversation.id):
            chat.mount(MessageView(m.role, m.content, m.stats))
        chat.scroll_end(animate=False)
        self.title = f"localpd — {self.conversation.title}"

    def action_new_chat(self) -> None:
        self.conversation = self.store.new(system=self.default_system)
        self.refresh_sidebar()
        self.show_conversation()

    def action_rename(self) -> None:
        def done(title: str | None) -> None:
            if title:
                self.conversation.title = title.strip()[:80]
                self.store.update(self.conversation)
                self.refresh_sidebar()
                self.title = f"localpd — {self.conversation.title}"

        self.push_screen(TextPrompt("Title", self.conversation.title), done)

    def action_delete_chat(self) -> None:
        if self.handle is not None:
            return
        self.store.delete(self.conversation.id)
        convs = self.store.conversations()
        self.conversation = convs[0] if convs else self.store.new(system=self.default_system)
        self.refresh_sidebar()
        self.show_conversation()

    def action_settings(self) -> None:
        def done(result: dict | None) -> None:
            if result is not None:
                self.conversation.system, self.conversation.settings = result["system"], result["settings"]
                self.store.update(self.conversation)
                self.notify("settings saved for this conversation")

        self.push_screen(SettingsScreen(self.conversation.system, self.conversation.settings), done)

    def action_pick_model(self) -> None:
        def done(name: str | None) -> None:
            if name:
                self.load_model(name)

        self.push_screen(ModelPicker(), done)

    def action_toggle_dark(self) -> None:
        self.theme = "textual-light" if self.theme == "textual-dark" else "textual-dark"

    def get_system_commands(self, screen):
        yield from super().get_system_commands(screen)
        for title, help_, action in (
                ("New chat", "start a new conversation", self.action_new_chat),
                ("Rename chat", "rename this conversation", self.action_rename),
                ("Delete chat", "delete this conversation", self.action_delete_chat),
                ("Conversation settings", "system prompt and sampling", self.action_settings),
                ("Switch model", "pick a model from the registry", self.action_pick_model),
                ("Regenerate", "answer the last message again", self.action_regenerate),
                ("Copy reply", "copy the last reply", self.action_copy_reply),
                ("Copy code block", "copy the last code block of the last reply", self.action_copy_code)):
            yield SystemCommand(title, help_, action)

    # -- sending and replying ------------------------------------------------------------------------------------
    def on_key(self, event) -> None:
        prompt = self.query_one("#prompt", Input)
        if self.focused is not prompt or not self.history or event.key not in ("up", "down"):
            return
        step = -1 if event.key == "up" else 1
        self.history_pos = max(0, min(len(self.history), self.history_pos + step))
        prompt.value = self.history[self.history_pos] if self.history_pos < len(self.history) else ""
        event.stop()

    @on(Input.Submitted, "#prompt")
    def prompt_submitted(self, event: Input.Submitted) -> None:
        text = event.value.strip()
        if text:
            event.input.value = ""
            self.send(text)

    def action_compose_multiline(self) -> None:
        def done(text: str | None) -> None:
            if text and text.strip():
                self.send(text.strip())

        self.push_screen(TextPrompt("Message", self.query_one("#prompt", Input).value, multiline=True), done)

    def send(self, text: str) -> None:
        if self.handle is not None:
            self.notify("a reply is running; Esc stops it", severity="warning")
            return
        if self.engine is None:
            self.notify("no model is loaded yet", severity="warning")
            return
        self.history.append(text)
        self.history_pos = len(self.history)
        if self.editing_from is not None:
            self.store.delete_from(self.conversation.id, self.editing_from)
            self.editing_from = None
            self.show_conversation()
        if self.conversation.title == "New chat":
            self.conversation.title = re.sub(r"\s+", " ", text)[:40]
            self.store.update(self.conversation)
            self.refresh_sidebar()
        self.store.add(self.conversation.id, "user", text)
        self.query_one("#chat", VerticalScroll).mount(MessageView("user", text))
        self.reply()

    def params(self) -> SamplingParams:
        return replace(self.defaults, **{k: v for k, v in self.conversation.settings.items() if k in SETTING_FIELDS})

    def prompt_ids(self) -> list[int]:
        """The conversation as token ids, oldest turns dropped until it leaves room for the reply."""
        messages = [{"role": m.role, "content": m.content} for m in self.store.messages(self.conversation.id)]
        system = [{"role": "system", "content": self.conversation.system}] if self.conversation.system else []
        template_vars = think_vars(self.conversation.settings.get("think"))
        ids, _ = fit_turns(lambda m: self.engine.encode_chat(m, template_vars=template_vars), system, messages[:-1],
                           messages[-1:], self.engine.max_context, self.params().max_tokens)
        return ids

    @work(exclusive=True, group="reply")
    async def reply(self) -> None:
        chat = self.query_one("#chat", VerticalScroll)
        panel = self.query_one(BandwidthPanel)
        conversation = self.conversation
        try:
            ids = self.prompt_ids()
            handle = self.engine.submit(ids, self.params())
        except LocalpdError as e:
            self.notify(str(e), severity="error")
            return
        self.handle = self.last_handle = handle
        view = MessageView("assistant")
        await chat.mount(view)
        stream = Markdown.get_stream(view)
        shown = ReplyMarkdown(self.engine, ids)
        panel.start_reply()
        parts, reason = [], None
        try:
            async for event in handle:
                reason = event.finish_reason
                if event.error:
                    self.notify(f"generation failed: {event.error}", severity="error")
                if event.text:
                    parts.append(event.text)
                    if markdown := shown.feed(event.text):
                        await stream.write(markdown)
                    chat.scroll_end(animate=False)
                panel.add_token(event, handle)
        finally:
            if markdown := shown.finish():
                await stream.write(markdown)
            await stream.stop()
            self.handle = None
            view.text = "".join(parts)
            s = handle.stats
            stats = {"finish_reason": reason or "cancelled", "prompt_tokens": s.prompt_tokens,
                     "cached_tokens": s.cached_tokens, "output_tokens": s.output_tokens, "ttft": s.ttft,
                     "decode_tps": s.decode_tps}
            if shown.split is not None and shown.split.inside:
                stats["inside_think"] = True  # the prompt opened the <think> block the reply goes on in
            if view.text or reason not in ("error", None):
                self.store.add(conversation.id, "assistant", view.text, stats)

    def action_stop(self) -> None:
        if self.handle is not None:
            self.handle.cancel()

    def last(self, role: str):
        msgs = [m for m in self.store.messages(self.conversation.id) if m.role == role]
        return msgs[-1] if msgs else None

    def action_regenerate(self) -> None:
        if self.handle is not None or self.engine is None:
            return
        reply = self.last("assistant")
        user = self.last("user")
        if user is None:
            return
        if reply is not None and reply.id > user.id:
            self.store.delete_from(self.conversation.id, reply.id)
        self.show_conversation()
        self.reply()

    def action_edit_last(self) -> None:
        user = self.last("user")
        if user is None or self.handle is not None:
            return
        self.editing_from = user.id
        prompt = self.query_one("#prompt", Input)
        prompt.value = user.content
        prompt.focus()
        self.notify("editing your last message: Enter resends it and drops what came after")

    def action_copy_reply(self) -> None:
        reply = self.last("assistant")
        if reply is not None:
            self.copy_to_clipboard(split_saved(reply.content, reply.stats)[1])
            self.notify("reply copied")

    def action_copy_code(self) -> None:
        reply = self.last("assistant")
        blocks = re.findall(r"```[^\n]*\n(.*?)```", reply.content if reply else "", flags=re.S)
        if blocks:
            self.copy_to_clipboard(blocks[-1])
            self.notify("code block copied")
        else:
            self.notify("no code block in the last reply", severity="warning")

    def on_unmount(self) -> None:
        if self.handle is not None:
            self.handle.cancel()
        if self.engine is not None:
            self.engine.close()
        self.store.close()


def run_tui(args) -> int:
    from localpd.cli.chat import params_from_args
    from localpd.load.registry import cache_dir

    params = params_from_args(args)

    def load(name: str | None) -> Engine:
        from localpd.cli.engine_args import CHAT_CONTEXT, engine_from_args

        return engine_from_args(args, name, default_ctx=CHAT_CONTEXT)

    LocalpdApp(load, Path(cache_dir()) / "conversations.db", args.model, params, args.system or "").run()
    return 0
