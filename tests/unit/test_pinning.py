"""CPU pinning for the benchmark's separate-hardware modes."""

from __future__ import annotations

import os
import threading

import pytest

from bench.pinning import Pinning, pin_this_process


def test_split_takes_the_verifiers_cpus_and_leaves_the_rest() -> None:
    available = sorted(os.sched_getaffinity(0))
    if len(available) < 2:
        pytest.skip("needs two CPUs")
    pinning = Pinning.split(str(available[0]))
    assert pinning.verifier == {available[0]} and pinning.others == set(available[1:])
    with pytest.raises(ValueError, match="leaves no CPU"):
        Pinning.split(",".join(map(str, available)))
    with pytest.raises(ValueError, match="choose among"):
        Pinning.split("4096")
    with pytest.raises(ValueError, match="CPU numbers"):
        Pinning.split("zero")


def test_pinning_moves_every_thread_of_the_process() -> None:
    available = frozenset(os.sched_getaffinity(0))
    seen: list[set[int]] = []
    started, release = threading.Event(), threading.Event()

    def worker() -> None:
        started.set()
        release.wait(10)
        seen.append(os.sched_getaffinity(0))

    thread = threading.Thread(target=worker)
    thread.start()
    started.wait(10)
    one = frozenset({min(available)})
    try:
        pin_this_process(one)
        release.set()
        thread.join(10)
        assert seen == [set(one)]  # a thread started before the call moved too
        assert os.sched_getaffinity(0) == one
    finally:
        pin_this_process(available)
    assert os.sched_getaffinity(0) == available


def test_a_cluster_gets_the_verifier_its_cpus_and_the_others_the_rest() -> None:
    pinning = Pinning(frozenset({0}), frozenset({1, 2}))
    assert pinning.services() == {"verifier": {0}, "drafter": {1, 2}, "coordinator": {1, 2}}
    assert pinning.drafter_args() == ["--torch-threads", "2"]
