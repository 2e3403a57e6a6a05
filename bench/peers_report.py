"""The llama.cpp peer benchmark's numbers and report: pure functions over measured runs (``bench.peers`` measures).

Every engine's time on a prompt splits in two: the prompt (every prompt token
but the last one into the KV cache: ``Verifier.prefill``, ``Llama.eval``) and
the decode (from the last prompt token to the last output token, one forward
per token for plain decoding). The decode rate leaves the prompt out; the total
rate does not.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from .machine import strain
from .records import first_divergence

LLAMA_CPP = "llama.cpp"
NA = "n/a"


@dataclass(frozen=True)
class Run:
    """One engine on one prompt."""

    tokens: list[int]  # output tokens, EOS excluded
    eos: bool  # ended at an EOS token
    total_ns: int  # from the prompt's token ids to the last output token
    prompt_ns: int  # the prompt part of total_ns (see the module docstring), left out of the decode rate
    rounds: int  # target forwards that committed output tokens (plain decoding: one per token)

    @property
    def committed(self) -> int:
        """Output tokens plus the EOS token where it ended there: what the forwards produced."""
        return len(self.tokens) + int(self.eos)


@dataclass
class ModeResult:
    """One engine configuration over every prompt, in prompt order."""

    name: str  # "llama.cpp", "plain-float32", "speculative-bfloat16", ...
    engine: str  # what runs, in words
    dtype: str  # the weights' type as the engine computes with them
    runs: list[Run]
    # Where this mode's prompt times come from when it cannot time its own prompt ("" when it does).
    prompt_time_from: str = ""
    identical_to: str = ""  # the mode whose tokens this one is compared with ("" for none)


@dataclass(frozen=True)
class Summary:
    mode: str
    engine: str
    dtype: str
    prompts: int
    tokens: int  # output tokens, EOS excluded
    total_s: float
    prompt_s: float
    decode_s: float
    decode_tokens_per_s: float | None
    total_tokens_per_s: float | None
    decode_ratio: float | None  # this mode's decode rate / llama.cpp's (above 1: faster than llama.cpp)
    total_ratio: float | None
    tau: float | None  # committed tokens per forward
    prompt_time_from: str
    identical_to: str
    identical: int | None  # prompts whose output equals identical_to's (an EOS ending counts as a token)


@dataclass(frozen=True)
class Agreement:
    """Does one prompt's output of a mode equal the reference mode's? Where not, the first differing token."""

    prompt: int
    identical: bool
    position: int | None = None
    reference_token: int | None = None  # None: the reference ended before this position
    mode_token: int | None = None


def rate(tokens: int, ns: int) -> float | None:
    """Tokens per second; None when no time was measured."""
    return tokens / (ns / 1e9) if ns > 0 else None


def ratio(ours: float | None, theirs: float | None) -> float | None:
    return ours / theirs if ours is not None and theirs else None


def borrow_prompt_times(runs: Sequence[Run], source: Sequence[Run]) -> list[Run]:
    """``runs`` with each prompt's ``prompt_ns`` taken from ``source``'s run of the same prompt (at most its total)."""
    return [replace(r, prompt_ns=min(s.prompt_ns, r.total_ns)) for r, s in zip(runs, source, strict=True)]


def agreements(reference: Sequence[Run], other: Sequence[Run], eos_id: int) -> list[Agreement]:
    """Per prompt, whether ``other`` produced exactly ``reference``'s tokens (an EOS ending counts)."""
    found = []
    for i, (ref, out) in enumerate(zip(reference, other, strict=True)):
        d = first_divergence(ref.tokens, ref.eos, out.tokens, out.eos, eos_id)
        found.append(
            Agreement(i, True) if d is None else Agreement(i, False, d.position, d.baseline_token, d.mode_token)
        )
    return found


