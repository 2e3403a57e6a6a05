from target_service.session_store import SessionStore


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_least_recently_used_is_evicted_when_full() -> None:
    store: SessionStore[int] = SessionStore(max_sessions=2, ttl_s=100, clock=Clock())
    store.put("a", 1)
    store.put("b", 2)
    assert store.get("a") == 1  # a is now the most recently used
    store.put("c", 3)
    assert store.get("b") is None
    assert (store.get("a"), store.get("c")) == (1, 3)
    assert store.num_evicted == 1


def test_idle_sessions_expire() -> None:
    clock = Clock()
    store: SessionStore[int] = SessionStore(max_sessions=8, ttl_s=10, clock=clock)
    store.put("old", 1)
    clock.now = 5
    store.put("new", 2)
    clock.now = 12
    assert store.get("old") is None
    assert store.get("new") == 2
    assert len(store) == 1


def test_pop_removes() -> None:
    store: SessionStore[int] = SessionStore(max_sessions=2, ttl_s=10)
    store.put("a", 1)
    assert store.pop("a") == 1
    assert store.pop("a") is None


def test_protected_keys_are_never_evicted_by_the_limit() -> None:
    store: SessionStore[int] = SessionStore(max_sessions=2, ttl_s=100, clock=Clock())
    store.put("a", 1)
    store.put("b", 2)
    store.put("c", 3, protected={"a"})  # a is least recent but protected: b goes
    assert (store.peek("a"), store.peek("b"), store.peek("c")) == (1, None, 3)
    store.put("d", 4, protected={"a", "c"})  # nothing evictable: one over the limit for now
    assert len(store) == 3
