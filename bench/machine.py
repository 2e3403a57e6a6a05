"""What the numbers were measured on: CPU, cores, library versions, thread settings, commit."""

from __future__ import annotations

import os
import platform
import subprocess
from pathlib import Path
from typing import Any

import torch
import transformers

from specserve.hardware import BF16_CPU_FLAGS, cpu_cores, cpu_flags, cpu_model
from target_service.engine_threads import compute_threads

ISA_FLAGS = ("avx2", "fma", "avx512f", "avx512_vnni", "avx512_bf16", "amx_tile", "amx_bf16", "amx_int8")


REPO = Path(__file__).resolve().parents[1]


def portable_path(path: str | Path) -> str:
    """A path as a committed result records it: relative to the repository, ``~/...`` under the home directory,
    else the file name alone; never this machine's absolute path."""
    resolved = Path(path).expanduser().resolve()
    if resolved.is_relative_to(REPO):
        return str(resolved.relative_to(REPO))
    home = Path.home().resolve()
    if resolved.is_relative_to(home):
        return str(Path("~") / resolved.relative_to(home))
    return resolved.name


def _git(*args: str) -> str:
    try:
        return subprocess.run(["git", *args], capture_output=True, text=True, check=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def _memory_gib() -> float | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return round(int(line.split()[1]) / 2**20, 1)
    except OSError:
        pass
    return None


def load_average() -> list[float] | None:
    """1, 5 and 15 minute load averages: a busy machine makes every timing here suspect."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def cpu_times() -> list[int] | None:
    """The kernel's counters of all CPUs' time by state (/proc/stat's "cpu" line, in ticks); None off Linux."""
    try:
        with open("/proc/stat") as stat:
            fields = stat.readline().split()
    except OSError:
        return None
    return [int(x) for x in fields[1:]] if fields and fields[0] == "cpu" else None


def steal_since(start: list[int] | None, end: list[int] | None = None) -> float | None:
    """The share of CPU time the hypervisor gave other guests between ``start`` and ``end`` (``cpu_times``; now by
    default): on a shared virtual machine the same code runs slower by about that much, and unevenly (None where
    not known)."""
    end = cpu_times() if end is None else end
    if not start or not end or len(end) < 8 or len(start) < 8:
        return None
    spent = [b - a for a, b in zip(start, end, strict=False)]
    total = sum(spent[:8])  # user nice system idle iowait irq softirq steal (guest time is inside user)
    return round(spent[7] / total, 3) if total > 0 else None


def strain(host: dict[str, Any]) -> str:
    """For reports: the CPU time stolen by the host while the run ran, as a sentence ('' where not recorded)."""
    steal = host.get("cpu_steal")
    return "" if steal is None else f" CPU time stolen by the hypervisor during the run: {steal:.0%}."


def describe() -> dict[str, Any]:
    model, flags = cpu_model(), cpu_flags()
    return {
        "cpu_model": model if model != "unknown" else platform.processor() or "unknown",
        "cpu_cores_per_socket": cpu_cores(),
        # Whether bf16 runs natively here: it decides the dtype that `--dtype auto` picks.
        "cpu_bf16_flags": [flag for flag in BF16_CPU_FLAGS if flag in flags],
        # The vector extensions that decide which kernels run (and how fast each dtype is).
        "cpu_flags": [flag for flag in ISA_FLAGS if flag in flags],
        "logical_cpus": os.cpu_count(),
        "cpus_available": len(os.sched_getaffinity(0)),
        "memory_gib": _memory_gib(),
        "platform": platform.platform(),
        "python_version": platform.python_version(),
        "torch_version": torch.__version__,
        "transformers_version": transformers.__version__,
        "torch_threads": compute_threads(),  # the engine's, not the serving thread's one (engine_threads)
        "torch_interop_threads": torch.get_num_interop_threads(),
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
        "load_average_at_start": load_average(),
        "cpu_times_at_start": cpu_times(),  # for ``steal_since`` at the end of a run
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "git_commit": _git("rev-parse", "--short", "HEAD") or "unknown",
        "git_dirty": bool(_git("status", "--porcelain", "--untracked-files=no")),
    }
