"""bench.numerics end to end on a tiny random Llama, in bf16 with the fp32 check (seconds, no real model).

Checks that the harness's numbers are consistent with each other and that
fp32 speculative output equals fp32 plain decoding; never how often bf16
diverges (that is what the harness measures).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from bench import numerics
from bench.numerics import Drafts, VariantResult
from bench.target import Case, Target
from draft_service.draft_head import DraftHead, DraftHeadConfig
from draft_service.drafter import ALL_SOURCES
from specserve.model_loading import ModelSource
from tests.conftest import CharTokenizer, tiny_llama

VOCAB = 64
EOS = 0
PROMPTS = 3
MAX_NEW_TOKENS = 12


def random_head(model: Any) -> DraftHead:
    """An untrained head over the target's embedding and LM head: it drafts poorly, which is all D needs here."""
    torch.manual_seed(1)
    config = DraftHeadConfig.for_target(model.config, draft_vocab_size=32, intermediate_size=64)
    embedding = model.get_input_embeddings().weight.detach().float()
    lm_head = model.get_output_embeddings().weight.detach().float()
    return DraftHead(config, embedding, lm_head, torch.arange(32)).eval()


def load(dtype: str) -> tuple[Target, Drafts]:
    model = tiny_llama(vocab_size=VOCAB, seed=5).to(getattr(torch, dtype))
    target = Target("tiny", ModelSource(Path("tiny")), CharTokenizer(), "tiny", frozenset({EOS}), model)
    return target, Drafts(ALL_SOURCES, random_head(model))


def cases() -> list[Case]:
    generator = torch.Generator().manual_seed(0)
    # Repeated phrases give the n-gram sources something to draft from.
    prompts = [(torch.randint(1, VOCAB, (5,), generator=generator).tolist() * 3) for _ in range(PROMPTS)]
    return [Case(i, "synthetic", i, "", ids) for i, ids in enumerate(prompts)]


@pytest.fixture(scope="module")
def results() -> list[VariantResult]:
    return numerics.measure(load, cases(), MAX_NEW_TOKENS, "bfloat16", with_fp32=True)


def test_every_variant_ran_every_prompt(results: list[VariantResult]) -> None:
    assert [r.name for r in results] == ["A", "B", "C", "D", "A-fp32", "E"]
    assert [r.dtype for r in results] == ["bfloat16"] * 4 + ["float32"] * 2
    for r in results:
        assert r.prompts == PROMPTS == len(r.outputs)
        assert r.identical + r.diverging == PROMPTS == r.identical + len(r.divergences)
        assert all(len(out) <= MAX_NEW_TOKENS for out in r.outputs)
        assert r.tokens == sum(len(out) - (out[-1:] == [EOS]) for out in r.outputs)
        assert r.reference == {"A": "", "A-fp32": "", "E": "A-fp32"}.get(r.name, "A")


def test_batched_plain_decoding_shares_forwards(results: list[VariantResult]) -> None:
    a, b, c = results[:3]
    assert a.forwards is not None and b.forwards is not None and c.forwards is not None
    assert a.forwards == a.tokens + sum(o[-1:] == [EOS] for o in a.outputs) + PROMPTS  # one per token, one prefill
    assert b.forwards <= MAX_NEW_TOKENS + 1 < a.forwards  # one forward per step for all prompts


def test_divergences_are_first_differences_with_a_gap(results: list[VariantResult]) -> None:
    reference = results[0].outputs
    for r in results[1:4]:
        for d in r.divergences:
            ours, theirs = reference[d.prompt], r.outputs[d.prompt]
            assert ours[: d.position] == theirs[: d.position]
            assert d.reference_token == (ours[d.position] if d.position < len(ours) else None)
            assert d.variant_token == (theirs[d.position] if d.position < len(theirs) else None)
            assert d.top2_gap >= 0 and d.category == "synthetic"


def test_fp32_speculative_output_is_identical_to_plain_decoding(results: list[VariantResult]) -> None:
    a32, e = results[4:]
    assert e.identical == PROMPTS and not e.divergences
    assert e.outputs == a32.outputs


def test_report_and_verdict(results: list[VariantResult], tmp_path: Path) -> None:
    meta = {
        "started_at": "now",
        "duration_s": 1.0,
        "machine": numerics.machine.describe(),
        "settings": {"model": "tiny", "dtype": "bfloat16", "prompts": PROMPTS, "max_new_tokens": MAX_NEW_TOKENS},
    }
    meta["settings"]["sources"] = list(ALL_SOURCES)
    paths = numerics.write_outputs(tmp_path, "bfloat16", meta, results)
    assert [p.name for p in paths] == ["numerics_bfloat16.json", "numerics_bfloat16.md"]
    document = json.loads(paths[0].read_text())
    verdict = document["verdict"]
    d = results[3]
    assert verdict["d_diverging"] == d.diverging
    assert verdict["noise_floor"] == max(results[1].diverging, results[2].diverging)
    assert verdict["fp32_identical"] == PROMPTS
    report = paths[1].read_text()
    assert f"speculative divergences D = {d.diverging} vs noise floor max(B, C) = {verdict['noise_floor']}" in report
    assert "largest top-2 gap at a divergence:" in report


def test_fp32_run_reports_d_as_e() -> None:
    results = numerics.measure(load, cases()[:1], 6, "float32", with_fp32=True)
    assert [r.name for r in results] == ["A", "B", "C", "D", "E"]
    assert results[3].diverging == results[4].diverging == 0  # fp32: speculative equals plain decoding


def test_an_int8_run_measures_a_d_on_int8_weights_and_checks_e_on_fp32_ones() -> None:
    """int8 weights round like bf16, so D is judged against the floor and E still checks fp32 identity."""
    results = numerics.measure(load, cases()[:1], 6, "float32", with_fp32=True, weights="int8")
    assert [r.name for r in results] == ["A", "B", "C", "D", "A-fp32", "E"]  # E on a model loaded in fp32 again
    assert results[-1].diverging == 0  # E: fp32 weights, speculative equals plain decoding
    assert "int8" in numerics.engine_for(load("float32")[0], "int8").step_form


def test_compare_finds_the_first_divergence_and_scores_the_reference_prefix() -> None:
    target, _ = load("float32")
    verifier = numerics.engine_for(target)
    try:
        case = cases()[0]
        reference = numerics.decode_alone(verifier, case, MAX_NEW_TOKENS, target.eos_ids, two_rows=False)
        assert len(reference.tokens) > 3, "the tiny target ended too early for this test"
        changed = list(reference.tokens)
        changed[3] = (changed[3] + 1) % VOCAB or 1
        [divergence] = numerics.compare(verifier, target, [case], [reference], [numerics.Output(changed, False)])
        nothing = numerics.compare(verifier, target, [case], [reference], [reference])
    finally:
        verifier.close()
    assert nothing == []
    assert (divergence.position, divergence.reference_token, divergence.variant_token) == (
        3,
        reference.tokens[3],
        changed[3],
    )
    assert divergence.top2_gap > 0 and divergence.reference_is_top1  # fp32: a fresh prefill agrees with decoding
