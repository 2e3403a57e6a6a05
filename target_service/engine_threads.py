"""The verifier's threads: one OpenMP team per process, the engine thread computing, the serving thread on one.

torch's OpenMP runtime (libgomp) keeps a team of worker threads for every
thread that has run a parallel region, and workers of a team wait for the
next region by spinning, which is what makes a one-row product cheap: a
sleeping worker costs a futex wake-up at every region, and a step of a
small model is thousands of regions. Once the process holds more of those
threads than it has CPUs, libgomp stops spinning ("throttled" waits) in
every team. A service that loads its model on the main thread (a team) and
then runs steps on an engine thread (a second team) is in that state for
good, and every step pays for it (docs/benchmarks.md, "An AMX Xeon: one OpenMP
team, and the step compiled whole").

So a process whose heavy work runs on one thread calls
``serve_on_this_thread`` on its main thread before any torch work (model
loading then runs on one core), and the thread that computes calls
``compute_on_this_thread``: the verifier does, unless started with
``--no-dedicated-cores``. Spinning workers hold their core between regions,
which the drafter and coordinator want where they share the machine; with
pre-drafting off, as a cluster on one machine runs it, the dedicated team
still decodes faster, plain and through the three processes (docs/benchmarks.md,
"One OpenMP team by default"). So it is the default.
"""

from __future__ import annotations

import torch

_handed_over = 0  # the threads the last ``serve_on_this_thread`` took from the serving thread (0: none yet)


def serve_on_this_thread() -> int:
    """Keep this thread's torch work on one thread (no OpenMP team of its own); returns the thread count torch
    had, for ``compute_on_this_thread``."""
    global _handed_over
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    _handed_over = threads
    return threads


def compute_threads() -> int:
    """The torch threads the heavy work runs on: what ``serve_on_this_thread`` took, else this thread's own.

    For reports: after ``serve_on_this_thread`` the serving thread says 1, which is not what the engine uses.
    """
    return _handed_over or torch.get_num_threads()


def compute_on_this_thread(threads: int) -> None:
    """Run this thread's torch work on ``threads`` threads (its OpenMP team)."""
    torch.set_num_threads(threads)
