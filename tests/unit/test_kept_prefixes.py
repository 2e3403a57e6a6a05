"""Released sessions' caches kept for the next turn (``target_service.kept_prefixes``), on a tiny model in fp32."""

from __future__ import annotations

import torch

from specserve.sampling import SamplingParams
from specserve.token_tree import TokenTree
from target_service.kept_prefixes import MIN_TOKENS, KeptPrefixes
from target_service.kv_arena import KVArena
from target_service.metrics import VerifierMetrics
from target_service.verifier import Verifier
from tests.conftest import tiny_llama

VOCAB = 48
MODEL = tiny_llama(vocab_size=VOCAB, seed=5, context=512)
PROMPT = [(7 * i + 3) % VOCAB for i in range(60)]


def decode(verifier: Verifier, session: str, tokens: list[int], steps: int, owner: str = "") -> list[int]:
    """Greedy plain rounds of ``session`` (already prefilled with ``tokens``): the tokens committed."""
    committed = list(tokens)
    for _ in range(steps):
        result = verifier.submit_verify(session, len(committed), TokenTree(), owner=owner).result()
        committed += result.committed
    return committed[len(tokens) :]


def next_turn(verifier: Verifier, owner: str = "a") -> tuple[list[int], list[int]]:
    """A first turn decoded and released, then the second turn's prompt (the first turn's text and more)."""
    verifier.submit_prefill("turn-1", PROMPT, SamplingParams(), owner=owner).result()
    answer = decode(verifier, "turn-1", PROMPT, 12, owner)
    assert verifier.release("turn-1", owner=owner)
    return answer, [*PROMPT, *answer, 5, 6, 7]


def test_the_next_turn_copies_the_released_cache_and_decodes_as_a_fresh_prefill_does() -> None:
    verifier = Verifier(MODEL, "fp")
    fresh = Verifier(MODEL, "fp", kept_prefixes=0)
    try:
        _, second = next_turn(verifier, owner="")
        assert verifier.stats().num_kept_caches == 1
        verifier.prefill("turn-2", second, SamplingParams())
        stats = verifier.stats()
        # The first turn cached its prompt and all but its last answer token; the prompt of the second has them.
        assert (stats.num_prefix_reuses, stats.num_reused_tokens) == (1, len(PROMPT) + 12 - 1)
        fresh.prefill("turn-2", second, SamplingParams())
        tree = TokenTree((1, 2, 3, 4), (-1, 0, 1, 0))
        torch.testing.assert_close(verifier.score("turn-2", tree), fresh.score("turn-2", tree), rtol=1e-5, atol=1e-5)
        assert decode(verifier, "turn-2", second, 16) == decode(fresh, "turn-2", second, 16)
    finally:
        verifier.close()
        fresh.close()


def test_a_cache_is_reused_by_its_own_caller_only() -> None:
    verifier = Verifier(MODEL, "fp")
    try:
        _, second = next_turn(verifier, owner="a")
        verifier.submit_prefill("other", second, SamplingParams(), owner="b").result()
        assert verifier.stats().num_prefix_reuses == 0
    finally:
        verifier.close()


def test_a_prefill_that_returns_features_returns_those_of_the_rows_it_computed() -> None:
    verifier = Verifier(MODEL, "fp")
    fresh = Verifier(MODEL, "fp", kept_prefixes=0)
    try:
        _, second = next_turn(verifier)
        result = verifier.submit_prefill("turn-2", second, SamplingParams(), True, owner="a").result()
        whole = fresh.prefill("turn-2", second, SamplingParams(), True)
        assert result.cached_tokens == len(PROMPT) + 11 and whole.cached_tokens == 0
        assert result.features is not None and whole.features is not None
        assert result.features.shape[0] == len(second) - 1 - result.cached_tokens
        # The last positions' features, as a fresh prefill computes them.
        assert (result.features == whole.features[result.cached_tokens :]).all()
    finally:
        verifier.close()
        fresh.close()


