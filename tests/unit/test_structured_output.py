"""Structured output through token trees on a tiny model, a 16-token vocabulary and a hand-written grammar.

- masked greedy through trees (drafts that mix right, wrong and forbidden tokens; forced tokens added) commits
  exactly what masked plain decoding does, on the real verifier engine;
- sampling: the first token's distribution, with a tree of sampled children some of which the grammar forbids,
  is the masked, renormalised p (chi-square);
- fitting a tree leaves the grammar state untouched; committing moves it by exactly the committed tokens;
- forced tokens are always accepted (greedy and sampled); EOS is allowed only where the grammar is complete;
- the drafter is told each round's verified tree (forced tokens included), so its pre-drafts hit after rounds
  whose accepted path ends in forced tokens, and the output stays what masked plain decoding gives;
- the end stays honest: a request cut by its token limit mid-grammar says so (finish reason length, the
  constraint incomplete, in the stats, the OpenAI answer, the metrics and the log line), and one whose limit is
  below the constraint's shortest output is refused before it runs.
"""

from __future__ import annotations

import asyncio
import dataclasses
import io
import json
import random
from types import SimpleNamespace

import llguidance
import numpy as np
import pytest
import torch
from scipy.stats import chisquare
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from bench.inproc import InProcessDrafter, InProcessVerifier
from coordinator import request_log
from coordinator.admission import AdmissionController
from coordinator.constraints import compiler
from coordinator.constraints.compiler import CompiledGrammar, GrammarCompiler
from coordinator.constraints.grammar_state import FittedTree, GrammarState, allows
from coordinator.constraints.refusals import ConstraintRefused
from coordinator.constraints.shortest import VocabularyBytes
from coordinator.constraints.spec import Constraint, ConstraintKind, ConstraintLimits
from coordinator.frontend import CallInfo, EdgeRequest, GenerationBackend, GenerationFrontend
from coordinator.metrics import CoordinatorMetrics
from coordinator.openai_api.translate import finish_reason, speculation_stats
from coordinator.ports import DraftStream
from coordinator.prompts import PromptLimits
from coordinator.rounds import FinishReason, Generation, GenerationRequest, RoundPolicy
from draft_service.drafter import Drafter
from draft_service.ngram_pool import InMemoryNgramPool
from draft_service.tree_builder import VerifyCost
from specserve.errors import DrafterFailed, InvalidArgument
from specserve.keyed_noise import PositionNoise
from specserve.probs import target_probs
from specserve.results import DraftFeedback, DraftReply, VerifiedTree
from specserve.sampling import SamplingParams
from specserve.tenancy import Tenant
from specserve.token_masks import TokenMasks
from specserve.token_tree import ROOT, DraftDistribution, TokenTree
from target_service.acceptance import accept_sampled
from target_service.tree_acceptance import masked_logits
from target_service.verifier import Verifier
from tests.conftest import CharTokenizer, run_generation, tiny_llama

EOS = 0
WORDS = ["<eos>", "a", "b", "c", "[", "]", ",", "ab", "abc", "],", "x", "y", "ca", "bc", "[a", "cab"]
VOCAB = len(WORDS)
# A list of items made of a/b/c: "x" and "y" are never allowed; EOS only after "]", and then nothing else.
GRAMMAR = 'start: "[" item ("," item)* "]"\nitem: /[abc]{1,6}/'
MODEL = tiny_llama(vocab_size=VOCAB, context=256)


def _tokenizer() -> SimpleNamespace:
    merges = [("a", "b"), ("ab", "c"), ("]", ","), ("c", "a"), ("b", "c"), ("[", "a"), ("c", "ab")]
    tok = Tokenizer(models.BPE(vocab={w: i for i, w in enumerate(WORDS)}, merges=merges))
    tok.decoder = decoders.ByteLevel()
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.add_special_tokens(["<eos>"])
    return SimpleNamespace(backend_tokenizer=tok)  # what the compiler reads of a Hugging Face tokenizer


COMPILER = GrammarCompiler(_tokenizer(), VOCAB, [EOS], "tiny")


LIST = Constraint(ConstraintKind.LARK_GRAMMAR, GRAMMAR)


def compiled(constraint: Constraint = LIST) -> CompiledGrammar:
    return asyncio.run(COMPILER.compile(constraint))


def random_tree(rng: random.Random, truth: list[int]) -> TokenTree:
    """Paths that follow the truth for a while, then guess (allowed, forbidden or EOS tokens alike)."""
    paths = []
    for _ in range(rng.randint(0, 3)):
        keep = rng.randint(0, len(truth))
        paths.append(truth[:keep] + [rng.randrange(VOCAB) for _ in range(rng.randint(0, 3))])
    return TokenTree.from_paths([p for p in paths if p])


