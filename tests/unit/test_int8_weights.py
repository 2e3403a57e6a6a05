"""``--weights int8``: the layers' products on int8 copies of the weights, against plain int8 decoding.

int8 weights are other weights, so the reference is plain greedy decoding through the same int8 engine (a
tree of size zero each round), not transformers. The products are row-invariant, so on this tiny model a tree
scores a token as a plain step does. On the real model the bf16-rounded inputs of the products turn CPU
attention's last-bit differences into bf16-sized ones, and ``bench.numerics --weights int8`` measured
speculative output leaving plain int8 decoding on 19 of 20 prompts against a noise floor of 6: int8 is an
opt-in speed mode, not lossless by design.md's rule (docs/numerics.md, ``--weights``).
"""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F

from bench.step_invariance import RowProbe
from specserve.packed_linear import ONEDNN_ROWS, PackedLinear, available_packing, quantize_int8
from specserve.sampling import SamplingParams
from specserve.token_tree import TokenTree
from target_service.main import parse_config
from target_service.model_runner import ModelRunner
from target_service.verifier import Verifier
from tests.conftest import tiny_llama

CPU = torch.device("cpu")
pytestmark = pytest.mark.skipif(
    available_packing(torch.float32, CPU) == "none", reason="no packed GEMM in this torch build"
)
VOCAB = 32
MODEL = tiny_llama(vocab_size=VOCAB, context=256, seed=3)


def test_quantized_weights_round_trip_within_half_a_step() -> None:
    weight = torch.randn(40, 64, generator=torch.Generator().manual_seed(0))
    quantized, scales = quantize_int8(weight)
    assert quantized.dtype == torch.int8 and scales.dtype == torch.bfloat16
    restored = quantized.float() * scales.float()[:, None]
    assert torch.all((restored - weight).abs() <= scales.float()[:, None] * 0.5 + 1e-7)


@pytest.mark.parametrize("rows", [1, 3, 8, 33])
def test_int8_product_is_the_linear_product_to_int8_and_bf16_precision(rows: int) -> None:
    generator = torch.Generator().manual_seed(rows)
    weight, bias = torch.randn(48, 64, generator=generator), torch.randn(48, generator=generator)
    x = torch.randn(rows, 64, generator=generator)
    packed = PackedLinear(weight, bias, "int8", ONEDNN_ROWS)
    assert packed.weight.dtype == torch.int8  # the float weights are not kept
    expected = F.linear(x, weight, bias)
    got = packed(x)
    assert got.dtype == torch.float32 and got.shape == expected.shape
    # int8 steps and bf16-rounded inputs: about 1% of the output's scale
    torch.testing.assert_close(got, expected, atol=0.05 * float(expected.abs().max()), rtol=0)


def test_int8_step_rows_get_the_same_bits_at_every_row_count() -> None:
    runner = ModelRunner(tiny_llama(vocab_size=64, seed=5, layers=2), "auto", weights="int8")
    assert runner.packing == "int8" and "int8" in runner.describe()
    probe = RowProbe(runner, vocab=64)
    alone = probe.step(1, 0)
    for total in range(2, max(ONEDNN_ROWS) + 1):
        shared = probe.step(1, total - 1)
        assert torch.equal(shared, alone), f"1 row alone and in a {total}-row step differ"


def test_int8_weights_change_the_logits_a_little() -> None:
    """int8 weights are really used (the logits move), and they stay close to the float model's."""
    probe_int8 = RowProbe(ModelRunner(MODEL, "auto", weights="int8"), vocab=VOCAB)
    probe_float = RowProbe(ModelRunner(MODEL, "auto"), vocab=VOCAB)
    int8, float32 = probe_int8.step(3, 0), probe_float.step(3, 0)
    assert not torch.equal(int8, float32)
    torch.testing.assert_close(int8, float32, atol=0.1 * float(float32.abs().max()), rtol=0)


def plain_engine_greedy(verifier: Verifier, prompt: list[int], count: int) -> list[int]:
    verifier.prefill("plain", prompt, SamplingParams())
    tokens: list[int] = []
    for _ in range(count):
        tokens += verifier.verify("plain", len(prompt) + len(tokens), TokenTree()).committed
    verifier.release("plain")
    return tokens


def test_greedy_trees_on_int8_weights_commit_what_plain_int8_decoding_does() -> None:
    verifier = Verifier(MODEL, "fp", weights="int8", throughput_guard=False)
    rng = random.Random(7)
    for case in range(6):
        prompt = [rng.randrange(VOCAB) for _ in range(rng.randrange(1, 12))]
        reference = plain_engine_greedy(verifier, prompt, 40)
        verifier.prefill("s", prompt, SamplingParams())
        committed: list[int] = []
        while len(committed) < 30:
            truth = reference[len(committed) : len(committed) + rng.randrange(0, 5)]
            # the true continuation as one branch, random siblings and children around it
            tokens, parents = list(truth), list(range(-1, len(truth) - 1))
            for _ in range(rng.randrange(0, 10)):
                tokens.append(rng.randrange(VOCAB))
                parents.append(rng.randrange(-1, len(tokens) - 1))
            result = verifier.verify("s", len(prompt) + len(committed), TokenTree(tuple(tokens), tuple(parents)))
            assert len(result.accepted_tokens) >= len(truth)
            committed += result.committed
            assert committed == reference[: len(committed)], f"case {case}"
        verifier.release("s")
    verifier.close()


def test_int8_weights_need_the_cpu_packed_path() -> None:
    with pytest.raises(ValueError, match="compile auto on a CPU"):
        ModelRunner(MODEL, "off", weights="int8")
    with pytest.raises(ValueError, match="weights"):
        ModelRunner(MODEL, "auto", weights="int4")
    with pytest.raises(SystemExit):
        parse_config(["--weights", "int8", "--compile", "off"])
    config, _ = parse_config(["--weights", "int8"])
    assert config.weights == "int8"
