"""The pool of KV cache blocks: reference counts, a free queue and the prefix cache (L2, no torch).

Modelled on vLLM v1's `BlockPool` (our own code). A KV cache block holds the keys and values of
`block_size` consecutive token positions of one sequence; this module only does the
bookkeeping and speaks block ids: the tensors live in the worker.

Free queue and eviction. Every block with `ref_cnt == 0` sits in one free queue, ordered by
when it was freed. `get_new_blocks` takes blocks from the head, so the block freed earliest is
reused (evicted) first: least recently used. A freed block keeps its `block_hash`, so a later
request with the same prefix can still hit it until it is evicted; `touch` takes such a block
back out of the middle of the queue in O(1) (an `OrderedDict` keyed by block id). Callers free
a request's blocks tail first (see `KVCacheManager.free`), so the tail of a cached prefix is
evicted before its head and the head stays reusable longest. A freed block with no hash (a
partial block, or a duplicate of a block already cached) can never be hit, so it goes to the
head of the queue and is reused before any cached block.

Prefix cache. A map block_hash -> block holds at most one block per hash; `cache_full_block`
registers a full, computed block and `get_new_blocks` drops the entry of a block it reuses.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass

BlockHash = bytes
"""The hash of a full block of token ids chained with its parent's (see `kv_cache_manager`)."""


class OutOfBlocksError(RuntimeError):
    """Raised by `BlockPool.get_new_blocks` when fewer blocks are free than asked for."""


@dataclass(slots=True)
class KVCacheBlock:
    """One KV cache block's bookkeeping.

    Attributes:
        block_id: index of the block in the worker's KV cache tensors, in [0, num_blocks).
        ref_cnt: number of requests whose block table holds this block; 0 means free.
        block_hash: the prefix-cache key of its tokens once it is full and computed, else None.
    """

    block_id: int
    ref_cnt: int = 0
    block_hash: BlockHash | None = None


@dataclass(slots=True)
class PrefixCacheStats:
    """Prefix-cache counters, in tokens.

    Attributes:
        num_queries: prefix-cache lookups (one per admitted request, resumes included).
        num_query_tokens: tokens of the looked-up prompts.
        num_hit_tokens: tokens found computed in the cache (a multiple of block_size).
    """

    num_queries: int = 0
    num_query_tokens: int = 0
    num_hit_tokens: int = 0

    def record(self, num_query_tokens: int, num_hit_tokens: int) -> None:
        self.num_queries += 1
        self.num_query_tokens += num_query_tokens
        self.num_hit_tokens += num_hit_tokens

    @property
    def hit_rate(self) -> float:
        """Fraction of queried tokens found in the cache; 0.0 before any query."""
        if self.num_query_tokens == 0:
            return 0.0
        return self.num_hit_tokens / self.num_query_tokens