def test_kept_caches_are_the_first_memory_to_go_and_do_not_count_as_used() -> None:
    verifier = Verifier(MODEL, "fp", kv_cache_bytes=2**20)
    try:
        config = MODEL.config
        per_token = 2 * config.num_hidden_layers * config.num_key_value_heads * (64 // 4) * 4  # keys + values, fp32
        next_turn(verifier)  # its cache: 60 + 11 tokens cached, 128 slots
        assert verifier.stats().num_kept_caches == 1 and verifier.stats().kv_used_bytes == 0
        # Sessions of 176 slots (99 tokens cached and the prefill's headroom) that fit the arena only without it.
        capacity_tokens = verifier.stats().kv_capacity_bytes // per_token
        count = capacity_tokens // 176
        assert count * 176 + 128 > capacity_tokens
        for i in range(count):
            verifier.prefill(f"s{i}", [i % VOCAB] * 100, SamplingParams())
        stats = verifier.stats()
        assert (stats.num_kept_caches, stats.num_evicted, stats.num_sessions) == (0, 0, count)
        assert stats.kv_used_bytes == count * 176 * per_token
    finally:
        verifier.close()


def arena() -> KVArena:
    return KVArena(num_layers=1, num_kv_heads=1, head_dim=2, capacity_tokens=1024, dtype=torch.float32)


def region_with(kv: KVArena, tokens: int):  # type: ignore[no-untyped-def]
    region = kv.allocate(tokens)
    assert region is not None
    region.length = tokens
    return region


def test_the_longest_shared_prefix_wins_and_short_ones_are_not_kept() -> None:
    kv = arena()
    kept = KeptPrefixes(kv, max_entries=8, ttl_s=60)
    base = list(range(100))
    kept.keep("a", base[:50], region_with(kv, 50))
    kept.keep("a", base[:80], region_with(kv, 80))
    kept.keep("a", base[: MIN_TOKENS - 1], region_with(kv, MIN_TOKENS - 1))  # too short: freed at once
    assert len(kept) == 2
    match = kept.take("a", [*base[:70], 999, 1000])
    assert match is not None and match[1] == 70 and len(match[0].tokens) == 80
    assert len(kept) == 1  # lent out until given back
    kept.give_back(match[0])
    assert kept.take("a", [5, *base]) is None  # no shared prefix of MIN_TOKENS
    assert kept.take("a", base[: MIN_TOKENS + 1]) is None  # all but the last two may come from a cache
    longest = kept.take("a", base[: MIN_TOKENS + 2])
    assert longest is not None and longest[1] == MIN_TOKENS


def test_kept_caches_are_bounded_in_number_and_age() -> None:
    kv = arena()
    now = [0.0]
    kept = KeptPrefixes(kv, max_entries=2, ttl_s=10, clock=lambda: now[0])
    for start in range(3):
        kept.keep("a", list(range(start, start + 40)), region_with(kv, 40))
    assert len(kept) == 2 and kept.take("a", list(range(0, 41))) is None  # the oldest went
    now[0] = 11.0
    kept.expire()
    assert len(kept) == 0 and kv.free_tokens == kv.capacity_tokens


def test_the_same_prompt_again_is_all_copied_and_decodes_the_same() -> None:
    verifier = Verifier(MODEL, "fp")
    try:
        verifier.prefill("first", PROMPT, SamplingParams())
        first = decode(verifier, "first", PROMPT, 10)
        verifier.release("first")
        verifier.prefill("again", PROMPT, SamplingParams())
        assert verifier.stats().num_reused_tokens == len(PROMPT) - 2  # the last cached token is prefilled
        assert decode(verifier, "again", PROMPT, 10) == first
    finally:
        verifier.close()


def test_metrics_count_kept_caches_and_the_tokens_reused() -> None:
    verifier = Verifier(MODEL, "fp")
    metrics = VerifierMetrics()
    metrics.track(verifier)
    value = metrics.registry.get_sample_value
    try:
        _, second = next_turn(verifier, owner="")
        assert value("specserve_verifier_kept_caches") == 1
        assert value("specserve_verifier_prefix_reuses_total") == 0
        result = verifier.submit_prefill("turn-2", second, SamplingParams()).result()
        assert result.cached_tokens == len(PROMPT) + 11
        assert value("specserve_verifier_prefix_reuses_total") == 1
        assert value("specserve_verifier_prefix_reused_tokens_total") == len(PROMPT) + 11
    finally:
        verifier.close()
