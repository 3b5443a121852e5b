"""`localpd serve [MODEL ...]`: the models behind the HTTP APIs (localpd.api.app), each served under its id (the
registry name, or the file's or folder's stem; none named: every registry model on disk, the default pulled if there
is none), the first loaded once the server listens and the others on their first request (localpd.api.models);
stopped gracefully: the first SIGTERM or Ctrl+C stops admitting and gives running requests --shutdown-timeout
seconds, then cuts them, each reply ending with a final event (finish_reason "abort"); a second signal exits at
once."""

from __future__ import annotations

import logging
import os
import sys
import threading

import uvicorn

from pathlib import Path

from localpd.api.app import create_app
from localpd.api.models import ModelPool, ServedModel
from localpd.api.service import Service
from localpd.cli.engine_args import default_model, engine_from_args
from localpd.engine import Engine
from localpd.engine.engine import parse_bytes
from localpd.errors import LocalpdError
from localpd.load.registry import file_size, list_models, load_registry, local_path
from localpd.measure.device import available_memory

log = logging.getLogger("localpd.api.app")


class GracefulServer(uvicorn.Server):
    """uvicorn's server with localpd's shutdown: on the first signal it stops listening (uvicorn's own), the
    service answers 503 to anything that still arrives, and after `grace` seconds the requests still running are
    cut, which ends their streams and lets uvicorn finish; a second signal exits at once."""

    def __init__(self, config: uvicorn.Config, service: Service, grace: float):
        super().__init__(config)
        self.service, self.grace = service, grace

    def handle_exit(self, sig: int, frame) -> None:
        if self.should_exit:
            log.warning("a second signal: exiting now")
            logging.shutdown()
            os._exit(128 + sig)
        self.should_exit = True
        self.service.closing = True
        log.info("shutting down: running requests have %g s to finish (a second signal exits now)", self.grace)
        timer = threading.Timer(self.grace, self.cut)
        timer.daemon = True  # a server with nothing running exits without waiting for it
        timer.start()

    def cut(self) -> None:
        n = self.service.cut_running()
        if n:
            log.warning("shutdown: cut %d running request%s", n, "" if n == 1 else "s")


def served_model(args, name: str) -> ServedModel:
    """A model the command line names (a registry name, a .gguf file or a model folder), served under its id and
    loaded with the command's engine options; a name that is neither is a LocalpdError."""
    entries = load_registry()[1]
    if name in entries:
        path = next((p for p in map(local_path, entries[name].sources) if p is not None), None)
        id_ = name
    else:
        path = Path(name).expanduser()
        if not path.exists():
            raise LocalpdError(f"{name} is neither a registry model ({', '.join(entries)}) nor a model file or "
                               f"folder")
        id_ = path.stem if path.is_file() else path.name

    def load() -> Engine:
        engine = engine_from_args(args, model=name, max_step_tokens=args.step_tokens, max_running=args.max_running)
        for note in engine.notes:
            log.info("%s: %s", id_, note)
        return engine

    return ServedModel(id_, load, file_size(path) if path else 0, path)


def model_pool(args) -> ModelPool:
    """The models `localpd serve` serves: the ones named, else every registry model on disk (the default, pulled
    at start, where none is)."""
    names = args.model or [e.name for e, path, _ in list_models() if path is not None] or [default_model()]
    memory = parse_bytes(args.memory) if args.memory else free_memory(args.device)
    if len(names) > 1 and args.kv_memory is None and memory and on_gpu(args.device):
        # an engine's own default takes most of the free GPU memory for its KV cache, which leaves none to the
        # next model: each gets half its share of the budget instead
        args.kv_memory = memory // (2 * min(args.max_loaded, len(names)))
        log.info("each model's KV cache: %.0f MiB (--kv-memory sets it)", args.kv_memory / 2**20)
    return ModelPool([served_model(args, n) for n in names], max_loaded=args.max_loaded, memory=memory,
                     keep_alive=args.keep_alive, fit_timeout=args.fit_timeout,
                     new_model=lambda name: served_model(args, name))


def on_gpu(device: str | None) -> bool:
    import torch

    return device != "cpu" and torch.cuda.is_available()


def free_memory(device: str | None) -> int | None:
    """Bytes the device has free as the server starts (the GPU's, else the machine's available memory)."""
    import torch

    return torch.cuda.mem_get_info()[0] if on_gpu(device) else available_memory()


def serve(args) -> None:
    pool = model_pool(args)
    log.info("serving %s", ", ".join(pool.models))
    if args.host not in ("127.0.0.1", "localhost", "::1") and not args.api_key:
        log.warning("listening on %s without --api-key: anyone who can reach this port can use the model", args.host)
    app = create_app(pool, api_key=args.api_key, max_waiting=args.max_waiting,
                     split_reasoning=args.reasoning == "split", cors_origins=args.cors)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    # uvicorn's own deadline backs the cut up: connections still open a second after it are closed
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level="info",
                            timeout_graceful_shutdown=args.shutdown_timeout + 1)
    service: Service = app.state.service
    GracefulServer(config, service, args.shutdown_timeout).run()
    # out without the interpreter's teardown, which frees the model object by object (seconds on a slow CPU,
    # counted against docker's and systemd's stop timeouts); nothing else is left to finish
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(1 if service.cut else 0)
