"""The drafter's per-session memory, bounded in bytes: over budget, least recently used sessions' state goes.

What a session holds beyond its committed tokens is its sources' own state,
chiefly the draft head's KV cache over the session's context and the target
features not fed to it yet (about 1.5 kB per position for SmolLM2's head,
12 MiB for an 8k context). When the sessions' total passes the budget, the
sources of the least recently used sessions ``forget`` theirs: those sessions
go on drafting with their n-gram sources. Drafting degrades; generation never
fails or changes, since every tree is verified.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Callable
from typing import Protocol

_log = logging.getLogger(__name__)

UNBOUNDED = 1 << 62


class Accountable(Protocol):
    """A session as its memory is accounted."""

    session_id: str

    @property
    def nbytes(self) -> int:
        """Bytes of the session's state, all of it."""
        ...

    def forget(self) -> int:
        """Free what can be freed (the sources' state); the bytes freed."""
        ...


class SessionMemory:
    """Bytes per open session, most recently used last, bounded by ``max_bytes``.

    ``used`` is called by a session after each step of its work (propose,
    work ahead): callers serialize those steps (the drafter's servicer holds
    its drafting lock), so forgetting another session's state never races
    with that session's own work. ``opened``/``closed`` may come from any
    thread.
    """

    def __init__(self, max_bytes: int, on_forget: Callable[[int], None] | None = None) -> None:
        if max_bytes < 0:
            raise ValueError(f"the drafter's session memory must be >= 0 bytes, got {max_bytes}")
        self.max_bytes = max_bytes
        self._on_forget = on_forget
        self._lock = threading.Lock()
        self._sessions: OrderedDict[int, tuple[Accountable, int]] = OrderedDict()  # id(session) -> (it, bytes)
        self._total = 0
        self.num_forgotten = 0

    @property
    def bytes_in_use(self) -> int:
        return self._total

    def __len__(self) -> int:
        return len(self._sessions)

    def opened(self, session: Accountable) -> None:
        """Count a new session (its tokens; its sources hold nothing yet). Frees nothing: see ``used``."""
        nbytes = session.nbytes
        with self._lock:
            self._sessions[id(session)] = (session, nbytes)
            self._total += nbytes

    def closed(self, session: Accountable) -> None:
        with self._lock:
            entry = self._sessions.pop(id(session), None)
            if entry is not None:
                self._total -= entry[1]

    def used(self, session: Accountable) -> None:
        """Count ``session``'s bytes now and mark it most recently used; then back under budget if over."""
        nbytes = session.nbytes
        with self._lock:
            old = self._sessions.pop(id(session), None)
            if old is None:  # closed (a step of work ahead that ended after its stream), or never opened
                return
            self._total += nbytes - old[1]
            self._sessions[id(session)] = (session, nbytes)
            if self._total <= self.max_bytes:
                return
            # Least recently used first; the session at work last, should it alone be over the budget.
            for key in list(self._sessions):
                if self._total <= self.max_bytes:
                    break
                victim, held = self._sessions[key]
                freed = victim.forget()
                if freed <= 0:
                    continue
                self._sessions[key] = (victim, held - freed)
                self._total -= freed
                self.num_forgotten += 1
                _log.info(
                    "session %s: forgot %d bytes of drafting state (drafter memory over %d bytes); "
                    "it drafts with its n-gram sources from now on",
                    victim.session_id,
                    freed,
                    self.max_bytes,
                )
                if self._on_forget is not None:
                    self._on_forget(freed)
