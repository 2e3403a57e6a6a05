# Benchmarks; the top-level Makefile includes this fragment.
#   make bench                the Spec-Bench run: all four modes, 10 prompts per category, 128 new tokens
#   make bench-verify-cost    the verifier's cost c(n)/c(1) for n = 1..64 tokens on a 512-token context
#   make bench-load           N = 1, 4, 16, 64 concurrent greedy streams through the coordinator (bench/results/load/)
#   make bench-numerics       the bf16 noise floor of plain decoding vs where speculative output diverges (bench/results/numerics/)
# All write to bench/results/. Pass flags through BENCH_ARGS / VERIFY_COST_ARGS / BENCH_LOAD_ARGS / BENCH_NUMERICS_ARGS, e.g.
#   make bench BENCH_ARGS="--prompts-per-category 2 --max-new-tokens 32 --out-dir bench/results/tmp"
#   make bench-verify-cost VERIFY_COST_ARGS="--shape llama-3.1-8b --dtype bfloat16 --device cuda"
#   make bench-load BENCH_LOAD_ARGS="--levels 1,2 --max-new-tokens 8 --verifier-arg='--dtype bfloat16'"
#   make bench-numerics BENCH_NUMERICS_ARGS="--prompts 2 --max-new-tokens 16 --out-dir bench/results/numerics/tmp"

PY ?= .venv/bin/python
BENCH_ARGS ?=
VERIFY_COST_ARGS ?=
BENCH_LOAD_ARGS ?=
BENCH_NUMERICS_ARGS ?=

.PHONY: bench bench-verify-cost bench-load bench-numerics

bench: proto
	$(PY) -m bench.run $(BENCH_ARGS)

bench-verify-cost: proto
	$(PY) -m bench.verify_cost $(VERIFY_COST_ARGS)

bench-load: proto
	$(PY) -m bench.load $(BENCH_LOAD_ARGS)

bench-numerics: proto
	$(PY) -m bench.numerics $(BENCH_NUMERICS_ARGS)
