# Benchmarks; the top-level Makefile includes this fragment.
#   make bench                the Spec-Bench run: the default modes in the dtype --dtype auto picks, 7 prompts per category, 128 new tokens;
#                             its report ends with where a round's time goes, mean ms per round per phase (bench/round_breakdown.py)
#   make bench-repetitive     the same run on the project's repetitive workloads instead, code edits and agent loops
#                             (bench/data/NOTICE.md), each with rows of its own (bench/out/repetitive/); BENCH_ARGS as for bench
#   make bench-gpu            on a CUDA machine: real-model decoding, tests/gpu, batch invariance, c(n) (bench/out/gpu/)
#   make bench-verify-cost    the verifier's cost c(n)/c(1) for n = 1..64 tokens on a 512-token context, and B = 1..16 sessions
#                             in one step, in float32 and bfloat16
#   make bench-load           N = 1, 4, 16, 64 concurrent greedy streams through the coordinator (bench/out/load/)
#   make bench-startup        the three services' start-up time, cold (empty model cache) and warm (bench/out/startup/)
#   make bench-head           the draft head's offline figures (top-1, chains, trees) on Spec-Bench's own answers, per task,
#                             beside a Spec-Bench run's served head-alone tau (bench/out/head_offline/)
#   make bench-sampling       seeded chat prompts at T = 0, 0.7, 1.0 with speculation on and off through the three
#                             processes, the drafter with coupled drafts and without (bench/out/sampling/)
#   make bench-numerics       the bf16 noise floor of plain decoding vs where speculative output diverges (bench/out/numerics/)
#   make bench-structured     structured output: JSON-schema prompts constrained with speculation, without, and unconstrained
#   make bench-multi-turn     agent loops turn by turn: a verifier that keeps released caches against one that keeps none
#   make bench-gemm-kernels   each product of the model's shape at 1-16 rows on every CPU kernel the engine can use
#   make bench-step-invariance  how far a row's fp32 logits move when more rows share its step (0: bit-identical)
#   make bench-kernel-ab      the block kernel's attention and products (--parts verify: whole verifies) against BASE's
#                             (default HEAD) in one process, in turn, bits compared (bench/out/kernel-ab/)
#   make bench-peers          specserve (plain, speculative in one process and in three) against llama.cpp on the
#                             same prompts (bench/out/peers/); opt-in: it first
#                             builds llama-cpp-python into the venv from source (make bench-peers-install), never make test
# All write to bench/out/ (git-ignored); a run is copied under bench/results/ only where a README cites it. Pass flags through BENCH_ARGS / VERIFY_COST_ARGS / BENCH_LOAD_ARGS / BENCH_NUMERICS_ARGS /
# BENCH_HEAD_ARGS / BENCH_PEERS_ARGS / BENCH_SAMPLING_ARGS / BENCH_STRUCTURED_ARGS / BENCH_GEMM_ARGS / BENCH_INVARIANCE_ARGS /
# BENCH_KERNEL_AB_ARGS, e.g.
#   make bench BENCH_ARGS="--prompts-per-category 2 --max-new-tokens 32 --out-dir bench/out/tmp"
#   make bench-verify-cost VERIFY_COST_ARGS="--shape llama-3.1-8b --dtypes bfloat16 --device cuda"
#   make bench-load BENCH_LOAD_ARGS="--levels 1,2 --max-new-tokens 8 --verifier-arg='--dtype bfloat16'"
#   make bench-head BENCH_HEAD_ARGS="--serving bench/out/spec_bench.json"
#   make bench-numerics BENCH_NUMERICS_ARGS="--prompts 2 --max-new-tokens 16 --out-dir bench/out/numerics-tmp"
#   make bench-peers BENCH_PEERS_ARGS="--prompts 2 --max-new-tokens 16 --out-dir bench/out/peers-tmp"

PY ?= .venv/bin/python
BENCH_ARGS ?=
VERIFY_COST_ARGS ?=
BENCH_LOAD_ARGS ?=
BENCH_NUMERICS_ARGS ?=
BENCH_HEAD_ARGS ?=
BENCH_PEERS_ARGS ?=
BENCH_SAMPLING_ARGS ?=
BENCH_STRUCTURED_ARGS ?=
BENCH_STARTUP_ARGS ?=
BENCH_GEMM_ARGS ?=
BENCH_INVARIANCE_ARGS ?=
BENCH_KERNEL_AB_ARGS ?=
BASE ?= HEAD

.PHONY: bench-multi-turn bench-repetitive bench-kernel-ab bench-gemm-kernels bench-step-invariance bench-startup bench-structured bench-gpu bench bench-verify-cost bench-load bench-head bench-numerics bench-peers bench-peers-install bench-sampling