@torch.inference_mode()
def masked_plain_greedy(prompt: list[int], state: GrammarState, max_new_tokens: int) -> list[int]:
    """Reference: one token per full forward, argmax of the logits masked by the grammar, until EOS."""
    out: list[int] = []
    while len(out) < max_new_tokens:
        logits = MODEL(input_ids=torch.tensor([prompt + out])).logits[0, -1:].float()
        row = state.fit(TokenTree(), 0, 0).masks
        token = int(masked_logits(logits, row).argmax())
        out.append(token)
        if token == EOS:
            break
        state.commit([token])
    return out


def check_forced_accepted(fitted: FittedTree, accepted: list[int]) -> None:
    on_path = {ROOT, *accepted}
    for node, forced in enumerate(fitted.forced):
        if forced and fitted.tree.parents[node] in on_path:
            assert node in on_path, "a forced node whose parent was accepted was rejected"


@pytest.mark.parametrize("seed", range(6))
def test_masked_greedy_through_trees_equals_masked_plain_decoding(seed: int) -> None:
    rng = random.Random(seed)
    prompt = [rng.randrange(1, VOCAB) for _ in range(rng.randint(1, 6))]
    grammar = compiled()
    reference = masked_plain_greedy(prompt, grammar.new_state(), 24)
    verifier = Verifier(MODEL, "tiny")
    verifier.prefill("s", prompt, SamplingParams())
    state = grammar.new_state()
    committed: list[int] = []
    while len(committed) < len(reference):
        truth = reference[len(committed) :]
        fitted = state.fit(random_tree(rng, truth), max_nodes=8, max_depth=8)
        result = verifier.verify("s", len(prompt) + len(committed), fitted.tree, token_masks=fitted.masks)
        check_forced_accepted(fitted, result.accepted_nodes)
        new = result.committed[: len(reference) - len(committed)]
        committed += new
        assert committed == reference[: len(committed)]
        if EOS in new:
            break
        state.commit(new)
    assert committed == reference


def test_fitting_leaves_the_grammar_state_untouched_and_commit_moves_it_exactly() -> None:
    grammar = compiled()
    state, fresh = grammar.new_state(), grammar.new_state()
    rng = random.Random(3)
    committed: list[int] = []
    for tokens in ([4], [1, 2], [6], [8, 3]):  # "[", "a" "b", ",", "abc" "c"
        before = state.fit(TokenTree(), 0, 0).masks.bits.copy()
        for _ in range(5):  # trees with allowed, forbidden and EOS branches, tried and thrown away
            state.fit(random_tree(rng, [*tokens, 5, 0]), max_nodes=12, max_depth=6)
        assert np.array_equal(state.fit(TokenTree(), 0, 0).masks.bits, before)
        state.commit(tokens)
        committed += tokens
        replay = grammar.new_state()
        replay.commit(committed)
        assert np.array_equal(state.fit(TokenTree(), 0, 0).masks.bits, replay.fit(TokenTree(), 0, 0).masks.bits)
    assert not fresh.complete


def test_eos_allowed_only_where_the_grammar_is_complete_and_forced_chains_are_drafted() -> None:
    state = compiled().new_state()
    first = state.fit(TokenTree(), max_nodes=4, max_depth=4)
    assert TokenMasks(first.masks.bits[:1]).allowed(VOCAB)[0].nonzero()[0].tolist() == [4, 14]  # "[" or "[a"
    assert not first.tree.token_ids
    for tokens in ([4], [1], [6], [3]):
        state.commit(tokens)
        assert not allows(state.fit(TokenTree(), 0, 0).masks.bits[0], EOS)
        assert not state.complete
    state.commit([5])  # "]"
    row = state.fit(TokenTree(), 0, 0).masks.bits[0]
    assert state.complete and allows(row, EOS)
    # The grammar is done: EOS is the one token left, drafted as a certain node.
    done = state.fit(TokenTree(), max_nodes=4, max_depth=4)
    assert done.tree.token_ids == (EOS,) and done.forced == (True,)


@pytest.mark.parametrize("at_most", [1, 2, 8])
def test_the_drafter_is_told_the_tokens_a_row_allows_where_they_are_few(at_most: int) -> None:
    state = compiled().new_state()
    state.commit([4])  # "["
    fitted = state.fit(TokenTree.from_paths([[1, 6, 2], [3, 5], [0]]), max_nodes=8, max_depth=4)
    allowed = fitted.masks.allowed(VOCAB)
    expected = {
        row - 1: tuple(np.flatnonzero(allowed[row]).tolist())  # row 0 is after the committed tokens (ROOT)
        for row in range(fitted.masks.num_rows)
        if 1 <= allowed[row].sum() <= at_most
    }
    assert state.few_allowed(fitted, at_most) == expected
    if at_most == 1:
        assert expected and all(len(tokens) == 1 for tokens in expected.values())


