"""Which KV pages belong to whom: a page allocator with reference counts and a prefix cache over full pages.

This is host-side bookkeeping only; the pages' keys and values live in a KVPool (localpd.kvcache.formats). A full page
is keyed by a chained hash of (the previous page's hash, its token ids, a salt naming the model, weight scheme
and KV dtype), so a page is found again only when everything before it matches too. Cached pages are never
written again: sequences only write at positions past the pages they matched. A cached page nobody references
stays in the cache (LRU order) until a fresh page is needed and nothing is free.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import dataclass

from localpd.errors import LocalpdError


def page_hash(parent: bytes, tokens: list[int], salt: str) -> bytes:
    h = hashlib.blake2b(parent, digest_size=16)
    h.update(salt.encode())
    h.update(b"".join(t.to_bytes(4, "little") for t in tokens))
    return h.digest()


@dataclass
class CachedPage:
    key: bytes
    tokens: tuple[int, ...]  # checked on every match, so a hash collision can never serve wrong keys


class PageTable:
    """Pages of one sequence, in order, and the chained hash of its last registered full page."""

    def __init__(self):
        self.pages: list[int] = []
        self.registered = 0  # leading full pages already offered to the prefix cache
        self.last_key = b""


class PagePool:
    def __init__(self, n_pages: int, page_size: int, salt: str = ""):
        if n_pages < 1:
            raise LocalpdError("the KV cache needs at least one page")
        self.n_pages = n_pages
        self.page_size = page_size
        self.salt = salt
        self.refs = [0] * n_pages
        self.free: list[int] = list(range(n_pages - 1, -1, -1))  # pop() hands out low ids first
        self.cached: dict[int, CachedPage] = {}  # page -> its key, for pages holding a full cached page
        self.by_key: dict[bytes, int] = {}
        self.evictable: OrderedDict[int, None] = OrderedDict()  # cached pages with no reference, oldest first
        self.hit_tokens = 0  # prompt tokens served from the cache, since the start
        self.query_tokens = 0  # prompt tokens looked up

    # -- accounting --------------------------------------------------------------------------------------------
    @property
    def available(self) -> int:
        """Pages a new allocation can get: free ones plus unreferenced cached ones (evicted on demand)."""
        return len(self.free) + len(self.evictable)

    @property
    def used(self) -> int:
        """Pages some sequence references."""
        return self.n_pages - self.available

    # -- prefix cache ------------------------------------------------------------------------------------------
    def match(self, table: PageTable, tokens: list[int]) -> int:
        """Attach the longest run of cached full pages that starts tokens; returns how many tokens they hold.
        Only an empty table can match."""
        assert not table.pages
        key, n = b"", 0
        ps = self.page_size
        while n + ps <= len(tokens):
            chunk = tokens[n:n + ps]
            next_key = page_hash(key, chunk, self.salt)
            page = self.by_key.get(next_key)
            if page is None or self.cached[page].tokens != tuple(chunk):
                break
            self._ref(page)
            table.pages.append(page)
            key, n = next_key, n + ps
        table.registered = len(table.pages)
        table.last_key = key
        return n

    def register(self, table: PageTable, tokens: list[int], n_computed: int) -> None:
        """Offer the sequence's newly completed full pages (KV written for all of their tokens) to the cache."""
        ps = self.page_size
        while (table.registered + 1) * ps <= n_computed:
            i = table.registered
            chunk = tokens[i * ps:(i + 1) * ps]
            key = page_hash(table.last_key, chunk, self.salt)
            page = table.pages[i]
            if key not in self.by_key and page not in self.cached:
                self.by_key[key] = page
                self.cached[page] = CachedPage(key, tuple(chunk))
            table.last_key = key
            table.registered += 1

    # -- allocation ----------------------------------------------------------------------------------------------
    def _ref(self, page: int) -> None:
        if self.refs[page] == 0:
            self.evictable.pop(page, None)
        self.refs[page] += 1

    def lacking(self, table: PageTable, n_tokens: int) -> int:
        """Pages the table lacks to hold n_tokens (0 where it holds them)."""
        return max(0, -(-n_tokens // self.page_size) - len(table.pages))

    def allocate(self, table: PageTable, n_tokens: int) -> bool:
        """Grow the table to hold n_tokens. False (and nothing allocated) when not enough pages are available."""
        need = self.lacking(table, n_tokens)
        if need <= 0:
            return True
        if need > self.available:
            return False
        for _ in range(need):
            if self.free:
                page = self.free.pop()
            else:  # evict the least recently released cached page
                page, _ = self.evictable.popitem(last=False)
                del self.by_key[self.cached.pop(page).key]
            self.refs[page] = 1
            table.pages.append(page)
        return True

    def release(self, table: PageTable) -> None:
        """Drop the table's references; unreferenced cached pages stay findable until evicted."""
        self._unref(table.pages)
        table.pages = []
        table.registered = 0
        table.last_key = b""

    def truncate(self, table: PageTable, n_tokens: int) -> None:
        """Shrink the table to the pages n_tokens need (speculative decoding's rollback of rejected positions): the
        pages past them are released. Registered pages are never dropped (they hold computed tokens only)."""
        keep = max(-(-n_tokens // self.page_size), table.registered)
        self._unref(table.pages[keep:])
        del table.pages[keep:]

    def _unref(self, pages: list[int]) -> None:
        for page in pages:
            if self.refs[page] <= 0:
                raise AssertionError(f"page {page} released more often than referenced")
            self.refs[page] -= 1
            if self.refs[page] == 0:
                if page in self.cached:
                    self.evictable[page] = None
                else:
                    self.free.append(page)

    def check(self) -> None:
        """Invariants, for tests: every page is exactly one of referenced, evictable-cached or free."""
        free = set(self.free)
        assert len(free) == len(self.free), "a page is twice in the free list"
        for p in range(self.n_pages):
            states = [self.refs[p] > 0, p in self.evictable, p in free]
            assert sum(states) == 1, f"page {p}: refs={self.refs[p]} evictable={states[1]} free={states[2]}"
            assert (p in self.evictable) <= (p in self.cached)
        assert all(self.by_key[c.key] == p for p, c in self.cached.items())
