"""The verifier's sessions and the KV cache memory they hold: admission in bytes, eviction, release.

A session holds every committed token and a region of the KV arena with the
keys and values of all of them but the last (the pending token). Memory is
admitted in bytes: a new session that finds no room evicts sessions idle for
``evict_idle_s`` (least recently used first); a session that must grow to
verify evicts any idle session with no call queued, and when there is none, a
session whose call is queued but not in the step being built (preemption by
recompute: waiting instead could last forever, since sessions whose rounds
are sent ahead always have a call queued and each needs room to grow).
Sessions in the step being built are never evicted: the forward writes into
their memory. An evicted session's next Verify gets NOT_FOUND, and the
coordinator prefills it again from its committed tokens.

A released session's cache is kept for a while (``kept_prefixes``): a new
session of the same caller whose prompt starts with its tokens copies them
instead of prefilling them. Kept caches are the first memory to go.

The engine thread owns it; ``peek`` and ``len`` are safe reads from any thread.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection
from dataclasses import dataclass, field

from specserve.sampling import SamplingParams, fresh_seed
from target_service.budget_policy import SessionAcceptance
from target_service.kept_prefixes import KeptPrefixes
from target_service.kv_arena import KVArena, Region
from target_service.lookahead import LookaheadWindow
from target_service.session_store import SessionStore

log = logging.getLogger(__name__)

# Slots reserved beyond a prompt at prefill, so the first rounds grow in place.
PREFILL_HEADROOM_TOKENS = 64


@dataclass
class Session:
    committed: list[int]  # all committed tokens; the cache holds all but the last
    region: Region
    sampling: SamplingParams
    seed: int  # keys the sampling draws by position (keyed_noise)
    acceptance: SessionAcceptance = field(default_factory=SessionAcceptance)  # sizes its draft budget
    owner: str = ""  # who created it (caller and tenant, from the edge); only the owner may use or release it
    lookahead: LookaheadWindow | None = None  # its Jacobi window, made at its first lookahead step
    # The decoder layers whose inputs its features are, concatenated per row (``layer_features``); empty: the
    # final hidden state after the norm.
    feature_layers: tuple[int, ...] = ()


class SessionCache:
    """Sessions by id, each with its region of ``arena``; ``busy()`` names the sessions not to evict now."""

    def __init__(
        self,
        arena: KVArena,
        max_sessions: int,
        ttl_s: float,
        max_session_tokens: int,
        evict_idle_s: float,
        busy: Callable[[], Collection[str]],
        max_kept: int = 0,
    ) -> None:
        """``max_kept``: released sessions' caches kept for new sessions to start from (0: none)."""
        self.arena = arena
        self._store: SessionStore[Session] = SessionStore(max_sessions, ttl_s, on_evict=self._forget)
        self.kept = KeptPrefixes(arena, max_kept, ttl_s)
        self._max_session_tokens = max_session_tokens
        self._evict_idle_s = evict_idle_s
        self._busy = busy

    def __len__(self) -> int:
        return len(self._store)

    @property
    def num_evicted(self) -> int:
        return self._store.num_evicted

    def peek(self, session_id: str) -> Session | None:
        return self._store.peek(session_id)

    def get(self, session_id: str) -> Session | None:
        """The session, marked as just used (eviction is least recently used first)."""
        return self._store.get(session_id)

    def expire(self) -> None:
        """Drop sessions idle past the TTL, and kept caches as old."""
        self._store.expire()
        self.kept.expire()

    def start(self, session_id: str, tokens: list[int], sampling: SamplingParams, owner: str) -> Session | None:
        """A new session for ``tokens`` (replacing one of the same id) with room to cache them, not yet
        registered; None when no memory can be found, even by evicting kept caches and idle sessions.

        Where a kept cache of ``owner`` starts with the same tokens, the region starts with its keys and values
        (``region.length`` of them; the prefill computes the rest).
        """
        old = self._store.pop(session_id)
        if old is not None:
            self.arena.free(old.region)
        need = len(tokens) - 1 + PREFILL_HEADROOM_TOKENS
        match = self.kept.take(owner, tokens)  # out of the store: nothing below evicts it
        region = self.arena.allocate(need)
        while region is None and (self.kept.evict_oldest() or self.evict_one(self._evict_idle_s)):
            region = self.arena.allocate(need)
        if match is not None:
            kept, shared = match
            if region is not None:
                self.kept.copy_into(kept, region, shared)
            self.kept.give_back(kept)
        if region is None:
            return None
        seed = sampling.seed if sampling.seed is not None else fresh_seed()
        return Session(list(tokens), region, sampling, seed, owner=owner)

    def register(self, session_id: str, session: Session, protected: Collection[str]) -> None:
        """Make a started session's cache usable by Verify; ``protected`` sessions are not evicted to fit it."""
        self._store.put(session_id, session, protected=protected)

    def reserve(self, region: Region, tokens: int, stepping: Collection[str]) -> bool:
        """Room for ``tokens`` in ``region``, evicting sessions if needed (least recently used first): idle ones,
        then ones whose calls are queued but not among the ``stepping`` sessions of the step being built."""
        while not self.arena.reserve(region, tokens, self._max_session_tokens):
            if not (
                self.kept.evict_oldest()
                or self.evict_one(0.0, keep=region)
                or self.evict_one(0.0, keep=region, busy=stepping)
            ):
                return False
        return True

    def evict_one(self, idle_s: float, keep: Region | None = None, busy: Collection[str] | None = None) -> bool:
        """Evict the least recently used session idle for ``idle_s`` and not ``busy`` (default: with no call in
        the step being built or queued); False if none."""
        busy = self._busy() if busy is None else busy
        victim = self._store.least_recent(idle_s, lambda key, s: key not in busy and s.region is not keep)
        if victim is None:
            return False
        log.info("evicting session %s to free KV cache memory", victim)
        self._store.evict(victim)
        return True

    def abandon(self, session_id: str, session: Session) -> None:
        """Give up a started session (a prefill cancelled or failed): its memory, unless it was registered."""
        if self._store.peek(session_id) is not session:
            self.arena.free(session.region)

    def discard(self, session_id: str, session: Session) -> None:
        """Forget a registered session (its step failed) and give its memory back."""
        if self._store.peek(session_id) is session:
            self._store.pop(session_id)
            self.arena.free(session.region)

    def release(self, session_id: str) -> bool:
        """Forget a session, its cache kept for a new session of its owner to start from (``kept_prefixes``);
        False when there was none."""
        session = self._store.pop(session_id)
        if session is not None:
            self.kept.keep(session.owner, session.committed, session.region)
        return session is not None

    def _forget(self, session_id: str, session: Session) -> None:
        """SessionStore eviction hook (TTL, session count, LRU): give the memory back."""
        self.arena.free(session.region)
