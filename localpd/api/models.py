"""The models one server serves (`localpd serve [MODEL ...]`) and which of them are loaded: `ModelPool`.

A model is loaded on its first request (the first served one at start), on a thread of its own, so the engines
already loaded keep stepping while it loads. Loading one past --max-loaded or the memory budget first unloads the
least recently used idle model; a model that a request holds is never unloaded, and a load that cannot make room
waits for requests to end, up to fit_timeout. An idle model unloads when its keep-alive runs out (Ollama's
keep_alive: the last request's, else the server's default).

A request holds the models it looks up (`acquire`) until its response has been sent: `held_by_request` is set
around each request by the app, and what it collects is released as the response ends, streams included."""

from __future__ import annotations

import asyncio
import contextvars
import gc
import logging
import math
import re
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from localpd.engine import Engine
from localpd.engine.engine import PAGE_SIZE
from localpd.errors import LocalpdError

log = logging.getLogger("localpd.api.models")

KEEP_ALIVE = 300.0  # seconds an idle model stays loaded (Ollama's default, 5 minutes)
FIT_TIMEOUT = 60.0  # seconds a load waits for running requests to leave room
MAX_LOADED = 3  # Ollama's default on one device

held_by_request: contextvars.ContextVar[list | None] = contextvars.ContextVar("held_by_request", default=None)


class UnknownModel(LocalpdError):
    pass


class LoadFailed(LocalpdError):
    pass


class NoRoom(LocalpdError):
    pass


DURATION = re.compile(r"([0-9]*\.?[0-9]+)(ns|us|µs|ms|s|m|h)")
UNIT_SECONDS = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}


def keep_alive_seconds(value) -> float | None:
    """Ollama's keep_alive as seconds: None (not given: the server's default); a number of seconds, or a duration
    string as Go writes them ("5m", "1h30m", "300ms", "-1s"; a plain number is seconds too). 0 unloads the model
    once the request ends; a negative one keeps it loaded (inf). Anything else is a LocalpdError."""
    if value is None or value == "":
        return None
    if isinstance(value, bool):
        raise LocalpdError(f"keep_alive must be a duration such as \"5m\" or a number of seconds, got {value!r}")
    if isinstance(value, (int, float)):
        seconds = float(value)
    elif isinstance(value, str):
        text = value.strip()
        sign = -1.0 if text.startswith("-") else 1.0
        body = text.lstrip("+-")
        try:
            seconds = sign * float(body)
        except ValueError:
            parts = DURATION.findall(body)
            if not body or "".join(n + u for n, u in parts) != body:
                raise LocalpdError(f"keep_alive must be a duration such as \"5m\", \"1h30m\" or \"-1\", or a number "
                                   f"of seconds, got {value!r}") from None
            seconds = sign * sum(float(n) * UNIT_SECONDS[u] for n, u in parts)
    else:
        raise LocalpdError(f"keep_alive must be a duration such as \"5m\" or a number of seconds, got {value!r}")
    if math.isnan(seconds):
        raise LocalpdError("keep_alive must be a duration, got NaN")
    return math.inf if seconds < 0 else seconds


def loaded_bytes(e: Engine) -> int:
    """What a loaded engine holds: its weights, a draft model's, and its KV pool (the draft's pages included)."""
    draft = e.drafter.model.weight_bytes if e.drafter is not None else 0
    return e.model.weight_bytes + draft + e.stats().kv_pages_total * PAGE_SIZE * e.kv_token_bytes


@dataclass(eq=False)
class ServedModel:
    """One model the server serves, loaded or not. size: bytes it holds loaded, measured at its last load, else
    its files' size (an estimate until it has loaded once)."""

    id: str
    load: Callable[[], Engine]
    size: int = 0
    path: Path | None = None
    context: int | None = None  # its context in tokens, once it has loaded
    engine: Engine | None = None
    loading: Future | None = None
    error: str | None = None
    users: int = 0  # requests holding it, from their lookup to the end of their response
    last_used: float = field(default_factory=time.monotonic)
    expires: float = math.inf  # time.monotonic() at which it unloads once idle
    pinned: bool = False  # handed in loaded (create_app(engine)): never unloaded

    @classmethod
    def of(cls, engine: Engine) -> "ServedModel":
        def cannot_reload() -> Engine:
            raise LocalpdError(f"{engine.name} was handed to the server loaded and cannot be loaded again")

        resolved = getattr(engine, "resolved", None)  # a synthetic model has no files
        return cls(engine.name, cannot_reload, loaded_bytes(engine), resolved.path if resolved else None,
                   context=engine.max_context, engine=engine, pinned=True)


