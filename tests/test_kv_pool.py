import pytest

from tensorfold.memory.kv_pool import KVPool, PoolExhausted


def test_lease_takes_pages_as_rows_are_written_and_returns_them():
    pool = KVPool(8, page_rows=4)
    lease = pool.lease(10)  # 3 pages promised
    assert pool.promised == 3 and pool.available == 5
    assert lease.cover(4) == [0]
    assert pool.promised == 2
    assert len(lease.cover(9)) == 3 and pool.promised == 0
    with pytest.raises(PoolExhausted):
        lease.cover(13)  # past the promise
    lease.release()
    assert pool.census().idle_even
    assert pool.census().line() == "kv pool idle: promised 0, free 8 + store 0 == total 8"


def test_unmet_promise_is_refused_and_release_returns_the_unused_promise():
    pool = KVPool(4, page_rows=4)
    a = pool.lease(12)
    assert not pool.can_promise(2)
    with pytest.raises(PoolExhausted):
        pool.lease(8)
    a.cover(1)
    a.release()
    assert pool.census().idle_even and pool.available == 4


def test_shared_pages_are_free_only_when_nothing_holds_them():
    freed = []
    pool = KVPool(4, page_rows=2, poison=True)
    pool.on_freed.append(freed.extend)
    lease = pool.lease(4)
    pages = list(lease.cover(4))
    pool.hold(pages, store=True)
    lease.release()
    census = pool.census()
    assert census.store == 2 and census.free == 2 and census.idle_even
    assert freed == []
    pool.drop(pages, store=True)
    assert sorted(freed) == sorted(pages)
    assert pool.census().free == 4


def test_census_is_uneven_while_a_stream_holds_pages():
    pool = KVPool(4, page_rows=2)
    lease = pool.lease(3)
    lease.cover(1)
    assert not pool.census().idle_even
    lease.release()
    assert pool.census().idle_even
