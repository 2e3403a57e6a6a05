"""Integration fixtures: the real packaged target, real processes on loopback, a real (private) Redis."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from draft_service.config import DrafterConfig
from specserve.local_cluster import LocalCluster, free_port
from specserve.model_loading import default_cache_root, load_model, load_tokenizer, materialize, resolve_model
from specserve.sampling import SamplingParams
from tests.conftest import plain_decode
from tests.redis_server import RedisServer

SPEC_BENCH = Path(__file__).parents[2] / "bench" / "data" / "spec_bench.jsonl"
# Identity with plain decoding is asserted token for token: the reference and the verifier run in fp32.
FP32_VERIFIER = ["--dtype", "float32"]
# Without the measured cost curve, draft budgets follow the tree limits (on a slow CPU the curve says drafting
# rarely pays, and rounds would draft nothing); without the throughput guard, no timed probe turns drafting off
# (3 s of every 11: a short request could fall inside one). Then every round drafts, which tests of drafting need.
EVERY_ROUND_DRAFTS = [*FP32_VERIFIER, "--no-profile-cost", "--no-throughput-guard"]
# The coordinator's half of the same: its drafting gate turns a session's drafting off when drafted rounds commit
# fewer tokens per second than plain ones, which on a loaded 2-core machine depends on timing. Tests of drafting
# pass this to their coordinator; the gate has its own tests (tests/unit/test_drafting_gate.py, the bench smoke).
EVERY_ROUND_DRAFTS_COORDINATOR = ["--no-gate-drafting"]


def spec_bench_prompts(per_category: int = 1, categories: tuple[str, ...] = ()) -> list[dict[str, Any]]:
    picked: dict[str, int] = {}
    prompts = []
    for line in SPEC_BENCH.read_text().splitlines():
        record = json.loads(line)
        category = record["category"]
        if categories and category not in categories:
            continue
        if picked.get(category, 0) < per_category:
            picked[category] = picked.get(category, 0) + 1
            prompts.append(record)
    return prompts


class Target:
    """The packaged target in the test process, for reference decoding."""

    def __init__(self) -> None:
        source = materialize(resolve_model("smollm2"), default_cache_root())
        self.model = load_model(source)
        self.tokenizer = load_tokenizer(source)
        self.eos = self.tokenizer.eos_token_id

    def chat_ids(self, text: str) -> list[int]:
        formatted = self.tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False
        )
        ids: list[int] = self.tokenizer(formatted, add_special_tokens=False)["input_ids"]
        return ids

    def greedy(self, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
        """Plain greedy decoding, cut before EOS as the service streams it."""
        return self.decode(prompt_ids, max_new_tokens, SamplingParams())

    def decode(self, prompt_ids: list[int], max_new_tokens: int, sampling: SamplingParams) -> list[int]:
        """Plain decoding (greedy, or seeded sampling with keyed draws), cut before EOS."""
        tokens = plain_decode(self.model, prompt_ids, max_new_tokens, sampling)
        return tokens[: tokens.index(self.eos)] if self.eos in tokens else tokens


@pytest.fixture(scope="session")
def target() -> Target:
    return Target()


@pytest.fixture(scope="module")
def cluster_redis_url() -> Iterator[str | None]:
    """An empty redis-server of the module's own, on a free port and stopped by pid; None (the drafter's in-memory
    pool) where redis-server is not installed.

    Never the machine's Redis: pool keys live 7 days, so what one run (or another user) wrote would be what the
    next run's drafter drafts from.
    """
    if shutil.which("redis-server") is None:
        yield None
        return
    with RedisServer() as server:
        yield server.url


@pytest.fixture(scope="module")
def cluster(cluster_redis_url: str | None, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    """Coordinator, drafter (with a private Redis where redis-server is installed) and verifier as real processes."""
    logs = tmp_path_factory.mktemp("cluster-logs")
    cluster = LocalCluster(free_port(), free_port(), free_port(), redis_url=cluster_redis_url, log_dir=logs)
    cluster.extra_verifier_args = EVERY_ROUND_DRAFTS
    # Pre-drafting, which a cluster on one machine turns off, on: its path (trees ready before they are asked
    # for) must stay token-identical too, as where the drafter has hardware of its own.
    cluster.extra_drafter_args = ["--predraft-outcomes", str(DrafterConfig().predraft_outcomes)]
    # Tests here kill the drafter and restart it: a short backoff has the coordinator use it again within seconds.
    cluster.extra_coordinator_args = [
        *EVERY_ROUND_DRAFTS_COORDINATOR,
        "--drafter-backoff-ms",
        "500",
        "--drafter-max-backoff-ms",
        "2000",
    ]
    with cluster as c:
        yield c
