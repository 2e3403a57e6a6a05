"""Published EAGLE-3 heads: the checkpoint layout, the verifier's layer features, lossless drafting from them."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Sequence
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM

from bench.inproc import InProcessDrafter, InProcessVerifier
from coordinator.grpc_clients import GrpcDrafter, GrpcVerifier
from coordinator.rounds import Generation, GenerationRequest, GenerationStats, RoundPolicy
from draft_service.config import DrafterConfig
from draft_service.draft_head import DraftHead, DraftHeadConfig, DraftHeadError
from draft_service.drafter import Drafter
from draft_service.eagle3_export import export_eagle3
from draft_service.eagle3_export import main as export_main
from draft_service.eagle3_head import Eagle3Head, eagle3_in_serving_dtype, is_eagle3_dir, load_eagle3_head
from draft_service.head_layer import HeadCache
from draft_service.head_proposer import HeadProposer
from draft_service.main import build_drafter, load_head
from draft_service.ngram_pool import InMemoryNgramPool
from draft_service.tree_builder import VerifyCost
from specserve.drain import Drain
from specserve.errors import InvalidArgument
from specserve.model_loading import vocab_fingerprint
from specserve.results import DraftFeedback
from specserve.sampling import SamplingParams
from specserve.token_tree import TokenTree
from specserve.v1 import verifier_pb2_grpc
from specserve.verify_call import SessionPrefill, VerifyCall
from target_service.metrics import VerifierMetrics
from target_service.model_runner import ModelRunner, StepOutput
from target_service.ragged_attention import Segment, StepPlan
from target_service.server import VerifierServicer
from target_service.verifier import Verifier
from tests.conftest import CharTokenizer, plain_decode, run_generation, tiny_llama
from tests.unit.test_drain import drafter_server

VOCAB = 48
HIDDEN = 64
FREE = VerifyCost({0: 1.0, 64: 1.0})  # every node pays: the builder keeps whatever the head proposes


def tiny_target(family: str, layers: int, seed: int) -> Any:
    """A randomly initialised target: the tiny Llama, or a Qwen2 (biases on Q, K and V, random here) or Qwen3
    (per-head Q and K norms) of the same shape."""
    if family == "llama":
        return TARGET
    torch.manual_seed(seed)
    common: dict[str, Any] = {
        "vocab_size": VOCAB,
        "hidden_size": HIDDEN,
        "intermediate_size": 2 * HIDDEN,
        "num_hidden_layers": layers,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 256,
        "tie_word_embeddings": False,
    }
    if family == "qwen3":
        return Qwen3ForCausalLM(Qwen3Config(**common, head_dim=16)).eval()
    model = Qwen2ForCausalLM(Qwen2Config(**common)).eval()
    with torch.no_grad():
        for layer in model.model.layers:
            for projection in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                projection.bias.normal_(0, 0.5)
    return model


def eagle3_weights(
    draft_ids: Sequence[int], *, hidden: int = HIDDEN, target_hidden: int = HIDDEN, seed: int = 0, embed: bool = False
) -> dict[str, torch.Tensor]:
    """Random weights in the published layout (names as SafeAILab's EAGLE-3 checkpoints spell them)."""
    generator = torch.Generator().manual_seed(seed)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator) * shape[-1] ** -0.5

    heads, kv_heads, head_dim, inter = 4, 2, hidden // 4, 3 * hidden
    draft = torch.tensor(draft_ids)
    t2d = torch.zeros(VOCAB, dtype=torch.bool)
    t2d[draft] = True
    weights = {
        "fc.weight": rand(hidden, 3 * target_hidden),
        "midlayer.input_layernorm.weight": 1 + 0.1 * rand(hidden, 1)[:, 0],
        "midlayer.hidden_norm.weight": 1 + 0.1 * rand(hidden, 1)[:, 0],
        "midlayer.self_attn.q_proj.weight": rand(heads * head_dim, 2 * hidden),
        "midlayer.self_attn.k_proj.weight": rand(kv_heads * head_dim, 2 * hidden),
        "midlayer.self_attn.v_proj.weight": rand(kv_heads * head_dim, 2 * hidden),
        "midlayer.self_attn.o_proj.weight": rand(hidden, heads * head_dim),
        "midlayer.post_attention_layernorm.weight": 1 + 0.1 * rand(hidden, 1)[:, 0],
        "midlayer.mlp.gate_proj.weight": rand(inter, hidden),
        "midlayer.mlp.up_proj.weight": rand(inter, hidden),
        "midlayer.mlp.down_proj.weight": rand(hidden, inter),
        "norm.weight": 1 + 0.1 * rand(hidden, 1)[:, 0],
        "lm_head.weight": rand(len(draft_ids), hidden) * 4,
        "d2t": draft - torch.arange(len(draft_ids)),
        "t2d": t2d,
    }
    if embed:
        weights["embed_tokens.weight"] = rand(VOCAB, hidden)
    return weights


