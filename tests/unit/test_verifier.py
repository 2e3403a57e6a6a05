"""The verifier on tiny random models: greedy losslessness, cache hygiene, errors."""

import random

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from specserve.errors import FailedPrecondition, InvalidArgument, NotFound, ResourceExhausted
from specserve.sampling import SamplingParams
from specserve.token_tree import TokenTree
from target_service.verifier import Verifier
from tests.conftest import plain_decode, plain_greedy, tiny_llama

VOCAB = 32
MODEL = tiny_llama(vocab_size=VOCAB, context=256)


def new_verifier(**kwargs: int) -> Verifier:
    return Verifier(MODEL, "fp", **kwargs)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    prompt=st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=20),
    rounds=st.lists(
        st.tuples(st.integers(0, 6), st.lists(st.integers(0, VOCAB - 1), max_size=6), st.floats(0, 1)),
        min_size=1,
        max_size=8,
    ),
)
def test_greedy_chain_verification_commits_what_plain_greedy_would(
    prompt: list[int], rounds: list[tuple[int, list[int], float]]
) -> None:
    """Drafts mix correct tokens (a prefix of the true continuation) with random ones."""
    total = sum(len(noise) + 7 for _, noise, _ in rounds)
    reference = plain_greedy(MODEL, prompt, total)
    verifier = new_verifier()
    verifier.prefill("s", prompt, SamplingParams())
    committed: list[int] = []
    for num_correct, noise, _ in rounds:
        truth = reference[len(committed) : len(committed) + num_correct]
        draft = truth + noise
        result = verifier.verify("s", len(prompt) + len(committed), TokenTree.chain(draft))
        assert len(result.accepted_tokens) >= len(truth)
        committed += result.committed
        assert committed == reference[: len(committed)]


def test_cache_after_rounds_equals_a_fresh_prefill() -> None:
    """Rejected drafts leave no trace: next-step logits match a fresh session's."""
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    verifier = new_verifier()
    verifier.prefill("a", prompt, SamplingParams())
    committed = list(prompt)
    for draft in ([7, 7, 7, 7], [], [1, 2, 3], plain_greedy(MODEL, prompt, 20)[:5]):
        committed += verifier.verify("a", len(committed), TokenTree.chain(draft)).committed
    verifier.prefill("b", committed, SamplingParams())
    probe = TokenTree.chain([0, 1, 2])
    a = verifier._sessions.peek("a")
    b = verifier._sessions.peek("b")
    assert a is not None and b is not None
    assert a.region.length == b.region.length == len(committed) - 1
    torch.testing.assert_close(verifier.score("a", probe), verifier.score("b", probe), rtol=1e-4, atol=1e-4)


def test_seeded_sampling_is_reproducible() -> None:
    verifier = new_verifier()
    outputs = []
    for _ in range(2):
        verifier.prefill("s", [1, 2, 3], SamplingParams(temperature=1.0, top_k=10, seed=42))
        committed = [1, 2, 3]
        for draft in ([4, 5], [6], []):
            committed += verifier.verify("s", len(committed), TokenTree.chain(draft)).committed
        outputs.append(committed)
    assert outputs[0] == outputs[1]


def test_unknown_session_is_not_found() -> None:
    with pytest.raises(NotFound, match="prefill it"):
        new_verifier().verify("nope", 3, TokenTree())


def test_committed_count_mismatch_fails_precondition() -> None:
    verifier = new_verifier()
    verifier.prefill("s", [1, 2, 3], SamplingParams())
    with pytest.raises(FailedPrecondition, match="holds 3 committed tokens"):
        verifier.verify("s", 5, TokenTree())


@pytest.mark.parametrize(
    ("tree", "message"),
    [
        (TokenTree((1, VOCAB), (-1, 0)), "outside the vocabulary"),
        (TokenTree((1, 2), (-1, 7)), "out of range"),
        (TokenTree((1,) * 9, tuple(range(-1, 8))), "at most 8"),
    ],
)
def test_malformed_trees_are_invalid(tree: TokenTree, message: str) -> None:
    verifier = new_verifier(max_tree_nodes=8)
    verifier.prefill("s", [1, 2, 3], SamplingParams())
    with pytest.raises(InvalidArgument, match=message):
        verifier.verify("s", 3, tree)
    # The session is untouched and still usable.
    assert verifier.verify("s", 3, TokenTree()).bonus_token >= 0


