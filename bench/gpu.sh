#!/usr/bin/env bash
# The engine's GPU checks and cost curves in one run of a few minutes: `make bench-gpu` on a machine with CUDA.
#
#   1. tests/gpu: captured steps against transformers, greedy speculation = plain decoding through CUDA graphs;
#   2. batch invariance of the step (bench.step_invariance), eager and graphs, fp32 and bf16;
#   3. c(n) for n = 1..64 and batched steps, eager (--compile off) against CUDA graphs (auto):
#      SmolLM2-135M's shape (bf16, fp32) and Llama-3.1-8B's (bf16), random weights.
# Results go to RESULTS (default bench/out/gpu); with OUT set (a lent device machine) they are also packed
# into $OUT/gpu-results.tgz after each part, so a run cut short still returns what it measured.
set -u
RESULTS=${RESULTS:-bench/out/gpu}
PY=${PY:-python3}
mkdir -p "$RESULTS"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
pack() { [ -n "${OUT:-}" ] && tar czf "$OUT/gpu-results.tgz" -C "$RESULTS" . ; true; }
part() {  # part SECONDS NAME COMMAND...: run with a time limit, log it, keep going on failure
  local limit=$1 name=$2; shift 2
  echo "=== $name ($(date -u +%H:%M:%S), limit ${limit}s)"
  timeout "$limit" "$@" 2>&1 | tee "$RESULTS/$name.log"
  echo "=== $name: exit ${PIPESTATUS[0]}"
  pack
}
nvidia-smi -L
$PY -c 'import torch, transformers, sys; print(sys.version.split()[0], "torch", torch.__version__, "transformers", transformers.__version__, torch.cuda.get_device_name())'
part 150 tests $PY -m pytest -q --noconftest -p no:cacheprovider tests/gpu
part 90 step-invariance $PY -m bench.step_invariance --device cuda --out-dir "$RESULTS"
part 150 verify-cost-smollm2 $PY -m bench.verify_cost --shape smollm2-135m --dtypes bfloat16,float32 --device cuda \
  --compile off,auto --out-dir "$RESULTS"
part 180 verify-cost-llama8b $PY -m bench.verify_cost --shape llama-3.1-8b --dtypes bfloat16 --device cuda \
  --compile off,auto --out-dir "$RESULTS"
