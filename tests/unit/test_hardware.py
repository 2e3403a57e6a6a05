from specserve.hardware import choose_dtype


def test_auto_picks_bf16_only_where_the_hardware_runs_it_natively() -> None:
    assert choose_dtype("auto", "cuda:0").dtype == "bfloat16"
    assert choose_dtype("auto", "cpu", frozenset({"avx2", "amx_bf16", "amx_tile"})).dtype == "bfloat16"
    assert choose_dtype("auto", "cpu", frozenset({"avx512f", "avx512_bf16"})).dtype == "bfloat16"
    plain = choose_dtype("auto", "cpu", frozenset({"avx2", "avx512f"}))
    assert plain.dtype == "float32" and "neither" in plain.reason
    assert choose_dtype("float32", "cuda").dtype == "float32"