def eagle3_config(draft_vocab: int, *, hidden: int = HIDDEN, target_hidden: int = HIDDEN, **extra: object) -> dict:
    return {
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        "hidden_size": hidden,
        "target_hidden_size": target_hidden,
        "intermediate_size": 3 * hidden,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "num_hidden_layers": 1,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "max_position_embeddings": 256,
        "hidden_act": "silu",
        "vocab_size": VOCAB,
        "draft_vocab_size": draft_vocab,
        "tie_word_embeddings": False,
        **extra,
    }


def write_checkpoint(
    path: Path, config: dict, weights: dict[str, torch.Tensor], fmt: str = "safetensors", prefix: str = ""
) -> Path:
    """An EAGLE-3 checkpoint directory as the published ones are: config.json and one weight file."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))
    named = {prefix + name: tensor.contiguous() for name, tensor in weights.items()}
    if fmt == "safetensors":
        save_file(named, str(path / "model.safetensors"))
    else:
        torch.save(named, path / "pytorch_model.bin")
    return path


DRAFT_IDS = [*range(0, VOCAB, 2), VOCAB - 1]  # a reduced draft vocabulary: d2t offsets are not all zero


def reference_logits(
    weights: dict[str, torch.Tensor], embedding: torch.Tensor, features: torch.Tensor, tokens: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The published EAGLE-3 math over a whole sequence at once, written out plainly (no cache, causal mask):
    (pre-norm outputs [n, hidden], draft logits [n, draft_vocab])."""
    w = {name: t.double() for name, t in weights.items() if t.is_floating_point()}
    eps, heads, kv_heads = 1e-5, 4, 2

    def norm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)

    g = features.double() @ w["fc.weight"].T
    e = norm(embedding.double()[tokens], w["midlayer.input_layernorm.weight"])
    hidden_in = torch.cat([e, norm(g, w["midlayer.hidden_norm.weight"])], dim=-1)
    n, head_dim = g.shape[0], w["midlayer.self_attn.o_proj.weight"].shape[1] // heads
    q = (hidden_in @ w["midlayer.self_attn.q_proj.weight"].T).view(n, heads, head_dim)
    k = (hidden_in @ w["midlayer.self_attn.k_proj.weight"].T).view(n, kv_heads, head_dim)
    v = (hidden_in @ w["midlayer.self_attn.v_proj.weight"].T).view(n, kv_heads, head_dim)
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    angles = torch.arange(n, dtype=torch.float64)[:, None] * inv_freq[None]
    cos, sin = torch.cat([angles, angles], -1).cos()[:, None], torch.cat([angles, angles], -1).sin()[:, None]

    def rotate(x: torch.Tensor) -> torch.Tensor:
        half = x.shape[-1] // 2
        return x * cos + torch.cat([-x[..., half:], x[..., :half]], -1) * sin

    q, k = rotate(q), rotate(k).repeat_interleave(heads // kv_heads, 1)
    v = v.repeat_interleave(heads // kv_heads, 1)
    scores = torch.einsum("qhd,khd->hqk", q, k) / head_dim**0.5
    scores = scores.masked_fill(~torch.ones(n, n, dtype=torch.bool).tril(), float("-inf"))
    attended = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(n, -1)
    x = g + attended @ w["midlayer.self_attn.o_proj.weight"].T
    normed = norm(x, w["midlayer.post_attention_layernorm.weight"])
    gate, up = normed @ w["midlayer.mlp.gate_proj.weight"].T, normed @ w["midlayer.mlp.up_proj.weight"].T
    x = x + (F.silu(gate) * up) @ w["midlayer.mlp.down_proj.weight"].T
    return x, norm(x, w["norm.weight"]) @ w["lm_head.weight"].T


def load(path: Path, target: Any) -> Eagle3Head:
    embedding = target.get_input_embeddings().weight.detach()
    return load_eagle3_head(
        path, target_fingerprint="fp", embedding=embedding, target_layers=target.config.num_hidden_layers
    )


TARGET = tiny_llama(vocab_size=VOCAB, seed=3, layers=6, context=256)


@pytest.mark.parametrize("fmt", ["safetensors", "bin"])
def test_the_loader_reads_the_published_layout_and_computes_eagle3s_math(tmp_path: Path, fmt: str) -> None:
    weights = eagle3_weights(DRAFT_IDS, seed=1)
    path = write_checkpoint(tmp_path / fmt, eagle3_config(len(DRAFT_IDS)), weights, fmt)
    assert is_eagle3_dir(path)
    head = load(path, TARGET)
    assert head.draft_vocab.tolist() == DRAFT_IDS
    assert head.feature_layers == (2, 3, 3)  # vLLM's and SGLang's default for 6 layers: 2, L // 2, L - 3
    generator = torch.Generator().manual_seed(5)
    features = torch.randn(7, 3 * HIDDEN, generator=generator)
    tokens = torch.randint(0, VOCAB, (7,), generator=generator)
    embedding: torch.Tensor = TARGET.get_input_embeddings().weight.detach()  # type: ignore[operator]
    want_out, want_logits = reference_logits(weights, embedding, features, tokens)
    cache = HeadCache()
    out = head.step(features[:4], tokens[:4], torch.arange(4), cache)  # then the rest on the cache
    rest = head.step(features[4:], tokens[4:], torch.arange(4, 7), cache)
    got_logits = torch.cat([out.logits[0], rest.logits[0]])
    torch.testing.assert_close(got_logits.double(), want_logits, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(rest.features[0].double(), want_out[4:], rtol=1e-4, atol=1e-4)
    # Deeper: the head's own pre-norm output stands in for the target's layers (its width tells them apart).
    deeper = head.step(rest.features[0, -1:], tokens[:1], torch.tensor([7]), cache)
    assert deeper.logits.shape == (1, 1, len(DRAFT_IDS))


def test_the_loader_reads_prefixed_names_its_own_embedding_and_the_configs_layer_ids(tmp_path: Path) -> None:
    weights = eagle3_weights(DRAFT_IDS, seed=2, embed=True, hidden=48)
    eagle = {"eagle_aux_hidden_state_layer_ids": [1, 3, 4], "use_aux_hidden_state": True}
    config = eagle3_config(len(DRAFT_IDS), hidden=48, eagle_config=eagle)
    folded = {name.replace("midlayer.", "layers.0."): t for name, t in weights.items()}
    head = load(write_checkpoint(tmp_path / "h", config, folded, prefix="model."), TARGET)
    assert head.feature_layers == (1, 3, 4)
    torch.testing.assert_close(head.embedding, weights["embed_tokens.weight"])


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda c, w: w.update({"fc.weight": torch.zeros(HIDDEN, 3 * HIDDEN + 1)}), "fc.weight is \\(64, 193\\)"),
        (lambda c, w: w.pop("midlayer.mlp.up_proj.weight"), "midlayer.mlp.up_proj.weight missing"),
        (lambda c, w: c.update({"vocab_size": VOCAB + 1}), "vocab_size 49, the target's vocabulary has 48"),
        (lambda c, w: c.update({"target_hidden_size": 96}), "target of hidden size 96, this target's is 64"),
        (lambda c, w: c.update({"eagle_aux_hidden_state_layer_ids": [1, 2, 6]}), "are not three of this target"),
        (lambda c, w: w.update({"d2t": torch.tensor([1] + [0] * (len(DRAFT_IDS) - 1))}), "two draft ids"),
        (lambda c, w: w["t2d"].__setitem__(1, True), "t2d does not mark exactly"),
        (lambda c, w: c.update({"num_hidden_layers": 2}), "2 decoder layers"),
        (lambda c, w: c.pop("hidden_size"), "not an EAGLE-3 head config"),
    ],
)
def test_the_loader_refuses_what_cannot_serve_this_target_naming_the_file(
    tmp_path: Path, change: object, message: str
) -> None:
    config, weights = eagle3_config(len(DRAFT_IDS)), eagle3_weights(DRAFT_IDS)
    change(config, weights)  # type: ignore[operator]
    path = write_checkpoint(tmp_path / "bad", config, weights)
    with pytest.raises(DraftHeadError, match=message) as caught:
        load(path, TARGET)
    assert str(path) in str(caught.value)


