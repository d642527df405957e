from tensorfold.memory.kv_pool import KVPool
from tensorfold.memory.prompt_radix import RadixStore


def make():
    dropped = []
    return RadixStore(dropped.append), dropped


def test_longest_kept_prefix_wins_and_the_limit_holds():
    store, _ = make()
    store.insert([1, 2, 3], [0], "a")
    store.insert([1, 2, 3, 4, 5], [0, 1], "b")
    store.insert([1, 2, 9], [2], "c")  # splits the edge after [1, 2]
    assert store.lookup([1, 2, 3, 4, 5, 6], limit=5).snapshot == "b"
    assert store.lookup([1, 2, 3, 4, 5], limit=4).snapshot == "a"  # must leave a row to compute
    assert store.lookup([1, 2, 9, 9], limit=3).snapshot == "c"
    assert store.lookup([1, 2], limit=2) is None
    assert store.lookup([7], limit=1) is None
    assert len(store) == 3


def test_content_keys_never_match_each_other():
    store, _ = make()
    store.insert([1, 2, 3], [0], "text")
    store.insert([1, 2, 3], [1], "image", key="sha256:ab")
    assert store.lookup([1, 2, 3, 4], 3).snapshot == "text"
    assert store.lookup([1, 2, 3, 4], 3, key="sha256:ab").snapshot == "image"


def test_least_recently_used_goes_first_and_empty_branches_are_pruned():
    store, dropped = make()
    a = store.insert([1, 2], [0], "a")
    b = store.insert([1, 3], [1], "b")
    store.lookup([1, 2, 5], 2)  # touches a
    assert store.evict_lru() is b
    assert dropped == [b]
    assert store.has([1, 3]) is None and store.has([1, 2]) is a
    store.drop(a)
    assert len(store) == 0 and list(store.kept()) == []


def test_store_pages_count_once_however_many_states_share_them():
    pool = KVPool(4, page_rows=2)
    lease = pool.lease(8)
    pages = list(lease.cover(8))
    pool.hold(pages[:1], store=True)
    pool.hold(pages[:2], store=True)
    assert pool.store_pages == 2
    lease.release()
    census = pool.census()
    assert census.store == 2 and census.free == 2 and census.idle_even
    pool.drop(pages[:1], store=True)
    assert pool.store_pages == 2
    pool.drop(pages[:2], store=True)
    assert pool.store_pages == 0 and pool.census().free == 4
