"""Reference decoders on the target model: the project's plain loop and Hugging Face generate.

Every decoder stops after ``max_new_tokens`` tokens or at an EOS token; the EOS
token ends the output and is not part of it (``Decoded.eos`` says it came).

The plain loop reads its logits as the verifier does (design.md, "Numerics"):
final norm and LM head in fp32 whatever dtype the layers run in, ties to the
lowest id. In fp32 that is exactly what transformers computes; in bf16 it keeps
the head's rounding from manufacturing argmax ties the verifier never sees.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from transformers import DynamicCache

from specserve.keyed_noise import PositionNoise
from specserve.probs import target_probs
from specserve.sampling import SamplingParams, fresh_seed


@dataclass
class Decoded:
    tokens: list[int]  # output tokens, EOS excluded
    eos: bool  # generation ended at an EOS token
    forwards: int  # target forwards, counting the prefill that produced the first token
    draft_tokens: int = 0  # tokens proposed for verification (prompt lookup)
    forward_ns: int = 0  # time inside target forwards (0 when not measured)


class Fp32Head:
    """The model's decoder with its final norm and LM head in fp32, on the last position only.

    Runs transformers' decoder (``model.get_decoder()``), takes the hidden state
    that enters its final norm (a forward pre-hook), and applies the norm to it
    in fp32 and an fp32 copy of the LM head, as ``target_service.model_runner``
    does. Build one per model and reuse it: the fp32 copy of a bf16 head is
    made once here, not inside a timed forward.
    """

    def __init__(self, model: Any) -> None:
        self._decoder = model.get_decoder()
        self._norm = self._decoder.norm
        weight = model.get_output_embeddings().weight.detach()
        self._weight = weight if weight.dtype == torch.float32 else weight.float()
        self.dtype = str(weight.dtype).removeprefix("torch.")

    @torch.inference_mode()
    def last_logits(self, input_ids: Sequence[int], cache: DynamicCache | None = None) -> torch.Tensor:
        """fp32 logits [1, vocab] after ``input_ids`` (appended to ``cache`` when one is given)."""
        entering: list[torch.Tensor] = []
        handle = self._norm.register_forward_pre_hook(lambda _, args: entering.append(args[0][0, -1:]))
        try:
            ids = torch.tensor([list(input_ids)], device=self._weight.device)
            self._decoder(input_ids=ids, past_key_values=cache, use_cache=cache is not None)
        finally:
            handle.remove()
        # RMSNorm computes in fp32 and multiplies by its weight: on fp32 input the result stays fp32.
        return F.linear(self._norm(entering[-1].float()), self._weight)


@torch.inference_mode()
def plain_decode(
    model: Any,
    prompt_ids: Sequence[int],
    max_new_tokens: int,
    eos_ids: frozenset[int],
    sampling: SamplingParams = SamplingParams(),
    head: Fp32Head | None = None,
) -> Decoded:
    """One token per forward with a KV cache: argmax, or the keyed sample of p, after each forward.

    Logits are fp32 from ``head`` (built here when not given). Sampling draws
    are keyed by position as the verifier's are, so a seeded run here commits
    what a seeded speculative run commits.
    """
    head = head or Fp32Head(model)
    noise = PositionNoise(sampling.seed if sampling.seed is not None else fresh_seed(), len(prompt_ids))
    cache = DynamicCache()
    next_input = list(prompt_ids)
    tokens: list[int] = []
    forward_ns = 0
    for _ in range(max_new_tokens):
        start = time.perf_counter_ns()
        logits = head.last_logits(next_input, cache)
        forward_ns += time.perf_counter_ns() - start
        if sampling.greedy:
            token = int(logits.argmax())
        else:
            token = noise.sample(target_probs(logits, sampling)[0], len(tokens))
        if token in eos_ids:
            return Decoded(tokens, True, len(tokens) + 1, forward_ns=forward_ns)
        tokens.append(token)
        next_input = [token]
    return Decoded(tokens, False, len(tokens), forward_ns=forward_ns)


@dataclass
class _ForwardCounter:
    calls: int = 0
    positions: int = 0  # input positions fed across all calls

    def __call__(self, module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        input_ids = kwargs.get("input_ids", args[0] if args else None)
        if input_ids is not None:
            self.calls += 1
            self.positions += int(input_ids.shape[-1])


@contextmanager
def _count_forwards(model: Any) -> Iterator[_ForwardCounter]:
    """Count the model's forward calls and their input lengths (a forward pre-hook, removed after)."""
    counter = _ForwardCounter()
    handle = model.register_forward_pre_hook(counter, with_kwargs=True)
    try:
        yield counter
    finally:
        handle.remove()


@torch.inference_mode()
def hf_generate(
    model: Any,
    prompt_ids: Sequence[int],
    max_new_tokens: int,
    eos_ids: frozenset[int],
    sampling: SamplingParams = SamplingParams(),
    prompt_lookup_num_tokens: int | None = None,
) -> Decoded:
    """Hugging Face ``generate``, optionally with prompt lookup decoding.

    Draft tokens are derived from the forward inputs: the first forward feeds
    the prompt plus its candidates, every later one the pending token plus its
    candidates, so proposed = positions - prompt - (forwards - 1).
    """
    kwargs: dict[str, Any] = {"do_sample": not sampling.greedy}
    if not sampling.greedy:
        # Explicit values: transformers would otherwise fill in its own defaults (top_k=50).
        kwargs.update(temperature=sampling.temperature, top_k=sampling.top_k, top_p=sampling.top_p)
        if sampling.seed is not None:
            torch.manual_seed(sampling.seed)
    if prompt_lookup_num_tokens:
        kwargs["prompt_lookup_num_tokens"] = prompt_lookup_num_tokens
    input_ids = torch.tensor([list(prompt_ids)], device=model.device)
    eos = sorted(eos_ids)
    with _count_forwards(model) as counter:
        out = model.generate(
            input_ids,
            attention_mask=torch.ones_like(input_ids),
            max_new_tokens=max_new_tokens,
            eos_token_id=eos,
            pad_token_id=eos[0],
            **kwargs,
        )
    generated: list[int] = out[0, input_ids.shape[1] :].tolist()
    ended = next((i for i, t in enumerate(generated) if t in eos_ids), None)
    tokens = generated if ended is None else generated[:ended]
    draft_tokens = counter.positions - len(prompt_ids) - (counter.calls - 1)
    return Decoded(tokens, ended is not None, counter.calls, draft_tokens=max(0, draft_tokens))


@torch.inference_mode()
def top2_gap(model: Any, prompt_ids: Sequence[int], prefix: Sequence[int], head: Fp32Head | None = None) -> float:
    """The target's fp32 logit margin between its best and second-best next token after prompt + prefix.

    One forward over the whole context, in the model's dtype, with the final
    norm and LM head in fp32 (``head``, built here when not given). A
    divergence from the baseline at a position with a tiny margin is float
    noise (batched vs one-token kernels, or bf16), not a verification bug.
    """
    logits = (head or Fp32Head(model)).last_logits([*prompt_ids, *prefix])[0]
    top = torch.topk(logits, 2).values
    return float(top[0] - top[1])