def test_missing_or_corrupt_checkpoints_are_refused_with_the_file(tmp_path: Path) -> None:
    with pytest.raises(DraftHeadError, match="no EAGLE-3 head directory"):
        load(tmp_path / "absent", TARGET)
    path = write_checkpoint(tmp_path / "h", eagle3_config(len(DRAFT_IDS)), eagle3_weights(DRAFT_IDS))
    (path / "model.safetensors").write_bytes(b"not a tensor file")
    with pytest.raises(DraftHeadError, match=r"model\.safetensors is not a readable weight file"):
        load(path, TARGET)
    (path / "model.safetensors").unlink()
    with pytest.raises(DraftHeadError, match="holds no weights"):
        load(path, TARGET)
    (path / "config.json").write_text("{")
    with pytest.raises(DraftHeadError, match=r"config\.json is not readable JSON"):
        load(path, TARGET)


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_the_verifier_returns_the_named_layers_inputs_beside_sessions_that_name_none(family: str) -> None:
    """Sessions naming different layers, and one naming none, in one step each for Prefill and for Verify:
    every session gets its own layers' inputs (the reference: transformers' ``hidden_states``), in its order."""
    target = tiny_target(family, layers=6, seed=4)
    verifier = Verifier(target, "fp")
    prompts = {"a": [3, 1, 4, 1, 5, 9, 2], "b": [2, 7, 1, 8], "c": [6, 6, 1, 0, 3]}
    layers = {"a": (4, 0, 2), "b": (), "c": (5,)}  # in the head's order, not sorted; "b": the final state

    def want(session: str, tokens: list[int], start: int, rows: int) -> np.ndarray:
        with torch.inference_mode():
            states = target(input_ids=torch.tensor([tokens]), output_hidden_states=True).hidden_states
        named = layers[session] or (len(states) - 1,)
        return torch.cat([states[k][0, start : start + rows] for k in named], dim=-1).numpy()

    with verifier.paused():  # one step serves all three
        prefills = {
            s: verifier.submit_prefill(s, p, SamplingParams(), True, feature_layers=layers[s])
            for s, p in prompts.items()
        }
    for session, future in prefills.items():
        got, prompt = future.result().features, prompts[session]
        assert got is not None and got.shape == (len(prompt) - 1, HIDDEN * max(1, len(layers[session])))
        expected = want(session, prompt, 0, len(prompt) - 1)
        np.testing.assert_allclose(got.astype(np.float32), expected, rtol=2e-2, atol=2e-2)
    with verifier.paused():  # their Verifies return the same layers at the positions they commit
        verifies = {
            s: verifier.submit_verify(s, len(p), TokenTree.chain([7, 7]), return_features=True)
            for s, p in prompts.items()
        }
    for session, future in verifies.items():
        result, prompt = future.result(), prompts[session]
        assert result.batch_sessions == len(prompts) and result.features is not None
        expected = want(session, prompt + result.committed, len(prompt) - 1, len(result.committed))
        np.testing.assert_allclose(result.features.astype(np.float32), expected, rtol=2e-2, atol=2e-2)
    with pytest.raises(InvalidArgument, match="feature layer 6 is not one of this target's decoder layers"):
        verifier.prefill("d", prompts["a"], SamplingParams(), True, feature_layers=(1, 2, 6))
    verifier.close()