class ModelPool:
    def __init__(self, models: list[ServedModel], max_loaded: int = MAX_LOADED, memory: int | None = None,
                 keep_alive: float = KEEP_ALIVE, fit_timeout: float = FIT_TIMEOUT,
                 new_model: Callable[[str], ServedModel] | None = None):
        """models: the first is the default (a request that names none). memory: bytes the loaded models may
        hold together (None: no limit). keep_alive: seconds an idle model stays loaded (inf: forever).
        new_model: how a registry model pulled while the server runs is served (None: it is not)."""
        if not models:
            raise LocalpdError("a server needs at least one model")
        self.models: dict[str, ServedModel] = {}
        for m in models:
            self.add(m)
        self.max_loaded, self.memory, self.keep_alive, self.fit_timeout = max_loaded, memory, keep_alive, fit_timeout
        self.new_model = new_model
        self.loads = self.unloads = 0
        self._lock = threading.Condition()
        self._closed = False
        self._doomed: list[Engine] = []  # detached engines the unload thread frees
        self._reaper = threading.Thread(target=self._reap, name="localpd-unload", daemon=True)
        self._reaper.start()

    # -- which models --------------------------------------------------------------------------------------------
    def add(self, m: ServedModel) -> None:
        if m.id in self.models:
            raise LocalpdError(f"two models would be served as {m.id!r}")
        self.models = {**self.models, m.id: m}  # a new dict: listing the models never sees one change

    def check_unloaded(self, m: ServedModel) -> None:
        """A LocalpdError when m is loaded, loading or held by a request."""
        if m.engine is not None or m.loading is not None or m.users:
            raise LocalpdError(f"{m.id} is loaded; it can be deleted once it is unloaded (keep_alive 0)")

    def remove(self, name: str) -> ServedModel:
        """Stops serving a model that is not loaded (its files are the caller's)."""
        with self._lock:
            m = self.find(name)
            self.check_unloaded(m)
            self.models = {k: v for k, v in self.models.items() if v is not m}
            return m

    @property
    def first(self) -> ServedModel:
        return next(iter(self.models.values()))

    def find(self, name: str | None) -> ServedModel:
        """The model a request names (Ollama's ":latest" tag dropped); none named: the first."""
        if not name:
            return self.first
        m = self.models.get(name) or self.models.get(name.removesuffix(":latest"))
        if m is None:
            raise UnknownModel(f"model {name!r} not found; this server serves {', '.join(self.models)}")
        return m

    def loaded(self) -> list[ServedModel]:
        with self._lock:
            return [m for m in self.models.values() if m.engine is not None]

    def engines(self) -> dict[str, Engine]:
        with self._lock:
            return {m.id: m.engine for m in self.models.values() if m.engine is not None}

    # -- a request's models --------------------------------------------------------------------------------------
    async def acquire(self, name: str | None, keep_alive: float | None = None) -> Engine:
        """The engine of the model named, loaded if it is not (off the event loop); held until the request's
        response ends (held_by_request), then kept for keep_alive seconds (None: the server's default)."""
        m = self.find(name)
        held = held_by_request.get()
        with self._lock:
            if held is not None:
                m.users += 1
                held.append((m, keep_alive))
            m.last_used = time.monotonic()
            engine, loading = m.engine, m.engine is None and self._start_load(m)
        if engine is not None:
            return engine
        return await asyncio.wrap_future(loading)

    def release(self, m: ServedModel, keep_alive: float | None) -> None:
        """A request that held m has ended: m stays loaded keep_alive seconds once idle (0: unloaded now)."""
        with self._lock:
            m.users -= 1
            now = m.last_used = time.monotonic()
            seconds = self.keep_alive if keep_alive is None else keep_alive
            m.expires = now + seconds
            if m.users == 0 and seconds <= 0 and m.engine is not None and not m.pinned:
                self._detach(m)  # gone from /api/ps as the response ends; freed on the unload thread
            self._lock.notify_all()

    def load_now(self, name: str | None = None) -> Future:
        """Starts loading a model (the first by default) without a request, as the server starts."""
        m = self.find(name)
        with self._lock:
            if m.engine is not None:
                done: Future = Future()
                done.set_result(m.engine)
                return done
            return self._start_load(m)

    # -- loading and unloading -----------------------------------------------------------------------------------
    def _start_load(self, m: ServedModel) -> Future:
        """Under the lock: m's load, started unless it already is."""
        if m.loading is None:
            m.loading = Future()
            threading.Thread(target=self._load, args=(m, m.loading), name=f"localpd-load-{m.id}",
                             daemon=True).start()
        return m.loading

    def _load(self, m: ServedModel, done: Future) -> None:
        deadline = time.monotonic() + self.fit_timeout
        with self._lock:
            while (victims := self._room_for(m)) is None:
                left = deadline - time.monotonic()
                if left <= 0 or self._closed:
                    m.loading = None
                    done.set_exception(NoRoom(self._no_room(m)))
                    return
                self._lock.wait(min(left, 1.0))
            for v in victims:
                self._detach(v)
        try:
            engine = m.load()
        except Exception as e:  # noqa: BLE001 - the requests waiting for it fail with its reason; others go on
            log.exception("loading %s failed", m.id)
            with self._lock:
                m.error, m.loading = f"{type(e).__name__}: {e}" if not isinstance(e, LocalpdError) else str(e), None
                self._lock.notify_all()
            done.set_exception(LoadFailed(f"the model {m.id!r} failed to load: {m.error}"))
            return
        with self._lock:
            m.engine, m.loading, m.error, m.size = engine, None, None, loaded_bytes(engine)
            m.context = engine.max_context
            m.last_used = time.monotonic()
            m.expires = m.last_used + self.keep_alive
            self.loads += 1
            self._lock.notify_all()
        log.info("loaded %s (%.0f MB)", m.id, m.size / 1e6)
        done.set_result(engine)

    def _room_for(self, m: ServedModel) -> list[ServedModel] | None:
        """Under the lock: the idle models to unload, least recently used first, so that m fits beside the
        others; None while it cannot (the models in the way are in use). A model alone always fits."""
        others = [x for x in self.models.values() if x is not m and (x.engine is not None or x.loading)]
        idle = sorted((x for x in others if x.engine is not None and not x.users and not x.pinned),
                      key=lambda x: x.last_used)
        victims: list[ServedModel] = []
        while self._over(m, [x for x in others if x not in victims]):
            if not idle:
                return None
            victims.append(idle.pop(0))
        return victims

    def _over(self, m: ServedModel, others: list[ServedModel]) -> bool:
        if not others:
            return False
        too_many = len(others) + 1 > self.max_loaded
        return too_many or (self.memory is not None and sum(x.size for x in others) + m.size > self.memory)

    def _no_room(self, m: ServedModel) -> str:
        busy = ", ".join(x.id for x in self.models.values() if x.engine is not None and x is not m)
        return (f"no room to load {m.id!r} within {self.fit_timeout:g} s: the loaded models ({busy}) are running "
                f"requests and --max-loaded {self.max_loaded}"
                + (f" / --memory {self.memory / 2**20:.0f} MiB" if self.memory is not None else "")
                + " leave no room beside them; try again shortly")

    def _detach(self, m: ServedModel) -> None:
        """Under the lock: m is unloaded for every later request; its engine is freed on the unload thread."""
        engine, m.engine = m.engine, None
        self._doomed.append(engine)
        self.unloads += 1
        log.info("unloading %s", m.id)
        self._lock.notify_all()

    def _reap(self) -> None:
        """The unload thread: frees detached engines, and detaches idle models whose keep-alive has run out."""
        with self._lock:
            while not self._closed:
                now = time.monotonic()
                for m in self.models.values():
                    if m.engine is not None and not m.users and not m.pinned and m.expires <= now:
                        self._detach(m)
                doomed, self._doomed = self._doomed, []
                if doomed:
                    self._lock.release()
                    try:
                        for engine in doomed:
                            engine.close()
                        del engine, doomed
                        collect()
                    finally:
                        self._lock.acquire()
                    continue
                wake = min((m.expires for m in self.models.values() if m.engine is not None and not m.users
                            and not m.pinned), default=math.inf)
                self._lock.wait(None if wake == math.inf else max(wake - now, 0.01))

    def close(self) -> None:
        """Closes every engine the pool loaded (not the ones handed in)."""
        with self._lock:
            self._closed = True
            for m in self.models.values():
                if m.engine is not None and not m.pinned:
                    m.engine.close()
            self._lock.notify_all()


def collect() -> None:
    """Frees what an unloaded engine held: the loader freezes what a load leaves (cli.engine_args), so the
    collector is let at everything once, then what survives is frozen again; CUDA's cache goes back."""
    gc.unfreeze()
    gc.collect()
    gc.freeze()
    import torch

    if torch.cuda.is_available():
        torch.cuda.empty_cache()