bench: proto
	$(PY) -m bench.run $(BENCH_ARGS)

# Workloads where the answer repeats the prompt (issue #56): BENCH_ARGS come last, so they can change either flag.
bench-repetitive: proto
	$(PY) -m bench.run --categories code_edit,agent_loop --out-dir bench/out/repetitive $(BENCH_ARGS)

bench-verify-cost: proto
	$(PY) -m bench.verify_cost $(VERIFY_COST_ARGS)

# On a machine with a CUDA GPU: Spec-Bench decoding with the packaged model (MODEL=smollm2 unless set), its
# tests, batch invariance and c(n) eager vs CUDA graphs (bench/out/gpu/).
bench-gpu: proto
	PY=$(PY) MODEL=$${MODEL:-smollm2} bash bench/gpu.sh

bench-load: proto
	$(PY) -m bench.load $(BENCH_LOAD_ARGS)

bench-startup: proto
	$(PY) -m bench.startup $(BENCH_STARTUP_ARGS)

bench-head: proto
	$(PY) -m bench.head_offline $(BENCH_HEAD_ARGS)

bench-sampling: proto
	$(PY) -m bench.sampling $(BENCH_SAMPLING_ARGS)

# Structured output (issue #33): 30 JSON-schema prompts, constrained speculative vs constrained plain vs
# unconstrained speculative, greedy, three processes (bench/out/structured/; the cited run in bench/results/structured/).
bench-structured: proto
	$(PY) -m bench.structured $(BENCH_STRUCTURED_ARGS)

bench-gemm-kernels: proto
	$(PY) -m bench.gemm_kernels $(BENCH_GEMM_ARGS)

bench-step-invariance: proto
	$(PY) -m bench.step_invariance $(BENCH_INVARIANCE_ARGS)

bench-kernel-ab: proto
	$(PY) -m bench.kernel_ab --base $(BASE) $(BENCH_KERNEL_AB_ARGS)

bench-numerics: proto
	$(PY) -m bench.numerics $(BENCH_NUMERICS_ARGS)

bench-peers: proto bench-peers-install
	$(PY) -m bench.peers $(BENCH_PEERS_ARGS)

# llama-cpp-python built from source for AVX2 only: the native build (AVX512/AMX) has crashed on these machines.
# Rebuilt only when the installed version or the flags recorded next to the venv's python differ from these.
LLAMA_CPP_VERSION := 0.3.36
LLAMA_CPP_CMAKE_ARGS := -DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_AVX512=OFF -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF
LLAMA_CPP_BUILD_FILE = $(dir $(PY))../llama-cpp-python-build.txt
LLAMA_CPP_BUILT = llama-cpp-python==$(LLAMA_CPP_VERSION) CMAKE_ARGS=$(LLAMA_CPP_CMAKE_ARGS)

bench-peers-install: venv
	@if $(PY) -c "import llama_cpp, sys; sys.exit(llama_cpp.__version__ != '$(LLAMA_CPP_VERSION)')" 2>/dev/null \
	  && [ "$$(cat $(LLAMA_CPP_BUILD_FILE) 2>/dev/null)" = "$(LLAMA_CPP_BUILT)" ]; then \
	  echo "llama-cpp-python $(LLAMA_CPP_VERSION) is built ($(LLAMA_CPP_CMAKE_ARGS))"; \
	else \
	  set -e; \
	  command -v c++ >/dev/null || { echo "building llama-cpp-python needs a C++ compiler (apt-get install g++)" >&2; exit 1; }; \
	  command -v cmake >/dev/null || $(PY) -m pip install -q cmake; \
	  rm -f $(LLAMA_CPP_BUILD_FILE); \
	  $(PY) -m pip uninstall -q -y llama-cpp-python 2>/dev/null || true; \
	  echo "building llama-cpp-python $(LLAMA_CPP_VERSION) from source (several minutes on 2 cores)"; \
	  PATH="$$(cd $(dir $(PY)) && pwd):$$PATH" CMAKE_ARGS="$(LLAMA_CPP_CMAKE_ARGS)" CMAKE_BUILD_PARALLEL_LEVEL=$$(nproc) \
	    $(PY) -m pip install --no-cache-dir --no-binary llama-cpp-python llama-cpp-python==$(LLAMA_CPP_VERSION); \
	  echo "$(LLAMA_CPP_BUILT)" > $(LLAMA_CPP_BUILD_FILE); \
	fi

# Agent loops turn by turn (the model's own answers fed back), on a verifier that keeps released sessions' caches
# and on one that keeps none, taking turns: prefill, time to first text, identical text (bench/out/multi_turn/).
bench-multi-turn: proto
	$(PY) -m bench.multi_turn $(BENCH_MULTI_TURN_ARGS)
