"""`localpd serve`: the model behind the HTTP APIs (localpd.api.app), loaded once the server listens, and stopped
gracefully: the first SIGTERM or Ctrl+C stops admitting and gives running requests --shutdown-timeout seconds, then
cuts them, each reply ending with a final event (finish_reason "abort"); a second signal exits at once."""

from __future__ import annotations

import logging
import os
import sys
import threading

import uvicorn

from localpd.api.app import create_app
from localpd.api.service import Service
from localpd.cli.engine_args import engine_from_args
from localpd.engine import Engine

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


def serve(args) -> None:
    def load() -> Engine:
        engine = engine_from_args(args, max_step_tokens=args.step_tokens, max_running=args.max_running)
        for note in engine.notes:
            log.info(note)
        return engine

    if args.host not in ("127.0.0.1", "localhost", "::1") and not args.api_key:
        log.warning("listening on %s without --api-key: anyone who can reach this port can use the model", args.host)
    app = create_app(load=load, api_key=args.api_key, max_waiting=args.max_waiting,
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
