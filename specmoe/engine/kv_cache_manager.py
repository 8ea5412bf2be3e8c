"""Per-request KV cache block tables with prefix caching and lookahead slots (L2, no torch).

Modelled on vLLM v1's `KVCacheManager` (our own code). It speaks request ids, token ids, token
counts and block ids; the scheduler owns each request's `num_computed_tokens` and passes it in.

One request's life:

1. Admission: `get_computed_blocks(request_id, token_ids)` finds the longest prefix of full
   blocks already in the prefix cache, then `allocate_slots(..., new_computed_blocks=blocks,
   num_computed_tokens=num_hit_tokens)` takes them (shared, ref_cnt += 1) plus new blocks for
   the tokens to compute. Call the two back to back, with no other allocation in between: a hit
   block that is free could otherwise be evicted.
2. Every step: `allocate_slots(request_id, token_ids, num_new_tokens, num_lookahead_tokens,
   num_computed_tokens=...)` makes room for num_computed + num_new + num_lookahead tokens. The
   lookahead slots hold the K draft tokens verified in the step. It returns None, allocating
   nothing, when blocks run out: the scheduler then preempts (`free`) and retries.
3. After verification rejects drafts: `free_excess(request_id, num_tokens_kept)` gives back
   the whole blocks past the kept tokens.
4. Finish, abort or preemption: `free(request_id)` returns every block, tail first.

Block hashing (prefix-cache keys). Only FULL blocks whose tokens are all computed are cached,
and only once computed: at the next `allocate_slots` (or an explicit `cache_blocks`) for the
request, whose `num_computed_tokens` says which tokens hold KV. The key of block i is
sha256(key of block i-1, or 32 zero bytes for block 0 || its token ids as int64 in machine
byte order): it chains the whole prefix, so equal tokens under a different prefix do not hit.
Keys are deterministic within a process and across processes on one machine; sha256 (not
Python's 64-bit `hash`) keeps collisions, which would silently reuse the wrong KV, negligible.

Invariants (checked by `check_invariants`):
- a request's block table holds exactly ceil(num_allocated_tokens / block_size) blocks, where
  num_allocated_tokens is the largest slot count asked for since the last `free_excess`;
- each block's ref_cnt equals the number of block tables that hold it;
- the blocks with ref_cnt 0 are exactly those in the free queue, so free + used == num_blocks;
- a prefix-cache entry maps a hash to a block carrying that hash.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

from specmoe.engine.block_pool import BlockHash, BlockPool, KVCacheBlock, check_count

_ROOT_HASH = bytes(32)


LOOKAHEAD_SLOTS = 16  # slots beyond a request's tokens that a cache is sized for


def blocks_for_requests(num_requests: int, tokens_per_request: int, block_size: int) -> int:
    """Blocks that hold `num_requests` requests of `tokens_per_request` tokens each plus
    LOOKAHEAD_SLOTS (room for a step's drafts), each request in whole blocks."""
    return num_requests * -(-(tokens_per_request + LOOKAHEAD_SLOTS) // block_size)


def hash_block_tokens(parent_hash: BlockHash | None, token_ids: Sequence[int]) -> BlockHash:
    """The prefix-cache key of one full block: sha256(parent key || token ids as int64).

    Args:
        parent_hash: the key of the previous block of the sequence; None for the first block.
        token_ids: the block's block_size token ids.

    Returns:
        a 32-byte digest.
    """
    hasher = hashlib.sha256(_ROOT_HASH if parent_hash is None else parent_hash)
    hasher.update(array("q", token_ids).tobytes())
    return hasher.digest()


@dataclass(slots=True)
class _RequestBlocks:
    """One request's block table.

    Attributes:
        blocks: the block table; block i holds token positions [i * block_size, (i+1) *
            block_size).
        block_hashes: keys of the leading full computed blocks already offered to the prefix
            cache, in order (the chain's parents).
        num_allocated_tokens: token slots the block table was sized for.
    """

    blocks: list[KVCacheBlock] = field(default_factory=list)
    block_hashes: list[BlockHash] = field(default_factory=list)
    num_allocated_tokens: int = 0


class KVCacheManager:
    """Block tables of running requests over one `BlockPool`.

    Args:
        num_blocks: KV cache blocks in the pool.
        block_size: token positions per block.
        enable_prefix_caching: reuse full computed blocks across requests with equal prefixes.

    Raises:
        ValueError: `num_blocks` or `block_size` is not an int >= 1.
    """

    def __init__(self, num_blocks: int, block_size: int,
                 enable_prefix_caching: bool = True) -> None:
        check_count("num_blocks", num_blocks, 1)
        check_count("block_size", block_size, 1)
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.block_pool = BlockPool(num_blocks)
        self._requests: dict[str, _RequestBlocks] = {}

    @property
    def num_free_blocks(self) -> int:
        return self.block_pool.num_free_blocks

    @property
    def usage(self) -> float:
        """Fraction of KV cache blocks in use, in [0, 1]."""
        return self.block_pool.usage

    @property
    def prefix_cache_hit_rate(self) -> float:
        """Prefix-cache hit tokens / queried prompt tokens since construction (0.0 if none)."""
        return self.block_pool.prefix_cache_stats.hit_rate

    @property
    def num_requests(self) -> int:
        return len(self._requests)

    def has_request(self, request_id: str) -> bool:
        return request_id in self._requests

    def num_blocks_for(self, num_tokens: int) -> int:
        """Blocks needed for `num_tokens` token slots: ceil(num_tokens / block_size)."""
        return -(-num_tokens // self.block_size)

    def get_block_ids(self, request_id: str) -> list[int]:
        """The request's block table (block ids in position order).

        Raises:
            ValueError: `request_id` holds no blocks.
        """
        return [block.block_id for block in self._get_request(request_id).blocks]

    def get_computed_blocks(self, request_id: str, token_ids: Sequence[int],
                            record_stats: bool = True) -> tuple[list[KVCacheBlock], int]:
        """The longest prefix of `token_ids` whose full blocks are in the prefix cache.

        At least the last token is always left to compute (its logits are needed), so a
        prompt of n tokens hits at most (n - 1) // block_size blocks. Takes no reference: pass
        the blocks to `allocate_slots` next.

        Args:
            request_id: a request that holds no blocks yet (new, or preempted and freed).
            token_ids: the request's tokens (prompt, plus outputs when resuming).
            record_stats: record the lookup in the prefix-cache statistics now; a caller that
                may fail to admit the request passes False and calls `record_prefix_query`
                once it is admitted.

        Returns:
            (hit blocks in position order, number of computed tokens = len(blocks) *
            block_size); ([], 0) when prefix caching is disabled.

        Raises:
            ValueError: `request_id` already holds blocks.
        """
        if request_id in self._requests:
            raise ValueError(f"request {request_id!r} already holds KV cache blocks; "
                             "get_computed_blocks is for requests being admitted")
        if not self.enable_prefix_caching:
            return [], 0
        hit_blocks: list[KVCacheBlock] = []
        parent_hash = None
        for start in range(0, (len(token_ids) - 1) // self.block_size * self.block_size,
                           self.block_size):
            parent_hash = hash_block_tokens(parent_hash,
                                            token_ids[start:start + self.block_size])
            block = self.block_pool.get_cached_block(parent_hash)
            if block is None:
                break
            hit_blocks.append(block)
        num_hit_tokens = len(hit_blocks) * self.block_size
        if record_stats:
            self.record_prefix_query(len(token_ids), num_hit_tokens)
        return hit_blocks, num_hit_tokens

    def record_prefix_query(self, num_query_tokens: int, num_hit_tokens: int) -> None:
        """Count one admission's prefix-cache lookup in the hit-rate statistics."""
        self.block_pool.prefix_cache_stats.record(num_query_tokens, num_hit_tokens)

    def allocate_slots(self, request_id: str, token_ids: Sequence[int], num_new_tokens: int,
                       num_lookahead_tokens: int = 0,
                       new_computed_blocks: Sequence[KVCacheBlock] | None = None, *,
                       num_computed_tokens: int) -> list[int] | None:
        """Make room for num_computed + num_new + num_lookahead tokens of a request.

        Also offers the request's newly full computed blocks to the prefix cache.

        Args:
            request_id: the request; it is registered on its first successful call.
            token_ids: its verified tokens so far (prompt + outputs); at least the first
                `num_computed_tokens` of them must hold KV in its blocks.
            num_new_tokens: tokens to compute this step (prompt chunk, or the last token).
            num_lookahead_tokens: extra slots written this step, e.g. the K draft tokens.
            new_computed_blocks: prefix-cache hits from `get_computed_blocks`; only when the
                request holds no blocks yet.
            num_computed_tokens: tokens whose KV is already in its blocks (hits included).

        Returns:
            the ids of the blocks appended to its block table (possibly []), or None when too
            few blocks are free: then nothing changes.

        Raises:
            ValueError: a count is negative, `num_computed_tokens` exceeds `len(token_ids)` or
                the slots the request holds, or `new_computed_blocks` is given for a request
                that already holds blocks, with prefix caching disabled, or is no longer cached.
        """
        for name, value in (("num_new_tokens", num_new_tokens),
                            ("num_lookahead_tokens", num_lookahead_tokens),
                            ("num_computed_tokens", num_computed_tokens)):
            check_count(name, value, 0)
        state = self._requests.get(request_id)
        if state is None:
            state = _RequestBlocks()
        computed_blocks = list(new_computed_blocks or ())
        self._check_computed(request_id, state, token_ids, computed_blocks, num_computed_tokens)
        num_tokens = num_computed_tokens + num_new_tokens + num_lookahead_tokens
        num_held = len(state.blocks) + len(computed_blocks)
        num_new_blocks = max(0, self.num_blocks_for(num_tokens) - num_held)
        num_evictable = sum(1 for block in computed_blocks if block.ref_cnt == 0)
        if num_new_blocks > self.block_pool.num_free_blocks - num_evictable:
            return None
        self._requests[request_id] = state
        if computed_blocks:
            self.block_pool.touch(computed_blocks)
            state.blocks.extend(computed_blocks)
            state.block_hashes = [block.block_hash for block in computed_blocks]
            state.num_allocated_tokens = len(computed_blocks) * self.block_size
        new_blocks = self.block_pool.get_new_blocks(num_new_blocks)
        state.blocks.extend(new_blocks)
        state.num_allocated_tokens = max(state.num_allocated_tokens, num_tokens)
        self._cache_full_blocks(state, token_ids, num_computed_tokens)
        return [block.block_id for block in new_blocks]

    def cache_blocks(self, request_id: str, token_ids: Sequence[int],
                     num_computed_tokens: int) -> None:
        """Offer the request's full computed blocks to the prefix cache now.

        `allocate_slots` does this on the next step anyway; call it after a step to make the
        blocks hittable by requests admitted before then.

        Raises:
            ValueError: `request_id` holds no blocks, or `num_computed_tokens` exceeds
                `len(token_ids)` or its allocated slots.
        """
        state = self._get_request(request_id)
        self._check_computed(request_id, state, token_ids, [], num_computed_tokens)
        self._cache_full_blocks(state, token_ids, num_computed_tokens)

    def free_excess(self, request_id: str, num_tokens_kept: int) -> int:
        """Give back the whole blocks past the first `num_tokens_kept` tokens (tail first).

        Called after verification with the request's new num_computed_tokens: the slots of
        rejected draft tokens are returned; a partly kept block stays.

        Returns:
            the number of blocks freed.

        Raises:
            ValueError: `request_id` holds no blocks; `num_tokens_kept` is negative, exceeds
                its allocated slots, or cuts into a block already in the prefix cache.
        """
        state = self._get_request(request_id)
        check_count("num_tokens_kept", num_tokens_kept, 0)
        if num_tokens_kept > state.num_allocated_tokens:
            raise ValueError(f"invalid num_tokens_kept={num_tokens_kept}: request "
                             f"{request_id!r} holds only {state.num_allocated_tokens} slots")
        num_cached_tokens = len(state.block_hashes) * self.block_size
        if num_tokens_kept < num_cached_tokens:
            raise ValueError(f"invalid num_tokens_kept={num_tokens_kept}: request "
                             f"{request_id!r} has {num_cached_tokens} tokens in prefix-cached "
                             "blocks, which must not be rewritten (use free to drop them)")
        num_kept_blocks = self.num_blocks_for(num_tokens_kept)
        excess_blocks = state.blocks[num_kept_blocks:]
        del state.blocks[num_kept_blocks:]
        self.block_pool.free_blocks(reversed(excess_blocks))
        state.num_allocated_tokens = num_tokens_kept
        return len(excess_blocks)

    def free(self, request_id: str) -> None:
        """Return all of a request's blocks, tail first (its cached blocks stay hittable).

        Raises:
            ValueError: `request_id` holds no blocks.
        """
        state = self._get_request(request_id)
        del self._requests[request_id]
        self.block_pool.free_blocks(reversed(state.blocks))

    def reset_prefix_cache(self) -> int:
        """Drop every prefix-cache entry; returns how many were dropped."""
        return self.block_pool.reset_prefix_cache()

    def check_invariants(self) -> None:
        """Raise AssertionError if the bookkeeping invariants of the module docstring fail."""
        pool = self.block_pool
        num_refs: Counter[int] = Counter()
        for request_id, state in self._requests.items():
            if len(state.blocks) != self.num_blocks_for(state.num_allocated_tokens):
                raise AssertionError(f"request {request_id!r} holds {len(state.blocks)} blocks "
                                     f"for {state.num_allocated_tokens} slots")
            num_refs.update(block.block_id for block in state.blocks)
        for block in pool.blocks:
            if block.ref_cnt != num_refs[block.block_id]:
                raise AssertionError(f"block {block.block_id} has ref_cnt {block.ref_cnt} but "
                                     f"{num_refs[block.block_id]} owners")
            if (block.ref_cnt == 0) != pool.is_free(block):
                raise AssertionError(f"block {block.block_id} (ref_cnt {block.ref_cnt}) is "
                                     f"{'' if pool.is_free(block) else 'not '}in the free queue")
            cached = None if block.block_hash is None else pool.get_cached_block(block.block_hash)
            if block.block_hash is not None and cached is not block:
                raise AssertionError(f"block {block.block_id} carries a hash not cached to it")
        if pool.num_free_blocks + pool.num_used_blocks != self.num_blocks:
            raise AssertionError("free + used blocks != num_blocks")

    def _get_request(self, request_id: str) -> _RequestBlocks:
        state = self._requests.get(request_id)
        if state is None:
            raise ValueError(f"unknown request_id={request_id!r}: it holds no KV cache blocks")
        return state

    def _check_computed(self, request_id: str, state: _RequestBlocks, token_ids: Sequence[int],
                        computed_blocks: list[KVCacheBlock], num_computed_tokens: int) -> None:
        if num_computed_tokens > len(token_ids):
            raise ValueError(f"invalid num_computed_tokens={num_computed_tokens}: request "
                             f"{request_id!r} has only {len(token_ids)} token ids")
        if computed_blocks:
            self._check_new_computed_blocks(request_id, state, computed_blocks)
        num_slots = max(state.num_allocated_tokens, len(computed_blocks) * self.block_size)
        if num_computed_tokens > num_slots:
            raise ValueError(f"invalid num_computed_tokens={num_computed_tokens}: request "
                             f"{request_id!r} holds only {num_slots} KV slots")

    def _check_new_computed_blocks(self, request_id: str, state: _RequestBlocks,
                                   computed_blocks: list[KVCacheBlock]) -> None:
        if state.blocks:
            raise ValueError(f"new_computed_blocks given for request {request_id!r}, which "
                             "already holds blocks; prefix hits are only taken on admission")
        if not self.enable_prefix_caching:
            raise ValueError("new_computed_blocks given but prefix caching is disabled")
        for block in computed_blocks:
            if (block.block_hash is None
                    or self.block_pool.get_cached_block(block.block_hash) is not block):
                raise ValueError(f"block {block.block_id} in new_computed_blocks is no longer "
                                 "in the prefix cache; call get_computed_blocks again")

    def _cache_full_blocks(self, state: _RequestBlocks, token_ids: Sequence[int],
                           num_computed_tokens: int) -> None:
        if not self.enable_prefix_caching:
            return
        num_full_blocks = min(num_computed_tokens // self.block_size, len(state.blocks))
        for index in range(len(state.block_hashes), num_full_blocks):
            parent_hash = state.block_hashes[-1] if state.block_hashes else None
            start = index * self.block_size
            block_hash = hash_block_tokens(parent_hash, token_ids[start:start + self.block_size])
            state.block_hashes.append(block_hash)
            self.block_pool.cache_full_block(state.blocks[index], block_hash)
