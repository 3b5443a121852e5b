"""The page allocator and prefix cache (localpd/kvcache/pages.py) alone; with the scheduler over them:
tests/engine/test_scheduler.py."""

from localpd.kvcache.pages import PagePool, PageTable


def test_prefix_match_needs_the_same_chain_and_full_pages():
    pool = PagePool(8, 4, salt="m")
    a = PageTable()
    assert pool.allocate(a, 10)
    tokens = list(range(10))
    pool.register(a, tokens, 10)  # pages 0-3 and 4-7 are full; 8-9 are not
    assert len(pool.cached) == 2
    pool.release(a)
    pool.check()
    b = PageTable()
    assert pool.match(b, tokens) == 8
    pool.release(b)
    c = PageTable()
    assert pool.match(c, [99] + tokens[1:]) == 0  # a different first page breaks the whole chain
    pool.release(c)
    other = PagePool(8, 4, salt="other model")
    d = PageTable()
    other.allocate(d, 8)
    other.register(d, tokens, 8)
    assert other.by_key.keys().isdisjoint(pool.by_key.keys())  # the salt separates models and dtypes
    pool.check()


def test_eviction_takes_the_least_recently_released_page():
    pool = PagePool(3, 2)
    tables = []
    for first in (10, 20, 30):
        t = PageTable()
        pool.allocate(t, 2)
        pool.register(t, [first, first + 1], 2)
        tables.append(t)
    for t in tables:
        pool.release(t)
    assert pool.available == 3 and len(pool.cached) == 3
    fresh = PageTable()
    pool.allocate(fresh, 2)  # needs one page: evicts the first released (tokens 10, 11)
    probe = PageTable()
    assert pool.match(probe, [10, 11]) == 0
    assert pool.match(PageTable(), [20, 21]) == 2
    pool.check()


def test_allocation_fails_whole_when_pages_run_out():
    pool = PagePool(2, 4)
    t = PageTable()
    assert not pool.allocate(t, 9)
    assert t.pages == [] and pool.available == 2
