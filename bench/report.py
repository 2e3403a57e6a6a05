"""The benchmark's Markdown report (Spec-Bench leaderboard layout, then each repetitive workload) and its plot."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from . import round_breakdown
from .aggregate import OVERALL, Summary
from .dataset import MT_BENCH_CATEGORIES, WORKLOADS
from .head_identity import head_line
from .machine import strain
from .records import Record

# Column titles of the Spec-Bench leaderboard, in its order.
TASK_COLUMNS = {
    "mt_bench": "Multi-turn Conversation",
    "translation": "Translation",
    "summarization": "Summarization",
    "qa": "Question Answering",
    "math_reasoning": "Mathematical Reasoning",
    "rag": "Retrieval-aug. Generation",
}
NA = "n/a"  # a figure this mode does not have
# The repetitive workloads' titles, and what their prompts are (the report says it above their tables).
WORKLOAD_TITLES = {"code_edit": "Code edit", "agent_loop": "Agent loop"}
WORKLOAD_NOTES = {
    "code_edit": "A function or small class in the prompt with an instruction to change a small part of it, the "
    "whole code asked back: `edit_replace` changes text in place (a rename, a constant, an off-by-one), "
    "`edit_insert` adds some (a docstring, a parameter, type hints, an empty-input guard).",
    "agent_loop": "An agent framework's conversation: tool schemas in the system turn, earlier tool calls (JSON) and "
    "their results (as user turns, `Tool result (<tool>):`) in the context, the model asked for the next step: "
    "`agent_call` a tool call, `agent_summary` a plain-text answer quoting the tool output.",
}
SHORT_NAMES = {
    "mt_bench": "MT-Bench",
    "math_reasoning": "Math reas.",
    "summarization": "Summ.",
    "translation": "Transl.",
    OVERALL: "Overall",
    **{workload: f"{title}, overall" for workload, title in WORKLOAD_TITLES.items()},
}


def _x(value: float | None) -> str:
    return NA if value is None else f"{value:.2f}x"


def _f(value: float | None, digits: int = 2) -> str:
    return NA if value is None else f"{value:.{digits}f}"


def _pct(value: float | None) -> str:
    return NA if value is None else f"{100 * value:.1f}%"


def _pinning(settings: dict[str, Any]) -> str:
    """What the run set about where and how the verifier works: CPU pinning, the throughput guard."""
    text = ""
    if settings.get("pinning"):
        text = (
            f"CPU pinning (separate hardware on one machine): {settings['pinning']}; `baseline` and `inproc` on "
            "the verifier's CPUs. "
        )
    if settings.get("throughput_guard") is False:
        text += "Throughput guard off: verifiers size trees by their cost model alone (`--no-throughput-guard`). "
    return text


def _device(settings: dict[str, Any], machine: dict[str, Any]) -> str:
    """Where the target ran, when it was not this machine's CPU."""
    device = settings.get("device", "cpu")
    return "" if device == "cpu" else f" Target on {device} ({machine.get('cuda') or 'no CUDA device named'})."


def _load(machine: dict[str, Any]) -> str:
    """The 1-minute load average at start and end of the run (not known: n/a)."""
    start, end = machine.get("load_average_at_start"), machine.get("load_average_at_end")
    return f"{start[0] if start else NA} at start, {end[0] if end else NA} at end"


def dtype_line(settings: dict[str, Any]) -> str:
    """The run's dtype and why it was chosen, and the modes that ran in another one (older runs: fp32)."""
    dtype = settings.get("dtype", "float32")
    reason = settings.get("dtype_reason")
    line = f"Dtype: {dtype}" + (f" ({reason})" if reason else "") + ", every mode's target"
    others = {mode: d for mode, d in settings.get("mode_dtypes", {}).items() if d != dtype}
    if others:
        line += " except " + ", ".join(f"`{mode}` ({d})" for mode, d in others.items())
    return line + "."


def verify_cost_line(settings: dict[str, Any]) -> str:
    """The verify cost curves the in-process drafters cut their trees at ("" where none was recorded)."""
    curves = {mode: points for mode, points in settings.get("verify_costs", {}).items() if points}
    if not curves:
        return ""
    described = "; ".join(
        f"`{mode}` " + ", ".join(f"{int(nodes)}: {ratio:.2f}" for nodes, ratio in points)
        for mode, points in curves.items()
    )
    if settings.get("flat_verify_cost"):
        return (
            "Verify cost c(n)/c(0) by draft nodes n, set flat (`--flat-verify-cost`: extra nodes cost nothing, as "
            "on a GPU), so trees grow to the tree limits; this CPU's real curve is steeper, and the speed-ups in "
            f"this report pay for the larger trees at it: {described}."
        )
    return (
        "Verify cost c(n)/c(0) by draft nodes n, the curve each in-process mode's verifier sized trees by: the "
        "one the verifier service keeps in the model cache for this machine, measured at the first start "
        f"(its drafter keeps the nodes that pay for it): {described}."
    )


