"""The one place an Engine is built from the command line's model options (cli.main.add_model_options), for chat,
the TUI, serve, bench, embed and perplexity."""

from __future__ import annotations

import gc

from localpd.engine import Engine
from localpd.engine.speculate import SpeculateConfig

CHAT_CONTEXT = 8192  # --ctx's default in chat and the TUI: the model's own context, at most this many tokens


def default_model() -> str:
    from localpd.load.registry import load_registry

    return load_registry()[0]


def engine_from_args(args, model: str | None = None, default_ctx: int | None = None, **options) -> Engine:
    """The Engine that --device, --quant, --kv, --ctx (default_ctx where it is not given), --kv-memory and, where the
    command has them, --speculate, --draft and --draft-tokens ask for,
    of model (by default the command's MODEL, else the registry's default). options: the command's own Engine
    arguments (progress, max_running, ...), which also override the ones above."""
    kw = dict(device=args.device, quant=args.quant, kv=args.kv, max_context=args.ctx or default_ctx,
              kv_memory=args.kv_memory)
    if getattr(args, "speculate", None):  # chat, tui, serve and bench (cli.main.add_speculate_options)
        kw["speculate"] = SpeculateConfig("draft" if args.draft else args.speculate, args.draft_tokens)
        kw["draft"] = args.draft
    engine = Engine(model or args.model or default_model(), **{**kw, **options})
    # what loading left behind, collected once and then kept out of the collector's walks: they cost ~3% of each
    # CPU decode step under perf (gc_collect_main, visit_*), over objects that live as long as the process
    gc.collect()
    gc.freeze()
    return engine