def generate_with(head: Eagle3Head, target: Any, prompt: list[int], n: int) -> tuple[list[int], GenerationStats]:
    pool = InMemoryNgramPool()
    drafter = Drafter(lambda *_: pool, sources=("draft_model",), cost=FREE, draft_head=head)
    assert drafter.feature_layers == head.feature_layers
    generation = Generation(
        GenerationRequest(prompt, n, SamplingParams()),
        InProcessVerifier(Verifier(target, "fp")),  # the round loop names the head's layers in the Prefill
        InProcessDrafter(drafter),
        CharTokenizer(),
        frozenset({-1}),
        "fp",
        RoundPolicy(max_draft_tokens=8),
    )
    tokens, _, stats = run_generation(generation)
    return tokens, stats


@pytest.mark.parametrize(
    ("family", "dtype"), [("llama", "float32"), ("qwen2", "float32"), ("qwen3", "float32"), ("llama", "bfloat16")]
)
def test_greedy_output_through_an_eagle3_heads_trees_is_plain_decoding(tmp_path: Path, family: str, dtype: str) -> None:
    """The target in fp32 (the head's dtype changes its drafts, never the output)."""
    target = tiny_target(family, layers=5, seed=6)
    config = eagle3_config(len(DRAFT_IDS), eagle_aux_hidden_state_layer_ids=[1, 2, 4])
    head = load(write_checkpoint(tmp_path / "h", config, eagle3_weights(DRAFT_IDS, seed=7)), target)
    head, _ = eagle3_in_serving_dtype(head, dtype)
    assert head.draft_lm_head.dtype == getattr(torch, dtype) and head.inv_freq.dtype == torch.float32
    prompt = [2, 7, 1, 8, 2, 8]
    tokens, stats = generate_with(head, target, prompt, 40)
    assert tokens == plain_decode(target, prompt, 40, SamplingParams())
    assert not stats.drafter_error
    assert stats.num_draft_tokens > 0  # the head drafted from the layers' features