def identity_line(settings: dict[str, Any]) -> str:
    """What the Identical column and the divergence table compare, and what to expect of them."""
    dtype = settings.get("dtype", "float32")
    others = [f"`{mode}`" for mode, d in settings.get("mode_dtypes", {}).items() if d != dtype]
    line = f"Identical: token-identical to `baseline` in the same dtype ({dtype})"
    if others:
        line += f"; {', '.join(others)} ran in another dtype and is compared with nothing (n/a)"
    line += ". "
    if dtype == "float32":
        return line + "In float32 specserve's greedy output must equal plain decoding token for token."
    return (
        line + f"In {dtype} a forward's results depend on how many rows share it, so outputs may diverge from "
        "plain decoding, but only at near-ties: every first divergence is listed with the top-1 minus top-2 "
        "logit gap there (fp32 logits of `baseline`'s model on `baseline`'s prefix)."
    )


def _table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return lines


def _lookup(summaries: Sequence[Summary]) -> Callable[[str, str], Summary | None]:
    index = {(s.mode, s.group): s for s in summaries}
    return lambda mode, group: index.get((mode, group))


def leaderboard(summaries: Sequence[Summary], modes: Sequence[str]) -> list[str]:
    """Speedup per task, then mean accepted tokens (tau) and overall speedup, as Spec-Bench lays it out."""
    present = {s.group for s in summaries}
    tasks = [t for t in TASK_COLUMNS if t in present]
    cell = _lookup(summaries)
    header = ["Mode", *(TASK_COLUMNS[t] for t in tasks), "#Mean Accepted Tokens", "Overall"]
    rows = []
    for mode in modes:
        overall = cell(mode, OVERALL)
        if overall is None:
            continue
        row = [f"`{mode}`"]
        for task in tasks:
            s = cell(mode, task)
            row.append(_x(s.speedup if s else None))
        rows.append([*row, _f(overall.tau), _x(overall.speedup)])
    return _table(header, rows)


def per_group(summaries: Sequence[Summary], modes: Sequence[str], groups: Sequence[str]) -> list[str]:
    """One row per mode, one column per group: "speedup / tau"."""
    cell = _lookup(summaries)
    header = ["Mode", *(SHORT_NAMES.get(g, g) for g in groups)]
    rows = []
    for mode in modes:
        row = [f"`{mode}`"]
        for group in groups:
            s = cell(mode, group)
            row.append(NA if s is None else f"{_x(s.speedup)} / {_f(s.tau)}")
        rows.append(row)
    return _table(header, rows)


def details(summaries: Sequence[Summary], modes: Sequence[str], group: str) -> list[str]:
    """Everything measured for one group, one row per mode."""
    header = [
        "Mode",
        "Prompts",
        "Tokens",
        "Tokens/s",
        "Speedup (total)",
        "Speedup (median)",
        "τ",
        "Acceptance",
        "ms/round",
        "Draft ms/round",
        "Verify ms/round",
        "Coord. ms/round",
        "Pre-draft hits",
        "Hidden draft ms/round",
        "Identical",
    ]
    rows = []
    for s in summaries:
        if s.group != group:
            continue
        rows.append(
            [
                f"`{s.mode}`",
                str(s.prompts),
                str(s.tokens),
                _f(s.tokens_per_s, 1),
                _x(s.speedup),
                _x(s.median_speedup),
                _f(s.tau),
                _pct(s.acceptance_rate),
                _f(s.ms_per_round, 1),
                _f(s.draft_ms_per_round),
                _f(s.verify_ms_per_round, 1),
                _f(s.coordination_ms_per_round),
                _pct(s.predraft_hit_rate),
                _f(s.hidden_draft_ms_per_round),
                f"{s.identical}/{s.compared}" if s.compared else NA,
            ]
        )
    rows.sort(key=lambda row: modes.index(row[0].strip("`")))
    return _table(header, rows)


def workload_groups(workload: str, present: set[str]) -> list[str]:
    """A workload's groups that ran: its categories, then the workload's overall."""
    return [*(c for c in WORKLOADS[workload] if c in present), workload]


def workload_sections(summaries: Sequence[Summary], modes: Sequence[str]) -> list[str]:
    """Each repetitive workload that ran: speedup / τ per category and overall, then every figure of its overall.

    The same columns as Spec-Bench's, in sections of their own: a workload's figures are read beside Spec-Bench's,
    never averaged into them (``aggregate.groups_of``).
    """
    present = {s.group for s in summaries}
    lines: list[str] = []
    for workload, title in WORKLOAD_TITLES.items():
        if workload not in present:
            continue
        lines += [f"## {title} (`{workload}`): speedup / τ", "", WORKLOAD_NOTES[workload], ""]
        lines += [*per_group(summaries, modes, workload_groups(workload, present)), ""]
        lines += [f"### {title}: all figures", "", *details(summaries, modes, workload), ""]
    return lines


