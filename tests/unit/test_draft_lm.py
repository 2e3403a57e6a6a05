"""The draft-LM source: a small model of the target's family drafting chains and trees (``draft_lm``).

Tiny random models of the llama, qwen2 and qwen3 shapes, saved by the test as Hugging Face directories with a
tokenizer of their own. Drafting for itself, a model's drafts are all accepted; drafting for another model with
the same tokenizer, the output is plain decoding (fp32, greedy and seeded sampling).
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from bench.inproc import InProcessDrafter, InProcessVerifier
from coordinator.rounds import Generation, GenerationRequest, GenerationStats, RoundPolicy
from draft_service.config import DrafterConfig
from draft_service.draft_lm import DraftLM, DraftLMError, load_draft_lm
from draft_service.draft_lm_source import DIGEST_TOKENS, SYNC_FEED_TOKENS, DraftLMProposer
from draft_service.drafter import Drafter
from draft_service.head_proposer import TreeShape
from draft_service.main import load_draft_model, parse_config, serve
from draft_service.ngram_pool import InMemoryNgramPool
from draft_service.source_gate import SourceGate
from draft_service.tree_builder import VerifyCost
from specserve.model_loading import load_tokenizer, resolve_model, vocab_fingerprint
from specserve.results import DraftFeedback
from specserve.sampling import SamplingParams
from target_service.cost_curve import CostCurve
from target_service.verifier import Verifier
from tests.conftest import CharTokenizer, plain_decode, run_generation

VOCAB = 48
FREE = VerifyCost({0: 1.0, 64: 1.0})  # every node pays: the builder keeps whatever the source proposes
# A verifier step that costs the same at any size, and far more than drafting: the verifier's budget is the
# round policy's whatever the drafting takes here (the budget and its throughput guard read wall-clock time).
FLAT = CostCurve((1, 64), (100.0, 100.0))
SAMPLED = SamplingParams(temperature=0.8, top_k=12, seed=5)
PROMPT = [2, 7, 1, 8, 2, 8]


def tiny(family: str, seed: int, layers: int = 2, context: int = 1024) -> Any:
    """A random model of ``family`` (a few ms a forward), in eval mode."""
    torch.manual_seed(seed)
    common: dict[str, Any] = {
        "vocab_size": VOCAB,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": layers,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": context,
        "tie_word_embeddings": False,
    }
    if family == "llama":
        model: Any = LlamaForCausalLM(LlamaConfig(**common))
    elif family == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(**common))  # biases on Q, K and V
        with torch.no_grad():  # random ones, so that the step is held to them
            for layer in model.model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    proj.bias.normal_(0, 0.5)
    else:
        model = Qwen3ForCausalLM(Qwen3Config(**common, head_dim=16))  # per-head Q and K norms
    return model.eval()


def save(model: Any, path: Path, words: str = "t") -> Path:
    """``model`` as a Hugging Face directory with a word-level tokenizer of VOCAB words ``{words}{i}``."""
    vocab = {f"{words}{i}": i for i in range(VOCAB)}
    backend = Tokenizer(models.WordLevel(vocab, unk_token=f"{words}0"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token=f"{words}1")
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def fingerprint_of(path: Path) -> str:
    return vocab_fingerprint(load_tokenizer(resolve_model(str(path))))


def generate(
    target: Any,
    draft: DraftLM,
    request: GenerationRequest,
    sources: tuple[str, ...] = ("draft_lm",),
    predraft_outcomes: int = 0,
    max_draft_tokens: int = 8,
) -> tuple[list[int], GenerationStats]:
    pool = InMemoryNgramPool()
    drafter = Drafter(lambda *_: pool, sources=sources, cost=FREE, draft_lm=draft, predraft_outcomes=predraft_outcomes)
    verifier = Verifier(target, "fp", cost_curve=FLAT, throughput_guard=False, lookahead="off")
    generation = Generation(
        request,
        InProcessVerifier(verifier),
        InProcessDrafter(drafter, predraft=predraft_outcomes > 0),
        CharTokenizer(),
        frozenset({-1}),
        "fp",
        RoundPolicy(max_draft_tokens=max_draft_tokens),
    )
    tokens, _, stats = run_generation(generation)
    verifier.close()
    return tokens, stats


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
@torch.inference_mode()
def test_the_step_computes_the_models_own_logits(family: str) -> None:
    """A prefill, then a row on its cache, then a tree level with its mask: transformers' logits each time."""
    model = tiny(family, seed=1)
    draft = DraftLM(model)
    tokens = [3, 9, 4, 11, 5, 30, 2]
    cache = draft.new_cache()
    logits = draft.step(torch.tensor(tokens[:5]), torch.arange(5), cache)
    want = model(input_ids=torch.tensor([tokens])).logits[0].float()
    torch.testing.assert_close(logits, want[:5], rtol=1e-4, atol=1e-4)
    one = draft.step(torch.tensor(tokens[5:6]), torch.tensor([5]), cache)
    torch.testing.assert_close(one, want[5:6], rtol=1e-4, atol=1e-4)
    # Two siblings at position 6 over the 6 cached positions, each seeing itself only among the new rows.
    allowed = torch.ones(2, 8, dtype=torch.bool)
    allowed[:, 6:] = torch.eye(2, dtype=torch.bool)
    level = draft.step(torch.tensor([2, 17]), torch.tensor([6, 6]), cache, allowed)
    sibling = model(input_ids=torch.tensor([[*tokens[:6], 17]])).logits[0, -1].float()
    torch.testing.assert_close(level, torch.stack([want[6], sibling]), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
@pytest.mark.parametrize("sampling", [SamplingParams(), SAMPLED], ids=["greedy", "sampled"])
def test_a_model_drafting_for_itself_has_its_drafts_accepted(family: str, sampling: SamplingParams) -> None:
    """Chains (a budget of 4, the tree's depth): the model's own top choice, or under sampling its Gumbel-max
    sample with the target's keyed noise, is the target's token at every position. The source gate runs it in
    its first rounds at least (``SourceGate.WARM_ROUNDS``); later rounds follow its timing."""
    target = tiny(family, seed=2)
    tokens, stats = generate(target, DraftLM(target), GenerationRequest(PROMPT, 40, sampling), max_draft_tokens=4)
    assert tokens == plain_decode(target, PROMPT, 40, sampling)
    assert not stats.drafter_error
    assert stats.num_draft_tokens >= 4 * SourceGate.WARM_ROUNDS  # its warm-up rounds drafted whole chains
    assert stats.num_accepted_tokens >= 0.9 * stats.num_draft_tokens, stats


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
@pytest.mark.parametrize("sampling", [SamplingParams(), SAMPLED], ids=["greedy", "sampled"])
def test_another_model_with_the_same_tokenizer_keeps_plain_decoding(family: str, sampling: SamplingParams) -> None:
    """Trees (a budget of 8) from a smaller model of the family, drafting for a different target."""
    target, draft = tiny(family, seed=3), tiny(family, seed=4, layers=1)
    tokens, stats = generate(target, DraftLM(draft), GenerationRequest(PROMPT, 40, sampling))
    assert tokens == plain_decode(target, PROMPT, 40, sampling)
    assert not stats.drafter_error
    assert stats.num_draft_tokens > 0


@pytest.mark.parametrize("sources", [("draft_lm",), ("suffix", "token_recycling", "draft_lm")])
def test_predrafted_outcomes_and_other_sources_keep_plain_decoding(sources: tuple[str, ...]) -> None:
    """Pre-drafting feeds hypothetical outcomes into the cache; the reports roll it back to what was committed."""
    target = tiny("llama", seed=5)
    draft = DraftLM(tiny("llama", seed=5))  # the same weights: the likeliest outcome is the one that happens
    tokens, stats = generate(target, draft, GenerationRequest(PROMPT, 48), sources, predraft_outcomes=3)
    assert tokens == plain_decode(target, PROMPT, 48, SamplingParams())
    assert not stats.drafter_error
    assert stats.num_predraft_hits > 0


def test_the_cache_rolls_back_to_the_committed_tokens_after_a_partial_acceptance() -> None:
    """A pre-drafted outcome (two accepted, a bonus guess) fed into the cache; the round accepted only the first
    draft and the verifier's bonus differs: the cache keeps the prompt and that token, and the next tree is
    the one a fresh source drafts for the committed tokens."""
    model = DraftLM(tiny("llama", seed=6))
    shape = TreeShape(depth=4, branching=2, beam=2, max_nodes=8)
    source = DraftLMProposer(model, PROMPT, shape)
    chain = source.propose(PROMPT, 4)
    assert chain.is_chain() and len(chain) == 4
    assert source.num_cached == len(PROMPT)  # the tree's entries went
    first, second = chain.token_ids[:2]
    guess = (second + 1) % VOCAB
    source.propose([*PROMPT, first, second, guess], 4)  # pre-drafting an outcome
    assert source.num_cached == len(PROMPT) + 3
    bonus = (second + 2) % VOCAB  # the verifier's own token after ``first``, not ``second``
    source.observe(DraftFeedback((first, bonus), accepted_node_indices=(0,)))
    assert source.num_cached == len(PROMPT) + 1
    committed = [*PROMPT, first, bonus]
    tree = source.propose(committed, 8)
    assert source.num_cached == len(committed)
    fresh = DraftLMProposer(model, committed, shape).propose(committed, 8)
    assert len(tree) > 4 and tree.token_ids == fresh.token_ids and tree.parents == fresh.parents
    np.testing.assert_allclose(tree.node_probs, fresh.node_probs, rtol=1e-4)


def test_a_confirmed_outcome_stays_in_the_cache() -> None:
    model = DraftLM(tiny("llama", seed=6))
    source = DraftLMProposer(model, PROMPT)
    first, second = source.propose(PROMPT, 2).token_ids
    source.propose([*PROMPT, first, second], 2)
    source.observe(DraftFeedback((first, second), accepted_node_indices=(0,)))
    assert source.num_cached == len(PROMPT) + 2


def test_a_long_prompt_is_digested_in_steps_and_drafts_as_if_fed_at_once() -> None:
    """Then its chain is the model's greedy continuation of the whole prompt."""
    weights = tiny("llama", seed=7)
    model = DraftLM(weights)
    prompt = [int(t) for t in torch.randint(0, VOCAB, (SYNC_FEED_TOKENS + DIGEST_TOKENS + 40,))]
    source = DraftLMProposer(model, prompt)
    assert len(source.propose(prompt, 4)) == 0  # the backlog is for ``digest``: no request waits for it
    steps = 0
    while source.digest(prompt):
        steps += 1
    assert steps == 2 and not source.digest(prompt)
    chain = source.propose(prompt, 4)
    assert list(chain.token_ids) == plain_decode(weights, prompt, 4, SamplingParams())


def test_a_forgotten_session_drafts_no_more_and_holds_nothing() -> None:
    source = DraftLMProposer(DraftLM(tiny("llama", seed=6)), PROMPT)
    assert len(source.propose(PROMPT, 4)) == 4 and source.nbytes > 0
    before = source.nbytes
    source.forget()
    assert source.nbytes < before // 10 and len(source.propose(PROMPT, 4)) == 0


def test_the_draft_lm_source_is_gated_and_wants_no_features() -> None:
    pool = InMemoryNgramPool()
    drafter = Drafter(lambda *_: pool, sources=("suffix", "draft_lm"), draft_lm=DraftLM(tiny("llama", seed=6)))
    assert not drafter.wants_features
    session = drafter.open_session("s", PROMPT, "")
    assert session._gated == frozenset({"draft_lm"})
    assert not session.propose(DraftFeedback(()), 4).wants_features


def test_the_draft_lm_source_needs_a_model_and_its_vocabulary() -> None:
    pool = InMemoryNgramPool()
    with pytest.raises(ValueError, match="needs a draft model"):
        Drafter(lambda *_: pool, sources=("draft_lm",))
    drafter = Drafter(lambda *_: pool, sources=("draft_lm",), draft_lm=DraftLM(tiny("llama", seed=6), "tiny", "fp"))
    assert drafter.vocab_fingerprint == "fp"
    with pytest.raises(ValueError, match="draft model tiny has the vocabulary fp"):
        drafter.open_session("s", PROMPT, "other")


def test_a_draft_model_is_loaded_from_a_directory(tmp_path: Path) -> None:
    path = save(tiny("qwen2", seed=8), tmp_path / "draft")
    model = load_draft_lm(str(path), fingerprint_of(path), "the target")
    assert model.fingerprint == fingerprint_of(path) and model.num_layers == 2


def test_a_draft_model_with_another_tokenizer_is_refused_at_start_up(tmp_path: Path) -> None:
    """The check ``draft_service.main`` runs before serving: its message names both models and what to do."""
    target = save(tiny("llama", seed=9), tmp_path / "target", words="w")
    draft = save(tiny("llama", seed=8), tmp_path / "draft", words="t")
    config = DrafterConfig(target_model=str(target), draft_model=str(draft), sources=("draft_lm",))
    with pytest.raises(DraftLMError) as refused:
        load_draft_model(config)
    message = str(refused.value)
    assert str(draft) in message and str(target) in message and "another tokenizer" in message
    assert "--draft-model" in message
    same = DrafterConfig(target_model=str(draft), draft_model=str(draft), sources=("draft_lm",))
    assert load_draft_model(same).fingerprint == fingerprint_of(draft)


def test_the_drafter_stops_at_start_up_on_a_mismatched_pair(tmp_path: Path) -> None:
    target = save(tiny("llama", seed=9), tmp_path / "target", words="w")
    draft = save(tiny("llama", seed=8), tmp_path / "draft", words="t")
    config = DrafterConfig(target_model=str(target), draft_model=str(draft), sources=("suffix", "draft_lm"))
    with pytest.raises(SystemExit, match=r"cannot use the draft_lm source: the draft model .* another tokenizer"):
        asyncio.run(serve(config))


def test_a_wrong_path_or_a_corrupt_checkpoint_is_refused_with_the_reason(tmp_path: Path) -> None:
    with pytest.raises(DraftLMError, match="no model at"):
        load_draft_lm(str(tmp_path / "missing"), "", "the target")
    path = save(tiny("llama", seed=8), tmp_path / "draft")
    for weights in path.glob("*.safetensors"):
        weights.write_bytes(b"not a checkpoint")
    with pytest.raises(DraftLMError, match="weights do not load"):
        load_draft_lm(str(path), "", "the target")


def test_draft_model_adds_the_draft_lm_source_and_the_source_needs_it(tmp_path: Path) -> None:
    config, _ = parse_config(["--draft-model", str(tmp_path), "--sources", "suffix"])
    assert config.draft_model == str(tmp_path) and config.sources == ("suffix", "draft_lm")
    config, _ = parse_config(["--draft-model", str(tmp_path), "--sources", "draft_lm,suffix"])
    assert config.sources == ("draft_lm", "suffix")
    with pytest.raises(SystemExit):
        parse_config(["--sources", "suffix,draft_lm"])
