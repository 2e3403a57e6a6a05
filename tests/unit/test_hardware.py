from pathlib import Path

import pytest
import torch

from specserve import packed_linear
from specserve.hardware import choose_dtype, cpu_cores, cpu_flags, cpu_model, cpu_vendor
from specserve.packed_linear import FP32_GEMM_ENV, available_packing


def test_auto_picks_bf16_only_where_the_hardware_runs_it_natively() -> None:
    assert choose_dtype("auto", "cuda:0").dtype == "bfloat16"
    assert choose_dtype("auto", "cpu", frozenset({"avx2", "amx_bf16", "amx_tile"})).dtype == "bfloat16"
    assert choose_dtype("auto", "cpu", frozenset({"avx512f", "avx512_bf16"})).dtype == "bfloat16"
    plain = choose_dtype("auto", "cpu", frozenset({"avx2", "avx512f"}))
    assert plain.dtype == "float32" and "neither" in plain.reason
    assert choose_dtype("float32", "cuda").dtype == "float32"


def test_auto_reads_a_gguf_models_blocks_in_fp32_on_every_cpu() -> None:
    blocks = choose_dtype("auto", "cpu", frozenset({"avx512f", "avx512_bf16"}), block_weights=True)
    assert blocks.dtype == "float32" and "block kernel" in blocks.reason
    assert choose_dtype("auto", "cpu", frozenset({"avx2"}), block_weights=True).dtype == "float32"
    assert choose_dtype("auto", "cpu", frozenset({"amx_bf16", "avx512_bf16"}), block_weights=True).dtype == "float32"
    assert choose_dtype("bfloat16", "cpu", frozenset({"avx512_bf16"}), block_weights=True).dtype == "bfloat16"
    assert choose_dtype("auto", "cuda:0", block_weights=True).dtype == "bfloat16"


def test_cpuinfo_fields_come_from_the_first_processor(tmp_path: Path) -> None:
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text(
        "processor\t: 0\nvendor_id\t: AuthenticAMD\nmodel name\t: AMD EPYC\ncpu cores\t: 8\n"
        "flags\t\t: avx2 avx512_bf16\n\n"
        "processor\t: 1\nvendor_id\t: GenuineIntel\nmodel name\t: other\ncpu cores\t: 4\nflags\t\t: sse\n"
    )
    assert cpu_vendor(cpuinfo) == "AuthenticAMD"
    assert cpu_model(cpuinfo) == "AMD EPYC"
    assert cpu_flags(cpuinfo) == {"avx2", "avx512_bf16"}
    assert cpu_cores(cpuinfo) == 8
    missing = tmp_path / "absent"
    assert (cpu_vendor(missing), cpu_model(missing), cpu_flags(missing)) == ("unknown", "unknown", frozenset())
    assert cpu_cores(missing) is None


def test_fp32_products_pack_for_mkl_on_intel_and_onednn_elsewhere(monkeypatch: pytest.MonkeyPatch) -> None:
    if not torch.backends.mkldnn.is_available() or not torch.backends.mkl.is_available():
        pytest.skip("this torch build has no oneDNN or no MKL")
    cpu = torch.device("cpu")
    monkeypatch.setattr(packed_linear, "cpu_vendor", lambda: "GenuineIntel")
    assert available_packing(torch.float32, cpu) == "mkl"
    bf16_packs = torch.ops.mkldnn._is_mkldnn_bf16_supported()  # an AVX2-only CPU has no bf16 packing
    assert available_packing(torch.bfloat16, cpu) == ("onednn" if bf16_packs else "none")
    monkeypatch.setattr(packed_linear, "cpu_vendor", lambda: "AuthenticAMD")
    assert available_packing(torch.float32, cpu) == "onednn"
    monkeypatch.setenv(FP32_GEMM_ENV, "mkl")
    assert available_packing(torch.float32, cpu) == "mkl"
    monkeypatch.setenv(FP32_GEMM_ENV, "blas")
    with pytest.raises(ValueError, match=FP32_GEMM_ENV):
        available_packing(torch.float32, cpu)
    assert available_packing(torch.float32, torch.device("meta")) == "none"
