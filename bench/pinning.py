"""Separate hardware on one machine: the verifier on some CPUs, drafter and coordinator on the others.

A deployment gives the drafter tier its own machines. On one machine the
benchmark approximates that by CPU affinity (``os.sched_setaffinity``): the
verifier process gets ``verifier`` CPUs; the drafter, the coordinator and
the harness's client get the rest. ``baseline`` and ``inproc`` run in the
harness pinned to the verifier's CPUs, i.e. on the hardware the verifier has
alone: the comparison asks whether a drafter tier on other hardware adds speed.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass

from .modes import Mode, Outcome, Prompt


@dataclass(frozen=True)
class Pinning:
    verifier: frozenset[int]  # the verifier (and the in-process modes)
    others: frozenset[int]  # the drafter, the coordinator and the client

    @staticmethod
    def split(verifier_cpus: str) -> Pinning:
        """``verifier_cpus`` ("0" or "0,1") against the CPUs this process may use; ValueError when unusable."""
        available = frozenset(os.sched_getaffinity(0))
        try:
            verifier = frozenset(int(cpu) for cpu in verifier_cpus.split(",") if cpu.strip())
        except ValueError as exc:
            raise ValueError(f"--pin-verifier-cpus {verifier_cpus!r}: give CPU numbers like 0 or 0,1") from exc
        if not verifier or not verifier <= available:
            raise ValueError(f"--pin-verifier-cpus {verifier_cpus!r}: choose among the CPUs {sorted(available)}")
        others = available - verifier
        if not others:
            raise ValueError("--pin-verifier-cpus leaves no CPU for the drafter and coordinator")
        return Pinning(verifier, others)

    def services(self) -> dict[str, frozenset[int]]:
        """Each cluster service's CPUs (``start_cluster``'s ``cpus``): the verifier's own, the others for the rest."""
        return {"verifier": self.verifier, "drafter": self.others, "coordinator": self.others}

    def drafter_args(self) -> list[str]:
        """The drafter's command-line torch threads, as many as its CPUs."""
        return ["--torch-threads", str(len(self.others))]

    def describe(self) -> str:
        return f"verifier on CPUs {_cpus(self.verifier)}, drafter and coordinator on CPUs {_cpus(self.others)}"


def read_pinning(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """``args.pin_verifier_cpus`` into ``args.pinning`` (None without it), torch threads set to the verifier's CPU
    count; a parser error names what is wrong with the CPUs."""
    args.pinning = None
    if args.pin_verifier_cpus:
        try:
            args.pinning = Pinning.split(args.pin_verifier_cpus)
        except ValueError as exc:
            parser.error(str(exc))
        args.torch_threads = len(args.pinning.verifier)


def _cpus(cpus: frozenset[int]) -> str:
    return ",".join(str(cpu) for cpu in sorted(cpus))


def pin_this_process(cpus: frozenset[int]) -> None:
    """Move every thread of this process (torch's pool included) onto ``cpus``.

    ``sched_setaffinity(0, ...)`` would move only the calling thread; threads
    created later inherit the affinity of the thread that creates them.
    """
    for task in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(task), cpus)
        except ProcessLookupError:  # the thread ended meanwhile
            continue


class PinnedMode:
    """A mode that runs with this process (every thread) on ``cpus``."""

    def __init__(self, mode: Mode, cpus: frozenset[int]) -> None:
        self._mode = mode
        self._cpus = cpus
        self.name = mode.name
        self.learns = mode.learns
        self.dtype = mode.dtype

    def run(self, prompt: Prompt) -> Outcome:
        pin_this_process(self._cpus)
        return self._mode.run(prompt)

    def reset(self) -> None:
        self._mode.reset()

    def close(self) -> None:
        self._mode.close()
