"""`localpd chat`: a terminal REPL, or one answer when a prompt is given or stdin is piped."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
from dataclasses import replace

from localpd.cli.engine_args import CHAT_CONTEXT, engine_from_args
from localpd.text.chat_template import think_vars
from localpd.text.prompt import fit_turns
from localpd.measure.device import DeviceInfo, cache_note, device_info
from localpd.engine import Engine
from localpd.engine.requests import GenerationStats
from localpd.errors import LocalpdError
from localpd.constrain.grammar import choice_pattern
from localpd.constrain.reasoning import reply_split
from localpd.measure.roofline import decode_ceiling_tps
from localpd.engine.sampling import SamplingParams

HELP = """commands:
  /set temperature|top_p|top_k|min_p|max_tokens|seed|repeat_penalty VALUE   change a sampling setting
  /set verbose on|off   print timings after each reply
  /set think on|off|default   thinking models (Qwen3): think first, answer at once, or the model's choice
  /system TEXT          set the system prompt (clears the conversation)
  /clear                forget the conversation
  /save FILE            write the conversation (system prompt, messages, settings) to a JSON file
  /load FILE            go on with a conversation /save wrote
  /stats                timings and decode bandwidth of the last reply
  /bye                  leave (or Ctrl+D)
  \"\"\"                   begin and end a multi-line message
Ctrl+C stops a reply without leaving."""

SETTINGS = {  # /set name -> (SamplingParams field, parser)
    "temperature": ("temperature", float), "top_p": ("top_p", float), "top_k": ("top_k", int),
    "min_p": ("min_p", float), "max_tokens": ("max_tokens", int), "seed": ("seed", int),
    "repeat_penalty": ("repetition_penalty", float),
}


def params_from_args(args) -> SamplingParams:
    choices, regex = getattr(args, "choice", None), getattr(args, "regex", None)
    return SamplingParams(
        temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, min_p=args.min_p,
        repetition_penalty=args.repeat_penalty, max_tokens=args.max_tokens, seed=args.seed, stop=list(args.stop),
        json_object=getattr(args, "format", None) is not None, json_schema=getattr(args, "format", None) or None,
        regex=choice_pattern(choices) if choices else regex, grammar=getattr(args, "grammar", None),
    ).validate()


def format_stats(s: GenerationStats, engine: Engine | None = None, info: DeviceInfo | None = None) -> str:
    """The last reply's timings; with the engine and its device's ceilings, also the bandwidth its decode steps
    reached and the tokens/s the device could reach at this context if every byte moved at that ceiling."""
    lines = [
        f"prompt tokens:        {s.prompt_tokens} ({s.cached_tokens} cached)",
        f"time to first token:  {s.ttft * 1000:.0f} ms",
        f"prefill rate:         {s.prefill_tps:.1f} tokens/s",
        f"output tokens:        {s.output_tokens}",
        f"decode rate:          {s.decode_tps:.1f} tokens/s",
    ]
    if s.drafted_tokens:  # speculative decoding
        lines.append(f"speculation:          {s.accepted_tokens} of {s.drafted_tokens} drafted tokens accepted "
                     f"({s.acceptance:.0%}), {s.tokens_per_pass:.2f} tokens per pass over the weights")
    if s.decode_step_seconds <= 0 or not s.decode_bytes:
        return "\n".join(lines)
    rate = s.decode_bytes / s.decode_step_seconds
    bandwidth = info.bandwidth if info is not None else None
    line = f"decode bandwidth:     {rate / 1e9:.1f} GB/s"
    if bandwidth:
        which = "measured copy" if info.measured_bandwidth else f"{info.peak_source} peak"
        line += f" ({rate / bandwidth:.0%} of {bandwidth / 1e9:.0f} GB/s, {which})"
    lines.append(line)
    if engine is not None and cache_note(engine.model.weight_bytes, info):
        lines.append(f"                      {cache_note(engine.model.weight_bytes, info)}")
    if bandwidth and engine is not None:
        context = s.prompt_tokens + s.output_tokens
        ceiling = decode_ceiling_tps(engine.model, context, engine.kv_traffic, bandwidth)
        lines.append(f"decode ceiling:       {ceiling:.1f} tokens/s at {context} tokens of context"
                     + (f" (one token a pass; this reply: {s.decode_tps / ceiling:.0%} of it)" if s.drafted_tokens
                        else ""))
    return "\n".join(lines)


class ReplyPrinter:
    """Prints a reply as it streams. A thinking model's reasoning is dimmed on a terminal, or goes to stderr when
    stdout is not one (so that stdout holds the answer alone); the whole reply, tags included, stays in the
    conversation, where the model's template expects it."""

    DIM, PLAIN = "\x1b[2m", "\x1b[0m"

    def __init__(self, engine: Engine, prompt_ids: list[int]):
        self.split = reply_split(engine.tokenizer, prompt_ids)
        self.tty = sys.stdout.isatty()
        self.thinking = False

    def write(self, text: str) -> None:
        reasoning, answer = ("", text) if self.split is None else self.split.feed(text)
        self._show(reasoning, answer)

    def close(self) -> None:
        if self.split is not None:
            self._show(*self.split.finish())
        self._end_reasoning(answer_follows=False)

    def _show(self, reasoning: str, answer: str) -> None:
        if reasoning:
            out = sys.stdout if self.tty else sys.stderr
            if not self.thinking:
                out.write(self.DIM if self.tty else "")
                self.thinking = True
            out.write(reasoning)
            out.flush()
        if answer:
            self._end_reasoning(answer_follows=True)
            sys.stdout.write(answer)
            sys.stdout.flush()

    def _end_reasoning(self, answer_follows: bool) -> None:
        if self.thinking:
            out = sys.stdout if self.tty else sys.stderr
            out.write((self.PLAIN if self.tty else "") + ("\n\n" if answer_follows and self.tty else "\n"))
            out.flush()
            self.thinking = False