def test_the_proposer_feeds_the_targets_layers_then_its_own_outputs(tmp_path: Path) -> None:
    head = load(write_checkpoint(tmp_path / "h", eagle3_config(len(DRAFT_IDS)), eagle3_weights(DRAFT_IDS)), TARGET)
    proposer = HeadProposer(head)
    tokens = [3, 1, 4, 1, 5]
    features = np.random.default_rng(0).standard_normal((4, 3 * HIDDEN)).astype(np.float16)
    proposer.observe(DraftFeedback(features=features, features_start=0))
    tree = proposer.propose(tokens, 8)
    assert 0 < len(tree) <= 8 and set(tree.token_ids) <= set(DRAFT_IDS)


def test_over_grpc_the_drafter_names_its_heads_layers_and_the_verifier_returns_them(tmp_path: Path) -> None:
    """DrafterInfo carries the head's layers to the coordinator's stream; its Prefill carries them to the
    verifier, whose features (Prefill's and Verify's) are those layers concatenated."""
    config = eagle3_config(len(DRAFT_IDS), eagle_aux_hidden_state_layer_ids=[1, 2, 4])
    head = load(write_checkpoint(tmp_path / "h", config, eagle3_weights(DRAFT_IDS)), TARGET)
    drafter = Drafter(lambda *_: InMemoryNgramPool(), sources=("draft_model",), draft_head=head)
    verifier = Verifier(TARGET, "fp")
    verifier_grpc = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    servicer = VerifierServicer(VerifierMetrics(), verifier)
    verifier_pb2_grpc.add_VerifierServiceServicer_to_server(servicer, verifier_grpc)
    port = verifier_grpc.add_insecure_port("127.0.0.1:0")
    verifier_grpc.start()
    prompt = [3, 1, 4, 1, 5]

    async def scenario() -> None:
        server, address = await drafter_server(Drain(), drafter=drafter)
        try:
            async with (
                grpc.aio.insecure_channel(address) as channel,
                grpc.aio.insecure_channel(f"127.0.0.1:{port}") as to_verifier,
                asyncio.timeout(30),
            ):
                stream = await GrpcDrafter(channel, address).open("s", prompt, "fp")
                assert stream.feature_layers == (1, 2, 4)
                await stream.close()
                remote = GrpcVerifier(to_verifier, f"127.0.0.1:{port}", timeout_s=30, stream=False)
                prefill = await remote.prefill(
                    SessionPrefill("s", tuple(prompt), SamplingParams(), True, stream.feature_layers)
                )
                assert prefill.features is not None and prefill.features.shape == (len(prompt) - 1, 3 * HIDDEN)
                call = VerifyCall("s", len(prompt), TokenTree.chain([2]), return_features=True)
                result = await remote.verify(call)
                assert result.features is not None and result.features.shape[1] == 3 * HIDDEN
        finally:
            await server.stop(None)

    try:
        asyncio.run(scenario())
    finally:
        verifier_grpc.stop(None)
        verifier.close()


