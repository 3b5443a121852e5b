"""The `localpd` command: chat, tui, serve, bench, quantize, export, embed, pull, models, eval."""

from __future__ import annotations

import argparse
import os
import sys

from localpd.api.models import FIT_TIMEOUT, KEEP_ALIVE, MAX_LOADED, keep_alive_seconds
from localpd.cli.engine_args import CHAT_CONTEXT, engine_from_args
from localpd.errors import LocalpdError
from localpd.kvcache.formats import FORMATS, kv_formats
from localpd.engine.scheduler import MAX_RUNNING, MAX_STEP_TOKENS
from localpd.quant.schemes import SCHEMES


class Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, not a usage dump
        print(f"localpd: error: {message} (see '{self.prog} --help')", file=sys.stderr)
        sys.exit(2)


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def seconds_arg(text: str) -> float:
    value = float(text)
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"must be >= 0 seconds, got {text}")
    return value


def keep_alive_arg(text: str) -> float:
    """--keep-alive: a duration (5m, 1h30m, 30s), seconds, 0 or a negative one (forever)."""
    try:
        value = keep_alive_seconds(text)
    except LocalpdError as e:
        raise argparse.ArgumentTypeError(str(e).replace("keep_alive", "--keep-alive")) from None
    if value is None:
        raise argparse.ArgumentTypeError("must not be empty")
    return value