def test_forbidden_deterministic_nodes_are_pruned_with_their_subtrees_sampled_ones_kept_as_leaves() -> None:
    state = compiled().new_state()
    state.commit([4])  # "["
    drafted = TokenTree(
        token_ids=(10, 1, 11, 2, 3, 10),  # x (det.), a (sampled), y (sampled), then children of x and a
        parents=(ROOT, ROOT, ROOT, 0, 1, 1),
        sampled=(False, True, True, False, False, False),
        distributions=(DraftDistribution(ROOT, (1, 11, 3), (0.5, 0.3, 0.2)),),
    )
    fitted = state.fit(drafted, max_nodes=8, max_depth=4)
    assert fitted.tree.token_ids == (1, 3, 11)  # a, its allowed child c; y kept as a leaf; x and x's child gone
    assert fitted.tree.parents == (ROOT, 0, ROOT)
    assert fitted.tree.sampled == (True, False, True)
    assert fitted.origin == (1, 4, 2)
    assert fitted.drafter_path([0, 1]) == (1, 4)
    fitted.tree.validate(VOCAB, 8)


def test_sampling_distribution_through_a_pruned_tree_is_the_masked_target() -> None:
    """The first committed token over many seeds, with sampled children (some forbidden) drafted from a q that
    differs from p, follows softmax(masked logits / T): chi-square."""
    grammar = compiled()
    state = grammar.new_state()
    state.commit([4, 1])  # "[a": next may be a/b/c/ab/abc/bc... or "," or "]" ...
    params = SamplingParams(temperature=1.0, seed=1)
    torch.manual_seed(0)
    root_logits = torch.randn(1, VOCAB) * 1.5
    child_logits = torch.randn(VOCAB, VOCAB)
    row0 = state.fit(TokenTree(), 0, 0).masks
    p = target_probs(masked_logits(root_logits, row0), params)[0].double()
    q_tokens = (1, 11, 2, 10, 6)  # a, y (forbidden), b, x (forbidden), ","
    q_probs = (0.3, 0.25, 0.2, 0.15, 0.1)
    rng = np.random.default_rng(0)
    draws = 6000
    counts = np.zeros(VOCAB)
    for seed in range(draws):
        picked = rng.choice(len(q_tokens), size=3, replace=False, p=q_probs)  # without replacement, in order
        kids = [q_tokens[i] for i in picked]
        drafted = TokenTree(tuple(kids), (ROOT,) * 3, (True,) * 3, (DraftDistribution(ROOT, q_tokens, q_probs),))
        fitted = state.fit(drafted, max_nodes=8, max_depth=4)
        rows = torch.cat([root_logits, child_logits[list(fitted.tree.token_ids)]])
        probs = target_probs(masked_logits(rows, fitted.masks), params)
        noise = PositionNoise(seed, first_position=7)
        acceptance = accept_sampled(fitted.tree, probs, noise)
        check_forced_accepted(fitted, acceptance.path)
        first = fitted.tree.token_ids[acceptance.path[0]] if acceptance.path else acceptance.bonus_token
        counts[first] += 1
    support = p.numpy() > 0
    assert counts[~support].sum() == 0, "a token the grammar forbids was committed"
    expected = p.numpy()[support] / p.numpy()[support].sum() * draws
    assert chisquare(counts[support], expected).pvalue > 1e-3


def test_masks_on_the_wire_are_checked() -> None:
    verifier = Verifier(MODEL, "tiny")
    verifier.prefill("s", [1, 2], SamplingParams())
    ones = TokenMasks(np.full((1, 4), 0xFF, dtype=np.uint8))
    with pytest.raises(InvalidArgument, match="rows"):
        verifier.verify("s", 2, TokenTree.chain([1]), token_masks=ones)
    with pytest.raises(InvalidArgument, match="allows no token"):
        verifier.verify("s", 2, TokenTree(), token_masks=TokenMasks(np.zeros((1, 4), dtype=np.uint8)))
    only_three = TokenMasks(np.array([[0b1000, 0, 0, 0]], dtype=np.uint8))
    assert verifier.verify("s", 2, TokenTree(), token_masks=only_three).bonus_token == 3


def test_a_row_that_allows_one_token_is_forced() -> None:
    bits = np.zeros((3, 4), dtype=np.uint8)
    bits[0, 1] = 0b100  # token 10 alone
    bits[1, 0] = 0b11  # tokens 0 and 1
    bits[2, 1] = 0b1  # token 8, and a padding bit past the 14-token vocabulary that does not count
    bits[2, 3] = 0b1000_0000
    assert TokenMasks(bits).forced_tokens(14).tolist() == [10, -1, 8]


