"""Start-up results kept on disk (``specserve.startup_cache``), and a weight's blocks found once a process.

A record read back must be what computing gives (the blocks found in a weight, the row counts a probe keeps);
a damaged, foreign or unwritable record must fall back to computing, never stop a start; the key must change
with whatever the result depends on. A fused product packed from its parts' blocks must pack what finding the
fused weight's own blocks packs.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from specserve import block_weights, packed_linear
from specserve.block_weights import (
    BLOCKS_KIND,
    KEPT_MIN_VALUES,
    Blocks,
    block_kernels,
    blocks_key,
    find_blocks,
    kept_blocks,
    quantize_q4_1,
    quantize_q8_0,
)
from specserve.llama_decoder import LlamaDecoder, find_layer_blocks
from specserve.packed_linear import (
    ONEDNN_ROWS,
    ROW_INVARIANCE_KIND,
    PackedLinear,
    Packing,
    kept_invariant_rows,
    probe_key,
    row_invariant_rows,
)
from specserve.startup_cache import (
    STARTUP_CACHE_ENV,
    ResultStore,
    TensorStore,
    key_digest,
    result_store,
    tensor_store,
)
from tests.conftest import gguf_like, q4_1_with_large_minimums, tiny_llama

needs_onednn = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="no oneDNN in this torch")
needs_kernel = pytest.mark.skipif(block_kernels() is None, reason="the block kernel does not build here")
SIDE = 256  # a SIDE x SIDE weight has KEPT_MIN_VALUES values: its blocks are kept
assert SIDE * SIDE >= KEPT_MIN_VALUES
PROBE: tuple[Packing, torch.dtype, int, int, tuple[int, ...]] = ("onednn", torch.float32, 64, 96, ONEDNN_ROWS)
Quantize = Callable[[torch.Tensor], torch.Tensor]


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty cache root of the test's own, the start-up cache on."""
    monkeypatch.setenv("SPECSERVE_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv(STARTUP_CACHE_ENV, raising=False)
    return tmp_path


def weight(out: int = SIDE, in_: int = SIDE, seed: int = 0) -> torch.Tensor:
    return torch.randn(out, in_, generator=torch.Generator().manual_seed(seed)) * 0.05


def same_bits(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    if a is None or b is None:
        return a is None and b is None
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def same_blocks(a: Blocks | None, b: Blocks | None) -> bool:
    if a is None or b is None:
        return a is None and b is None
    return a.block_format == b.block_format and all(
        same_bits(getattr(a, name), getattr(b, name)) for name in ("scale", "low", "q")
    )


def fail(*args: object) -> None:
    raise AssertionError("computed, where the record should have been read")


def only_record(folder: Path) -> Path:
    (record,) = folder.iterdir()
    return record


# ---- the records ----


def test_a_result_reads_back_under_its_own_key_only(cache: Path) -> None:
    store = ResultStore(cache / "kind")
    store.put({"a": 1, "rows": (1, 2)}, [1, 2])
    assert store.get({"a": 1, "rows": [1, 2]}) == [1, 2], "tuples and lists name the same JSON key"
    assert store.get({"a": 2, "rows": [1, 2]}) is None
    store.path({"a": 1, "rows": [1, 2]}).rename(store.path({"a": 2}))  # a record under another key's name
    assert store.get({"a": 2}) is None


def test_a_record_that_does_not_read_is_logged_and_replaced(cache: Path, caplog: pytest.LogCaptureFixture) -> None:
    store = ResultStore(cache / "kind")
    store.put({"a": 1}, [1])
    store.path({"a": 1}).write_text('{"key": {"a": 1}, "res')
    with caplog.at_level(logging.WARNING):
        assert store.get({"a": 1}) is None
    assert "does not read" in caplog.text
    store.put({"a": 1}, [3])
    assert store.get({"a": 1}) == [3]


def test_an_unwritable_cache_is_logged_once_and_never_raises(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    store = ResultStore(blocker / "kind")  # its folder cannot be made
    with caplog.at_level(logging.WARNING):
        store.put({"a": 1}, [1])
        store.put({"a": 2}, [2])
    assert store.get({"a": 1}) is None and store.written == 0
    assert caplog.text.count("could not keep") == 1


def test_tensors_read_back_and_damaged_bytes_are_found_out(cache: Path, caplog: pytest.LogCaptureFixture) -> None:
    store = TensorStore(cache / "kind")
    tensors = {"x": torch.linspace(-1, 1, 64), "q": torch.arange(16, dtype=torch.uint8)}
    store.put({"a": 1}, tensors, {"format": "Q8_0"})
    kept = store.get({"a": 1})
    assert kept is not None
    assert kept[1] == {"format": "Q8_0"} and all(same_bits(kept[0][n], t) for n, t in tensors.items())
    path = store.path({"a": 1})
    damaged = bytearray(path.read_bytes())
    damaged[-1] ^= 1  # one bit of the last tensor's data: the file still parses
    path.write_bytes(bytes(damaged))
    with caplog.at_level(logging.WARNING):
        assert store.get({"a": 1}) is None
        path.write_bytes(b"not a safetensors file")
        assert store.get({"a": 1}) is None
    assert "damaged" in caplog.text and "does not read" in caplog.text


def test_the_startup_cache_off_reads_and_keeps_nothing(cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(STARTUP_CACHE_ENV, "off")
    assert result_store("kind") is None and tensor_store("kind") is None
    w = quantize_q4_1(weight())
    assert same_blocks(kept_blocks(w, tensor_store(BLOCKS_KIND)), find_blocks(w))
    assert list(cache.iterdir()) == []


# ---- a weight's blocks ----


@pytest.mark.parametrize("quantize", [quantize_q4_1, quantize_q8_0])
def test_blocks_read_back_are_the_blocks_found(
    cache: Path, monkeypatch: pytest.MonkeyPatch, quantize: Quantize
) -> None:
    w = quantize(weight())
    store = tensor_store(BLOCKS_KIND)
    first = kept_blocks(w, store)
    assert same_blocks(first, find_blocks(w)) and store is not None and store.written == 1
    monkeypatch.setattr(block_weights, "find_blocks", fail)  # the next start reads them: nothing is found again
    assert same_blocks(kept_blocks(w.clone(), tensor_store(BLOCKS_KIND)), first)


def test_a_damaged_blocks_record_is_found_again_and_replaced(
    cache: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    w = quantize_q4_1(weight())
    expected = find_blocks(w)
    kept_blocks(w, tensor_store(BLOCKS_KIND))
    record = only_record(cache / BLOCKS_KIND)
    record.write_bytes(record.read_bytes()[:-7])  # cut short
    store = tensor_store(BLOCKS_KIND)
    with caplog.at_level(logging.WARNING):
        assert same_blocks(kept_blocks(w, store), expected)
    assert "does not read" in caplog.text or "damaged" in caplog.text
    assert store is not None and store.written == 1, "replaced"
    monkeypatch.setattr(block_weights, "find_blocks", fail)
    assert same_blocks(kept_blocks(w, tensor_store(BLOCKS_KIND)), expected)


def test_a_record_that_holds_no_blocks_of_the_weight_is_not_used(cache: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A whole record under the weight's key whose tensors are not its blocks' layout (another writer's)."""
    w, q8_0 = quantize_q4_1(weight()), find_blocks(quantize_q8_0(weight()))
    store = tensor_store(BLOCKS_KIND)
    assert store is not None and q8_0 is not None
    store.put(blocks_key(w), {"scale": q8_0.scale, "q": q8_0.q}, {"format": "Q4_1"})  # no minimums, int8 integers
    with caplog.at_level(logging.WARNING):
        assert same_blocks(kept_blocks(w, store), find_blocks(w))
    assert "holds no blocks" in caplog.text


def test_the_blocks_key_is_the_weights_own_bytes(cache: Path) -> None:
    store = tensor_store(BLOCKS_KIND)
    w, other = quantize_q4_1(weight(seed=0)), quantize_q4_1(weight(seed=1))
    kept_blocks(w, store)
    assert same_blocks(kept_blocks(other, store), find_blocks(other)), "another weight of the shape: its own blocks"
    assert len(list((cache / BLOCKS_KIND).iterdir())) == 2
    moved = w.clone()
    moved[0, 0] = torch.nextafter(moved[0, 0], torch.tensor(float("inf")))  # one value one ulp off: not blocks
    assert kept_blocks(moved, store) is None and len(list((cache / BLOCKS_KIND).iterdir())) == 2


def test_small_weights_and_weights_that_are_not_blocks_leave_no_record(cache: Path) -> None:
    store = tensor_store(BLOCKS_KIND)
    small = quantize_q4_1(weight(out=8, in_=64))
    assert same_blocks(kept_blocks(small, store), find_blocks(small))
    assert kept_blocks(weight(), store) is None
    assert not (cache / BLOCKS_KIND).exists()


# ---- the row-count probe ----


@needs_onednn
def test_probed_rows_read_back_are_the_rows_probed(cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    rows = kept_invariant_rows(*PROBE)
    assert rows == row_invariant_rows(*PROBE)
    assert len(list((cache / ROW_INVARIANCE_KIND).iterdir())) == 1
    monkeypatch.setattr(packed_linear, "row_invariant_rows", fail)
    assert kept_invariant_rows(*PROBE) == rows


@pytest.mark.parametrize("damage", ["not json", '{"key": {}, "result": [1]}', "rows no probe gives"])
def test_a_damaged_probe_record_is_probed_again_and_replaced(
    cache: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, damage: str
) -> None:
    calls: list[tuple[object, ...]] = []

    def probe(*args: object) -> tuple[int, ...]:
        calls.append(args)
        return (2, 4, 32)

    monkeypatch.setattr(packed_linear, "row_invariant_rows", probe)
    assert kept_invariant_rows(*PROBE) == (2, 4, 32)
    store = result_store(ROW_INVARIANCE_KIND)
    assert store is not None
    if damage == "rows no probe gives":
        store.put(probe_key(*PROBE), [2, 99])  # 99 is no candidate, and the largest (always kept) is missing
    else:
        store.path(probe_key(*PROBE)).write_text(damage)
    with caplog.at_level(logging.WARNING):
        assert kept_invariant_rows(*PROBE) == (2, 4, 32)
    assert len(calls) == 2 and caplog.records
    assert store.get(probe_key(*PROBE)) == [2, 4, 32], "replaced"


def test_the_probe_key_names_what_the_rows_depend_on(monkeypatch: pytest.MonkeyPatch) -> None:
    base = key_digest(probe_key(*PROBE))
    assert key_digest(probe_key(*PROBE)) == base
    others = [
        probe_key("mkl", torch.float32, 64, 96, ONEDNN_ROWS),
        probe_key("onednn", torch.bfloat16, 64, 96, ONEDNN_ROWS),
        probe_key("onednn", torch.float32, 65, 96, ONEDNN_ROWS),
        probe_key("onednn", torch.float32, 64, 96, (2, 4, 8)),
    ]
    threads = torch.get_num_threads()
    torch.set_num_threads(threads + 1)
    try:
        others.append(probe_key(*PROBE))
    finally:
        torch.set_num_threads(threads)
    with monkeypatch.context() as patched:
        patched.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")
        others.append(probe_key(*PROBE))
    libraries = packed_linear._kernel_libraries()
    for name in ("cpu", "cpu_flags", "torch", "torch_build", "block_kernel"):
        with monkeypatch.context() as patched:
            patched.setattr(packed_linear, "_kernel_libraries", lambda name=name: {**libraries, name: "another"})
            others.append(probe_key(*PROBE))
    digests = {key_digest(key) for key in others}
    assert base not in digests and len(digests) == len(others)


# ---- blocks found once ----


@pytest.mark.parametrize("quantize", [quantize_q4_1, quantize_q8_0])
def test_joined_blocks_are_the_fused_weights_own(quantize: Quantize) -> None:
    parts = [quantize(weight(out, 96, seed)) for out, seed in ((37, 0), (16, 1), (16, 2))]
    found = [find_blocks(p) for p in parts]
    assert all(f is not None for f in found)
    assert same_blocks(Blocks.joined([f for f in found if f is not None]), find_blocks(torch.cat(parts)))


def test_joined_blocks_whose_parts_took_other_steps_are_the_fused_weights_own() -> None:
    """A part whose first scale guesses rebuild (no neighbour step) beside one whose guesses do not."""
    blocks = 8
    stepped, _ = q4_1_with_large_minimums(64, blocks)
    plain = quantize_q4_1(weight(out=16, in_=blocks * 32))
    parts = [plain, stepped, plain]
    found = [find_blocks(p) for p in parts]
    assert all(f is not None for f in found)
    assert same_blocks(Blocks.joined([f for f in found if f is not None]), find_blocks(torch.cat(parts)))


def test_blocks_of_two_formats_do_not_join() -> None:
    q4, q8 = find_blocks(quantize_q4_1(weight(8, 64))), find_blocks(quantize_q8_0(weight(8, 64)))
    assert q4 is not None and q8 is not None and q4.block_format != q8.block_format
    assert Blocks.joined([q4, q8]) is None


@needs_kernel
def test_a_decoder_packed_from_blocks_found_once_packs_what_each_product_finds(cache: Path) -> None:
    model = gguf_like(tiny_llama(vocab_size=64, seed=3))
    found = find_layer_blocks(model)
    assert found is not None and len(found) == len(model.model.layers)
    once, each = LlamaDecoder(model, "blocks", ONEDNN_ROWS, found), LlamaDecoder(model, "blocks", ONEDNN_ROWS)
    for a, b in zip(once.blocks, each.blocks, strict=True):
        for product in ("qkv", "o", "gate_up", "down"):
            packed_a, packed_b = getattr(a, product).blocks, getattr(b, product).blocks
            assert packed_a is not None and packed_b is not None
            assert packed_a.kernel_args()[1] == packed_b.kernel_args()[1]
            assert same_bits(packed_a.kernel_args()[0], packed_b.kernel_args()[0])
    assert find_layer_blocks(tiny_llama(vocab_size=64, seed=3)) is None, "trained-like weights are no blocks"


@needs_kernel
def test_blocks_of_another_shape_are_refused() -> None:
    w, other = quantize_q4_1(weight(32, 64)), find_blocks(quantize_q4_1(weight(16, 64)))
    with pytest.raises(ValueError, match="blocks of a"):
        PackedLinear(w, None, "blocks", (), blocks=other)
