"""The output processor: a step's sampled tokens become each request's events. It detokenizes (UTF-8 safe), holds
back and cuts stop strings, ends a request at an end-of-sequence token or its token budget, and keeps the request's
timings; an embedding request ends with its vector."""

from __future__ import annotations

import weakref
from typing import Callable

from localpd.engine.requests import Request, StepStats, TokenEvent
from localpd.engine.runner import StepOutput


class OutputProcessor:
    def __init__(self, finish: Callable[[Request, TokenEvent], None]):
        # the engine's: the request leaves the scheduler, its last event goes out. Held weakly: the engine holds
        # this processor, and without a cycle between them an engine nobody holds frees its memory (GPU memory:
        # weights, pages) at once, not at some later cyclic garbage collection
        self._finish = weakref.WeakMethod(finish)

    def finish(self, req: Request, event: TokenEvent) -> None:
        self._finish()(req, event)

    def process(self, out: StepOutput, requests: dict) -> None:
        """requests: the engine's running requests by sequence (each of the step's adds the step's bytes)."""
        step, now = out.stats, out.now
        for w in out.work:  # before the events: a request's last step counts too
            if w.seq in requests:
                req = requests[w.seq]
                req.handle.stats.bytes_moved += step.bytes
                if req.first_token_at is None:
                    req.handle.stats.prefill_steps.append(step)
        sampled = [w for w in out.work if w.sample]
        for w, req, outcome in zip(sampled, out.requests, out.outcomes):
            if req.embed:
                self._embedded(req, outcome, step, now)
            else:
                self._emit(req, outcome, 0 if w.chain else len(w.draft), step, now)

    def _embedded(self, req: Request, vector: list[float], step: StepStats, now: float) -> None:
        s = req.handle.stats
        s.prefill_seconds, s.cached_tokens = now - req.arrival, req.seq.cached_tokens
        self.finish(req, TokenEvent(None, "", "stop", step, embedding=vector))

    def flush(self, req: Request) -> str:
        return req.stops.flush(req.detok.flush() if req.detok else "")

    def _emit(self, req: Request, outcome: list, drafted: int, step: StepStats, now: float) -> None:
        """outcome: the step's (token, logprob, top logprobs) for this request, several where its draft (drafted
        tokens) held or the step chained decode steps; the request may end at any of them."""
        s = req.handle.stats
        if req.first_token_at is None:
            req.first_token_at = now
            s.prefill_seconds = now - req.arrival
            s.cached_tokens = req.seq.cached_tokens
        else:
            s.decode_seconds = now - req.first_token_at
            s.decode_step_seconds += step.seconds
            s.decode_bytes += step.bytes
            s.decode_steps += step.passes
            s.decode_written += len(outcome)
            s.drafted_tokens += drafted
            s.accepted_tokens += len(outcome) - 1 if drafted else 0
        for token, lp, top in outcome:
            if not self._token(req, token, lp, top, step):
                return

    def _token(self, req: Request, token: int, lp, top, step: StepStats) -> bool:
        """One written token to the request's stream; whether the request goes on."""
        s = req.handle.stats
        if token in req.eos:
            self.finish(req, TokenEvent(None, self.flush(req), "stop", step))
            return False
        req.seq.output.append(token)
        s.output_tokens = len(req.seq.output)
        text, hit = req.stops.push(req.detok.push(token) if req.detok else "")
        if hit:
            self.finish(req, TokenEvent(token, text, "stop", step, lp, top))
        elif len(req.seq.output) >= req.seq.max_tokens:
            self.finish(req, TokenEvent(token, text + self.flush(req), "length", step, lp, top))
        else:
            req.handle._push(TokenEvent(token, text, None, step, lp, top))
            return True
        return False