def _counting_head_rows(verifier: Verifier) -> list[int]:
    """The rows the head computes in each of ``verifier``'s steps, from now on."""
    counts: list[int] = []
    forward = verifier._runner.forward

    def counted(plan, input_ids, positions, score_rows, *rows):  # type: ignore[no-untyped-def]
        counts.append(int(score_rows.numel()))
        return forward(plan, input_ids, positions, score_rows, *rows)

    verifier._runner.forward = counted  # type: ignore[method-assign]
    return counts


@pytest.mark.parametrize("sampling", [SamplingParams(), SamplingParams(temperature=1.0, seed=5)])
def test_rows_with_one_allowed_token_skip_the_head_and_keep_their_token(sampling: SamplingParams) -> None:
    """A forced row's logits are not computed, yet its token is what the row picks (greedy and sampled), and the
    rows the head did compute give what a verifier scoring every row gives."""
    state = compiled().new_state()
    state.commit([4, 1])  # "[a"
    # "]" then EOS: after "]" the grammar allows EOS alone; a drafted "," branch beside it keeps its own rows.
    fitted = state.fit(TokenTree.from_paths([[5, 0], [6, 2]]), max_nodes=8, max_depth=4)
    forced = fitted.masks.forced_tokens(VOCAB)
    assert (forced >= 0).sum() >= 1 and (forced < 0).sum() >= 1
    prompt = [4, 1]
    skipping = Verifier(MODEL, "tiny")
    skipping.prefill("s", prompt, sampling)
    counts = _counting_head_rows(skipping)
    result = skipping.verify("s", len(prompt), fitted.tree, num_successors=2, token_masks=fitted.masks)
    assert counts == [int((forced < 0).sum())]
    reference = Verifier(MODEL, "tiny")
    reference.prefill("s", prompt, sampling)
    logits = masked_logits(reference.score("s", fitted.tree), fitted.masks)
    picks = logits.argmax(dim=-1).tolist()
    for row, token in enumerate(forced.tolist()):
        if token >= 0:
            assert picks[row] == token and result.successors[row][0] == token
        elif sampling.greedy:
            assert result.successors[row] == logits[row].topk(2).indices.tolist()
    path = [ROOT, *result.accepted_nodes]
    for node in path[1:]:  # every accepted node was its parent row's pick
        parent_row = 0 if fitted.tree.parents[node] == ROOT else fitted.tree.parents[node] + 1
        assert fitted.masks.allows(parent_row, fitted.tree.token_ids[node])
    check_forced_accepted(fitted, result.accepted_nodes)
    last_row = 0 if path[-1] == ROOT else path[-1] + 1
    if forced[last_row] >= 0:
        assert result.bonus_token == forced[last_row]


def test_bad_constraints_are_invalid_argument_naming_the_problem() -> None:
    for constraint, words in [
        (Constraint(ConstraintKind.JSON_SCHEMA, '{"type": "strin"}'), "strin"),
        (Constraint(ConstraintKind.JSON_SCHEMA, "{not json"), "not valid JSON"),
        (Constraint(ConstraintKind.REGEX, "(a"), "regex"),
        (Constraint(ConstraintKind.LARK_GRAMMAR, "start: nowhere"), "nowhere"),
        (Constraint(ConstraintKind.CHOICE), "at least one"),
        (Constraint(ConstraintKind.REGEX, "a" * 70_000), "limit"),
    ]:
        with pytest.raises(InvalidArgument, match=words):
            compiled(constraint)


def _schema(schema: object) -> Constraint:
    return Constraint(ConstraintKind.JSON_SCHEMA, json.dumps(schema))


