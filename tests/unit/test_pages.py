"""Page allocator of the paged KV cache: errors leave it intact; invariants hold under random use."""

from __future__ import annotations

import copy

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dflash_compiler.runtime.pages import SCRATCH_PAGE, KVCacheError, PageAllocator


def _state(a: PageAllocator):
    return copy.deepcopy((a._free, a._seqs, a._freed))


def test_lazy_pages_slots_and_rollback():
    a = PageAllocator(num_pages=8, page_size=16, max_seq_len=100)
    a.create(7)
    assert a.pages(7) == [] and a.length(7) == 0
    a.reserve({7: 17})
    assert len(a.pages(7)) == 2 and a.length(7) == 17
    assert SCRATCH_PAGE not in a.pages(7)
    first, second = a.pages(7)
    assert a.slot(7, 0) == first * 16 and a.slot(7, 16) == second * 16
    a.rollback(7, 16)
    assert a.pages(7) == [first] and a.free_pages == 6
    a.reserve({7: 10})  # shorter than held: no change
    assert a.length(7) == 16


def test_errors_are_clear_and_leave_state_intact():
    a = PageAllocator(num_pages=4, page_size=16, max_seq_len=40)
    a.create(1)
    a.create(2)
    a.reserve({1: 30})
    cases = [
        (lambda: a.reserve({2: 33}), "exhausted: 3 pages needed, 1 free"),
        (lambda: a.reserve({2: 41}), "exceed max_seq_len 40"),
        (lambda: a.reserve({1: 30, 9: 5}), "unknown sequence id 9"),
        (lambda: a.create(1), "already exists"),
        (lambda: a.rollback(1, 31), "cannot roll back to 31"),
        (lambda: a.slot(2, 0), "not allocated"),
    ]
    for call, message in cases:
        before = _state(a)
        with pytest.raises(KVCacheError, match=message):
            call()
        assert _state(a) == before
    a.free(2)
    with pytest.raises(KVCacheError, match="already freed"):
        a.free(2)
    a.check_invariants()


def test_all_or_nothing_batch_reserve():
    a = PageAllocator(num_pages=4, page_size=16, max_seq_len=64)
    a.create(1)
    a.create(2)
    with pytest.raises(KVCacheError, match="exhausted"):
        a.reserve({1: 32, 2: 17})  # 2 + 2 pages > 3 free
    assert a.pages(1) == [] and a.pages(2) == []


ops = st.lists(
    st.tuples(st.sampled_from(["create", "append", "rollback", "free"]), st.integers(0, 5), st.integers(0, 70)),
    max_size=80,
)


@settings(max_examples=200, deadline=None)
@given(ops)
def test_invariants_under_random_operations(sequence):
    a = PageAllocator(num_pages=10, page_size=16, max_seq_len=64)
    model: dict[int, int] = {}  # seq -> length, an independent model of what must hold
    for op, seq, n in sequence:
        before = _state(a)
        try:
            if op == "create":
                a.create(seq)
                model[seq] = 0
            elif op == "append":
                a.reserve({seq: a.length(seq) + n})
                model[seq] += n
            elif op == "rollback":
                target = min(n, a.length(seq))
                a.rollback(seq, target)
                model[seq] = target
            else:
                a.free(seq)
                del model[seq]
        except KVCacheError:
            assert _state(a) == before
        a.check_invariants()
        assert {s: a.length(s) for s in a.sequences} == model
        used = sum(len(a.pages(s)) for s in a.sequences)
        assert used + a.free_pages == 9
