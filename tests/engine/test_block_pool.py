"""BlockPool: reference counts, the LRU free queue and the prefix-cache map (no torch)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from specmoe.engine.block_pool import BlockPool, OutOfBlocksError


def _cached_pool(num_blocks: int) -> tuple[BlockPool, list]:
    """A pool whose blocks are all in use, block i cached under hash bytes([i])."""
    pool = BlockPool(num_blocks)
    blocks = pool.get_new_blocks(num_blocks)
    for block in blocks:
        assert pool.cache_full_block(block, bytes([block.block_id]))
    return pool, blocks


def test_allocate_and_free_exact_counts():
    pool = BlockPool(8)
    assert (pool.num_free_blocks, pool.usage) == (8, 0.0)
    blocks = pool.get_new_blocks(3)
    assert [b.block_id for b in blocks] == [0, 1, 2]
    assert all(b.ref_cnt == 1 for b in blocks)
    assert (pool.num_free_blocks, pool.num_used_blocks, pool.usage) == (5, 3, 3 / 8)
    pool.free_blocks(blocks[:2])
    assert pool.num_free_blocks == 7
    pool.free_blocks(blocks[2:])
    assert (pool.num_free_blocks, pool.usage) == (8, 0.0)
    assert pool.get_new_blocks(0) == []


def test_get_new_blocks_out_of_blocks_takes_nothing():
    pool = BlockPool(4)
    pool.get_new_blocks(3)
    with pytest.raises(OutOfBlocksError, match="num_new_blocks=2.*only 1 of 4"):
        pool.get_new_blocks(2)
    assert pool.num_free_blocks == 1


def test_shared_reference_counts():
    pool = BlockPool(4)
    block = pool.get_new_blocks(1)[0]
    pool.touch([block])
    assert block.ref_cnt == 2
    pool.free_blocks([block])
    assert (block.ref_cnt, pool.num_free_blocks) == (1, 3)
    pool.free_blocks([block])
    assert (block.ref_cnt, pool.num_free_blocks) == (0, 4)


def test_over_free_raises_and_frees_nothing():
    pool = BlockPool(4)
    a, b = pool.get_new_blocks(2)
    with pytest.raises(ValueError, match="block 1 2 time"):
        pool.free_blocks([a, b, b])
    assert (a.ref_cnt, b.ref_cnt, pool.num_free_blocks) == (1, 1, 2)
    pool.free_blocks([a])
    with pytest.raises(ValueError, match="block 0.*ref_cnt is 0"):
        pool.free_blocks([a])


def test_freed_cached_block_keeps_hash_and_can_be_touched_back():
    pool, blocks = _cached_pool(4)
    pool.free_blocks([blocks[2]])
    assert pool.get_cached_block(bytes([2])) is blocks[2]
    assert blocks[2].block_hash == bytes([2]) and pool.is_free(blocks[2])
    pool.touch([blocks[2]])  # a prefix hit takes it out of the middle of the free queue
    assert (blocks[2].ref_cnt, pool.num_free_blocks) == (1, 0)
    with pytest.raises(OutOfBlocksError):
        pool.get_new_blocks(1)


def test_lru_eviction_order_and_hash_dropped_on_reuse():
    pool, blocks = _cached_pool(4)
    pool.free_blocks([blocks[3], blocks[1]])  # a request's blocks, tail first
    pool.free_blocks([blocks[0]])  # freed later
    assert pool.free_block_ids() == [3, 1, 0]
    reused = pool.get_new_blocks(2)
    assert [b.block_id for b in reused] == [3, 1]
    assert all(b.block_hash is None for b in reused)
    assert pool.get_cached_block(bytes([3])) is None and pool.get_cached_block(bytes([1])) is None
    assert pool.get_cached_block(bytes([0])) is blocks[0]
    assert pool.num_cached_blocks == 2  # blocks 0 (free) and 2 (in use)


def test_uncached_blocks_are_evicted_before_cached_ones():
    pool = BlockPool(3)
    cached, partial, other = pool.get_new_blocks(3)
    pool.cache_full_block(cached, b"h")
    pool.free_blocks([cached])
    pool.free_blocks([partial, other])  # no hash: nothing can hit them
    assert pool.free_block_ids()[-1] == cached.block_id
    assert cached not in pool.get_new_blocks(2)


def test_cache_full_block_one_block_per_hash():
    pool = BlockPool(3)
    first, duplicate, free = pool.get_new_blocks(3)
    pool.free_blocks([free])
    assert pool.cache_full_block(first, b"h")
    assert pool.cache_full_block(first, b"h")  # idempotent
    assert not pool.cache_full_block(duplicate, b"h")
    assert duplicate.block_hash is None and pool.get_cached_block(b"h") is first
    with pytest.raises(ValueError, match="block 0 is already cached"):
        pool.cache_full_block(first, b"other")
    with pytest.raises(ValueError, match="block 2.*free"):
        pool.cache_full_block(free, b"x")


def test_reset_prefix_cache():
    pool, blocks = _cached_pool(3)
    pool.free_blocks([blocks[0]])
    assert pool.reset_prefix_cache() == 3
    assert pool.num_cached_blocks == 0 and all(b.block_hash is None for b in blocks)
    assert pool.get_cached_block(bytes([0])) is None


def test_prefix_cache_stats_in_tokens():
    pool = BlockPool(1)
    assert pool.prefix_cache_stats.hit_rate == 0.0
    pool.prefix_cache_stats.record(num_query_tokens=10, num_hit_tokens=8)
    pool.prefix_cache_stats.record(num_query_tokens=30, num_hit_tokens=0)
    stats = pool.prefix_cache_stats
    assert (stats.num_queries, stats.num_query_tokens, stats.num_hit_tokens) == (2, 40, 8)
    assert stats.hit_rate == pytest.approx(0.2)


@pytest.mark.parametrize("num_blocks", [0, -3, 2.0, True])
def test_bad_num_blocks_is_named(num_blocks):
    with pytest.raises(ValueError, match=f"num_blocks={num_blocks!r}"):
        BlockPool(num_blocks)


def test_bad_num_new_blocks_is_named():
    with pytest.raises(ValueError, match="num_new_blocks=-1"):
        BlockPool(2).get_new_blocks(-1)


def test_scheduling_layer_does_not_import_torch_or_numpy():
    code = ("import sys, specmoe.engine.block_pool, specmoe.engine.kv_cache_manager, "
            "specmoe.engine.scheduler, specmoe.engine.stats; "
            "print(sorted(m for m in ('torch', 'numpy') if m in sys.modules))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            check=True)
    assert result.stdout.strip() == "[]"
