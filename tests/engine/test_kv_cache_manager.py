"""KVCacheManager: block tables, prefix hits, lookahead slots and rollback, no leaks (no torch).

Token ids are small ints; a "step" is simulated by the counts the scheduler would pass.
"""

from __future__ import annotations

import random

import pytest

from specmoe.engine.kv_cache_manager import KVCacheManager, hash_block_tokens


def _admit(manager: KVCacheManager, request_id: str, token_ids: list[int],
           num_new_tokens: int | None = None) -> tuple[list[int] | None, int]:
    """Admit a request the way the scheduler does; returns (new block ids, hit tokens)."""
    blocks, num_hit_tokens = manager.get_computed_blocks(request_id, token_ids)
    if num_new_tokens is None:
        num_new_tokens = len(token_ids) - num_hit_tokens
    new_block_ids = manager.allocate_slots(request_id, token_ids, num_new_tokens,
                                           new_computed_blocks=blocks,
                                           num_computed_tokens=num_hit_tokens)
    return new_block_ids, num_hit_tokens


def _computed_request(manager: KVCacheManager, request_id: str, token_ids: list[int]) -> None:
    """Admit a request, compute its whole prompt and offer its full blocks to the cache."""
    assert _admit(manager, request_id, token_ids)[0] is not None
    manager.cache_blocks(request_id, token_ids, num_computed_tokens=len(token_ids))


def test_allocate_and_free_exact_counts():
    manager = KVCacheManager(num_blocks=10, block_size=4)
    assert manager.allocate_slots("a", list(range(10)), 10, num_computed_tokens=0) == [0, 1, 2]
    assert (manager.num_free_blocks, manager.usage) == (7, 0.3)
    assert manager.get_block_ids("a") == [0, 1, 2]
    # A decode step that still fits in the last block allocates nothing.
    assert manager.allocate_slots("a", list(range(11)), 1, num_computed_tokens=10) == []
    assert manager.allocate_slots("b", [1], 1, num_computed_tokens=0) == [3]
    manager.check_invariants()
    manager.free("a")
    manager.free("b")
    assert (manager.num_free_blocks, manager.usage, manager.num_requests) == (10, 0.0, 0)


def test_prefix_hit_shares_blocks_with_reference_counts():
    manager = KVCacheManager(num_blocks=10, block_size=4)
    prompt_a = list(range(1, 11))  # 2 full blocks + 2 tokens
    prompt_b = prompt_a[:8] + [99, 98]
    assert _admit(manager, "a", prompt_a) == ([0, 1, 2], 0)
    # Not computed yet: nothing to hit.
    assert manager.get_computed_blocks("b", prompt_b) == ([], 0)
    # A's next step: its 10 prompt tokens are now computed, so its full blocks get cached.
    assert manager.allocate_slots("a", prompt_a + [11], 1, num_computed_tokens=10) == []
    assert _admit(manager, "b", prompt_b) == ([3], 8)
    assert manager.get_block_ids("b") == [0, 1, 3]
    pool = manager.block_pool
    assert [pool.blocks[i].ref_cnt for i in range(4)] == [2, 2, 1, 1]
    assert manager.num_free_blocks == 6
    manager.free("a")
    assert [pool.blocks[i].ref_cnt for i in range(4)] == [1, 1, 0, 1]
    assert manager.num_free_blocks == 7
    manager.free("b")
    assert manager.num_free_blocks == 10
    assert manager.prefix_cache_hit_rate == pytest.approx(8 / 30)
    manager.check_invariants()


