"""Session affinity across verifier replicas.

A verifier keeps each session's KV cache in its own memory, so every call of
a session must reach the replica that prefilled it. gRPC's round_robin
balances per call, which would send most Verify calls to a replica that has
never seen the session (each then costs a re-prefill). The router keeps one
connection per replica, pins each new session to the replica with the fewest
sessions pinned by this coordinator, and re-resolves the replica set
periodically. A session whose replica vanished is pinned afresh; its first
call there fails with NOT_FOUND and the round loop re-prefills it, so no
token is lost or repeated.

Failover: a replica that cannot be reached (ReplicaUnreachable: connection
refused or reset, as when its pod is killed) is marked down for ``down_s``
and gets no new sessions meanwhile; once that has passed, the next session
pinned to it is its probe. The failed call's session is pinned afresh to a
replica that is up and the call raises SessionMoved, on which the round loop
prefills the session there from its committed tokens and repeats the round.
With no replica up, calls fail with UNAVAILABLE and a message saying so.

With a ``k8s://`` target (coordinator.discovery) the replica set comes from a
watch of the Service's EndpointSlices instead, read at every call (no refresh
period): a replica that turns ready gets the next new session; one that is
terminating (or not ready) is listed as not ``accepting``: it keeps the
sessions pinned to it, so they finish there, and gets no new ones.

A conversation's next turn goes back to the replica that prefilled its last
turn (``coordinator.prefix_homes``), where that replica kept the last turn's
cache: unless it carries ``prefix_slack`` sessions more than the least
loaded replica.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import TypeVar

from coordinator.discovery import Replica
from coordinator.ports import VerifierInfo, VerifierPort
from coordinator.prefix_homes import PrefixHomes, block_keys
from specserve.errors import ReplicaDraining, ReplicaUnreachable, SessionMoved, Unavailable
from specserve.results import PrefillResult, VerifyResult
from specserve.verify_call import SessionPrefill, VerifyCall

_DNS_SCHEME = "dns:///"
T = TypeVar("T")


def replica_resolver(target: str) -> Callable[[], list[str]]:
    """A function listing the replicas of ``target``.

    ``dns:///name:port`` resolves the name (a headless Service lists every
    ready pod); a comma-separated list of addresses is used as is.
    """
    if not target.startswith(_DNS_SCHEME):
        addresses = [a.strip() for a in target.split(",") if a.strip()]
        return lambda: list(addresses)
    host, _, port = target[len(_DNS_SCHEME) :].rpartition(":")

    def resolve() -> list[str]:
        infos = socket.getaddrinfo(host, int(port), type=socket.SOCK_STREAM)
        found = {f"[{info[4][0]}]:{port}" if info[0] == socket.AF_INET6 else f"{info[4][0]}:{port}" for info in infos}
        return sorted(found)

    return resolve


class StickyVerifierRouter:
    """A VerifierPort over several verifier replicas, with per-session affinity."""

    def __init__(
        self,
        resolve: Callable[[], Sequence[str | Replica]],
        connect: Callable[[str], VerifierPort],
        refresh_s: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
        down_s: float = 5.0,
        on_pin: Callable[[str], None] | None = None,
        prefix_slack: int = 4,
    ) -> None:
        """``resolve`` lists the replicas (addresses: all accepting); ``on_pin`` hears each new session's replica;
        ``prefix_slack``: the most sessions a replica may carry beyond the least loaded one and still get a new
        session whose prompt it prefilled last (``prefix_homes``)."""
        self._resolve = resolve
        self._on_pin = on_pin
        self._resolved: Sequence[str | Replica] | None = None
        self._not_accepting: set[str] = set()  # listed, keeping their sessions, but given no new ones
        self._connect = connect
        self._refresh_s = refresh_s
        self._clock = clock
        self._down_s = down_s
        self._replicas: dict[str, VerifierPort] = {}
        self._pinned: dict[str, str] = {}  # session id -> replica address
        self._down_until: dict[str, float] = {}  # replica address -> when it may get sessions again
        # Replicas that are shutting down: they serve the sessions they hold, but get no new ones until then.
        self._closed_until: dict[str, float] = {}
        self._next_refresh = 0.0
        self._homes = PrefixHomes()
        self._prefix_slack = prefix_slack

    @property
    def replicas(self) -> list[str]:
        self._refresh()
        return sorted(self._replicas)

    def _refresh(self) -> None:
        if self._clock() < self._next_refresh and self._replicas:
            return
        self._next_refresh = self._clock() + self._refresh_s
        try:
            resolved = self._resolve()
        except OSError:
            return  # keep the replicas we know; DNS hiccups must not fail requests
        if isinstance(resolved, tuple) and resolved is self._resolved:
            return  # a watched set (immutable) that has not changed since the last call
        self._resolved = resolved
        replicas = [r if isinstance(r, Replica) else Replica(r) for r in resolved]
        addresses = [r.address for r in replicas]
        self._not_accepting = {r.address for r in replicas if not r.accepting}
        for address in addresses:
            if address not in self._replicas:
                self._replicas[address] = self._connect(address)
        for gone in set(self._replicas) - set(addresses):
            del self._replicas[gone]
            self._down_until.pop(gone, None)
            self._homes.forget(gone)

    def _is_up(self, address: str) -> bool:
        return self._down_until.get(address, 0.0) <= self._clock()

    def _no_replica(self) -> Unavailable:
        if not self._replicas:
            return Unavailable(
                "no verifier replica is available: retry shortly",
                detail="no verifier replica is known: check the verifier address and its DNS name",
            )
        if all(a in self._not_accepting for a in self._replicas):
            return Unavailable(
                "no verifier replica takes new sessions now: retry shortly",
                detail=f"replicas terminating or not ready: {', '.join(sorted(self._replicas))}",
            )
        return Unavailable(
            f"every verifier replica failed within the last {self._down_s:g} s: retry once one is back",
            detail=f"replicas down: {', '.join(sorted(self._replicas))}: check the verifier pods",
        )

    def _pin(self, session_id: str, prompt_keys: Sequence[int] = ()) -> str:
        """Pin ``session_id`` to the replica that is up with the fewest sessions pinned here, or to the one that
        prefilled the longest prefix of its prompt (``prompt_keys``: its ``block_keys``) last if it carries at
        most ``prefix_slack`` more."""
        now = self._clock()
        load = {
            a: 0
            for a in self._replicas
            if self._is_up(a) and self._closed_until.get(a, 0.0) <= now and a not in self._not_accepting
        }
        if not load:
            raise self._no_replica()
        for pinned in self._pinned.values():
            if pinned in load:
                load[pinned] += 1
        address = min(sorted(load), key=load.__getitem__)
        home = self._homes.home(prompt_keys, load) if len(load) > 1 else None
        if home is not None and load[home] <= load[address] + self._prefix_slack:
            address = home
        self._pinned[session_id] = address
        if self._on_pin is not None:
            self._on_pin(address)
        return address

    def _address_for(self, session_id: str, creating: bool, prompt_keys: Sequence[int] = ()) -> str:
        """The replica holding ``session_id``; pinned afresh when it has none (or, ``creating`` it from a prompt
        of ``prompt_keys``, a down one)."""
        self._refresh()
        address = self._pinned.get(session_id)
        if address is None or address not in self._replicas:
            return self._pin(session_id, prompt_keys)
        if not self._is_up(address):
            # The replica failed under another session: this one is gone with it.
            if creating:
                return self._pin(session_id, prompt_keys)
            self._pin(session_id)
            raise SessionMoved(
                "a verifier replica is down; the session moved to another replica",
                detail=f"verifier replica {address} is down",
            )
        return address

    async def _call(
        self,
        session_id: str,
        creating: bool,
        call: Callable[[VerifierPort], Awaitable[T]],
        prompt_keys: Sequence[int] = (),
    ) -> T:
        address = self._address_for(session_id, creating, prompt_keys)
        try:
            return await call(self._replicas[address])
        except ReplicaDraining as exc:
            if not creating:
                raise
            # Shutting down: this replica keeps its sessions, but this new one must start elsewhere.
            self._closed_until[address] = self._clock() + self._down_s
            self._pinned.pop(session_id, None)
            try:
                self._pin(session_id)
            except Unavailable:
                raise Unavailable(str(exc), detail=exc.detail) from exc
            raise SessionMoved(f"{exc}; the session moved to another replica", detail=exc.detail) from exc
        except ReplicaUnreachable as exc:
            self._down_until[address] = self._clock() + self._down_s
            self._pinned.pop(session_id, None)
            if not any(self._is_up(a) for a in self._replicas):
                raise self._no_replica() from exc
            self._pin(session_id)
            raise SessionMoved(f"{exc}; the session moved to another replica", detail=exc.detail) from exc

    @property
    def keeps_order(self) -> bool:
        """A session's calls go to one replica at a time: in order where every replica keeps it."""
        self._refresh()
        return bool(self._replicas) and all(replica.keeps_order for replica in self._replicas.values())

    async def info(self) -> VerifierInfo:
        self._refresh()
        for address in sorted(self._replicas, key=lambda a: (not self._is_up(a), a)):
            try:
                return await self._replicas[address].info()
            except ReplicaUnreachable:
                self._down_until[address] = self._clock() + self._down_s
        raise self._no_replica()

    async def prefill(self, call: SessionPrefill) -> PrefillResult:
        keys = block_keys(call.token_ids)
        result = await self._call(call.session_id, True, lambda r: r.prefill(call), keys)
        address = self._pinned.get(call.session_id)
        if address is not None:
            self._homes.record(keys, address)  # where its cache will be kept when it is released
        return result

    async def verify(self, call: VerifyCall) -> VerifyResult:
        return await self._call(call.session_id, False, lambda r: r.verify(call))

    async def release(self, session_id: str) -> None:
        address = self._pinned.pop(session_id, None)
        replica = self._replicas.get(address) if address is not None else None
        if replica is not None and address is not None and self._is_up(address):
            await replica.release(session_id)
