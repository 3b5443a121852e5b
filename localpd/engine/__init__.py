"""The engine: requests in, TokenEvents out, one step at a time on its own thread (localpd.engine.engine)."""

from localpd.engine.engine import Engine

__all__ = ["Engine"]