@pytest.mark.parametrize("num_tokens, num_hit_tokens", [(8, 4), (9, 8), (12, 8), (13, 12)])
def test_last_token_is_always_left_to_compute(num_tokens, num_hit_tokens):
    manager = KVCacheManager(num_blocks=10, block_size=4)
    prompt = list(range(20, 36))
    _computed_request(manager, "a", prompt)
    blocks, num_computed = manager.get_computed_blocks("b", prompt[:num_tokens])
    assert num_computed == num_hit_tokens
    assert [b.block_id for b in blocks] == manager.get_block_ids("a")[:num_hit_tokens // 4]


def test_hash_chain_same_block_under_other_prefix_does_not_hit():
    manager = KVCacheManager(num_blocks=10, block_size=4)
    _computed_request(manager, "a", [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13])
    assert manager.get_computed_blocks("b", [0, 0, 0, 0, 5, 6, 7, 8, 9])[1] == 0
    assert manager.get_computed_blocks("c", [1, 2, 3, 4, 0, 0, 0, 0, 9, 10, 11, 12, 13])[1] == 4
    assert manager.get_computed_blocks("d", [1, 2, 3, 4, 5, 6, 7, 8, 0])[1] == 8
    assert hash_block_tokens(None, [5, 6, 7, 8]) != hash_block_tokens(
        hash_block_tokens(None, [1, 2, 3, 4]), [5, 6, 7, 8])


def test_cached_blocks_reused_after_owner_freed_them():
    manager = KVCacheManager(num_blocks=6, block_size=4)
    prompt = list(range(10))
    _computed_request(manager, "a", prompt)
    owner_block_ids = manager.get_block_ids("a")
    manager.free("a")
    assert manager.num_free_blocks == 6
    # The hits come back out of the free queue; the new block is A's uncached partial one.
    assert _admit(manager, "b", prompt) == ([2], 8)
    assert manager.get_block_ids("b") == owner_block_ids
    assert manager.num_free_blocks == 3
    manager.check_invariants()


def test_eviction_takes_the_tail_of_a_freed_prefix_before_its_head():
    manager = KVCacheManager(num_blocks=4, block_size=2)
    prompt = list(range(7))  # blocks 0, 1, 2 full and cached; block 3 partial
    _computed_request(manager, "a", prompt)
    manager.free("a")
    assert manager.block_pool.free_block_ids() == [3, 2, 1, 0]
    assert _admit(manager, "c", [50, 51, 52]) == ([3, 2], 0)
    blocks, num_hit_tokens = manager.get_computed_blocks("b", prompt)
    assert ([b.block_id for b in blocks], num_hit_tokens) == ([0, 1], 4)


def test_cache_entries_evicted_under_pressure_stop_hitting():
    manager = KVCacheManager(num_blocks=3, block_size=2)
    _computed_request(manager, "a", [1, 2, 3, 4, 5])
    manager.free("a")
    _admit(manager, "b", [7, 7, 7, 7, 7, 7])  # takes all three blocks
    manager.free("b")
    assert manager.get_computed_blocks("c", [1, 2, 3, 4, 5])[1] == 0


@pytest.mark.parametrize("num_spec_tokens, num_accepted, num_new_blocks, num_freed", [
    (7, 0, 2, 1), (7, 3, 2, 1), (7, 4, 2, 0), (7, 7, 2, 0), (9, 0, 3, 2), (0, 0, 1, 0)])
def test_lookahead_slots_for_drafts_and_rollback(num_spec_tokens, num_accepted,
                                                 num_new_blocks, num_freed):
    manager = KVCacheManager(num_blocks=16, block_size=4)
    prompt = list(range(8))
    _admit(manager, "a", prompt)
    token_ids = prompt + [100]  # the token sampled after prefill; K drafts follow it
    new_block_ids = manager.allocate_slots("a", token_ids, 1, num_spec_tokens,
                                           num_computed_tokens=8)
    assert len(new_block_ids) == num_new_blocks
    num_held = 2 + num_new_blocks
    assert manager.num_free_blocks == 16 - num_held
    num_computed = 8 + 1 + num_accepted  # the last token plus the accepted drafts
    assert manager.free_excess("a", num_computed) == num_freed
    assert len(manager.get_block_ids("a")) == -(-num_computed // 4) == num_held - num_freed
    assert manager.num_free_blocks == 16 - num_held + num_freed
    manager.check_invariants()
    manager.free("a")
    assert manager.num_free_blocks == 16


def test_blocks_past_a_smaller_request_are_kept_until_free_excess():
    manager = KVCacheManager(num_blocks=8, block_size=4)
    _admit(manager, "a", [1, 2, 3])
    assert len(manager.allocate_slots("a", [1, 2, 3, 4], 1, 8, num_computed_tokens=3)) == 2
    assert manager.allocate_slots("a", [1, 2, 3, 4], 1, 0, num_computed_tokens=3) == []
    assert len(manager.get_block_ids("a")) == 3
    manager.check_invariants()
    assert manager.free_excess("a", 4) == 2


def test_out_of_blocks_returns_none_and_changes_nothing():
    manager = KVCacheManager(num_blocks=4, block_size=4)
    prompt = list(range(12))
    _admit(manager, "a", prompt)
    assert manager.allocate_slots("b", [5] * 8, 8, num_computed_tokens=0) is None
    assert not manager.has_request("b")
    # A decode step with 4 lookahead slots needs 2 more blocks; 1 is free.
    assert manager.allocate_slots("a", prompt + [1], 1, 4, num_computed_tokens=12) is None
    assert manager.get_block_ids("a") == [0, 1, 2]
    assert (manager.num_free_blocks, manager.block_pool.num_cached_blocks) == (1, 0)
    manager.check_invariants()
    assert manager.free_excess("a", 12) == 0


def test_out_of_blocks_counts_free_hit_blocks_as_taken():
    manager = KVCacheManager(num_blocks=4, block_size=2)
    _computed_request(manager, "a", [1, 2, 3, 4, 5])
    manager.free("a")  # blocks 0, 1 stay cached while free
    prompt = [1, 2, 3, 4, 5, 6, 7, 8, 9]
    blocks, num_hit_tokens = manager.get_computed_blocks("b", prompt)
    assert num_hit_tokens == 4
    # 5 blocks needed: 2 hits + 3 new, but taking the hits leaves only 2 free.
    assert manager.allocate_slots("b", prompt, 5, new_computed_blocks=blocks,
                                  num_computed_tokens=4) is None
    assert manager.num_free_blocks == 4 and all(b.ref_cnt == 0 for b in blocks)
    assert manager.block_pool.num_cached_blocks == 2
    assert _admit(manager, "b", prompt[:7]) == ([2, 3], 4)
    assert manager.num_free_blocks == 0
    manager.check_invariants()


def test_prefix_caching_disabled():
    manager = KVCacheManager(num_blocks=8, block_size=4, enable_prefix_caching=False)
    prompt = list(range(10))
    _computed_request(manager, "a", prompt)
    assert manager.get_computed_blocks("b", prompt) == ([], 0)
    assert manager.block_pool.num_cached_blocks == 0
    assert manager.prefix_cache_hit_rate == 0.0


def test_reset_prefix_cache_stops_hits_and_keeps_owners_working():
    manager = KVCacheManager(num_blocks=8, block_size=4)
    prompt = list(range(10))
    _computed_request(manager, "a", prompt)
    assert manager.reset_prefix_cache() == 2
    assert manager.get_computed_blocks("b", prompt) == ([], 0)
    manager.allocate_slots("a", prompt + [1, 2, 3], 3, num_computed_tokens=10)
    manager.check_invariants()
    manager.free("a")
    assert manager.num_free_blocks == 8


def test_random_operations_never_leak_or_overwrite_shared_blocks():
    """A scheduler-like random walk with a fake KV store: token id written at each slot."""
    rng = random.Random(20250807)
    sim = _Simulation(KVCacheManager(num_blocks=24, block_size=4), rng)
    for _ in range(600):
        sim.random_operation()
        sim.manager.check_invariants()
    for request_id in list(sim.running):
        sim.manager.free(request_id)
    assert (sim.manager.num_free_blocks, sim.manager.usage) == (24, 0.0)
    # The walk exercised what it should.
    assert sim.manager.block_pool.prefix_cache_stats.num_hit_tokens > 0
    assert sim.num_preempted > 0 and sim.num_rejected_admissions > 0 and sim.num_rollbacks > 0


class _Simulation:
    def __init__(self, manager: KVCacheManager, rng: random.Random) -> None:
        self.manager, self.rng = manager, rng
        self.kv = [[None] * manager.block_size for _ in range(manager.num_blocks)]
        self.prefixes = [[rng.randrange(3) for _ in range(12)] for _ in range(3)]
        self.running: dict[str, list] = {}  # request id -> [token_ids, num_computed_tokens]
        self.num_requests = self.num_preempted = 0
        self.num_rejected_admissions = self.num_rollbacks = 0

    def random_operation(self) -> None:
        choice = self.rng.random()
        if choice < 0.3 or not self.running:
            self.admit()
        elif choice < 0.9:
            self.step(self.rng.choice(list(self.running)))
        elif choice < 0.98:
            request_id = self.rng.choice(list(self.running))
            self.manager.free(request_id)  # finish or abort
            del self.running[request_id]
        else:
            self.manager.reset_prefix_cache()

    def admit(self) -> None:
        rng, bs = self.rng, self.manager.block_size
        token_ids = rng.choice(self.prefixes)[:rng.randint(1, 12)]
        token_ids += [rng.randrange(3) for _ in range(rng.randint(0, 6))]
        request_id = f"r{self.num_requests}"
        self.num_requests += 1
        blocks, num_computed = self.manager.get_computed_blocks(request_id, token_ids)
        for index, block in enumerate(blocks):  # a hit holds exactly the prefix's KV
            assert self.kv[block.block_id] == token_ids[index * bs:(index + 1) * bs]
        num_new = rng.randint(1, len(token_ids) - num_computed)  # chunked prefill
        if self.manager.allocate_slots(request_id, token_ids, num_new, new_computed_blocks=blocks,
                                       num_computed_tokens=num_computed) is None:
            self.num_rejected_admissions += 1
            return
        self.running[request_id] = [token_ids, num_computed]
        self.prefill(request_id, num_new)

    def step(self, request_id: str) -> None:
        token_ids, num_computed = self.running[request_id]
        is_prefill = num_computed + 1 < len(token_ids)  # else: verify [last, drafts]
        num_new = self.rng.randint(1, len(token_ids) - num_computed) if is_prefill else 1
        num_drafts = 0 if is_prefill else self.rng.randint(0, 5)
        if self.manager.allocate_slots(request_id, token_ids, num_new, num_drafts,
                                       num_computed_tokens=num_computed) is None:
            self.manager.free(request_id)  # preemption by recomputation
            del self.running[request_id]
            self.num_preempted += 1
        elif is_prefill:
            self.prefill(request_id, num_new)
        else:
            self.verify(request_id, num_drafts)

    def prefill(self, request_id: str, num_new: int) -> None:
        state = self.running[request_id]
        self.write_kv(request_id, state[0], state[1], num_new)
        state[1] += num_new
        if state[1] == len(state[0]):
            state[0].append(self.rng.randrange(3))  # the first sampled token
        self.check_kv(request_id)

    def verify(self, request_id: str, num_drafts: int) -> None:
        """One forward over [last, d1..dK]; accept a prefix, append a bonus, roll back."""
        token_ids, num_computed = self.running[request_id]
        drafts = [self.rng.randrange(3) for _ in range(num_drafts)]
        self.write_kv(request_id, token_ids + drafts, num_computed, 1 + num_drafts)
        num_accepted = self.rng.randint(0, num_drafts)
        token_ids += drafts[:num_accepted] + [self.rng.randrange(3)]
        self.running[request_id][1] = num_computed + 1 + num_accepted
        self.manager.free_excess(request_id, num_computed + 1 + num_accepted)
        num_blocks_kept = -(-(num_computed + 1 + num_accepted) // self.manager.block_size)
        assert len(self.manager.get_block_ids(request_id)) == num_blocks_kept
        self.num_rollbacks += num_drafts > num_accepted
        self.check_kv(request_id)

    def write_kv(self, request_id: str, token_ids: list[int], start: int, num: int) -> None:
        bs, pool = self.manager.block_size, self.manager.block_pool
        block_ids = self.manager.get_block_ids(request_id)
        for position in range(start, start + num):
            block = pool.blocks[block_ids[position // bs]]
            assert block.ref_cnt == 1 and block.block_hash is None, "write to a shared block"
            self.kv[block.block_id][position % bs] = token_ids[position]

    def check_kv(self, request_id: str) -> None:
        """Every computed position of the request holds its token's KV."""
        bs = self.manager.block_size
        token_ids, num_computed = self.running[request_id]
        block_ids = self.manager.get_block_ids(request_id)
        for position in range(num_computed):
            assert self.kv[block_ids[position // bs]][position % bs] == token_ids[position]


def test_bad_constructor_values_are_named():
    with pytest.raises(ValueError, match="num_blocks=0"):
        KVCacheManager(0, 4)
    with pytest.raises(ValueError, match="block_size=0"):
        KVCacheManager(4, 0)
    with pytest.raises(ValueError, match="block_size=-2"):
        KVCacheManager(4, -2)


def test_unknown_request_is_named():
    manager = KVCacheManager(4, 4)
    for call in (manager.free, manager.get_block_ids, lambda rid: manager.free_excess(rid, 0)):
        with pytest.raises(ValueError, match="request_id='nope'"):
            call("nope")
    manager.allocate_slots("a", [1], 1, num_computed_tokens=0)
    manager.free("a")
    with pytest.raises(ValueError, match="request_id='a'"):
        manager.free("a")


def test_bad_counts_are_named():
    manager = KVCacheManager(8, 4)
    with pytest.raises(ValueError, match="num_new_tokens=-1"):
        manager.allocate_slots("a", [1], -1, num_computed_tokens=0)
    with pytest.raises(ValueError, match="num_lookahead_tokens=-2"):
        manager.allocate_slots("a", [1], 1, -2, num_computed_tokens=0)
    with pytest.raises(ValueError, match="num_computed_tokens=3.*only 2 token ids"):
        manager.allocate_slots("a", [1, 2], 1, num_computed_tokens=3)
    with pytest.raises(ValueError, match="num_computed_tokens=2.*only 0 KV slots"):
        manager.allocate_slots("a", [1, 2], 1, num_computed_tokens=2)
    manager.allocate_slots("a", [1, 2], 2, num_computed_tokens=0)
    with pytest.raises(ValueError, match="num_tokens_kept=3.*only 2 slots"):
        manager.free_excess("a", 3)
    assert manager.num_requests == 1 and manager.num_free_blocks == 7


def test_misuse_of_prefix_hits_is_rejected():
    manager = KVCacheManager(num_blocks=4, block_size=2)
    prompt = [1, 2, 3, 4, 5]
    _computed_request(manager, "a", prompt)
    with pytest.raises(ValueError, match="'a' already holds"):
        manager.get_computed_blocks("a", prompt)
    blocks, _ = manager.get_computed_blocks("b", prompt)
    with pytest.raises(ValueError, match="'a', which already holds blocks"):
        manager.allocate_slots("a", prompt, 1, new_computed_blocks=blocks, num_computed_tokens=4)
    with pytest.raises(ValueError, match="num_tokens_kept=2.*4 tokens in prefix-cached"):
        manager.free_excess("a", 2)
    manager.free("a")
    manager.reset_prefix_cache()  # the hits from above are stale now
    with pytest.raises(ValueError, match="block 0 in new_computed_blocks is no longer"):
        manager.allocate_slots("b", prompt, 1, new_computed_blocks=blocks, num_computed_tokens=4)
    assert manager.num_free_blocks == 4 and not manager.has_request("b")