def summarize(result: ModeResult, baseline: Summary | None, identical: int | None) -> Summary:
    """One mode's totals over its prompts; ``baseline`` (llama.cpp's summary) gives the ratios."""
    tokens = sum(len(r.tokens) for r in result.runs)
    total_ns = sum(r.total_ns for r in result.runs)
    prompt_ns = sum(r.prompt_ns for r in result.runs)
    decode_ns = total_ns - prompt_ns
    rounds = sum(r.rounds for r in result.runs)
    decode_rate, total_rate = rate(tokens, decode_ns), rate(tokens, total_ns)
    return Summary(
        mode=result.name,
        engine=result.engine,
        dtype=result.dtype,
        prompts=len(result.runs),
        tokens=tokens,
        total_s=total_ns / 1e9,
        prompt_s=prompt_ns / 1e9,
        decode_s=decode_ns / 1e9,
        decode_tokens_per_s=decode_rate,
        total_tokens_per_s=total_rate,
        decode_ratio=ratio(decode_rate, baseline.decode_tokens_per_s) if baseline else None,
        total_ratio=ratio(total_rate, baseline.total_tokens_per_s) if baseline else None,
        tau=sum(r.committed for r in result.runs) / rounds if rounds else None,
        prompt_time_from=result.prompt_time_from,
        identical_to=result.identical_to,
        identical=identical,
    )


def summarize_all(results: Sequence[ModeResult], eos_id: int) -> tuple[list[Summary], dict[str, list[Agreement]]]:
    """Every mode's summary (ratios against llama.cpp when it ran) and its per-prompt agreement with its reference."""
    by_name = {r.name: r for r in results}
    compared = {
        r.name: agreements(by_name[r.identical_to].runs, r.runs, eos_id) for r in results if r.identical_to in by_name
    }
    llama = by_name.get(LLAMA_CPP)
    baseline = summarize(llama, None, None) if llama else None
    summaries = [
        summarize(r, baseline, sum(a.identical for a in compared[r.name]) if r.name in compared else None)
        for r in results
    ]
    return summaries, compared


# ---- Markdown ----


def _num(value: float | None, digits: int = 1) -> str:
    return NA if value is None else f"{value:.{digits}f}"


def _ratio(value: float | None) -> str:
    return NA if value is None else f"{value:.2f}x"


def _tok(token: int | None) -> str:
    return "end" if token is None else str(token)


def _header(meta: dict[str, Any]) -> list[str]:
    settings, host, llama = meta["settings"], meta["machine"], meta.get("llama_cpp", {})
    prompts = f"{settings['prompts']} Spec-Bench prompts ({settings['category']})"
    if settings.get("prompts_requested", settings["prompts"]) != settings["prompts"]:
        prompts += f", of {settings['prompts_requested']} asked for: the category holds no more"
    return [
        "# Peers: specserve against llama.cpp on a CPU",
        "",
        f"{meta['started_at']}, {meta['duration_s']:.0f} s. Model `{settings['model_source']}`; {prompts}, chat "
        f"template applied, the same token ids into every engine; greedy, up to {settings['max_new_tokens']} new "
        f"tokens, stopping at EOS; {settings['threads']} threads for llama.cpp and torch alike.",
        "",
        f"Machine: {host['cpu_model']}, {host['cpus_available']} CPUs available, bf16 flags "
        f"{host['cpu_bf16_flags'] or 'none'}, torch {host['torch_version']}, commit {host['git_commit']}"
        f"{' (dirty)' if host['git_dirty'] else ''}, load average {host['load_average_at_start']} at start, "
        f"{host.get('load_average_at_end')} at end.{strain(host)}",
        "",
        f"llama.cpp: llama-cpp-python {llama.get('version', NA)}, built with `{llama.get('build_flags') or NA}`; "
        f"runtime features: {llama.get('system_info') or NA}. Weights: the GGUF as shipped (Q4_1), "
        f"n_ctx {settings['n_ctx']}. specserve de-quantizes the same GGUF to {settings['auto_dtype']} "
        f"({settings['auto_dtype_reason']}) and fp32.",
        "",
    ]