def threads_arg(text: str) -> int:
    """--threads: a positive whole number."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a whole number >= 1, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def apply_threads(args) -> None:
    """torch's intra-op threads, before any model loads: --threads, else the physical cores this process may run
    on (torch's own default counts the machine's physical cores, whatever the affinity). OMP_NUM_THREADS or
    MKL_NUM_THREADS, when set, stand as torch read them. The CPU kernels size their pools from
    torch.get_num_threads(), so this one call sets them too."""
    import torch

    if getattr(args, "threads", None):
        torch.set_num_threads(args.threads)
    elif hasattr(args, "threads") and not (os.environ.get("OMP_NUM_THREADS") or os.environ.get("MKL_NUM_THREADS")):
        from localpd.measure.device import physical_cores

        torch.set_num_threads(physical_cores())


def add_model_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--threads", "-t", type=threads_arg, metavar="N",
                   help="CPU threads for torch and the CPU kernels, as llama.cpp's -t (default: the physical cores "
                        "this process may run on)")
    p.add_argument("--device", choices=["cpu", "cuda"], help="where to run (default: cuda when available)")
    p.add_argument("--ctx", type=positive_int, help="context length in tokens (default: the model's; chat and tui at "
                   f"most {CHAT_CONTEXT})")
    p.add_argument("--quant", choices=SCHEMES, metavar="SCHEME",
                   help="weight scheme: " + ", ".join(SCHEMES) + " (default: native; fp32 on a CPU where localpd's CPU "
                   "kernels cannot be built)")
    p.add_argument("--kv", type=kv_dtype_arg, metavar="DTYPE",
                   help="KV cache dtype: " + ", ".join(FORMATS) + ", or KEYS/VALUES such as int4ch/int4 "
                   "(default: fp16 on the CPU's kernels, else the compute dtype)")
    p.add_argument("--kv-memory", metavar="SIZE",
                   help="bytes for the KV cache, a --draft model's pages included, e.g. 4GiB (default: most of the "
                        "free GPU memory; two contexts on CPU)")


def draft_tokens_arg(text: str) -> int:
    """--draft-tokens: 1 .. speculate.MAX_DRAFT."""
    from localpd.engine.speculate import MAX_DRAFT

    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a whole number, got {text!r}") from None
    if not 1 <= value <= MAX_DRAFT:
        raise argparse.ArgumentTypeError(f"must be between 1 and {MAX_DRAFT}, got {value}")
    return value


def add_speculate_options(p: argparse.ArgumentParser) -> None:
    from localpd.engine.speculate import DRAFT_TOKENS, MODES

    p.add_argument("--speculate", choices=MODES, default="off",
                   help="speculative decoding: ngram drafts the next tokens from the prompt and reply so far (prompt "
                        "lookup) and checks them in one step, same output; off decodes a token a step (default off)")
    p.add_argument("--draft-tokens", type=draft_tokens_arg, default=DRAFT_TOKENS, metavar="K",
                   help=f"the most tokens drafted a step; fewer where the recent drafts were rejected, none where "
                        f"drafting loses (default {DRAFT_TOKENS})")
    p.add_argument("--draft", metavar="MODEL",
                   help="speculative decoding by a draft model: a small model of the same vocabulary (registry name "
                        "or file) drafts the next tokens, which this one checks in one step, same output")


def add_sampling_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--temperature", type=float, default=0.7, help="0 for greedy (default 0.7)")
    p.add_argument("--top-p", type=float, default=0.9)
    p.add_argument("--top-k", type=int, default=40)
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--repeat-penalty", type=float, default=1.0)
    p.add_argument("--max-tokens", type=positive_int, default=512)
    p.add_argument("--seed", type=int)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")


def format_arg(text: str) -> dict:
    """--format: "json" ({} : any object), or a file holding a JSON schema (the schema)."""
    if text == "json":
        return {}
    import json

    from localpd.constrain.grammar import GrammarError, check, json_grammar

    try:
        schema = json.loads(open(text, encoding="utf-8").read())
        check(json_grammar(schema))
    except OSError as e:
        raise argparse.ArgumentTypeError(f"neither json nor a readable schema file: {e.strerror}: {text}") from None
    except ValueError as e:  # not JSON, or a schema the grammar engine cannot take (GrammarError)
        raise argparse.ArgumentTypeError(f"{text} is not a JSON schema localpd can take: {e}") from None
    return schema


def nonempty(text: str) -> str:
    if not text:
        raise argparse.ArgumentTypeError("must not be empty")
    return text


def regex_arg(text: str) -> str:
    """--regex: a pattern the grammar engine can hold, checked now."""
    from localpd.constrain.grammar import GrammarError, check, regex_grammar

    try:
        check(regex_grammar(text))
    except GrammarError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


def grammar_arg(path: str) -> str:
    """--grammar: a file holding a GBNF or Lark grammar, its text checked now."""
    from localpd.constrain.grammar import GrammarError, check, text_grammar

    try:
        text = open(path, encoding="utf-8").read()
        check(text_grammar(text))
    except OSError as e:
        raise argparse.ArgumentTypeError(f"cannot read the grammar file: {e.strerror}: {path}") from None
    except GrammarError as e:
        raise argparse.ArgumentTypeError(f"{path}: {e}") from None
    return text


def kv_dtype_arg(text: str) -> str:
    try:
        kv_formats(text)
    except LocalpdError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="localpd", description="Local LLM inference that shows how close it comes to the card's limit.")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=Parser)

    chat = sub.add_parser("chat", help="chat with a model (one answer when PROMPT is given or stdin is piped)")
    chat.add_argument("model", nargs="?", help="registry name, .gguf file or model directory (default: the registry's default)")
    chat.add_argument("prompt", nargs="?", help="answer this once and exit")
    chat.add_argument("--system", help="system prompt")
    chat.add_argument("--verbose", action="store_true", help="print timings after each reply")
    chat.add_argument("--think", choices=["on", "off"],
                      help="thinking models (Qwen3): reason in a <think> block first, or answer at once (default: "
                           "the model's own choice)")
    shape = chat.add_mutually_exclusive_group()
    shape.add_argument("--format", type=format_arg, metavar="json|SCHEMA.json",
                       help="json: every reply is one JSON object; a JSON schema file: one value of that schema "
                            "(constrained decoding)")
    shape.add_argument("--regex", type=regex_arg, metavar="PATTERN",
                       help="every reply is a whole match of this regular expression (ECMA's regular part, as the "
                            "server's guided_regex)")
    shape.add_argument("--grammar", type=grammar_arg, metavar="FILE",
                       help="every reply is a sentence of the GBNF (llama.cpp's) or Lark grammar in FILE")
    shape.add_argument("--choice", action="append", type=nonempty, metavar="TEXT",
                       help="every reply is one of these texts (repeatable; the server's guided_choice)")
    add_model_options(chat)
    add_speculate_options(chat)
    add_sampling_options(chat)

    tui = sub.add_parser("tui", help="the chat app: saved conversations and the live bandwidth panel")
    tui.add_argument("model", nargs="?", help="registry name, .gguf file or model directory (default: the registry's default)")
    tui.add_argument("--system", help="system prompt for new conversations")
    add_model_options(tui)
    add_speculate_options(tui)
    add_sampling_options(tui)

    serve = sub.add_parser("serve", help="an OpenAI-compatible API on localhost (/v1/chat/completions ...)")
    serve.add_argument("model", nargs="*", metavar="MODEL",
                       help="registry names, .gguf files or model directories, each served under its name (default: "
                            "every registry model downloaded, else the registry's default); the first loads at start, "
                            "the others on their first request")
    serve.add_argument("--max-loaded", type=positive_int, default=MAX_LOADED, metavar="N",
                       help=f"models loaded at once; loading one more unloads the least recently used idle one "
                            f"(default {MAX_LOADED})")
    serve.add_argument("--memory", metavar="SIZE",
                       help="bytes the loaded models may hold together (weights and KV cache), e.g. 8GiB; past it the "
                            "least recently used idle one is unloaded (default: what the device has free at start)")
    serve.add_argument("--keep-alive", type=keep_alive_arg, default=KEEP_ALIVE, metavar="DURATION",
                       help="how long an idle model stays loaded: 5m, 1h, 30s, 0 (unload after each request) or -1 "
                            "(forever); a request's keep_alive overrides it (default 5m)")
    serve.add_argument("--fit-timeout", type=seconds_arg, default=FIT_TIMEOUT, metavar="SECONDS",
                       help="how long a request waits for room to load its model while the loaded ones are busy, "
                            f"before a 503 (default {FIT_TIMEOUT:g})")
    serve.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1: this machine only)")
    serve.add_argument("--port", type=positive_int, default=8000)
    serve.add_argument("--api-key", help="require 'Authorization: Bearer KEY' on every route but / and /health")
    serve.add_argument("--max-waiting", type=positive_int, default=64, help="queued requests before answering 503")
    serve.add_argument("--max-running", type=positive_int, default=MAX_RUNNING,
                       help=f"sequences decoded together; more wait their turn (default {MAX_RUNNING})")
    serve.add_argument("--step-tokens", type=positive_int, default=MAX_STEP_TOKENS,
                       help=f"tokens one step computes, prompt chunks included: more is faster prefill, fewer is "
                            f"shorter decode stalls behind a long prompt; it caps --max-running too "
                            f"(default {MAX_STEP_TOKENS})")
    serve.add_argument("--cors", action="append", default=[], metavar="ORIGIN",
                       help="let web pages from ORIGIN (e.g. http://localhost:3000, or * for any) call the API from "
                            "a browser (repeatable; default: none)")
    serve.add_argument("--reasoning", choices=("split", "inline"), default="split",
                       help="a thinking model's <think> block: in reasoning_content (split, the default) or left in "
                            "the content (inline)")
    serve.add_argument("--shutdown-timeout", type=seconds_arg, default=5.0, metavar="SECONDS",
                       help="on SIGTERM or Ctrl+C, how long running requests may go on before they are cut, each "
                            "ending with finish_reason abort (default 5; a second signal exits at once)")
    add_model_options(serve)
    add_speculate_options(serve)

    bench = sub.add_parser("bench", help="prefill/decode speed, MBU and MFU against the device's ceilings")
    from localpd.measure.bench import add_arguments

    add_arguments(bench)
    add_model_options(bench)
    add_speculate_options(bench)

    quant = sub.add_parser("quantize", help="quantize a model once and save it (loads memory-mapped afterwards)")
    quant.add_argument("model", help="registry name, .gguf file or model directory")
    quant.add_argument("--scheme", required=True, choices=SCHEMES, metavar="SCHEME", help=", ".join(SCHEMES))
    quant.add_argument("--out", help="output directory (default: $LOCALPD_HOME/quantized/NAME-SCHEME)")
    quant.add_argument("--calibration", metavar="FILE",
                       help="text whose activations weigh the int4 rounding error (default: localpd's own text)")
    quant.add_argument("--no-calibration", action="store_true",
                       help="int4 without activation importance (clipping search and refit alone)")

    export = sub.add_parser("export", help="write a model as localpd holds it for llama.cpp/Ollama (gguf) or "
                                           "vLLM/SGLang (compressed-tensors)")
    export.add_argument("model", help="registry name, .gguf file, model directory or `localpd quantize` output")
    export.add_argument("--format", required=True, choices=("gguf", "compressed-tensors"),
                        help="gguf: one file; compressed-tensors: a Hugging Face directory")
    export.add_argument("-o", "--out", required=True, help="the file (gguf) or directory (compressed-tensors)")
    export.add_argument("--quant", choices=SCHEMES, metavar="SCHEME",
                        help="quantize to this scheme first: " + ", ".join(SCHEMES) + " (default: as the model is)")
    export.add_argument("--force", action="store_true", help="replace OUT if it exists")

    embed = sub.add_parser("embed", help="embedding vectors of texts, one JSON array a line (the server's /v1/embeddings)")
    embed.add_argument("model")
    embed.add_argument("texts", nargs="*", metavar="TEXT", help="texts to embed (default: each line of stdin)")
    add_model_options(embed)

    pull = sub.add_parser("pull", help="download a model from the registry")
    pull.add_argument("model")

    sub.add_parser("models", help="list the registry's models, and which are present locally")

    ev = sub.add_parser("eval", help="measure a model")
    ev_sub = ev.add_subparsers(dest="metric", required=True, parser_class=Parser)
    ppl = ev_sub.add_parser("perplexity", help="perplexity on a text file (sliding window past the context)")
    ppl.add_argument("model")
    ppl.add_argument("--text", required=True, help="a UTF-8 text file")
    ppl.add_argument("--max-tokens", type=positive_int, help="score only the first N tokens of the text")
    ppl.add_argument("--window", type=positive_int, default=1024, help="tokens per window (default 1024)")
    add_model_options(ppl)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:2] == ["bench", "kernels"]:  # its own options; `bench MODEL` takes the rest
        from localpd.measure.bench_kernels import main as bench_kernels

        return bench_kernels(argv[2:])
    args = build_parser().parse_args(argv)
    apply_threads(args)
    try:
        if args.command == "chat":
            from localpd.cli.chat import run_chat

            return run_chat(args)
        if args.command == "tui":
            from localpd.tui.app import run_tui

            return run_tui(args)
        if args.command == "serve":
            from localpd.cli.serve import serve

            return serve(args)
        if args.command == "bench":
            from localpd.measure.bench import run

            return run(args, engine_from_args)
        if args.command == "quantize":
            from localpd.quantize.quantize import run_quantize

            return run_quantize(args)
        if args.command == "export":
            from localpd.cli.export import run_export

            return run_export(args)
        if args.command == "pull":
            from localpd.load.registry import pull

            resolved = pull(args.model)
            print(resolved.path)
            return 0
        if args.command == "models":
            return print_models()
        if args.command == "eval":
            return eval_perplexity(args)
        if args.command == "embed":
            return embed_texts(args)
    except LocalpdError as e:
        print(f"localpd: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return 130
    except BrokenPipeError:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    return 2


def print_models() -> int:
    from localpd.load.registry import list_models, load_registry

    default, _ = load_registry()
    rows = [("NAME", "SIZE", "LOCAL", "WEIGHTS", "DESCRIPTION")]
    for entry, path, size in list_models():
        name = entry.name + (" (default)" if entry.name == default else "")
        local = f"{size / 1e6:.0f} MB" if size else "-"
        rows.append((name, entry.size_hint or "", local, weight_types(path), entry.description or ""))
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    for r in rows:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths)) + "  " + r[4])
    return 0


def weight_types(path) -> str:
    """A present GGUF file's bits per weight and tensor types with their counts ("4.85 bpw: Q4_1 151, F32 61");
    "-" where there is no GGUF file."""
    from localpd.load.gguf import GGUFFile

    if path is None or path.suffix != ".gguf":
        return "-"
    try:
        g = GGUFFile(path)
    except LocalpdError as e:
        return f"unreadable: {e}"
    types = ", ".join(f"{kind} {n}" for kind, n in g.type_counts().items())
    return f"{g.bits_per_weight():.2f} bpw: {types}"


def embed_texts(args) -> int:
    """Each text's vector (Engine.embed: the last token's final hidden state, L2-normalised) as a JSON array on a
    line of its own, in order; the texts are embedded together."""
    import asyncio
    import json

    from localpd.cli.engine_args import engine_from_args
    from localpd.engine.engine import embeddings

    texts = args.texts or [line.rstrip("\n") for line in sys.stdin]
    if not texts or any(not t.strip() for t in texts):
        raise LocalpdError("nothing to embed: give non-empty texts, as arguments or one a line on stdin")
    engine = engine_from_args(args)
    try:
        ids = [engine.tokenizer.encode(t) for t in texts]
        longest = max(range(len(ids)), key=lambda i: len(ids[i]))
        if len(ids[longest]) >= engine.max_context:
            raise LocalpdError(f"text {longest + 1} has {len(ids[longest])} tokens; the context is "
                               f"{engine.max_context} (--ctx)")
        for vector in asyncio.run(embeddings(engine, ids)):
            print(json.dumps([round(x, 6) for x in vector]))
    finally:
        engine.close()
    return 0


def eval_perplexity(args) -> int:
    from pathlib import Path

    from localpd.cli.engine_args import engine_from_args
    from localpd.measure.perplexity import perplexity

    path = Path(args.text)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise LocalpdError(f"cannot read text file {path}: {e}") from None
    engine = engine_from_args(args)
    for note in engine.notes:
        print(note, file=sys.stderr)
    ids = engine.tokenizer.encode(text)[: args.max_tokens]
    window = min(args.window, engine.max_context)
    r = perplexity(engine.model, ids, window=window, kv_dtype=engine.kv_dtype)
    print(f"perplexity {r.perplexity:.4f} over {r.tokens_scored} tokens ({r.windows} windows of {window}), "
          f"model {engine.name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
