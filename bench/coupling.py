"""How often the draft head's first draft is the target's sampled token: ``python -m bench.coupling``.

Offline, on the target's own seeded samples: for each prompt and
temperature the target decodes plainly (keyed Gumbel-max draws,
``decoding.plain_decode``), then, at every generated position t before EOS, the target's distribution p_t and the draft
head's q_t (from the target's features at the positions before, as the
drafter has them; the same temperature, top-k and top-p) give

- **coupled**: the head's Gumbel-max draft under the target's keyed noise,
  argmax log q_t + G(seed, t), equals the target's token;
- **top-1**: the head's most likely token equals it (what the head drafts
  first without coupling, and under greedy decoding);
- **independent**: a draft sampled from q_t with noise of its own equals it;
- **bound**: the mean over positions of (1 - TV(p_t, q_t)) / (1 + TV(p_t, q_t)),
  the least the coupled rate can be in expectation (Daliri et al. 2024);
- **TV**: the mean total variation between p_t and q_t.

Depth 1 only (the root's first child); writes ``coupling.json`` and ``coupling.md``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from specserve.keyed_noise import PositionNoise
from specserve.probs import target_probs
from specserve.sampling import SamplingParams

from . import machine
from .dataset import CATEGORIES, load_questions, select
from .decoding import plain_decode
from .target import Target, chat_ids, draft_head, load_target

INDEPENDENT_SEED_OFFSET = 1 << 32  # a seed whose noise has nothing to do with the target's


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="bench.coupling", description=__doc__.split("\n\n")[0])
    parser.add_argument("--temperatures", default="0.7,1.0")
    parser.add_argument("--prompts-per-category", type=int, default=1)
    parser.add_argument("--categories", default="writing,roleplay,reasoning,coding,extraction,humanities")
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--seed", type=int, default=0, help="a request's seed is this + question id")
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--out-dir", type=Path, default=Path("bench/out/coupling"))
    args = parser.parse_args(argv)
    args.temperatures = [float(t) for t in args.temperatures.split(",")]
    unknown = set(args.categories.split(",")) - set(CATEGORIES)
    if unknown:
        parser.error(f"unknown categories {sorted(unknown)}")
    return args


@torch.inference_mode()
def position_rates(target: Target, head: Any, prompt_ids: list[int], sampling: SamplingParams, n: int) -> np.ndarray:
    """Per generated position: [coupled match, top-1 match, independent match, bound, TV]."""
    # What the service produces with this seed (EOS, where reached, is not a position drafted for).
    generated = plain_decode(target.model, prompt_ids, n, target.eos_ids, sampling, target.fp32_head).tokens
    tokens = prompt_ids + generated
    out = target.model(input_ids=torch.tensor([tokens]), output_hidden_states=True)
    features = out.hidden_states[-1][0].float()  # after the final norm: what the verifier forwards
    head_dtype = head.draft_lm_head.dtype
    draft = head(features[None, :-1].to(head_dtype), torch.tensor([tokens[1:]])).logits[0].float()
    ids = head.draft_vocab
    seed = sampling.seed or 0
    rows = []
    for j in range(len(prompt_ids), len(tokens)):
        p = target_probs(out.logits[0, j - 1 : j].float(), sampling)[0].double()
        q_draft = target_probs(draft[j - 2 : j - 1], sampling)[0].double()  # the head's output at j-2 predicts x_j
        q = torch.zeros_like(p)
        q[ids] = q_draft
        tv = float((p - q).abs().sum() / 2)
        actual = tokens[j]
        g = PositionNoise(seed, j).gumbel(0, ids.numpy())
        coupled = int(ids[torch.argmax(q_draft.log() + g)])
        other = PositionNoise(seed + INDEPENDENT_SEED_OFFSET, j).gumbel(0, ids.numpy())
        independent = int(ids[torch.argmax(q_draft.log() + other)])
        top1 = int(ids[torch.argmax(q_draft)])
        rows.append([coupled == actual, top1 == actual, independent == actual, (1 - tv) / (1 + tv), tv])
    return np.array(rows, dtype=np.float64)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    target = load_target(args.model, "float32")
    head = draft_head(target, target.model)
    questions = select(load_questions(), args.categories.split(","), args.prompts_per_category)
    summary = []
    for temperature in args.temperatures:
        per_position = np.concatenate(
            [
                position_rates(
                    target,
                    head,
                    chat_ids(target.tokenizer, q.text),
                    SamplingParams(temperature=temperature, seed=args.seed + q.question_id),
                    args.max_new_tokens,
                )
                for q in questions
            ]
        )
        coupled, top1, independent, bound, tv = per_position.mean(axis=0)
        summary.append(
            {
                "temperature": temperature,
                "positions": len(per_position),
                "coupled": coupled,
                "top1": top1,
                "independent": independent,
                "bound": bound,
                "tv": tv,
            }
        )
    meta = {
        "machine": machine.describe(),
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "command": "python -m bench.coupling" + (" " + " ".join(argv) if argv else ""),
        "prompts": len(questions),
        "max_new_tokens": args.max_new_tokens,
    }
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / "coupling.json").write_text(json.dumps({"meta": meta, "summary": summary}, indent=1) + "\n")
    lines = [
        "# The draft head's first draft against the target's sampled token",
        "",
        f"{meta['prompts']} Spec-Bench chat prompts, up to {meta['max_new_tokens']} sampled tokens each (seeded), "
        f"SmolLM2-135M in float32 and the shipped draft head; {meta['date']}. Command: `{meta['command']}`.",
        "",
        "| T | positions | coupled | head top-1 | independent sample | bound (1-TV)/(1+TV) | mean TV |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in summary:
        lines.append(
            f"| {row['temperature']:g} | {row['positions']} | {row['coupled']:.3f} | {row['top1']:.3f} | "
            f"{row['independent']:.3f} | {row['bound']:.3f} | {row['tv']:.3f} |"
        )
    (args.out_dir / "coupling.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