def check_count(name: str, value: int, minimum: int) -> None:
    """Raise ValueError naming `name` and `value` unless `value` is an int >= `minimum`."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"invalid {name}={value!r}: must be an int >= {minimum}")


class BlockPool:
    """A fixed set of KV cache blocks with reference counts, an LRU free queue and a prefix cache.

    Args:
        num_blocks: number of KV cache blocks (ids 0 .. num_blocks - 1).

    Raises:
        ValueError: `num_blocks` is not an int >= 1.
    """

    def __init__(self, num_blocks: int) -> None:
        check_count("num_blocks", num_blocks, 1)
        self.num_blocks = num_blocks
        self.blocks = [KVCacheBlock(block_id) for block_id in range(num_blocks)]
        # block_id -> block, head first; holds exactly the blocks with ref_cnt == 0.
        self._free_queue: OrderedDict[int, KVCacheBlock] = OrderedDict(
            (block.block_id, block) for block in self.blocks)
        self._cached_blocks: dict[BlockHash, KVCacheBlock] = {}
        self.prefix_cache_stats = PrefixCacheStats()

    @property
    def num_free_blocks(self) -> int:
        """Blocks with ref_cnt 0 (cached-but-free blocks included: they can be evicted)."""
        return len(self._free_queue)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free_queue)

    @property
    def num_cached_blocks(self) -> int:
        """Entries in the prefix cache, in use or free."""
        return len(self._cached_blocks)

    @property
    def usage(self) -> float:
        """Fraction of blocks in use (ref_cnt > 0), in [0, 1]."""
        return self.num_used_blocks / self.num_blocks

    def is_free(self, block: KVCacheBlock) -> bool:
        return block.block_id in self._free_queue

    def free_block_ids(self) -> list[int]:
        """The free queue, head (next to be evicted) first."""
        return list(self._free_queue)

    def get_new_blocks(self, num_new_blocks: int) -> list[KVCacheBlock]:
        """Take `num_new_blocks` blocks from the head of the free queue, each with ref_cnt 1.

        A reused block loses its prefix-cache entry (its old contents are overwritten).

        Raises:
            ValueError: `num_new_blocks` is not an int >= 0.
            OutOfBlocksError: fewer than `num_new_blocks` blocks are free (nothing is taken).
        """
        check_count("num_new_blocks", num_new_blocks, 0)
        if num_new_blocks > len(self._free_queue):
            raise OutOfBlocksError(
                f"cannot allocate num_new_blocks={num_new_blocks}: only "
                f"{len(self._free_queue)} of {self.num_blocks} KV cache blocks are free")
        new_blocks = []
        for _ in range(num_new_blocks):
            _, block = self._free_queue.popitem(last=False)
            self._evict_cached_block(block)
            block.ref_cnt = 1
            new_blocks.append(block)
        return new_blocks

    def free_blocks(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference to each block; a block reaching ref_cnt 0 joins the free queue.

        Blocks are freed in the order given, so the first one given is evicted first: pass a
        request's blocks tail first. A freed block keeps its hash (it can still be hit); one
        with no hash goes to the head of the queue.

        Raises:
            ValueError: a block would drop below ref_cnt 0 (nothing is freed).
        """
        blocks = list(blocks)
        for block_id, num_refs in Counter(block.block_id for block in blocks).items():
            if self.blocks[block_id].ref_cnt < num_refs:
                raise ValueError(
                    f"cannot free block {block_id} {num_refs} time(s): its ref_cnt is "
                    f"{self.blocks[block_id].ref_cnt}")
        for block in blocks:
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self._free_queue[block.block_id] = block
                if block.block_hash is None:
                    self._free_queue.move_to_end(block.block_id, last=False)

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Add one reference to each block, taking free ones out of the free queue.

        Used for prefix-cache hits: the blocks are shared, not copied.
        """
        for block in blocks:
            if block.ref_cnt == 0:
                del self._free_queue[block.block_id]
            block.ref_cnt += 1

    def get_cached_block(self, block_hash: BlockHash) -> KVCacheBlock | None:
        """The block cached under `block_hash` (in use or free), or None on a miss."""
        return self._cached_blocks.get(block_hash)

    def cache_full_block(self, block: KVCacheBlock, block_hash: BlockHash) -> bool:
        """Register a full, computed block under `block_hash`.

        Returns:
            True if the block is now cached under `block_hash`; False if another block already
            is (the block stays uncached: one block per hash).

        Raises:
            ValueError: the block is free, or is already cached under a different hash.
        """
        if block.ref_cnt == 0:
            raise ValueError(f"cannot cache block {block.block_id}: it is free (ref_cnt 0)")
        if block.block_hash is not None:
            if block.block_hash != block_hash:
                raise ValueError(f"block {block.block_id} is already cached under another hash")
            return True
        if block_hash in self._cached_blocks:
            return False
        block.block_hash = block_hash
        self._cached_blocks[block_hash] = block
        return True

    def reset_prefix_cache(self) -> int:
        """Forget every prefix-cache entry (blocks in use keep their contents and owners).

        Returns:
            the number of entries dropped.
        """
        num_dropped = len(self._cached_blocks)
        for block in self._cached_blocks.values():
            block.block_hash = None
        self._cached_blocks.clear()
        return num_dropped

    def _evict_cached_block(self, block: KVCacheBlock) -> None:
        if block.block_hash is not None:
            del self._cached_blocks[block.block_hash]
            block.block_hash = None
