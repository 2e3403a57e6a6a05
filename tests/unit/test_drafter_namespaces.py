"""What the drafter keeps per pool namespace (successor tables, acceptance statistics, n-gram pools) is bounded:
in bytes, within --max-memory-mib, and in count, whatever namespaces and fingerprints callers send."""

from __future__ import annotations

import tracemalloc

from draft_service.drafter import Drafter
from draft_service.namespace_state import NAMESPACE, NAMESPACE_BYTES
from draft_service.ngram_pool import InMemoryNgramPool, PoolShape
from draft_service.pools import PoolRegistry
from draft_service.proposers import SuccessorTable
from draft_service.session_memory import SESSION, SessionMemory
from specserve.results import DraftFeedback

RECYCLING = ("token_recycling",)


def successors(first: int, count: int, width: int = 4) -> tuple[tuple[int, tuple[int, ...]], ...]:
    """A report's successor rows: ``count`` fresh tokens, each with ``width`` fresh ids past the small-int cache."""
    return tuple((first + i, tuple(100_000 + width * (first + i) + j for j in range(width))) for i in range(count))


def test_the_bytes_estimated_per_successor_entry_bound_what_python_holds() -> None:
    for width in (1, 4, 8):
        table = SuccessorTable()
        tracemalloc.start()
        try:
            before = tracemalloc.get_traced_memory()[0]
            for i in range(2000):  # fresh ids past the small-int cache, built here as a report's are
                table.update(10_000 + i, tuple(100_000 + width * i + j for j in range(width)))
            measured = tracemalloc.get_traced_memory()[0] - before
        finally:
            tracemalloc.stop()
        assert measured <= table.nbytes <= 1.5 * measured, width
    table.update(10_000, (1, 2))  # replaced: counted once, at its new width
    assert table.nbytes == sum(160 + 40 * len(table.get(t)) for t in range(10_000, 12_000))
    table.clear()
    assert table.nbytes == 0 and len(table) == 0


def test_successor_tables_count_in_the_memory_bound_and_the_least_recently_used_namespace_forgets_first() -> None:
    drafter = Drafter(lambda *_: InMemoryNgramPool(), sources=RECYCLING, memory=SessionMemory(max_bytes=10**9))
    a = drafter.open_session("a", [1, 2, 3], "fp", pool_namespace="tenant:a")
    b = drafter.open_session("b", [1, 2, 3], "fp", pool_namespace="tenant:b")
    a.propose(DraftFeedback((4,), successors(10_000, 500)), max_nodes=4)
    held = drafter.memory.bytes_of(NAMESPACE)
    assert held >= 500 * (160 + 4 * 40), "tenant:a's table is counted"
    # Room for about one table of 500 entries: when tenant:b's fills, tenant:a's (used less recently) goes.
    drafter.memory.max_bytes = drafter.memory.bytes_in_use + 100 * 320
    b.propose(DraftFeedback((4,), successors(20_000, 500)), max_nodes=4)
    assert drafter.memory.bytes_in_use <= drafter.memory.max_bytes
    assert drafter.memory.forgotten(NAMESPACE) == 1 and drafter.memory.forgotten(SESSION) == 0
    assert a.propose(DraftFeedback((10_001,)), max_nodes=4).tree.token_ids == (), "tenant:a's table is empty"
    assert b.propose(DraftFeedback((20_001,)), max_nodes=4).tree.token_ids != (), "tenant:b's is kept"
    # tenant:a learns again from its next report.
    a.propose(DraftFeedback((5,), successors(30_000, 1)), max_nodes=4)
    assert a.propose(DraftFeedback((30_000,)), max_nodes=4).tree.token_ids != ()


def test_namespaces_are_capped_the_least_recently_opened_dropped_and_its_open_sessions_go_on() -> None:
    drafter = Drafter(lambda *_: InMemoryNgramPool(), sources=RECYCLING, max_namespaces=2)
    first = drafter.open_session("first", [1, 2, 3], "fp", pool_namespace="tenant:first")
    first.propose(DraftFeedback((4,), successors(10_000, 50)), max_nodes=4)
    for name in ("tenant:x", "tenant:y"):  # a caller's made-up namespaces (or fingerprints)
        drafter.open_session(name, [1, 2, 3], "fp", pool_namespace=name).close()
    assert drafter.num_namespaces == 2 and drafter.memory.count(NAMESPACE) == 2
    assert drafter.memory.bytes_of(NAMESPACE) == 2 * NAMESPACE_BYTES, "tenant:first's table is no longer counted"
    # The session still open on the dropped namespace drafts on, without a table, and fills nothing unaccounted.
    reply = first.propose(DraftFeedback((5,), successors(20_000, 50)), max_nodes=4)
    assert reply.tree.token_ids == ()
    assert drafter.memory.bytes_of(NAMESPACE) == 2 * NAMESPACE_BYTES
    # Opened again, it is a fresh namespace (and drops the least recent of the others).
    again = drafter.open_session("again", [1, 2, 3], "fp", pool_namespace="tenant:first")
    again.propose(DraftFeedback((4,), successors(10_000, 1)), max_nodes=4)
    assert again.propose(DraftFeedback((10_000,)), max_nodes=4).tree.token_ids != ()
    assert drafter.num_namespaces == 2


def test_a_purge_drops_the_namespaces_acceptance_statistics_with_its_tables() -> None:
    drafter = Drafter(lambda *_: InMemoryNgramPool(), sources=RECYCLING)
    session = drafter.open_session("s", [1, 2, 3], "fp", pool_namespace="tenant:a")
    session.propose(DraftFeedback((4,), successors(10_000, 3)), max_nodes=4)
    shared = session._builder.stats.parent
    assert shared is not None
    shared.update("token_recycling", 1, True)
    assert drafter.forget_successors("tenant:a") == 1
    assert shared.num_counts == 0 and drafter.num_namespaces == 0
    assert drafter.memory.count(NAMESPACE) == 0 and drafter.memory.bytes_of(NAMESPACE) == 0


def test_the_pool_registry_is_capped_and_a_dropped_pool_gives_its_bytes_back_for_good() -> None:
    shape = PoolShape(key_len=2, continuation_len=2)
    registry = PoolRegistry(shape, None, 0.05, max_keys=10**6, max_pools=2)
    dropped = registry("fp", "tenant:a")
    assert isinstance(dropped, InMemoryNgramPool)  # no Redis: the in-memory pool itself
    dropped.record(list(range(100, 120)))
    registry("fp", "tenant:b").record(list(range(200, 220)))
    registry("fp", "tenant:a")  # asked for again: now the most recent
    registry("fp", "tenant:c")  # tenant:b is the least recent: dropped
    assert len(registry) == 2
    assert registry.nbytes == len(dropped) * shape.bytes_per_key > 0  # tenant:c holds nothing yet
    assert registry("fp", "tenant:a") is dropped
    kept = registry("fp", "tenant:a")
    registry("fp", "tenant:d")
    registry("fp", "tenant:e")  # tenant:a dropped too now
    assert registry.nbytes == 0
    kept.record(list(range(300, 340)))  # a session still open on it: nothing recorded, nothing counted
    assert kept.lookup([300, 301]) == [] and registry.nbytes == 0
