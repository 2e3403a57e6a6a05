#!/usr/bin/env bash
# The engine's GPU checks and cost curves in one run of a few minutes: `make bench-gpu` on a machine with CUDA.
#
#   decode (with MODEL set: the packaged 'smollm2' or a path to its GGUF): Spec-Bench decoding with the real
#      weights (bench.run --device cuda, one prompt per category, 128 tokens): plain decoding through the graphs
#      against transformers' eager loop (bf16) and against n-gram speculation in process (bf16; fp32: token
#      identity);
#   tests: tests/gpu, captured steps against transformers, greedy speculation = plain decoding through graphs;
#   step-invariance: batch invariance of the step (bench.step_invariance), eager and graphs, fp32 and bf16;
#   verify-cost: c(n) for n = 1..64 and batched steps, eager (--compile off) against CUDA graphs (auto):
#      SmolLM2-135M's shape (bf16, fp32) and Llama-3.1-8B's (bf16), random weights;
#   decode-head (with MODEL; not in the default PARTS): plain decoding against speculation with the draft head;
#   decode-eager (with MODEL): the graphs against the engine's eager step on three prompts;
#   distributed (with MODEL; not in the default PARTS; about 7 minutes on an H200, one device call of 8): the
#      three processes on the device, coordinator, drafter (--device) and verifier (--device), the n-gram pool in
#      a private redis-server (REDIS_SERVER, default the one on PATH) or else the drafter's in-memory pool:
#      Spec-Bench (bench.run, one prompt per category, 128 tokens, greedy) plain decoding through the graphs
#      against speculation in process and through the three processes, bf16 then fp32; then bench.load, N = 1
#      and 16 concurrent streams through the coordinator with speculation on and off (bf16). The drafter runs
#      every default source where transformers is the pinned version, else the n-gram sources (the draft head
#      refuses another version's vocabulary); DRAFT_SOURCES=a,b,c picks them.
# PARTS picks parts by name (default: all but decode-head and distributed, in this order).
# DEVICE (default cuda) is where decode and distributed run; DEVICE=cpu rehearses them on a machine without a
# GPU, cut down with DIST_CATEGORIES (default all), DIST_TOKENS (128), DIST_LEVELS (1,16), DIST_DTYPES
# ("bfloat16 float32"; bench.load runs the first) and LIMIT_FACTOR (multiplies every part's time limit).
# Results go to RESULTS (default bench/out/gpu); with OUT set (a lent device machine) they are also packed
# into $OUT/gpu-results.tgz after each part, so a run cut short still returns what it measured.
set -u
RESULTS=${RESULTS:-bench/out/gpu}
PY=${PY:-python3}
DEVICE=${DEVICE:-cuda}
mkdir -p "$RESULTS"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
pack() { [ -n "${OUT:-}" ] && tar czf "$OUT/gpu-results.tgz" -C "$RESULTS" . ; true; }
part() {  # part SECONDS NAME COMMAND...: run with a time limit, log it, keep going on failure
  local limit=$(($1 * ${LIMIT_FACTOR:-1})) name=$2; shift 2
  echo "=== $name ($(date -u +%H:%M:%S), limit ${limit}s)"
  timeout -s INT -k 20 "$limit" "$@" 2>&1 | tee "$RESULTS/$name.log"  # INT: bench.run writes what it measured
  echo "=== $name: exit ${PIPESTATUS[0]}"
  pack
}
command -v nvidia-smi >/dev/null && nvidia-smi -L
$PY -c 'import torch, transformers, sys; print(sys.version.split()[0], "torch", torch.__version__, "transformers", transformers.__version__, torch.cuda.get_device_name() if torch.cuda.is_available() else "no CUDA device")'
PARTS=${PARTS:-decode tests step-invariance verify-cost decode-eager}
want() { [[ " $PARTS " == *" $1 "* ]]; }
if [ -n "${MODEL:-}" ]; then
  decode() {  # decode SECONDS NAME bench.run-ARGS...
    local limit=$1 name=$2; shift 2
    part "$limit" "$name" $PY -m bench.run --device "$DEVICE" --model "$MODEL" --prompts-per-category 1 \
      --max-new-tokens 128 --no-progress --out-dir "$RESULTS/$name" "$@"
  }
  # The n-gram sources alone: the draft head is checked against the tokenizer's vocabulary fingerprint, and
  # transformers 5.17 (the device image's) reads the GGUF's vocabulary differently from the pinned 5.23.
  NGRAM=inproc:suffix+token_recycling
  want decode && decode 200 decode-bfloat16 --dtype bfloat16 --modes baseline,hf-plain,$NGRAM
  want decode && decode 150 decode-float32 --dtype float32 --modes baseline,$NGRAM
  # The draft head too (inproc: head and n-gram sources, the head on the GPU as a drafter with --device cuda
  # runs it, its greedy trees in captured graphs): needs the pinned transformers 5.23 on the device (carried as a wheel where the image
  # has another), or the head refuses the vocabulary.
  want decode-head && decode 200 decode-head-bfloat16 --dtype bfloat16 --modes baseline,inproc
  want decode-head && decode 150 decode-head-float32 --dtype float32 --modes baseline,inproc
  want decode-eager && decode 150 decode-eager-bf16 --dtype bfloat16 --modes baseline,baseline-eager \
    --categories writing,coding,math_reasoning
  if want distributed; then
    REDIS_SERVER=${REDIS_SERVER-$(command -v redis-server)}
    REDIS_URL=""  # '': the drafter's embedded in-memory n-gram pool
    if [ -n "$REDIS_SERVER" ]; then  # a private one on a free port, stopped by its pid when this script ends
      port=$($PY -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
      "$REDIS_SERVER" --port "$port" --bind 127.0.0.1 --save '' --appendonly no >"$RESULTS/redis.log" 2>&1 &
      redis_pid=$!
      trap 'kill "$redis_pid" 2>/dev/null; wait "$redis_pid" 2>/dev/null' EXIT
      for _ in $(seq 50); do (exec 3<>"/dev/tcp/127.0.0.1/$port") 2>/dev/null && REDIS_URL=redis://127.0.0.1:$port/15 && break; sleep 0.1; done
    fi
    echo "n-gram pool: ${REDIS_URL:-in-memory, in the drafter}"
    # The draft head checks the tokenizer's vocabulary fingerprint, which another transformers reads differently.
    pinned=$(sed -n 's/^ *"transformers==\([^"]*\)".*/\1/p' pyproject.toml)
    installed=$($PY -c 'import transformers; print(transformers.__version__)')
    [ "$installed" = "$pinned" ] || DRAFT_SOURCES=${DRAFT_SOURCES-suffix,token_recycling}
    SOURCES=() INPROC=inproc
    if [ -n "${DRAFT_SOURCES:-}" ]; then
      SOURCES=(--drafter-arg="--sources $DRAFT_SOURCES") INPROC="inproc:${DRAFT_SOURCES//,/+}"
    fi
    echo "draft sources: ${DRAFT_SOURCES:-all the defaults} (transformers $installed, pinned $pinned)"
    DIST_TOKENS=${DIST_TOKENS:-128} DIST_DTYPES=${DIST_DTYPES:-bfloat16 float32}
    dist_args=(--device "$DEVICE" --model "$MODEL" --max-new-tokens "$DIST_TOKENS" --redis-url "$REDIS_URL" ${SOURCES[@]+"${SOURCES[@]}"})
    for dtype in $DIST_DTYPES; do  # the first dtype loads CUDA's and the model's files cold: the longer limit
      [ "$dtype" = "${DIST_DTYPES%% *}" ] && limit=150 || limit=110
      part $limit "distributed-$dtype" $PY -m bench.run "${dist_args[@]}" --dtype "$dtype" \
        --modes "baseline,$INPROC,distributed" --categories "${DIST_CATEGORIES:-all}" --prompts-per-category 1 \
        --no-progress --out-dir "$RESULTS/distributed-$dtype"
    done
    load_args=("${dist_args[@]}" --levels "${DIST_LEVELS:-1,16}" --verifier-arg="--dtype ${DIST_DTYPES%% *}")
    part 90 load-speculation $PY -m bench.load "${load_args[@]}" --out-dir "$RESULTS/load-speculation"
    part 80 load-plain $PY -m bench.load "${load_args[@]}" --coordinator-arg="--drafter ''" \
      --out-dir "$RESULTS/load-plain"
  fi
fi
want tests && part 150 tests $PY -m pytest -q --noconftest -p no:cacheprovider tests/gpu
want step-invariance && part 90 step-invariance $PY -m bench.step_invariance --device cuda --out-dir "$RESULTS"
want verify-cost && part 150 verify-cost-smollm2 $PY -m bench.verify_cost --shape smollm2-135m --dtypes bfloat16,float32 --device cuda \
  --compile off,auto --out-dir "$RESULTS"
want verify-cost && part 180 verify-cost-llama8b $PY -m bench.verify_cost --shape llama-3.1-8b --dtypes bfloat16 --device cuda \
  --compile off,auto --out-dir "$RESULTS"
