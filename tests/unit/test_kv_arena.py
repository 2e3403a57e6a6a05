"""The KV arena: regions in preallocated memory, growth, moves and compaction keep the data."""

from __future__ import annotations

import torch

from target_service.kv_arena import BLOCK_TOKENS, KVArena, Region, bytes_per_token


def arena(tokens: int = 256) -> KVArena:
    return KVArena(num_layers=2, num_kv_heads=2, head_dim=4, capacity_tokens=tokens, dtype=torch.float32)


def fill(a: KVArena, region: Region, length: int, value: float) -> None:
    """Write ``length`` tokens whose keys encode (value, position) and whose values are their negation."""
    for layer in range(len(a.keys)):
        keys = value + torch.arange(length, dtype=torch.float32)[None, :, None].expand(2, length, 4) / 1000
        a.write(layer, region, 0, keys, -keys)
    region.length = length


def check(a: KVArena, region: Region, value: float) -> None:
    for layer in range(len(a.keys)):
        keys, values = a.read(layer, region, region.length)
        expected = value + torch.arange(region.length, dtype=torch.float32)[None, :, None].expand(2, -1, 4) / 1000
        torch.testing.assert_close(keys, expected)
        torch.testing.assert_close(values, -expected)


def test_sizes_and_accounting_are_in_bytes() -> None:
    a = arena(250)
    assert a.capacity_tokens == 240  # whole blocks
    assert a.bytes_per_token == bytes_per_token(2, 2, 4, torch.float32) == 2 * 2 * 2 * 4 * 4
    assert a.capacity_bytes == 240 * a.bytes_per_token and a.used_bytes == 0
    region = a.allocate(20)
    assert region is not None and region.capacity == 2 * BLOCK_TOKENS
    assert a.used_bytes == 32 * a.bytes_per_token
    a.free(region)
    assert a.used_bytes == 0 and a.free_tokens == 240


def test_allocation_fails_when_full_and_freed_space_coalesces() -> None:
    a = arena(64)
    regions = [a.allocate(16) for _ in range(4)]
    assert all(r is not None for r in regions) and a.allocate(1) is None
    for r in regions[1:3]:
        assert r is not None
        a.free(r)
    big = a.allocate(32)  # the two freed neighbours became one range
    assert big is not None and big.start == 16


def test_growth_in_place_then_by_moving_keeps_the_data() -> None:
    a = arena(256)
    first = a.allocate(16)
    assert first is not None
    fill(a, first, 10, 1.0)
    assert a.reserve(first, 40, limit=1000) and first.start == 0 and a.num_moves == 0  # grew in place
    blocker = a.allocate(16)
    assert blocker is not None
    assert a.reserve(first, 100, limit=1000) and first.start != 0 and a.num_moves == 1
    check(a, first, 1.0)


def test_fragmented_memory_is_compacted_to_make_room() -> None:
    a = arena(128)
    pieces = [a.allocate(16) for _ in range(8)]
    for i, piece in enumerate(pieces):
        assert piece is not None
        fill(a, piece, 5 + i, float(i))
    for piece in pieces[::2]:
        assert piece is not None
        a.free(piece)  # 64 tokens free, in four separate holes
    kept = [p for p in pieces[1::2] if p is not None]
    assert a.reserve(kept[0], 64, limit=64)  # needs its 16 plus 48 of the holes: only after compaction
    assert a.num_compactions == 1 and kept[0].capacity >= 64
    for i, piece in zip(range(1, 8, 2), kept, strict=True):
        check(a, piece, float(i))
    assert a.free_tokens == 128 - 3 * 16 - 64


def test_reserve_fails_cleanly_when_memory_is_short() -> None:
    a = arena(64)
    region = a.allocate(16)
    other = a.allocate(48)
    assert region is not None and other is not None
    fill(a, region, 8, 3.0)
    assert not a.reserve(region, 40, limit=1000)
    check(a, region, 3.0)  # untouched


def test_keep_moves_only_the_accepted_entries_into_place() -> None:
    a = arena(64)
    region = a.allocate(32)
    assert region is not None
    fill(a, region, 12, 0.0)  # entries 0..11; pretend 4..11 are the pending token and a tree
    a.keep(region, 4, [0, 3, 5])  # pending (row 0), then nodes at rows 3 and 5
    assert region.length == 7
    keys, _ = a.read(0, region, 7)
    torch.testing.assert_close(keys[0, :, 0], torch.tensor([0, 1, 2, 3, 4, 7, 9], dtype=torch.float32) / 1000)