def console_summary(summaries: Sequence[Summary], modes: Sequence[str]) -> list[str]:
    """What a run prints when it ends: Spec-Bench's leaderboard when it ran, each workload's speedup / τ table."""
    present = {s.group for s in summaries}
    lines = leaderboard(summaries, modes) if OVERALL in present else []
    for workload, title in WORKLOAD_TITLES.items():
        if workload in present:
            lines += ["", f"{title}: speedup / τ", *per_group(summaries, modes, workload_groups(workload, present))]
    return lines


def title(groups: set[str]) -> str:
    """The report's title: the question sets that ran (Spec-Bench when none is known)."""
    names = ["Spec-Bench"] if OVERALL in groups else []
    names += [t for workload, t in WORKLOAD_TITLES.items() if workload in groups]
    return "specserve on " + (", ".join(names) or "Spec-Bench")


def divergences(records: Sequence[Record], greedy: bool, dtype: str = "float32") -> list[str]:
    lines: list[str] = []
    different = [r for r in records if r.identical is False]
    compared = [r for r in records if r.identical is not None and r.mode != "baseline"]
    if not greedy:
        # specserve draws by position (keyed_noise), as `baseline` does; Hugging Face draws in sequence.
        hf = [r for r in records if r.mode.startswith("hf")]
        if hf:
            differ = sum(r.identical is False for r in hf)
            note = f"Hugging Face modes draw samples in their own way: {differ} of {len(hf)} differ, as expected."
            lines += [note, ""]
        different = [r for r in different if not r.mode.startswith("hf")]
    if not different:
        every = "Every compared output" if greedy else "Every compared specserve output"
        return [*lines, f"{every} is token-identical to `baseline` ({dtype})."]
    if greedy:
        lines += [f"{len(different)} of {len(compared)} compared outputs differ from `baseline` ({dtype}).", ""]
    header = ["Mode", "Category", "Question", "First differing position", "Baseline / mode token", "Top-2 logit gap"]
    rows = [
        [
            f"`{r.mode}`",
            r.category,
            str(r.question_id),
            str(r.first_diff),
            f"{r.baseline_token} / {r.mode_token}",
            _f(r.logit_gap, 4),
        ]
        for r in different
    ]
    return [*lines, *_table(header, rows)]


def notes(records: Sequence[Record]) -> list[str]:
    """Records the services annotated (a drafter dropped mid-request, say)."""
    noted = [r for r in records if r.note]
    if not noted:
        return []
    rows = [[f"`{r.mode}`", r.category, str(r.question_id), r.note] for r in noted]
    return ["## Notes", "", *_table(["Mode", "Category", "Question", "Note"], rows), ""]


def markdown(
    summaries: Sequence[Summary], records: Sequence[Record], modes: Sequence[str], meta: dict[str, Any]
) -> str:
    settings = meta["settings"]
    machine = meta["machine"]
    cost_line = verify_cost_line(settings)
    present = {s.group for s in summaries}
    mt = [c for c in MT_BENCH_CATEGORIES if c in present]
    decoding = "greedy" if settings["temperature"] == 0 else f"sampling at temperature {settings['temperature']}"
    warm = settings.get("warm_pool_prompts_per_category", 0)
    pools = (
        f"Warm pools: {settings.get('warm_pool_prompts', 0)} other prompts ({warm} per category) ran through the "
        "specserve modes before measuring. "
        if warm
        else "Cold pools: every specserve mode starts from empty n-gram pools. "
    )
    lines = [
        f"# {title(present)}",
        "",
        f"Target {settings['model']} ({settings['dtype']}), {decoding}, up to {settings['max_new_tokens']} new "
        f"tokens, {len(records) // max(1, len(modes))} prompts ({settings['prompts_per_category']} per category), "
        f"modes interleaved prompt by prompt.{_device(settings, machine)} Machine: {machine['cpu_model']}, "
        f"{machine['cpus_available']} CPUs available, torch {machine['torch_version']} with "
        f"{machine['torch_threads']} threads, load average {_load(machine)}.{strain(machine)} "
        f"n-gram pool of `distributed`: {settings['distributed_pool']}. {pools}"
        f"{_pinning(settings)}{head_line(settings.get('draft_head'))}"
        f"Run {meta['started_at']}, commit {machine['git_commit']}{' (dirty)' if machine['git_dirty'] else ''}.",
        "",
        dtype_line(settings),
        "",
        *([cost_line, ""] if cost_line else []),
        "Speedup is `baseline` time / mode time on the same prompts (ratio of total times), `baseline` in "
        f"{settings.get('dtype', 'float32')} for every mode; τ is tokens committed per target forward "
        "(1.00 for `baseline`). " + identity_line(settings),
        "",
    ]
    if OVERALL in present:
        lines += [
            "## Speedup over `baseline` (Spec-Bench leaderboard layout)",
            "",
            *leaderboard(summaries, modes),
            "",
            "## Speedup / τ per task",
            "",
            *per_group(summaries, modes, [g for g in [*TASK_COLUMNS, OVERALL] if g in present]),
            "",
        ]
    if mt:
        lines += ["## MT-Bench categories: speedup / τ", "", *per_group(summaries, modes, mt), ""]
    if OVERALL in present:
        lines += ["## All figures, overall", "", *details(summaries, modes, OVERALL), ""]
    lines += workload_sections(summaries, modes)
    lines += round_breakdown.section(records, modes)
    lines += [
        "## Outputs that differ from `baseline`",
        "",
        *divergences(records, settings["temperature"] == 0, settings.get("dtype", "float32")),
        "",
    ]
    lines += notes(records)
    if meta.get("error"):
        lines += [f"**Incomplete run**: stopped after {len(records)} records: {meta['error']}", ""]
    return "\n".join(lines)


