"""`localpd serve`: the model behind the HTTP APIs (localpd.api.app), loaded once the server listens."""

from __future__ import annotations

import logging

from localpd.api.app import create_app
from localpd.cli.engine_args import engine_from_args
from localpd.engine import Engine

log = logging.getLogger("localpd.api.app")


def serve(args) -> int:
    import uvicorn

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
    uvicorn.run(app, host=args.host, port=args.port, log_level="info")
    return 0