# What the client is told for each class of llguidance's refusals: our words, the caller's own names only.
REFUSALS = [
    (_schema({"type": "strin"}), "unknown_type", 'json_schema has an unknown type "strin"; the types are string, '
     "number, integer, boolean, object, array and null"),
    (_schema({"type": ["string", "x" * 100]}), "unknown_type", "json_schema has a type that is not one of the JSON "
     "types; the types are string, number, integer, boolean, object, array and null"),
    (_schema({"type": "object", "if": {}, "then": {}}), "unsupported_keyword",
     'json_schema uses keywords this server does not support: "if", "then"'),
    (_schema({"type": "string", "format": "weird"}), "unknown_format",
     'json_schema has an unknown string format "weird"'),
    (_schema({"type": "string", "pattern": "(?=a)b"}), "regex_syntax", 'json_schema has a "pattern" that is not a '
     "valid regular expression: look-around (lookahead, lookbehind) is not supported"),
    (_schema({"$ref": "#/$defs/nope"}), "bad_reference", 'json_schema has a $ref "#/$defs/nope" that points to '
     "nothing in the schema"),
    (_schema({"$ref": "https://example.com/a.json"}), "bad_reference", "json_schema has a $ref to another document; "
     'only references inside it ("#/...") work'),
    (_schema({"type": "integer", "minimum": 5, "maximum": 1}), "unsatisfiable",
     "json_schema allows no value at all: its keywords contradict each other"),
    (_schema({"type": "string", "minLength": "x"}), "bad_value",
     'json_schema has a value for "minLength" that this server cannot use'),
    (Constraint(ConstraintKind.REGEX, "(a"), "regex_syntax",
     "regex is not a valid regular expression at character 1: a parenthesis is not closed"),
    (Constraint(ConstraintKind.REGEX, r"(a)\1"), "regex_syntax",
     "regex is not a valid regular expression at character 4: backreferences are not supported"),
    (Constraint(ConstraintKind.REGEX, "ab\n(c"), "regex_syntax",  # no position: llguidance escaped the line break
     "regex is not a valid regular expression: a parenthesis is not closed"),
    (Constraint(ConstraintKind.LARK_GRAMMAR, "start: nowhere"), "grammar_syntax",
     'lark_grammar uses "nowhere" at line 1, column 8, which no rule or terminal defines'),
    (Constraint(ConstraintKind.LARK_GRAMMAR, 'start: ("a"'), "grammar_syntax",
     "lark_grammar has a syntax error at line 1, column 12"),
    (Constraint(ConstraintKind.LARK_GRAMMAR, 'item: "a"'), "grammar_syntax", 'lark_grammar has no "start" rule'),
    (Constraint(ConstraintKind.LARK_GRAMMAR, "start: A\nA: /[a-/"), "regex_syntax", "lark_grammar has an invalid "
     "regular expression at line 2, column 4: a character class [...] is not closed"),
    (Constraint(ConstraintKind.LARK_GRAMMAR, 'start: %json {"type": "strin"}'), "unknown_type", "lark_grammar has a "
     '%json schema at line 1, column 8 that has an unknown type "strin"; the types are string, number, integer, '
     "boolean, object, array and null"),
]  # fmt: skip


@pytest.mark.parametrize(("constraint", "reason", "message"), REFUSALS)
def test_refusals_are_told_in_our_words_with_the_library_text_kept_for_the_log(
    constraint: Constraint, reason: str, message: str
) -> None:
    with pytest.raises(ConstraintRefused) as refused:
        compiled(constraint)
    assert (str(refused.value), refused.value.reason) == (message, reason)
    assert refused.value.detail and refused.value.detail not in message  # llguidance's own text, whole
    for library_words in ("Invalid type", "Unimplemented", "regex parse error", "start: /", "at 1(", "error:"):
        assert library_words not in message


