"""What the hardware runs fast: the dtype that ``--dtype auto`` picks.

bf16 pays on GPUs and on CPUs whose matrix units take it natively (Intel AMX,
AVX512-BF16 on recent Intel and AMD cores); elsewhere bf16 matmuls are
emulated and slower than fp32, so fp32 it is. One exception: a model whose
layers come as llama.cpp Q4_1/Q8_0 blocks (a GGUF file, the default target's)
runs in fp32 on every CPU, where the block kernel reads those blocks
(``specserve.block_weights``): fewer bytes than bf16's and the fp32 model's
products, so faster and exactly lossless, AMX's bf16 included (see
docs/benchmarks.md, "The block kernel" and "The block kernel against AMX").
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

BF16_CPU_FLAGS = ("amx_bf16", "avx512_bf16")


@dataclass(frozen=True)
class DtypeChoice:
    dtype: str  # "float32", "bfloat16" or "float16"
    reason: str  # why, for the start-up log and VerifierInfo


def _first_field(key: str, cpuinfo: Path) -> str | None:
    """The first processor's ``key`` in /proc/cpuinfo (None where absent)."""
    try:
        text = cpuinfo.read_text()
    except OSError:
        return None
    for line in text.splitlines():
        name, _, value = line.partition(":")
        if name.strip() == key:
            return value.strip()
    return None


def cpu_flags(cpuinfo: Path = Path("/proc/cpuinfo")) -> frozenset[str]:
    """The first processor's feature flags (empty where /proc/cpuinfo is absent)."""
    return frozenset((_first_field("flags", cpuinfo) or "").split())


def cpu_model(cpuinfo: Path = Path("/proc/cpuinfo")) -> str:
    """The first processor's model name ("unknown" where /proc/cpuinfo is absent)."""
    return _first_field("model name", cpuinfo) or "unknown"


def cpu_vendor(cpuinfo: Path = Path("/proc/cpuinfo")) -> str:
    """The first processor's vendor id ("GenuineIntel", "AuthenticAMD"; "unknown" where absent)."""
    return _first_field("vendor_id", cpuinfo) or "unknown"


def cpu_cores(cpuinfo: Path = Path("/proc/cpuinfo")) -> int | None:
    """The first processor's physical cores per socket, its "cpu cores" (None where absent)."""
    value = _first_field("cpu cores", cpuinfo) or ""
    return int(value) if value.isdigit() else None


def choose_dtype(
    requested: str, device: str, flags: frozenset[str] | None = None, block_weights: bool = False
) -> DtypeChoice:
    """``requested`` unless it is "auto"; then bf16 where the device runs it natively, else fp32.

    ``block_weights``: the model's layers are llama.cpp blocks the CPU's block kernel reads (fp32 then, AMX or
    not).
    """
    if requested != "auto":
        return DtypeChoice(requested, "requested")
    if device.startswith("cuda"):
        return DtypeChoice("bfloat16", "auto: CUDA device")
    have = cpu_flags() if flags is None else flags
    if block_weights:
        return DtypeChoice("float32", "auto: GGUF Q4_1/Q8_0 blocks read in fp32 by the block kernel")
    native = [flag for flag in BF16_CPU_FLAGS if flag in have]
    if native:
        return DtypeChoice("bfloat16", f"auto: CPU has {', '.join(native)}")
    return DtypeChoice("float32", "auto: CPU has neither AMX nor AVX512-BF16")
