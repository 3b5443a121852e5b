"""Stop strings over a stream of text deltas."""


def partial_tail(text: str, marker: str) -> int:
    """Length of the longest end of `text` that is the start of `marker` but not all of it: what a stream must
    hold back until the next delta says whether the marker follows."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:k]):
            return k
    return 0


class StopMatcher:
    """Holds back text that might be the start of a stop string; cuts the stream at the first full match."""

    def __init__(self, stops: list[str]):
        self.stops = [s for s in stops if s]
        self.pending = ""

    def push(self, delta: str) -> tuple[str, bool]:
        """Returns (text safe to emit, whether a stop string was hit)."""
        self.pending += delta
        if not self.stops:
            out, self.pending = self.pending, ""
            return out, False
        hits = [i for i in (self.pending.find(s) for s in self.stops) if i >= 0]
        if hits:
            out, self.pending = self.pending[:min(hits)], ""
            return out, True
        cut = len(self.pending) - max(partial_tail(self.pending, s) for s in self.stops)
        out, self.pending = self.pending[:cut], self.pending[cut:]
        return out, False

    def flush(self, tail: str = "") -> str:
        """End of stream: whatever is held back (plus tail) up to a stop string, if one appears."""
        text, _ = self.push(tail)
        text, self.pending = text + self.pending, ""
        return text