def test_our_head_exported_to_the_layout_loads_with_the_parts_that_carry_over_exact(tmp_path: Path) -> None:
    """Export -> load as EAGLE-3: the draft vocabulary, draft logits' weight, output projection, MLP and norms
    are ours exactly (fp32); the rest is a linearisation (``eagle3_export``), so drafts differ, output does not."""
    torch.manual_seed(11)
    config = DraftHeadConfig.for_target(TARGET.config, draft_vocab_size=len(DRAFT_IDS), intermediate_size=96)
    embedding = TARGET.get_input_embeddings().weight.detach()
    lm_head = TARGET.get_output_embeddings().weight.detach()
    ours = DraftHead(config, embedding, lm_head, torch.tensor(DRAFT_IDS)).eval()
    out = export_eagle3(ours, tmp_path / "exported", TARGET.config.num_hidden_layers, VOCAB, torch.float32)
    head = load(out, TARGET)
    layer: Any = ours.body.layers[0]
    assert torch.equal(head.draft_vocab, ours.draft_vocab)
    assert torch.equal(head.draft_lm_head, ours.draft_lm_head)
    assert torch.equal(head.o, layer.self_attn.o_proj.weight)
    assert torch.equal(head.gate_up, torch.cat([layer.mlp.gate_proj.weight, layer.mlp.up_proj.weight]))
    assert torch.equal(head.down, layer.mlp.down_proj.weight)
    assert torch.equal(head.mlp_norm, layer.post_attention_layernorm.weight)
    assert torch.equal(head.norm, ours.body.norm.weight)
    assert head.feature_layers == (2, 3, 3)
    assert head.eagle.rms_norm_eps == config.rms_norm_eps and head.head_dim == ours.head_dim
    torch.testing.assert_close(head.inv_freq, ours.body.rotary_emb.inv_freq)
    prompt = [5, 3, 5, 8, 9, 7]
    tokens, stats = generate_with(head, TARGET, prompt, 24)
    assert tokens == plain_decode(TARGET, prompt, 24, SamplingParams())
    assert stats.num_draft_tokens > 0


def save_target(path: Path) -> tuple[Path, PreTrainedTokenizerFast]:
    """The tiny target as a Hugging Face directory with a word-level tokenizer of its vocabulary."""
    TARGET.save_pretrained(path)
    words = Tokenizer(models.WordLevel({f"w{i}": i for i in range(VOCAB)}, unk_token="w0"))
    words.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=words, eos_token="w1")
    tokenizer.save_pretrained(path)
    return path, tokenizer