def _table(summaries: Sequence[Summary]) -> list[str]:
    out = [
        "| mode | engine | dtype | prompts | tokens | decode tok/s | x llama.cpp | total tok/s | x llama.cpp | "
        "prompt s | decode s | tau | identical |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for s in summaries:
        identical = f"{s.identical}/{s.prompts} to {s.identical_to}" if s.identical is not None else ""
        prompt_s = _num(s.prompt_s, 2) + ("*" if s.prompt_time_from else "")
        out.append(
            f"| {s.mode} | {s.engine} | {s.dtype} | {s.prompts} | {s.tokens} | {_num(s.decode_tokens_per_s)} | "
            f"{_ratio(s.decode_ratio)} | {_num(s.total_tokens_per_s)} | {_ratio(s.total_ratio)} | {prompt_s} | "
            f"{_num(s.decode_s, 2)} | {_num(s.tau, 2)} | {identical} |"
        )
    return out


def _divergences(name: str, reference: str, found: Sequence[Agreement], cases: Sequence[dict[str, Any]]) -> list[str]:
    differing = [a for a in found if not a.identical]
    if not differing:
        return []
    out = [
        f"## {name} against {reference}: first differing tokens",
        "",
        f"| prompt | category | question | position | {reference} token | {name} token |",
        "|---:|---|---:|---:|---:|---:|",
    ]
    for a in differing:
        case = cases[a.prompt] if a.prompt < len(cases) else {}
        out.append(
            f"| {a.prompt} | {case.get('category', '')} | {case.get('question_id', '')} | {a.position} | "
            f"{_tok(a.reference_token)} | {_tok(a.mode_token)} |"
        )
    return [*out, ""]


def markdown(meta: dict[str, Any], summaries: Sequence[Summary], compared: dict[str, list[Agreement]]) -> str:
    out = [*_header(meta), *_table(summaries), ""]
    out += [
        "Decode tok/s: output tokens (EOS excluded) over the time from the last prompt token to the last output "
        "token; the prompt's other tokens (`Llama.eval`, `Verifier.prefill`) are left out. Total tok/s: over the "
        "whole time from the token ids. x llama.cpp: the mode's rate over llama.cpp's (above 1: faster). "
        "tau: committed tokens (EOS included) per target forward.",
        "",
    ]
    lenders: dict[str, list[str]] = {}
    for s in summaries:
        if s.prompt_time_from:
            lenders.setdefault(s.prompt_time_from, []).append(s.mode)
    if lenders:
        out += [
            "\\* "
            + "; ".join(
                f"{' and '.join(modes)}: no prefill timed apart, so the prompt time is {lender}'s on the same "
                "prompt (the same engine call on the same tokens)"
                for lender, modes in lenders.items()
            )
            + ".",
            "",
        ]
    out += [
        "Token agreement is reported, not required: llama.cpp computes with the Q4_1 weights and its own kernels, "
        "specserve with de-quantized weights in torch, so near-ties may break differently. Speculative decoding "
        "is compared with plain decoding in its own dtype (lossless: identical in fp32; in bf16 the forward "
        "shape moves the rounding, see `make bench-numerics`).",
        "",
    ]
    by_mode = {s.mode: s for s in summaries}
    for name, found in compared.items():
        out += _divergences(name, by_mode[name].identical_to, found, meta.get("settings", {}).get("cases", []))
    return "\n".join(out)


def write_outputs(
    out_dir: Path, meta: dict[str, Any], results: Sequence[ModeResult], eos_id: int
) -> tuple[list[Summary], list[Path]]:
    """``peers.json`` (settings, machine, llama.cpp build, summaries, every run) and ``peers.md``."""
    summaries, compared = summarize_all(results, eos_id)
    out_dir.mkdir(parents=True, exist_ok=True)
    document = {
        "meta": meta,
        "summaries": [asdict(s) for s in summaries],
        "agreement": {name: [asdict(a) for a in found] for name, found in compared.items()},
        "modes": [asdict(r) for r in results],
    }
    json_path, md_path = out_dir / "peers.json", out_dir / "peers.md"
    json_path.write_text(json.dumps(document, indent=1) + "\n")
    md_path.write_text(markdown(meta, summaries, compared))
    return summaries, [json_path, md_path]


def leaderboard(summaries: Sequence[Summary]) -> list[str]:
    """One line per mode for the terminal."""
    return [
        f"{s.mode:<22} decode {_num(s.decode_tokens_per_s):>7} tok/s ({_ratio(s.decode_ratio):>6} llama.cpp)  "
        f"total {_num(s.total_tokens_per_s):>7} tok/s ({_ratio(s.total_ratio):>6})"
        + (f"  identical to {s.identical_to}: {s.identical}/{s.prompts}" if s.identical is not None else "")
        for s in summaries
    ]