def run_chat(args) -> int:
    params = params_from_args(args)
    interactive = args.prompt is None and sys.stdin.isatty()
    if args.prompt is None and not interactive:
        args.prompt = sys.stdin.read().strip()
        if not args.prompt:
            raise LocalpdError("no prompt: stdin was empty")
    if interactive:
        print(f"loading {args.model or 'the default model'} ...", file=sys.stderr)
    engine = engine_from_args(args, default_ctx=CHAT_CONTEXT, progress=True)
    try:
        chat = Chat(engine, params, args.system, verbose=args.verbose, think=args.think)
        if interactive or args.verbose:
            for note in engine.notes + ([engine.path] if args.verbose else []):
                print(note, file=sys.stderr)
        if not interactive:
            chat.reply(args.prompt)
            return 0
        print(f"{engine.name} on {engine.device.type}. /? for help, /bye to leave.", file=sys.stderr)
        chat.repl()
        return 0
    finally:
        engine.close()  # the engine thread must not be mid-step while the interpreter shuts down


class Chat:
    def __init__(self, engine: Engine, params: SamplingParams, system: str | None, verbose: bool = False,
                 think: str | None = None):
        self.engine = engine
        self.params = params
        self.system = system
        self.verbose = verbose
        self.think = think  # "on", "off" or None: the template's enable_thinking, or left to the model
        self.messages: list[dict] = []
        self.last_stats = GenerationStats()
        self._info: DeviceInfo | None = None

    def device_info(self) -> DeviceInfo:
        """The device's bandwidth ceilings, measured (or read from the cache) the first time stats are shown."""
        if self._info is None:
            self._info = device_info(self.engine.device)
        return self._info

    def fit_to_context(self, user_text: str) -> list[int]:
        """Token ids of the conversation plus the new message, dropping the oldest turns if they don't fit."""
        think = think_vars(self.think)
        system = [{"role": "system", "content": self.system}] if self.system else []
        ids, self.messages = fit_turns(lambda m: self.engine.encode_chat(m, template_vars=think), system,
                                       self.messages, [{"role": "user", "content": user_text}],
                                       self.engine.max_context, self.params.max_tokens)
        return ids

    def reply(self, user_text: str) -> str:
        parts: list[str] = []
        interrupted = False
        shown = handle = None
        try:
            ids = self.fit_to_context(user_text)
            shown = ReplyPrinter(self.engine, ids)
            handle = self.engine.submit(ids, self.params)
            self.last_stats = handle.stats
            for event in handle:
                if event.finish_reason == "error":
                    raise LocalpdError(event.error)
                parts.append(event.text)
                shown.write(event.text)
        except KeyboardInterrupt:
            interrupted = True
            if handle is not None:  # the engine stops generating too, not only the printing
                handle.cancel()
        finally:
            if shown is not None:
                shown.close()
        sys.stdout.write("\n")
        sys.stdout.flush()
        text = "".join(parts)
        if not interrupted:  # a stopped reply is not part of the conversation
            self.messages += [{"role": "user", "content": user_text}, {"role": "assistant", "content": text}]
        if self.verbose:
            print(format_stats(self.last_stats, self.engine, self.device_info()), file=sys.stderr)
        return text

    def repl(self) -> None:
        # Ctrl+C stops a reply (KeyboardInterrupt): a REPL started by a process that ignores SIGINT would inherit
        # that, and Python installs no handler of its own then
        signal.signal(signal.SIGINT, signal.default_int_handler)
        setup_history()
        while True:
            try:
                line = read_message()
            except EOFError:
                print(file=sys.stderr)
                return
            except KeyboardInterrupt:
                print("\n(use Ctrl+D or /bye to leave)", file=sys.stderr)
                continue
            if not line.strip():
                continue
            if line.startswith("/"):
                if self.command(line.strip()) == "bye":
                    return
                continue
            try:
                self.reply(line)
            except LocalpdError as e:
                print(f"error: {e}", file=sys.stderr)

    def command(self, line: str) -> str | None:
        name, _, rest = line.partition(" ")
        rest = rest.strip()
        if name in ("/bye", "/exit", "/quit"):
            return "bye"
        if name in ("/?", "/help"):
            print(HELP, file=sys.stderr)
        elif name == "/clear":
            self.messages = []
            print("conversation cleared", file=sys.stderr)
        elif name == "/system":
            self.system = rest or None
            self.messages = []
            print("system prompt set" if rest else "system prompt removed", file=sys.stderr)
        elif name in ("/save", "/load") and not rest:
            print(f"{name} takes a file name", file=sys.stderr)
        elif name == "/save":
            self.save(rest)
        elif name == "/load":
            self.load(rest)
        elif name == "/stats":
            print(format_stats(self.last_stats, self.engine, self.device_info()), file=sys.stderr)
        elif name == "/set":
            self.set(rest)
        else:
            print(f"unknown command {name}; /? lists them", file=sys.stderr)
        return None

    def save(self, path: str) -> None:
        """The conversation as JSON, written whole or not at all (a new file renamed over the old)."""
        data = {"model": self.engine.name, "system": self.system, "think": self.think, "messages": self.messages,
                "params": {k: getattr(self.params, field) for k, (field, _) in SETTINGS.items()}}
        tmp = f"{path}.tmp-{os.getpid()}"
        try:
            with open(tmp, "w", encoding="utf-8") as f:
                json.dump(data, f, ensure_ascii=False, indent=1)
            os.replace(tmp, path)
        except OSError as e:
            print(f"cannot save to {path}: {e.strerror or e}", file=sys.stderr)
            with contextlib.suppress(OSError):
                os.remove(tmp)
            return
        print(f"saved {len(self.messages)} messages to {path}", file=sys.stderr)

    def load(self, path: str) -> None:
        """Go on with a saved conversation; a file that is not one leaves this conversation as it is."""
        try:
            with open(path, encoding="utf-8") as f:
                data = json.load(f)
            if not isinstance(data, dict) or "messages" not in data:
                raise ValueError("it is not a conversation /save wrote")
            messages, system = data["messages"], data.get("system")
            if not (isinstance(messages, list) and all(
                    isinstance(m, dict) and m.get("role") in ("user", "assistant") and isinstance(m.get("content"), str)
                    for m in messages) and (system is None or isinstance(system, str))):
                raise ValueError("its messages are not a list of user and assistant turns")
            params = replace(self.params, **{SETTINGS[k][0]: v for k, v in data.get("params", {}).items()
                                              if k in SETTINGS}).validate()
        except (OSError, ValueError, TypeError, LocalpdError) as e:
            reason = e.strerror if isinstance(e, OSError) and e.strerror else e
            print(f"cannot load {path}: {reason}", file=sys.stderr)
            return
        self.messages, self.system, self.params = messages, system, params
        self.think = data.get("think") if data.get("think") in ("on", "off") else None
        print(f"loaded {len(messages)} messages from {path}", file=sys.stderr)

    def set(self, rest: str) -> None:
        key, _, value = rest.partition(" ")
        value = value.strip()
        if key == "verbose":
            self.verbose = value in ("on", "true", "1", "")
            return
        if key == "think":
            if value not in ("on", "off", "default"):
                print("think takes on, off or default", file=sys.stderr)
                return
            self.think = None if value == "default" else value
            print(f"think = {value}", file=sys.stderr)
            return
        if key not in SETTINGS:
            print(f"unknown setting '{key}'; settings: verbose, think, {', '.join(SETTINGS)}", file=sys.stderr)
            return
        field, parse = SETTINGS[key]
        try:
            self.params = replace(self.params, **{field: parse(value)}).validate()
        except (ValueError, LocalpdError) as e:
            print(f"bad value for {key}: {e}", file=sys.stderr)
            return
        print(f"{key} = {value}", file=sys.stderr)


def read_message() -> str:
    """One message; one opened with three double quotes runs on until a line that ends with them."""
    line = input(">>> ")
    if not line.lstrip().startswith('"""'):
        return line
    body = line.lstrip()[3:]
    if body.rstrip().endswith('"""'):
        return body.rstrip()[:-3]
    lines = [body]
    while not lines[-1].rstrip().endswith('"""'):
        lines.append(input("... "))
    lines[-1] = lines[-1].rstrip()[:-3]
    return "\n".join(lines).strip("\n")


def setup_history() -> None:
    try:
        import atexit
        import readline
    except ImportError:
        return
    from localpd.load.registry import cache_dir

    path = os.path.join(cache_dir(), "chat_history")
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        readline.read_history_file(path)
    except OSError:
        pass
    atexit.register(lambda: _save_history(readline, path))


def _save_history(readline, path: str) -> None:
    try:
        readline.set_history_length(1000)
        readline.write_history_file(path)
    except OSError:
        pass