def test_the_drafter_serves_an_eagle3_directory_given_as_its_draft_head(tmp_path: Path) -> None:
    """``--draft-head DIR`` with a config.json in it: the head loads over the target's embedding, with the
    target's vocabulary fingerprint; a head that does not fit stops the drafter with the file and the reason."""
    target_dir, tokenizer = save_target(tmp_path / "target")
    head_dir = write_checkpoint(tmp_path / "eagle3", eagle3_config(len(DRAFT_IDS)), eagle3_weights(DRAFT_IDS))
    config = DrafterConfig(
        sources=("draft_model",), draft_head_path=str(head_dir), target_model=str(target_dir), head_dtype="float32"
    )
    head = load_head(config)
    assert isinstance(head, Eagle3Head) and head.feature_layers == (2, 3, 3)
    assert head.target_fingerprint == vocab_fingerprint(tokenizer)
    drafter, _ = build_drafter(config, head)
    assert drafter.feature_layers == (2, 3, 3) and drafter.wants_features
    bad = eagle3_config(len(DRAFT_IDS), target_hidden_size=2 * HIDDEN)
    write_checkpoint(head_dir, bad, eagle3_weights(DRAFT_IDS, target_hidden=2 * HIDDEN))
    with pytest.raises(DraftHeadError, match=f"{head_dir}.*target of hidden size 128, this target's is 64"):
        load_head(config)


@pytest.mark.parametrize(("compile", "static"), [("auto", False), ("off", False), ("off", True)])
def test_a_step_that_keeps_layers_scores_its_rows_as_one_that_keeps_none(compile: str, static: bool) -> None:
    """Keeping layers changes no logit: the prepacked and eager steps compute the same bits with or without
    (a static step's, which keeps no layers, runs eagerly then: the same figures to within rounding)."""
    runner = ModelRunner(TARGET, compile, static=static)
    prompt = [5, 9, 2, 7, 7, 1]
    rows = torch.arange(len(prompt))

    def step(layers: tuple[int, ...]) -> StepOutput:
        arena = runner.new_arena(64)
        region = arena.allocate(16)
        assert region is not None
        plan = StepPlan(arena, [Segment.chunk(region, 0, slice(0, len(prompt)), torch.device("cpu"))])
        return runner.forward(plan, torch.tensor(prompt), rows, rows, rows[:0], rows[1:4], layers)

    plain, kept = step(()), step((1, 4))
    assert plain.layer_features is None and kept.layer_features is not None
    if static:
        torch.testing.assert_close(kept.logits, plain.logits, atol=1e-5, rtol=1e-5)
    else:
        assert torch.equal(kept.logits, plain.logits)
    with torch.inference_mode():
        states = TARGET(input_ids=torch.tensor([prompt]), output_hidden_states=True).hidden_states
    want = torch.stack([states[1][0, 1:4], states[4][0, 1:4]], dim=1)
    torch.testing.assert_close(kept.layer_features, want, atol=1e-5, rtol=1e-5)
    assert kept.layer_union == (1, 4)


def test_the_export_command_writes_a_head_file_as_a_checkpoint_the_drafter_loads(tmp_path: Path) -> None:
    target_dir, tokenizer = save_target(tmp_path / "target")
    torch.manual_seed(12)
    config = DraftHeadConfig.for_target(TARGET.config, draft_vocab_size=len(DRAFT_IDS), intermediate_size=96)
    embedding = TARGET.get_input_embeddings().weight.detach()
    ours = DraftHead(config, embedding, TARGET.get_output_embeddings().weight.detach(), torch.tensor(DRAFT_IDS))
    ours.save(tmp_path / "head.pt", target_fingerprint=vocab_fingerprint(tokenizer))
    out = tmp_path / "exported"
    args = ["--head", str(tmp_path / "head.pt"), "--model", str(target_dir), "--out", str(out), "--dtype", "bfloat16"]
    assert export_main(args) == 0
    head = load(out, TARGET)
    assert head.draft_vocab.tolist() == DRAFT_IDS and head.feature_layers == (2, 3, 3)
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "bfloat16"
    assert export_main([*args[:2], "--model", str(target_dir), "--out", str(out), "--head", str(out)]) == 1
