"""Draft streams spread over the drafter endpoints a ``k8s://`` watch lists.

With a ``dns:///`` name, one gRPC channel balances Draft streams round robin and learns of new drafter pods only
when a connection ends (drafters close connections older than ``--max-connection-age-s``). With a watched
set the pool keeps one connection per endpoint and opens each new session on an accepting endpoint (ready,
not terminating) with the fewest streams open from here, preferring the coordinator's own zone and falling
back to any zone when none there accepts. A pod that turns ready gets sessions from the next one on; a
terminating one finishes its open streams and gets no new ones; a connection is closed once its endpoint is
gone and its last stream has ended.

A drafter that refuses a new stream because it is draining is skipped for ``refuse_s`` (the watch normally
says so first); the health-checking wrapper opens the session again, landing on another endpoint.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from coordinator.discovery import Replica
from coordinator.ports import DraftStream
from specserve.errors import DrafterDraining, DrafterFailed
from specserve.results import DraftFeedback, DraftReply, VerifiedTree
from specserve.sampling import GREEDY, SamplingParams

log = logging.getLogger(__name__)


class PooledDrafter(Protocol):
    """One endpoint's connection (GrpcDrafter over its own channel)."""

    async def info(self) -> Any: ...

    async def open(
        self, session_id: str, prompt_tokens: Sequence[int], vocab_fingerprint: str, sampling: SamplingParams = ...
    ) -> DraftStream: ...

    async def aclose(self) -> None: ...


class DrafterPool:
    """A DrafterPort over the drafter endpoints ``resolve`` lists (read at every new session)."""

    def __init__(
        self,
        resolve: Callable[[], Sequence[Replica]],
        connect: Callable[[str], PooledDrafter],
        zone: str = "",
        on_pin: Callable[[str], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
        refuse_s: float = 5.0,
    ) -> None:
        self._resolve = resolve
        self._connect = connect
        self.zone = zone  # the coordinator's own zone; "" prefers none
        self._on_pin = on_pin
        self._clock = clock
        self._refuse_s = refuse_s
        self._drafters: dict[str, PooledDrafter] = {}
        self._open: dict[str, int] = {}  # address -> streams open from here
        self._listed: tuple[Replica, ...] = ()
        self._refused_until: dict[str, float] = {}
        self._closing: set[asyncio.Task[None]] = set()

    @property
    def streams(self) -> dict[str, int]:
        """Open streams per endpoint address (for tests and logs)."""
        return {a: n for a, n in self._open.items() if n}

    def _refresh(self) -> None:
        self._listed = tuple(self._resolve())
        listed = {r.address for r in self._listed}
        for gone in set(self._drafters) - listed:
            if not self._open.get(gone):
                self._close(gone)

    def _close(self, address: str) -> None:
        drafter = self._drafters.pop(address, None)
        self._open.pop(address, None)
        self._refused_until.pop(address, None)
        if drafter is not None:
            task = asyncio.get_running_loop().create_task(drafter.aclose())
            self._closing.add(task)
            task.add_done_callback(self._closing.discard)

    def choose(self) -> str:
        """The endpoint for a new session: accepting, in our zone when one there is, fewest open streams."""
        self._refresh()
        now = self._clock()
        candidates = [r for r in self._listed if r.accepting and self._refused_until.get(r.address, 0.0) <= now]
        if not candidates:
            raise DrafterFailed(
                "no drafter endpoint takes new sessions",
                detail=f"drafter endpoints: {', '.join(r.address for r in self._listed) or 'none'} "
                "(none ready, or all terminating)",
            )
        local = [r for r in candidates if self.zone and r.zone == self.zone]
        pool = local or candidates
        return min(sorted(r.address for r in pool), key=lambda a: self._open.get(a, 0))

    def _drafter(self, address: str) -> PooledDrafter:
        drafter = self._drafters.get(address)
        if drafter is None:
            drafter = self._drafters[address] = self._connect(address)
        return drafter

    async def info(self) -> Any:
        """DrafterInfo of an accepting endpoint (the vocabulary check at start-up)."""
        return await self._drafter(self.choose()).info()

    async def open(
        self,
        session_id: str,
        prompt_tokens: Sequence[int],
        vocab_fingerprint: str,
        sampling: SamplingParams = GREEDY,
    ) -> DraftStream:
        address = self.choose()
        drafter = self._drafter(address)
        self._open[address] = self._open.get(address, 0) + 1
        try:
            stream = await drafter.open(session_id, prompt_tokens, vocab_fingerprint, sampling)
        except DrafterDraining:
            self._refused_until[address] = self._clock() + self._refuse_s
            self._release(address)
            raise
        except BaseException:
            self._release(address)
            raise
        if self._on_pin is not None:
            self._on_pin(address)
        return _PooledStream(self, address, stream)

    def _release(self, address: str) -> None:
        self._open[address] = max(0, self._open.get(address, 0) - 1)
        if not self._open[address] and address not in {r.address for r in self._listed}:
            self._close(address)

    async def aclose(self) -> None:
        for address in list(self._drafters):
            self._close(address)
        if self._closing:
            await asyncio.gather(*self._closing, return_exceptions=True)


class _PooledStream:
    """A stream that tells its pool when it ends, so the pool counts open streams per endpoint."""

    def __init__(self, pool: DrafterPool, address: str, inner: DraftStream) -> None:
        self._pool = pool
        self._address = address
        self._inner = inner
        self.wants_features = inner.wants_features
        self._closed = False

    @property
    def takes_verified_trees(self) -> bool:
        return self._inner.takes_verified_trees

    @property
    def sparse_features(self) -> bool:
        return self._inner.sparse_features

    @property
    def feature_layers(self) -> tuple[int, ...]:
        return self._inner.feature_layers

    async def propose(self, feedback: DraftFeedback, max_nodes: int) -> DraftReply:
        try:
            reply: DraftReply = await self._inner.propose(feedback, max_nodes)
        except DrafterDraining:  # a refused stream surfaces at its first read
            self._pool._refused_until[self._address] = self._pool._clock() + self._pool._refuse_s
            raise
        return reply

    async def verifying(self, verified: VerifiedTree) -> None:
        await self._inner.verifying(verified)

    async def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._pool._release(self._address)
        await self._inner.close()
