"""A drafter behind a circuit breaker and a timeout that follows its measured latency.

``HealthCheckedDrafter`` wraps any DrafterPort (gRPC or in-process) and is one
itself. A drafter can slow a request, never fail it; this wrapper bounds how
much it can slow requests:

- Timeout. Each proposal waits at most ``DraftLatency.timeout_s``: ``factor``
  times the p99 of the drafter's recent round trips, clamped to
  [``floor_s``, ``ceiling_s``]. The ceiling is the configured
  ``--draft-timeout-ms``; until enough round trips are measured the ceiling
  applies. A timeout counts as a sample at the timeout, so a drafter that got
  slower (more load) raises its own timeout instead of timing out again.
- Circuit breaker. A failure (an error, a timeout, or a misbehaviour the
  round loop reports: a malformed tree, one the verifier rejected) opens the
  circuit: new requests skip the drafter (``DrafterSkipped``) for a backoff
  period that starts at ``backoff_s`` and doubles with each failure in a row
  up to ``max_backoff_s``; streams still open on the drafter give up at once
  instead of each waiting for their own timeout. When the period is over, a
  background probe (a Draft stream asking for no tree) decides: an answer
  within the ceiling closes the circuit, anything else opens it for the next,
  doubled, period. A session that ends with at least one tree and no failure
  resets the doubling.

So a stalled drafter costs one timeout per backoff period (the probe's, in the
background, after the first), not one per request.

A drafter that is shutting down (``DrafterDraining``: it refuses new Draft
streams, finishing the open ones) is not failing: a session it refuses opens
again, and on a tier of several drafters (a ``dns:///`` name, round robin)
lands on another one, up to ``DRAINING_RETRIES`` times; then the request goes
on without a drafter. The circuit stays as it was.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
import uuid
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar

from coordinator.ports import DrafterPort, DraftStream
from specserve.errors import DrafterDraining, DrafterFailed, DrafterSkipped
from specserve.results import DraftFeedback, DraftReply, VerifiedTree
from specserve.sampling import GREEDY, SamplingParams

log = logging.getLogger(__name__)
T = TypeVar("T")

DRAINING_RETRIES = 3
"""Times a session refused by a draining drafter opens again (on a round-robin tier: on the next drafter)."""


class DraftLatency:
    """Round trips of one drafter's proposals, and the timeout they call for.

    ``timeout_s`` = clamp(``factor`` x p99 of the last ``window`` round trips,
    ``floor_s``, ``ceiling_s``), or ``ceiling_s`` until ``min_samples`` are in.
    The p99 rather than the mean: drafting time has a long tail (a first round
    after a long prompt, a verifier forward competing for the same cores) that
    a mean would cut off and count as failures.
    """

    def __init__(
        self, ceiling_s: float, floor_s: float = 0.1, factor: float = 4.0, window: int = 128, min_samples: int = 8
    ) -> None:
        self.ceiling_s = ceiling_s
        self.floor_s = min(floor_s, ceiling_s)
        self._factor = factor
        self._min_samples = min_samples
        self._samples: deque[float] = deque(maxlen=window)

    def observe(self, seconds: float) -> None:
        self._samples.append(seconds)

    @property
    def p99_s(self) -> float | None:
        if len(self._samples) < self._min_samples:
            return None
        ordered = sorted(self._samples)
        return ordered[math.ceil(0.99 * len(ordered)) - 1]

    @property
    def timeout_s(self) -> float:
        p99 = self.p99_s
        if p99 is None:
            return self.ceiling_s
        return min(self.ceiling_s, max(self.floor_s, self._factor * p99))


class _Circuit:
    """Closed (use the drafter) or open until a probe succeeds; the backoff doubles with each failure in a row."""

    def __init__(self, backoff_s: float, max_backoff_s: float, clock: Callable[[], float]) -> None:
        self._backoff_s = backoff_s
        self._max_backoff_s = max_backoff_s
        self._clock = clock
        self.failures_in_a_row = 0
        self.open_until: float | None = None  # monotonic; None: closed
        self.last_failure = ""

    @property
    def is_open(self) -> bool:
        return self.open_until is not None

    def fail(self, reason: str) -> float:
        """Open (or keep open) for the next backoff period; returns its length."""
        backoff = min(self._max_backoff_s, self._backoff_s * 2**self.failures_in_a_row)
        self.failures_in_a_row += 1
        self.last_failure = reason
        self.open_until = self._clock() + backoff
        return backoff

    def close(self) -> None:
        self.open_until = None

    def reset(self) -> None:
        self.failures_in_a_row = 0


class HealthCheckedDrafter:
    """A DrafterPort that skips its drafter while it is failing and times proposals out by its latency."""

    def __init__(
        self,
        inner: DrafterPort,
        name: str,
        ceiling_s: float,
        floor_s: float = 0.1,
        backoff_s: float = 5.0,
        max_backoff_s: float = 60.0,
        clock: Callable[[], float] = time.monotonic,
        on_failure: Callable[[str], None] | None = None,
        on_circuit: Callable[[bool], None] | None = None,
    ) -> None:
        self._inner = inner
        self.name = name
        self.latency = DraftLatency(ceiling_s, floor_s)
        self._circuit = _Circuit(backoff_s, max_backoff_s, clock)
        self._clock = clock
        self._on_failure = on_failure
        self._on_circuit = on_circuit
        self._tripped: asyncio.Future[None] | None = None  # done when the circuit opens
        self._probe: asyncio.Task[None] | None = None
        self._streams: dict[str, _HealthCheckedStream] = {}
        self._probe_fingerprint = ""

    @property
    def circuit_open(self) -> bool:
        return self._circuit.is_open

    @property
    def failures_in_a_row(self) -> int:
        return self._circuit.failures_in_a_row

    def skip_reason(self) -> str:
        assert self._circuit.open_until is not None
        remaining = max(0.0, self._circuit.open_until - self._clock())
        until = time.strftime("%H:%M:%S", time.localtime(time.time() + remaining))
        state = "probing" if remaining == 0 else f"{remaining:.1f} s more"
        # No address: this reaches clients (GenerationStats.drafter_error); the log names the drafter.
        return (
            f"drafter skipped: circuit open until {until} ({state}) after {self._circuit.failures_in_a_row} "
            f"failure(s) in a row, the last: {self._circuit.last_failure}"
        )

    def tripped(self) -> asyncio.Future[None]:
        """A future that completes when the circuit next opens."""
        if self._tripped is None or self._tripped.done():
            self._tripped = asyncio.get_running_loop().create_future()
        return self._tripped

    async def open(
        self,
        session_id: str,
        prompt_tokens: Sequence[int],
        vocab_fingerprint: str,
        sampling: SamplingParams = GREEDY,
    ) -> DraftStream:
        if self._circuit.is_open:
            raise DrafterSkipped(self.skip_reason())
        self._probe_fingerprint = vocab_fingerprint

        async def opening() -> DraftStream:
            inner: DraftStream = await self._bounded(
                self._inner.open(session_id, prompt_tokens, vocab_fingerprint, sampling), self.latency.ceiling_s
            )
            return inner

        stream = _HealthCheckedStream(self, await _past_draining(opening), session_id, opening)
        self._streams[session_id] = stream
        return stream

    def misbehaved(self, session_id: str, reason: str) -> None:
        """The round loop caught the drafter sending what it must not (DrafterMonitor)."""
        stream = self._streams.get(session_id)
        if stream is not None:
            stream.failed = True
        self.record_failure(reason)

    def record_failure(self, reason: str) -> None:
        backoff = self._circuit.fail(reason)
        log.warning(
            "drafter at %s failed (%s); skipping it for %.1f s (%d failure(s) in a row)",
            self.name,
            reason,
            backoff,
            self._circuit.failures_in_a_row,
        )
        if self._on_failure is not None:
            self._on_failure(reason)
        if self._on_circuit is not None:
            self._on_circuit(True)
        if self._tripped is not None and not self._tripped.done():
            self._tripped.set_result(None)
        if self._probe is None or self._probe.done():
            self._probe = asyncio.get_running_loop().create_task(self._probe_until_healthy())

    async def _bounded(self, call: Any, timeout_s: float) -> Any:
        """Await ``call`` for at most ``timeout_s``; a timeout or failure opens the circuit.

        Gives up at once (DrafterSkipped) when the circuit opens meanwhile because of another session.
        """
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        task = asyncio.ensure_future(call)
        tripped = self.tripped()
        try:
            await asyncio.wait({task, tripped}, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:
            task.cancel()
            # The round loop's own deadline (the same ceiling) may fire a moment before ours.
            if loop.time() >= deadline - 0.01:
                self.record_failure(f"no answer within {timeout_s * 1000:.0f} ms")
            raise
        if task.done():
            try:
                return task.result()
            except DrafterDraining:
                raise  # go elsewhere: not a failure
            except DrafterFailed as exc:
                if not self._circuit.is_open:  # else another session already counted this outage
                    self.record_failure(str(exc))
                raise
        task.cancel()
        if tripped.done():  # opened by another session since this call began
            raise DrafterSkipped(self.skip_reason())
        reason = f"no answer within {timeout_s * 1000:.0f} ms"
        self.latency.observe(timeout_s)  # censored: the round trip took at least this long
        self.record_failure(reason)
        raise DrafterFailed(
            reason,
            detail=f"drafter at {self.name}: {reason} (the timeout follows its p99 latency, within --draft-timeout-ms)",
        )

    async def _probe_until_healthy(self) -> None:
        while self._circuit.open_until is not None:
            await asyncio.sleep(max(0.0, self._circuit.open_until - self._clock()))
            try:
                async with asyncio.timeout(self.latency.ceiling_s):
                    await self._probe_once()
            except (DrafterFailed, TimeoutError) as exc:
                reason = str(exc) or f"probe: no answer within {self.latency.ceiling_s * 1000:.0f} ms"
                backoff = self._circuit.fail(f"probe: {reason}")
                log.info("drafter at %s still failing (%s); next probe in %.1f s", self.name, reason, backoff)
                if self._on_failure is not None:
                    self._on_failure(reason)
                continue
            self._circuit.close()
            log.info("drafter at %s answers again; requests use it", self.name)
            if self._on_circuit is not None:
                self._on_circuit(False)

    async def _probe_once(self) -> None:
        """A Draft stream that asks for no tree: the whole path a request takes, at almost no cost.

        A draining drafter's refusal, at the open or at the first read, is retried as a session's is (on a
        round-robin tier, on the next drafter).
        """

        async def probe() -> None:
            stream = await self._inner.open(f"probe-{uuid.uuid4().hex}", [0], self._probe_fingerprint)
            try:
                await stream.propose(DraftFeedback(()), 0)
            finally:
                with contextlib.suppress(DrafterFailed):
                    await stream.close()

        await _past_draining(probe)

    async def aclose(self) -> None:
        if self._probe is not None:
            self._probe.cancel()


async def _past_draining(attempt: Callable[[], Awaitable[T]]) -> T:
    """``attempt()``, again while a draining drafter refuses it (``DRAINING_RETRIES`` times at most)."""
    for tries in range(DRAINING_RETRIES + 1):
        try:
            return await attempt()
        except DrafterDraining:
            if tries == DRAINING_RETRIES:
                raise
    raise AssertionError("unreachable")


class _HealthCheckedStream:
    def __init__(
        self,
        owner: HealthCheckedDrafter,
        inner: DraftStream,
        session_id: str,
        opening: Callable[[], Awaitable[DraftStream]],
    ) -> None:
        self._owner = owner
        self._inner = inner
        self._session_id = session_id
        self._opening = opening  # opens the session again: on another drafter when a draining one refused it
        self.wants_features = inner.wants_features
        self.failed = False
        self._answered = False  # once the drafter has answered, the session's state is there
        self._trees = 0

    @property
    def takes_verified_trees(self) -> bool:
        return self._inner.takes_verified_trees  # the session may have opened again on another drafter

    @property
    def sparse_features(self) -> bool:
        return self._inner.sparse_features  # so may this

    @property
    def feature_layers(self) -> tuple[int, ...]:
        return self._inner.feature_layers  # and this: a drafter on another head reads other layers

    async def propose(self, feedback: DraftFeedback, max_nodes: int) -> DraftReply:
        if self._owner.circuit_open:
            # Another session found the drafter failing: this one stops using it too.
            raise DrafterSkipped(self._owner.skip_reason())
        timeout_s = self._owner.latency.timeout_s
        started = self._owner._clock()
        try:
            reply = await self._propose(feedback, max_nodes, timeout_s)
        except DrafterFailed:
            self.failed = True
            raise
        self._answered = True
        if max_nodes > 0:  # report-only calls skip drafting: they would understate its latency
            self._owner.latency.observe(self._owner._clock() - started)
            self._trees += 1
        return reply

    async def _propose(self, feedback: DraftFeedback, max_nodes: int, timeout_s: float) -> DraftReply:
        """The proposal; while no drafter has answered, a draining drafter's refusal opens the session again.

        A draining drafter refuses only new streams, so it refuses a session before answering it: the first
        report (the prompt's features and nothing learnt yet) goes whole to the drafter the session opens on.
        """
        for attempt in range(DRAINING_RETRIES + 1):
            try:
                reply: DraftReply = await self._owner._bounded(self._inner.propose(feedback, max_nodes), timeout_s)
                return reply
            except DrafterDraining:
                if self._answered or attempt == DRAINING_RETRIES:
                    raise
                with contextlib.suppress(DrafterFailed):
                    await self._inner.close()
                self._inner = await self._opening()
        raise AssertionError("unreachable")

    async def verifying(self, verified: VerifiedTree) -> None:
        if self._owner.circuit_open:
            return  # the next proposal skips the drafter
        try:
            await self._owner._bounded(self._inner.verifying(verified), self._owner.latency.timeout_s)
        except DrafterFailed:
            self.failed = True
            raise

    async def close(self) -> None:
        self._owner._streams.pop(self._session_id, None)
        if self._trees and not self.failed:
            self._owner._circuit.reset()
        await self._inner.close()
