"""The drafter's memory, bounded in bytes: over budget, the least recently used entries' state goes.

Entries are sessions and the pool namespaces' shared state (successor tables
and acceptance statistics: ``draft_service.namespace_state``), in one LRU
order; each says its ``kind``.

What a session holds beyond its committed tokens is its sources' own state,
chiefly the draft head's KV cache over the session's context and the target
features not fed to it yet (about 1.5 kB per position for SmolLM2's head,
12 MiB for an 8k context). When the sessions' total passes the budget, the
sources of the least recently used sessions ``forget`` theirs: those sessions
go on drafting with their n-gram sources. Drafting degrades; generation never
fails or changes, since every tree is verified. A forgotten namespace's
table and statistics are learnt again from its next sessions' rounds.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Callable
from typing import Protocol

_log = logging.getLogger(__name__)

UNBOUNDED = 1 << 62
SESSION = "session"
"""The kind of a draft session's entry (``draft_service.namespace_state.NAMESPACE``: a namespace's)."""


class Accountable(Protocol):
    """A session, or a namespace's shared state, as its memory is accounted."""

    @property
    def kind(self) -> str:
        """What it is (``SESSION``, ``NAMESPACE``): bytes and entries are reported per kind."""
        ...

    @property
    def label(self) -> str:
        """Which one, for the log."""
        ...

    @property
    def nbytes(self) -> int:
        """Bytes of its state, all of it."""
        ...

    def forget(self) -> int:
        """Free what can be freed (the sources' state); the bytes freed."""
        ...


class SessionMemory:
    """Bytes per entry (open session, namespace state), most recently used last, bounded by ``max_bytes``.

    ``used`` is called by a session after each step of its work (propose,
    work ahead), for itself and its namespace's state: callers serialize
    those steps (the drafter's servicer holds its drafting lock), so
    forgetting another entry's state never races with its own work.
    ``opened``/``closed`` may come from any thread.
    """

    def __init__(self, max_bytes: int, on_forget: Callable[[int], None] | None = None) -> None:
        if max_bytes < 0:
            raise ValueError(f"the drafter's session memory must be >= 0 bytes, got {max_bytes}")
        self.max_bytes = max_bytes
        self._on_forget = on_forget
        self._lock = threading.Lock()
        self._sessions: OrderedDict[int, tuple[Accountable, int]] = OrderedDict()  # id(session) -> (it, bytes)
        self._total = 0
        self._bytes: dict[str, int] = {}  # per kind
        self._entries: dict[str, int] = {}  # per kind
        self._forgotten: dict[str, int] = {}  # per kind: times an entry's state was freed

    @property
    def bytes_in_use(self) -> int:
        return self._total

    @property
    def num_forgotten(self) -> int:
        """Times a session's state was freed to stay within the bound."""
        return self.forgotten(SESSION)

    def forgotten(self, kind: str) -> int:
        """Times an entry of ``kind`` had its state freed to stay within the bound."""
        return self._forgotten.get(kind, 0)

    def bytes_of(self, kind: str) -> int:
        """Bytes the entries of ``kind`` hold."""
        return self._bytes.get(kind, 0)

    def count(self, kind: str) -> int:
        """Entries of ``kind`` counted (``SESSION``: open sessions)."""
        return self._entries.get(kind, 0)

    def __len__(self) -> int:
        return len(self._sessions)

    def _add(self, kind: str, nbytes: int) -> None:
        self._total += nbytes
        self._bytes[kind] = self._bytes.get(kind, 0) + nbytes

    def opened(self, session: Accountable) -> None:
        """Count a new entry (a session's tokens; its sources hold nothing yet). Frees nothing: see ``used``."""
        nbytes = session.nbytes
        with self._lock:
            self._sessions[id(session)] = (session, nbytes)
            self._add(session.kind, nbytes)
            self._entries[session.kind] = self._entries.get(session.kind, 0) + 1

    def closed(self, session: Accountable) -> None:
        with self._lock:
            entry = self._sessions.pop(id(session), None)
            if entry is not None:
                self._add(session.kind, -entry[1])
                self._entries[session.kind] -= 1

    def used(self, session: Accountable) -> None:
        """Count ``session``'s bytes now and mark it most recently used; then back under budget if over."""
        nbytes = session.nbytes
        with self._lock:
            old = self._sessions.pop(id(session), None)
            if old is None:  # closed (a step of work ahead that ended after its stream), or never opened
                return
            self._add(session.kind, nbytes - old[1])
            self._sessions[id(session)] = (session, nbytes)
            if self._total <= self.max_bytes:
                return
            # Least recently used first; the entry at work last, should it alone be over the budget.
            for key in list(self._sessions):
                if self._total <= self.max_bytes:
                    break
                victim, held = self._sessions[key]
                freed = victim.forget()
                if freed <= 0:
                    continue
                self._sessions[key] = (victim, held - freed)
                self._add(victim.kind, -freed)
                self._forgotten[victim.kind] = self._forgotten.get(victim.kind, 0) + 1
                _log.info(
                    "%s: forgot %d bytes of drafting state (drafter memory over %d bytes)%s",
                    victim.label,
                    freed,
                    self.max_bytes,
                    "; it drafts with its n-gram sources from now on" if victim.kind == SESSION else "",
                )
                if self._on_forget is not None:
                    self._on_forget(freed)
