"""The verifier's thread layout: the serving thread on one torch thread, the engine's on the rest."""

from __future__ import annotations

import threading

import pytest
import torch

from target_service.engine_threads import compute_on_this_thread, compute_threads, serve_on_this_thread
from target_service.main import parse_config


def test_the_serving_thread_gives_its_threads_to_the_computing_one() -> None:
    before = torch.get_num_threads()
    seen: list[int] = []
    try:
        threads = serve_on_this_thread()
        assert threads == before and torch.get_num_threads() == 1

        def engine() -> None:
            compute_on_this_thread(threads)
            seen.append(torch.get_num_threads())

        worker = threading.Thread(target=engine)
        worker.start()
        worker.join()
        assert seen == [before]
        assert compute_threads() == before  # what reports name: the engine's threads, not this thread's one
    finally:
        torch.set_num_threads(before)


def test_one_openmp_team_is_the_default_and_can_be_turned_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SPECSERVE_DEDICATED_CORES", raising=False)
    assert parse_config(["--model", "tiny"])[0].dedicated_cores
    assert not parse_config(["--model", "tiny", "--no-dedicated-cores"])[0].dedicated_cores
    monkeypatch.setenv("SPECSERVE_DEDICATED_CORES", "0")
    assert not parse_config(["--model", "tiny"])[0].dedicated_cores
    assert parse_config(["--model", "tiny", "--dedicated-cores", "--compile", "inductor"])[0].dedicated_cores
