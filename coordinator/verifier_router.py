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
"""

from __future__ import annotations

import socket
import time
from collections.abc import Callable, Sequence

from coordinator.ports import VerifierInfo, VerifierPort
from specserve.acceptance import PrefillResult, VerifyResult
from specserve.errors import Unavailable
from specserve.sampling import SamplingParams
from specserve.token_tree import TokenTree

_DNS_SCHEME = "dns:///"


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
        resolve: Callable[[], Sequence[str]],
        connect: Callable[[str], VerifierPort],
        refresh_s: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._resolve = resolve
        self._connect = connect
        self._refresh_s = refresh_s
        self._clock = clock
        self._replicas: dict[str, VerifierPort] = {}
        self._pinned: dict[str, str] = {}  # session id -> replica address
        self._next_refresh = 0.0

    @property
    def replicas(self) -> list[str]:
        self._refresh()
        return sorted(self._replicas)

    def _refresh(self) -> None:
        if self._clock() < self._next_refresh and self._replicas:
            return
        self._next_refresh = self._clock() + self._refresh_s
        try:
            addresses = list(self._resolve())
        except OSError:
            return  # keep the replicas we know; DNS hiccups must not fail requests
        for address in addresses:
            if address not in self._replicas:
                self._replicas[address] = self._connect(address)
        for gone in set(self._replicas) - set(addresses):
            del self._replicas[gone]

    def _replica_for(self, session_id: str) -> VerifierPort:
        self._refresh()
        address = self._pinned.get(session_id)
        if address is None or address not in self._replicas:
            if not self._replicas:
                raise Unavailable("no verifier replica is known: check the verifier address and its DNS name")
            load = {a: 0 for a in self._replicas}
            for pinned in self._pinned.values():
                if pinned in load:
                    load[pinned] += 1
            address = min(sorted(load), key=load.__getitem__)
            self._pinned[session_id] = address
        return self._replicas[address]

    async def info(self) -> VerifierInfo:
        self._refresh()
        if not self._replicas:
            raise Unavailable("no verifier replica is known: check the verifier address and its DNS name")
        return await self._replicas[min(self._replicas)].info()

    async def prefill(
        self, session_id: str, token_ids: Sequence[int], sampling: SamplingParams, return_features: bool = False
    ) -> PrefillResult:
        return await self._replica_for(session_id).prefill(session_id, token_ids, sampling, return_features)

    async def verify(
        self, session_id: str, num_committed: int, tree: TokenTree, top_k: int = 0, return_features: bool = False
    ) -> VerifyResult:
        return await self._replica_for(session_id).verify(session_id, num_committed, tree, top_k, return_features)

    async def release(self, session_id: str) -> None:
        address = self._pinned.pop(session_id, None)
        replica = self._replicas.get(address) if address is not None else None
        if replica is not None:
            await replica.release(session_id)