def test_a_refusal_over_the_size_limits_and_a_compile_timeout(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(compiler, "PARSER_LIMITS", llguidance.LLParserLimits(max_grammar_size=20))
    many = Constraint(ConstraintKind.LARK_GRAMMAR, "start: " + " | ".join(f'"w{i}" x' for i in range(30)) + '\nx: "q"')
    with pytest.raises(ConstraintRefused) as refused:
        compiled(many)
    assert refused.value.reason == "too_large"
    assert str(refused.value) == ("lark_grammar is over the compile limits (grammar size or lexer states); simplify it")
    assert "limit for this grammar: 20" in refused.value.detail
    slow = GrammarCompiler(_tokenizer(), VOCAB, [EOS], "tiny", ConstraintLimits(compile_timeout_s=1e-6))
    with pytest.raises(ConstraintRefused, match=r"regex took longer than 1e-06 s to compile; simplify it") as late:
        asyncio.run(slow.compile(Constraint(ConstraintKind.REGEX, "[abc]+")))
    assert late.value.reason == "timeout"


def test_the_request_log_carries_the_library_text_under_the_request_id() -> None:
    stream = io.StringIO()
    request_log.configure(stream)
    try:
        backend = GenerationBackend(
            lambda text, **_: {"input_ids": [1] * len(text)},
            PromptLimits(max_new_tokens=16, max_session_tokens=64),
            lambda request: pytest.fail("a refused constraint must not start a generation"),
            constraints=COMPILER,
        )
        front = GenerationFrontend("tiny", AdmissionController(), None, backend)
        request = EdgeRequest(prompt="hi", max_new_tokens=4, constraint=_schema({"type": "strin"}))

        async def run() -> None:
            async for _ in front.generate(request, CallInfo("req-33", "grpc", Tenant("acme"))):
                pass

        with pytest.raises(InvalidArgument) as refused:
            asyncio.run(run())
    finally:
        request_log.configure()
    (line,) = [json.loads(text) for text in stream.getvalue().splitlines()]
    assert (line["request_id"], line["status"], line["error"]) == ("req-33", "INVALID_ARGUMENT", str(refused.value))
    assert line["error_detail"] == "Invalid type: strin"


def test_compiled_grammars_are_cached_by_constraint_and_vocabulary() -> None:
    a = compiled(Constraint(ConstraintKind.CHOICE, choices=("ab", "c")))
    assert compiled(Constraint(ConstraintKind.CHOICE, choices=("ab", "c"))) is a
    assert compiled(Constraint(ConstraintKind.CHOICE, choices=("c", "ab"))) is not a


def test_the_compiler_and_a_constrained_generation_feed_the_metrics() -> None:
    metrics = CoordinatorMetrics()
    observed = GrammarCompiler(_tokenizer(), VOCAB, [EOS], "tiny", observer=metrics)
    grammar = asyncio.run(observed.compile(LIST))
    assert asyncio.run(observed.compile(LIST)) is grammar
    with pytest.raises(ConstraintRefused):
        asyncio.run(observed.compile(Constraint(ConstraintKind.REGEX, "(a")))
    value = metrics.registry.get_sample_value
    assert (value("specserve_grammar_cache_queries_total"), value("specserve_grammar_cache_hits_total")) == (3, 1)
    assert value("specserve_grammar_compile_seconds_count", {"kind": "lark_grammar"}) == 1
    assert value("specserve_grammar_compile_failures_total", {"kind": "regex", "reason": "regex_syntax"}) == 1

    prompt = [5, 5]  # the model closes the list after 13 tokens: "]" leaves EOS the only token
    reference = masked_plain_greedy(prompt, grammar.new_state(), 24)
    generation = _generation(grammar, prompt, 24)
    tokens, _, stats = run_generation(generation)
    assert [*tokens, EOS] == reference
    assert (stats.constraint_kind, stats.constraint_complete) == ("lark_grammar", True)
    assert len(stats.mask_ns_per_round) == stats.num_rounds and sum(stats.mask_ns_per_round) == stats.mask_ns
    assert stats.num_forced_tokens > 0
    metrics.observe_finished(stats, e2e_seconds=1.0)
    assert value("specserve_constrained_requests_total", {"kind": "lark_grammar", "complete": "true"}) == 1
    assert value("specserve_spec_decode_num_forced_tokens_total", {"decoding": "greedy"}) == stats.num_forced_tokens
    assert value("specserve_constraint_mask_seconds_count") == stats.num_rounds


class WatchedStream:
    """A draft stream that notes, per round, whether the accepted path ended in a forced token and whether the
    drafter had the round's tree ready; ``tell``: False keeps the verified tree from the drafter (as before);
    ``fail_on``: the verified tree whose sending fails like a lost connection (0: none); ``sees_prefix``: False
    keeps the forced prefix from it (a drafter from before prefixes: it drafts after the committed tokens)."""

    def __init__(
        self, inner: DraftStream, tell: bool, fail_on: int = 0, sees_prefix: bool = True, takes: bool = True
    ) -> None:
        self._inner = inner
        self._tell = tell
        self._sees_prefix = sees_prefix
        self._fail_on = fail_on
        self._told = 0
        self.wants_features = inner.wants_features
        self.takes_verified_trees = takes  # True: it watches each verified tree, whether or not it passes it on
        self.feature_layers: tuple[int, ...] = ()
        self._verified: VerifiedTree | None = None
        self.rounds: list[tuple[bool, bool]] = []  # (the last path ended in a forced token, pre-drafted)

    async def propose(self, feedback: DraftFeedback, max_nodes: int) -> DraftReply:
        ended_forced, verified, self._verified = False, self._verified, None
        if verified is not None and feedback.new_tokens:
            node, children = ROOT, verified.tree.children()
            for token in feedback.new_tokens[:-1]:  # the accepted path; the bonus token follows it
                node = next(c for c in children[node] if verified.tree.token_ids[c] == token)
            ended_forced = node != ROOT and verified.is_forced(node)
        if not self._sees_prefix and feedback.forced_prefix:
            max_nodes -= len(feedback.forced_prefix)
            feedback = dataclasses.replace(feedback, forced_prefix=())
        reply = await self._inner.propose(feedback, max_nodes)
        if feedback.new_tokens and max_nodes:
            self.rounds.append((ended_forced, reply.predrafted))
        return reply

    async def verifying(self, verified: VerifiedTree) -> None:
        self._verified = verified
        self._told += 1
        if self._told == self._fail_on:
            raise DrafterFailed("connection lost", detail="drafter at 127.0.0.1:1: connection reset")
        if self._tell:
            await self._inner.verifying(verified)

    async def close(self) -> None:
        await self._inner.close()


class WatchedDrafter:
    def __init__(self, tell: bool, fail_on: int = 0, sees_prefix: bool = True, takes: bool = True) -> None:
        # Prompt lookup alone (it follows the output's repeats), every node kept, three outcomes pre-drafted.
        drafter = Drafter(
            lambda *_: InMemoryNgramPool(),
            sources=("prompt_lookup",),
            cost=VerifyCost({0: 1.0, 64: 1.0}),
            predraft_outcomes=3,
        )
        self._inner = InProcessDrafter(drafter, predraft=True)
        self._tell = tell
        self._fail_on = fail_on
        self._sees_prefix = sees_prefix
        self._takes = takes
        self.streams: list[WatchedStream] = []

    async def open(self, *args: object, **kwargs: object) -> DraftStream:
        inner = await self._inner.open(*args, **kwargs)  # type: ignore[arg-type]
        self.streams.append(WatchedStream(inner, self._tell, self._fail_on, self._sees_prefix, self._takes))
        return self.streams[-1]


REPEATING = 'start: (item ",xy,")+ "]"\nitem: /[abc]{1,4}/'  # items repeat, and ",xy," is forced after each


def repeating_generation(drafter: WatchedDrafter) -> tuple[Generation, list[int]]:
    """REPEATING's generation (40 tokens at most) through the tiny verifier with ``drafter``, and the tokens
    masked plain decoding gives."""
    grammar = compiled(Constraint(ConstraintKind.LARK_GRAMMAR, REPEATING))
    prompt = [1, 2, 3]
    reference = [t for t in masked_plain_greedy(prompt, grammar.new_state(), 40) if t != EOS]
    generation = Generation(
        GenerationRequest(prompt, 40, constraint=grammar),
        InProcessVerifier(Verifier(MODEL, "tiny")),
        drafter,  # type: ignore[arg-type]
        CharTokenizer(),
        frozenset({EOS}),
        "tiny",
        RoundPolicy(max_draft_tokens=6),
    )
    return generation, reference


def test_predrafts_hit_after_rounds_that_end_in_forced_tokens_once_the_drafter_is_told_the_verified_tree() -> None:
    """The drafter keys a pre-draft by the path it expects accepted plus a guessed bonus token. Under a
    constraint most paths end in tokens the grammar forced, which the drafter never drafted: told only of its
    own tree, it pre-drafts for paths that cannot be the whole acceptance. The forced prefix is kept from it: it
    puts a round's first forced tokens in the drafter's own tree (``test_forced_prefix``), and the verified tree
    is what tells it of the others."""
    hits, hits_after_forced = {}, {}
    for tell in (False, True):
        drafter = WatchedDrafter(tell, sees_prefix=False)
        generation, reference = repeating_generation(drafter)
        tokens, _, stats = run_generation(generation)
        assert tokens == reference  # what is pre-drafted changes the speed, never the output
        (stream,) = drafter.streams
        assert sum(ended for ended, _ in stream.rounds) >= 3
        hits[tell] = stats.num_predraft_hits
        hits_after_forced[tell] = sum(ended and hit for ended, hit in stream.rounds)
    assert hits_after_forced[True] > hits_after_forced[False]
    assert hits[True] > hits[False]


def test_a_drafter_that_does_not_predraft_is_not_told_the_verified_tree() -> None:
    """Only pre-drafting uses the verified tree: a drafter without it (one sharing the verifier's cores) is spared
    the message and the coordinator the work of building it, each round."""
    drafter = WatchedDrafter(tell=True, takes=False)
    generation, reference = repeating_generation(drafter)
    tokens, _, stats = run_generation(generation)
    assert tokens == reference
    (stream,) = drafter.streams
    assert stream._told == 0 and stats.num_drafter_trees >= 3 and stats.num_forced_tokens > 0


def test_a_drafter_lost_while_told_the_verified_tree_is_dropped_and_the_output_stays_the_same() -> None:
    generation, reference = repeating_generation(WatchedDrafter(tell=True, fail_on=3))
    tokens, _, stats = run_generation(generation)
    assert tokens == reference
    assert stats.drafter_error == "drafter dropped: connection lost"
    assert stats.num_drafter_trees == 3 and stats.num_rounds_without_drafter > 0


def _generation(grammar: CompiledGrammar, prompt: list[int], max_new_tokens: int) -> Generation:
    return Generation(
        GenerationRequest(prompt, max_new_tokens, constraint=grammar),
        InProcessVerifier(Verifier(MODEL, "tiny")),
        None,  # no drafter: the grammar's forced tokens are the only drafts
        CharTokenizer(),
        frozenset({EOS}),
        "tiny",
        RoundPolicy(max_draft_tokens=8),
    )


@pytest.mark.parametrize("max_new_tokens", [2, 5, 12])
def test_a_cut_mid_grammar_ends_with_length_and_says_the_constraint_is_incomplete(max_new_tokens: int) -> None:
    grammar = compiled()
    prompt = [5, 5]  # the model closes the list after 13 tokens
    reference = masked_plain_greedy(prompt, grammar.new_state(), 24)
    assert len(reference) > max_new_tokens + 1
    tokens, _, stats = run_generation(_generation(grammar, prompt, max_new_tokens))
    assert tokens == reference[:max_new_tokens]  # the same text plain decoding has at that length
    assert (stats.finish_reason, stats.constrained, stats.constraint_complete) == (FinishReason.LENGTH, True, False)
    assert finish_reason(stats) == "length" and speculation_stats(stats).constraint_complete is False
    metrics = CoordinatorMetrics()
    metrics.observe_finished(stats, e2e_seconds=1.0)
    value = metrics.registry.get_sample_value
    assert value("specserve_constrained_requests_total", {"kind": "lark_grammar", "complete": "false"}) == 1
    record = request_log.RequestRecord("r", "grpc", "t")
    record.finished(stats, 1.0)
    assert (record.constraint, record.constraint_complete) == ("lark_grammar", False)


def test_a_limit_that_ends_exactly_where_the_grammar_completes_is_length_but_complete() -> None:
    grammar = compiled()
    prompt = [5, 5]
    reference = masked_plain_greedy(prompt, grammar.new_state(), 24)  # ends "]", EOS
    tokens, _, stats = run_generation(_generation(grammar, prompt, len(reference) - 1))
    assert tokens == reference[:-1]
    assert (stats.finish_reason, stats.constraint_complete) == (FinishReason.LENGTH, True)
    assert finish_reason(stats) == "length" and speculation_stats(stats).constraint_complete is True


def test_the_fewest_tokens_that_write_forced_bytes_take_any_tokenization() -> None:
    vocab = VocabularyBytes(llguidance.LLTokenizer(_tokenizer().backend_tokenizer.to_str(), n_vocab=VOCAB), VOCAB)
    # exact: "abc" "ab" (or "ab" "cab"); past the end: "abc" then "ab" reaching into "abc"
    assert vocab.fewest_tokens(b"abcab") == (2, 2)
    assert vocab.fewest_tokens(b"[") == (1, 1)  # "[" exactly, or "[a" past it
    assert vocab.fewest_tokens(b"cax") == (2, None)  # "ca" "x" exactly; no token goes on past an "x"
    assert vocab.fewest_tokens(b"xq") == (None, None)  # no token writes "q"


@pytest.mark.parametrize(
    ("constraint", "floor"),
    [
        (Constraint(ConstraintKind.CHOICE, choices=("abcab",)), 2),  # all forced: "abc" "ab", then complete
        (Constraint(ConstraintKind.CHOICE, choices=("cabcab", "cabx")), 2),  # "cab" forced, then one more
        (Constraint(ConstraintKind.CHOICE, choices=("ab", "c")), 1),  # no forced bytes: one token at least
        (Constraint(ConstraintKind.REGEX, "[abc]*"), 0),  # the empty output completes it
        (LIST, 1),  # "[" forced, but "[a" writes it and goes on
    ],
)
def test_a_compiled_constraint_knows_a_floor_on_its_shortest_output(constraint: Constraint, floor: int) -> None:
    assert compiled(constraint).min_tokens == floor


def _backend(metrics: CoordinatorMetrics | None = None) -> tuple[GenerationBackend, list[GenerationRequest]]:
    started: list[GenerationRequest] = []

    def new_generation(request: GenerationRequest) -> Generation:
        started.append(request)
        raise _Started

    observed = GrammarCompiler(_tokenizer(), VOCAB, [EOS], "tiny", observer=metrics)
    backend = GenerationBackend(
        lambda text, **_: {"input_ids": [1] * len(text)},
        PromptLimits(max_new_tokens=16, max_session_tokens=64),
        new_generation,
        constraints=observed,
    )
    return backend, started


class _Started(Exception):
    """The request got past every check and a generation was asked for."""


def _ask(front: GenerationFrontend, constraint: Constraint, max_new_tokens: int) -> None:
    request = EdgeRequest(prompt="hi", max_new_tokens=max_new_tokens, constraint=constraint)

    async def run() -> None:
        async for _ in front.generate(request, CallInfo("req", "grpc", Tenant("acme"))):
            pass

    asyncio.run(run())


def test_a_limit_below_the_shortest_output_is_refused_before_the_request_runs() -> None:
    metrics = CoordinatorMetrics()
    backend, started = _backend(metrics)
    front = GenerationFrontend("tiny", AdmissionController(), metrics, backend)
    long_choice = Constraint(ConstraintKind.CHOICE, choices=("abcabcab",))  # "abc" "abc" "ab": three tokens
    with pytest.raises(InvalidArgument) as refused:
        _ask(front, long_choice, 2)
    assert str(refused.value) == (
        "max_new_tokens is 2, but any output that completes this choice takes at least 3 tokens; raise "
        "max_new_tokens (max_tokens in the OpenAI API)"
    )
    assert not started
    value = metrics.registry.get_sample_value
    assert value("specserve_grammar_compile_failures_total", {"kind": "choice", "reason": "too_few_tokens"}) == 1
    with pytest.raises(_Started):  # three is enough
        _ask(front, long_choice, 3)
    assert started[0].max_new_tokens == 3 and started[0].constraint is not None
