"""specserve benchmarks: Spec-Bench speedup and acceptance (``run``), verifier forward cost (``verify_cost``)."""
