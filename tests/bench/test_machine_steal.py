"""bench.machine's share of CPU time stolen by the hypervisor, from /proc/stat's counters."""

from __future__ import annotations

from bench.machine import cpu_times, steal_since, strain


def test_steal_is_the_stolen_ticks_over_all_ticks_between_two_readings() -> None:
    # user nice system idle iowait irq softirq steal guest guest_nice
    start = [100, 0, 20, 500, 0, 0, 0, 10, 0, 0]
    end = [160, 0, 30, 520, 0, 0, 0, 20, 5, 0]  # 60 + 10 + 20 + 10 = 100 ticks spent, 10 of them stolen
    assert steal_since(start, end) == 0.1
    assert strain({"cpu_steal": 0.1}) == " CPU time stolen by the hypervisor during the run: 10%."


def test_unknown_counters_say_nothing() -> None:
    assert steal_since(None) is None and steal_since([1, 2], [3, 4]) is None
    assert steal_since([0] * 8, [0] * 8) is None  # no time passed
    assert strain({}) == "" and strain({"cpu_steal": None}) == ""
    now = cpu_times()
    assert now is None or len(now) >= 8  # Linux: every state's counter, steal the eighth