@pytest.mark.parametrize(
    ("tokens", "sampling", "message"),
    [
        ([], SamplingParams(), "at least one token"),
        ([1, VOCAB + 3], SamplingParams(), "outside the vocabulary"),
        ([1] * 300, SamplingParams(), "do not fit the context"),
        ([1, 2], SamplingParams(temperature=-1), "temperature"),
        ([1, 2], SamplingParams(temperature=1, top_p=2), "top_p"),
        ([1, 2], SamplingParams(temperature=float("nan")), "temperature must be a finite number"),
        ([1, 2], SamplingParams(temperature=1e-40), "temperature must not be a subnormal"),
        ([1, 2], SamplingParams(temperature=1, top_p=float("inf")), "top_p must be a finite number"),
    ],
)
def test_bad_prefills_are_invalid(tokens: list[int], sampling: SamplingParams, message: str) -> None:
    with pytest.raises(InvalidArgument, match=message):
        new_verifier().prefill("s", tokens, sampling)


def test_refused_prefill_leaves_no_session() -> None:
    verifier = new_verifier()
    with pytest.raises(InvalidArgument):
        verifier.prefill("s", [1, 2], SamplingParams(temperature=float("nan")))
    assert verifier.num_active_sessions == 0
    assert verifier.stats().kv_used_bytes == 0


def test_a_session_whose_sampling_fails_is_dropped_and_others_go_on(monkeypatch: pytest.MonkeyPatch) -> None:
    """The engine raising for one session's sampling releases that session (its cache freed), and only it."""
    import target_service.tree_acceptance as engine

    verifier = new_verifier()
    verifier.prefill("ok", [1, 2, 3], SamplingParams())
    verifier.prefill("bad", [1, 2, 3], SamplingParams(temperature=1.0, seed=1))
    used_by_two = verifier.stats().kv_used_bytes

    def no_mass(*args: object) -> object:
        raise ValueError("cannot sample from a distribution with no mass")

    monkeypatch.setattr(engine, "accept_sampled", no_mass)
    with verifier.paused():  # both in one engine step
        bad = verifier.submit_verify("bad", 3, TokenTree.chain([4]))
        ok = verifier.submit_verify("ok", 3, TokenTree.chain([4]))
    with pytest.raises(InvalidArgument, match="was released") as raised:
        bad.result()
    assert "no mass" not in str(raised.value)
    assert ok.result().bonus_token >= 0
    assert verifier.num_active_sessions == 1
    assert verifier.stats().kv_used_bytes < used_by_two
    with pytest.raises(NotFound):
        verifier.verify("bad", 3, TokenTree())


def test_context_limit_is_resource_exhausted() -> None:
    verifier = new_verifier(max_session_tokens=10)
    verifier.prefill("s", [1] * 8, SamplingParams())
    with pytest.raises(ResourceExhausted, match="context limit of 10"):
        verifier.verify("s", 8, TokenTree.chain([1, 2]))


def test_sessions_are_bounded_and_release_frees() -> None:
    verifier = new_verifier(max_sessions=2)
    for name in "abc":
        verifier.prefill(name, [1, 2], SamplingParams())
    assert verifier.num_active_sessions == 2
    with pytest.raises(NotFound):
        verifier.verify("a", 2, TokenTree())  # least recently used, evicted
    assert verifier.release("b") is True
    assert verifier.release("b") is False
    assert verifier.num_active_sessions == 1


def random_tree_around(truth: list[int], rng: random.Random, size: int) -> TokenTree:
    """A tree that holds ``truth`` as one path (at a random sibling rank) among random branches."""
    tokens: list[int] = []
    parents: list[int] = []
    truth_nodes: list[int] = []
    for token in truth:
        parent = truth_nodes[-1] if truth_nodes else -1
        for _ in range(rng.randrange(3)):  # decoys before the true child, never equal to it
            tokens.append((token + rng.randrange(1, VOCAB)) % VOCAB)
            parents.append(parent)
        truth_nodes.append(len(tokens))
        tokens.append(token)
        parents.append(parent)
    while len(tokens) < size:
        parents.append(rng.randrange(-1, len(tokens)))
        tokens.append(rng.randrange(VOCAB))
    return TokenTree(tuple(tokens), tuple(parents))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    prompt=st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=16),
    rounds=st.lists(st.tuples(st.integers(0, 5), st.integers(0, 12)), min_size=1, max_size=6),
    seed=st.integers(0, 2**16),
)
def test_greedy_tree_verification_commits_what_plain_greedy_would(
    prompt: list[int], rounds: list[tuple[int, int]], seed: int
) -> None:
    rng = random.Random(seed)
    reference = plain_greedy(MODEL, prompt, sum(depth + 1 for depth, _ in rounds) + 8)
    verifier = new_verifier()
    verifier.prefill("s", prompt, SamplingParams())
    committed: list[int] = []
    for depth, extra in rounds:
        truth = reference[len(committed) : len(committed) + depth]
        tree = random_tree_around(truth, rng, len(truth) * 3 + extra)
        result = verifier.verify("s", len(prompt) + len(committed), tree)
        assert len(result.accepted_tokens) >= len(truth)
        assert [tree.token_ids[n] for n in result.accepted_nodes] == result.accepted_tokens
        committed += result.committed
        assert committed == reference[: len(committed)]


