"""The packaged model drafting for itself through the three processes: every draft is accepted.

A draft language model identical to the target proposes, in fp32 and greedy, exactly the tokens the target
commits; a draft it rejects would mean its cache was not rolled back to what the verifier committed (or fed a
token twice). The drafting time per round is printed beside the draft head's, from the same prompts.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from client import GenerationParams, Stats
from specserve.local_cluster import LocalCluster, free_port, wait_serving
from tests.conftest import wait_until
from tests.integration.conftest import EVERY_ROUND_DRAFTS, EVERY_ROUND_DRAFTS_COORDINATOR, Target
from tests.integration.test_end_to_end import generate, generate_with

pytestmark = [pytest.mark.integration, pytest.mark.slow]

PROMPTS = ("Name three primary colours.", "Write a Python function that adds two numbers.")
TOKENS = 32
# A round's cap on draft tokens, no deeper than the source's tree: it drafts a chain, its likeliest path, which a
# model identical to the target gets right every time. (With a larger budget it adds siblings, which no target
# can accept all of.)
CHAIN = 4


def drafting_cluster(logs_dir: Path, sources: list[str]) -> LocalCluster:
    """Budgets held open (no cost curve, no throughput guard, no drafting gate): such a drafter costs a target
    step, so every measured curve would turn it off, and this test is about what it drafts."""
    cluster = LocalCluster(free_port(), free_port(), free_port(), log_dir=logs_dir)
    cluster.extra_verifier_args = EVERY_ROUND_DRAFTS
    cluster.extra_drafter_args = sources
    cluster.extra_coordinator_args = [*EVERY_ROUND_DRAFTS_COORDINATOR, "--drafter-backoff-ms", "500"]
    return cluster


def serving(cluster: LocalCluster) -> Iterator[LocalCluster]:
    with cluster as c:
        wait_serving(c.drafter_address, 600)
        # The coordinator serves before the drafter has loaded.
        wait_until(lambda: not generate(c.coordinator_address, "Say hi.", 2)[2].drafter_error, 120, "requests draft")
        yield c


@pytest.fixture(scope="module")
def self_drafting(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    logs = tmp_path_factory.mktemp("draft-lm-logs")
    yield from serving(drafting_cluster(logs, ["--draft-model", "smollm2", "--sources", "draft_lm"]))


@pytest.fixture(scope="module")
def head_drafting(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    logs = tmp_path_factory.mktemp("head-logs")
    yield from serving(drafting_cluster(logs, ["--sources", "draft_model"]))


def run_prompts(address: str, target: Target) -> list[Stats]:
    stats: list[Stats] = []
    for text in PROMPTS:
        tokens, stat = generate_with(address, text, GenerationParams(max_new_tokens=TOKENS, max_draft_tokens=CHAIN))
        assert tokens == target.greedy(target.chat_ids(text), TOKENS)
        assert stat.drafter_error == ""
        stats.append(stat)
    return stats


def draft_ms_per_round(stats: list[Stats]) -> float:
    return 1000 * sum(s.draft_s for s in stats) / sum(s.num_rounds for s in stats)


def test_the_target_drafting_for_itself_has_every_draft_accepted(
    self_drafting: LocalCluster, head_drafting: LocalCluster, target: Target
) -> None:
    lm = run_prompts(self_drafting.coordinator_address, target)
    drafted = sum(s.num_draft_tokens for s in lm)
    accepted = sum(s.num_accepted_tokens for s in lm)
    # Only a stream's last round may lose drafts: those past its end (the token limit, an end-of-sequence token).
    assert drafted > 0 and drafted - accepted <= CHAIN * len(PROMPTS), f"{accepted} of {drafted} drafts accepted"
    head = run_prompts(head_drafting.coordinator_address, target)
    print(
        f"draft_lm: {accepted}/{drafted} accepted, {draft_ms_per_round(lm):.1f} ms drafting a round; "
        f"draft head: {sum(s.num_accepted_tokens for s in head)}/{sum(s.num_draft_tokens for s in head)} "
        f"accepted, {draft_ms_per_round(head):.1f} ms a round"
    )