def _section(group: str) -> int:
    """Which part of the plot a group is in: tasks, MT-Bench categories, overall, then one part per workload."""
    if group in TASK_COLUMNS:
        return 0
    if group in MT_BENCH_CATEGORIES:
        return 1
    if group == OVERALL:
        return 2
    workloads = list(WORKLOADS)
    owner = group if group in WORKLOADS else next(w for w in workloads if group in WORKLOADS[w])
    return 3 + workloads.index(owner)


def _section_boundaries(groups: Sequence[str]) -> list[float]:
    """x positions between the tasks, the MT-Bench categories, overall and each workload."""
    section = [_section(g) for g in groups]
    return [i - 0.5 for i in range(1, len(groups)) if section[i] != section[i - 1]]


def plot_groups(present: set[str]) -> list[str]:
    """The groups a plot shows, in order: Spec-Bench's tasks, its MT-Bench categories and overall, then each
    workload's categories followed by its overall."""
    workload_groups = [g for workload, members in WORKLOADS.items() for g in (*members, workload)]
    return [g for g in [*TASK_COLUMNS, *MT_BENCH_CATEGORIES, OVERALL, *workload_groups] if g in present]


def plot(summaries: Sequence[Summary], modes: Sequence[str], path: Path) -> None:
    """Grouped bars: speedup (top) and tau (bottom) per group, one bar per mode."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    present = {s.group for s in summaries}
    groups = plot_groups(present)
    index = {(s.mode, s.group): s for s in summaries}
    fig, axes = plt.subplots(2, 1, figsize=(max(8.0, 0.9 * len(groups) + 2), 8), sharex=True)
    width = 0.8 / max(1, len(modes))
    for axis, metric, label in ((axes[0], "speedup", "speedup over baseline"), (axes[1], "tau", "τ (tokens/forward)")):
        for i, mode in enumerate(modes):
            values = [getattr(index[(mode, g)], metric) if (mode, g) in index else None for g in groups]
            xs = [j + (i - (len(modes) - 1) / 2) * width for j in range(len(groups))]
            axis.bar(xs, [v or 0.0 for v in values], width, label=mode)
        axis.axhline(1.0, color="grey", linewidth=0.8, linestyle="--")
        for boundary in _section_boundaries(groups):
            axis.axvline(boundary, color="black", linewidth=0.6)
        axis.set_ylabel(label)
        axis.grid(axis="y", alpha=0.3)
    axes[0].legend(ncols=len(modes), loc="upper left", fontsize="small")
    axes[1].set_xticks(range(len(groups)), [SHORT_NAMES.get(g, g) for g in groups], rotation=30, ha="right")
    fig.suptitle(title(present))
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def rerender(json_path: Path) -> None:
    """Write the Markdown and the plot again from a run's JSON (after changing this module, say)."""
    import json

    from .aggregate import summarize_all

    document = json.loads(json_path.read_text())
    records = [Record(**r) for r in document["records"]]
    modes = document["meta"]["settings"]["modes"]
    summaries = summarize_all(records, modes)
    json_path.with_suffix(".md").write_text(markdown(summaries, records, modes, document["meta"]))
    plot(summaries, modes, json_path.with_suffix(".png"))


if __name__ == "__main__":
    import sys

    for name in sys.argv[1:] or ["bench/out/spec_bench.json"]:
        rerender(Path(name))