SAMPLED = SamplingParams(temperature=0.9, top_k=12, top_p=0.95)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    prompt=st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=16),
    rounds=st.lists(st.tuples(st.integers(0, 5), st.integers(0, 12)), min_size=1, max_size=6),
    seed=st.integers(0, 2**63 - 1),
)
def test_seeded_tree_sampling_commits_what_plain_seeded_decoding_would(
    prompt: list[int], rounds: list[tuple[int, int]], seed: int
) -> None:
    """With deterministic drafts, a seed fixes the tokens whatever was drafted: keyed draws per position."""
    sampling = SamplingParams(SAMPLED.temperature, SAMPLED.top_p, SAMPLED.top_k, seed)
    rng = random.Random(seed)
    reference = plain_decode(MODEL, prompt, sum(depth + 1 for depth, _ in rounds) + 8, sampling)
    verifier = new_verifier()
    verifier.prefill("s", prompt, sampling)
    committed: list[int] = []
    for depth, extra in rounds:
        truth = reference[len(committed) : len(committed) + depth]
        tree = random_tree_around(truth, rng, len(truth) * 3 + extra)
        result = verifier.verify("s", len(prompt) + len(committed), tree)
        assert len(result.accepted_tokens) >= len(truth)
        committed += result.committed
        assert committed == reference[: len(committed)]


def test_seeded_sampling_changes_with_the_seed() -> None:
    """The draws do depend on the seed (the check above is not comparing two constant outputs)."""
    outputs = {tuple(plain_decode(MODEL, [1, 2, 3], 12, SamplingParams(1.0, 1.0, 0, seed))) for seed in range(5)}
    assert len(outputs) == 5


def test_cache_after_tree_rounds_equals_a_fresh_prefill() -> None:
    rng = random.Random(5)
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    reference = plain_greedy(MODEL, prompt, 40)
    verifier = new_verifier()
    verifier.prefill("a", prompt, SamplingParams())
    committed = list(prompt)
    for depth in (3, 0, 5, 2):
        done = len(committed) - len(prompt)
        tree = random_tree_around(reference[done : done + depth], rng, 20)
        committed += verifier.verify("a", len(committed), tree).committed
    verifier.prefill("b", committed, SamplingParams())
    a, b = verifier._sessions.peek("a"), verifier._sessions.peek("b")
    assert a is not None and b is not None
    assert a.region.length == b.region.length == len(committed) - 1
    probe = TokenTree.chain([0, 1, 2])
    torch.testing.assert_close(verifier.score("a", probe), verifier.score("b", probe), rtol=1e-4, atol=1e-4)


def test_tree_rows_equal_sequential_decoding_of_each_path() -> None:
    """Row i + 1 of a tree forward is what decoding node i's path one token at a time gives."""
    rng = random.Random(11)
    prompt = [2, 7, 1, 8]
    tree = random_tree_around([], rng, 12)
    verifier = new_verifier()
    verifier.prefill("t", prompt, SamplingParams())
    rows = verifier.score("t", tree)
    for node in range(len(tree)):
        path = [tree.token_ids[i] for i in tree.path_to(node)]
        with torch.inference_mode():
            expected = MODEL(input_ids=torch.tensor([prompt + path])).logits[0, -1]
        torch.testing.assert_close(rows[node + 1], expected, rtol=1e-4, atol=1e-4)


def test_a_parked_verifier_ends_its_engine_thread_and_the_next_call_starts_another() -> None:
    """``park``: the benchmarks' in-process modes park their verifiers between prompts, so that one process
    holds one OpenMP team (``target_service.engine_threads``); nothing a session had is lost."""
    prompt = [3, 1, 4, 1, 5]
    reference = plain_greedy(MODEL, prompt, 6)
    verifier = new_verifier()
    try:
        verifier.prefill("s", prompt, SamplingParams())
        first = verifier._thread
        verifier.park()
        assert not first.is_alive()
        committed = verifier.verify("s", len(prompt), TokenTree.chain(reference[:2])).committed
        assert committed == reference[:3]
        assert verifier._thread is not first and verifier._thread.is_alive()
        verifier.park()
        verifier.park()  # parked already: nothing to wait for
        committed += verifier.verify("s", len(prompt) + 3, TokenTree.chain([])).committed
        assert committed == reference[:4]
    finally:
        verifier.close()
    assert not verifier._thread.is_alive()
