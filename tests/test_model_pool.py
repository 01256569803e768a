"""The block pool's eviction order and hash map, op by op."""

from __future__ import annotations

import pytest

from kvgate.model.pool import BlockPool
from kvgate.model.request import Request


def test_the_null_block_is_taken_and_never_queued() -> None:
    pool = BlockPool(5, 4)
    assert pool.null_block.block_id == 0 and pool.null_block.is_null
    assert list(pool.free_queue) == [1, 2, 3, 4]


def test_unhashed_blocks_are_reused_first_hashed_ones_last() -> None:
    pool = BlockPool(8, 4)
    a, b, c, d = pool.get_new_blocks(4)
    pool.add_key((0, "4:x"), b, 4)
    pool.add_key((0, "8:y"), d, 8)
    pool.free_blocks([a, b, c, d])
    # Unhashed a, c go to the head in order; hashed b, d to the tail in order.
    assert list(pool.free_queue) == [1, 3, 5, 6, 7, 2, 4]


def test_reuse_evicts_the_cached_state() -> None:
    pool = BlockPool(3, 4)
    [a] = pool.get_new_blocks(1)
    pool.add_key((1, "4:x"), a, 4)
    pool.free_blocks([a])
    assert pool.cached_block("4:x", [1]) == [a]
    pool.get_new_blocks(2)  # takes block 2, then the cached block 1
    assert pool.cached_block("4:x", [1]) is None and a.hash is None and a.ref == 1


def test_touch_takes_a_free_block_out_of_the_queue() -> None:
    pool = BlockPool(4, 4)
    [a] = pool.get_new_blocks(1)
    pool.add_key((0, "4:x"), a, 4)
    pool.free_blocks([a])
    pool.touch([a, pool.null_block])
    assert a.ref == 1 and a.block_id not in list(pool.free_queue)
    assert pool.null_block.ref == 0


def test_more_blocks_than_free_is_an_error() -> None:
    pool = BlockPool(3, 4)
    with pytest.raises(ValueError):
        pool.get_new_blocks(3)


def _keyed(keys: list[str]) -> Request:
    """A request whose prefix keys are `keys` (the pool reads nothing else)."""
    request = Request("R", [0] * 4 * len(keys), 4)
    request.keys = keys
    return request


def test_a_partial_key_is_replaced_by_the_full_block_key() -> None:
    pool = BlockPool(4, 4)
    [a] = pool.get_new_blocks(1)
    assert pool.cache_partial_block(_keyed(["4:p", "8:q"]), a, 4, group_id=1) == (1, "4:p")
    pool.cache_full_blocks(_keyed(["4:p", "8:q"]), [a], 0, 1, 8, 1, None)
    assert a.hash == (1, "8:q") and a.hash_tokens == 8
    assert pool.cached_block("4:p", [1]) is None


def test_a_second_key_on_a_keyed_block_is_secondary() -> None:
    pool = BlockPool(4, 4)
    [a] = pool.get_new_blocks(1)
    pool.cache_partial_block(_keyed(["4:p", "8:q"]), a, 8, group_id=1)
    pool.cache_partial_block(_keyed(["4:p", "8:q"]), a, 4, group_id=1)  # lower: kept as secondary
    assert pool.keys_of(a) == [(1, "8:q"), (1, "4:p")]


def test_moving_keys_repoints_every_key_and_keeps_the_position() -> None:
    pool = BlockPool(4, 4)
    src, dst = pool.get_new_blocks(2)
    pool.add_key((1, "8:q"), src, 8)
    pool.add_key((1, "4:p"), src, 4)
    pool.move_keys(src, dst)
    assert src.hash is None and pool.keys_of(src) == []
    assert pool.keys_of(dst) == [(1, "8:q"), (1, "4:p")] and dst.hash_tokens == 8
    assert pool.cached_block("4:p", [1]) == [dst]


def test_lookup_takes_the_oldest_block_under_a_key() -> None:
    pool = BlockPool(4, 4)
    a, b = pool.get_new_blocks(2)
    pool.add_key((0, "4:x"), a, 4)
    pool.add_key((0, "4:x"), b, 4)
    assert pool.cached_block("4:x", [0]) == [a]
    pool.drop_keys(a)
    assert pool.cached_block("4:x", [0]) == [b]
