"""The C heap's free memory, given back to the system.

glibc keeps the chunks a process frees for its next allocations rather than returning them, so a model's load (each
tensor's conversion temporaries, a weight's first copy once moved) would leave hundreds of MiB counted in the
process's memory that nothing uses. `trim` hands them back (malloc_trim), where the C library is glibc; a `Trimmer`
does so every so many bytes of work (each trim costs the pages it returns a fault when the heap takes them again, so
a trim after every tensor made a load 10% slower).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools

EVERY = 256 << 20  # bytes of tensors made or moved between a Trimmer's trims


@functools.cache
def _malloc_trim():
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
    except (OSError, AttributeError):  # not glibc (musl, macOS, Windows): nothing to trim this way
        return None


def trim() -> None:
    fn = _malloc_trim()
    if fn is not None:
        fn(0)


class Trimmer:
    """trim() once `add` has counted `every` bytes since the last."""

    def __init__(self, every: int = EVERY):
        self.every, self.count = every, 0

    def add(self, nbytes: int) -> None:
        self.count += nbytes
        if self.count >= self.every:
            trim()
            self.count = 0
