"""The paged KV cache's bookkeeping: which pages each sequence owns and how many rows it holds.

Pure Python, shared by the GPU runtime and the numpy graph runner. Page 0 is reserved as the scratch
page that padded (inactive) rows of a captured launch write into, so real sequences never see it.
Every operation validates first and mutates after, so a refused call leaves the cache as it was.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from dflash_compiler.errors import DFlashError

SCRATCH_PAGE = 0


class KVCacheError(DFlashError):
    """A refused cache operation; the cache is unchanged."""


@dataclass
class _Sequence:
    pages: list[int] = field(default_factory=list)
    length: int = 0


class PageAllocator:
    """Owns ``num_pages`` pages of ``page_size`` rows; sequences grow lazily up to ``max_seq_len`` rows."""

    def __init__(self, num_pages: int, page_size: int, max_seq_len: int) -> None:
        if num_pages < 2:
            raise ValueError(f"num_pages must be >= 2 (page {SCRATCH_PAGE} is scratch), got {num_pages}")
        self.num_pages = num_pages
        self.page_size = page_size
        self.max_seq_len = max_seq_len
        self._free: list[int] = list(range(num_pages - 1, SCRATCH_PAGE, -1))  # pop() hands out low ids first
        self._seqs: dict[int, _Sequence] = {}
        self._freed: set[int] = set()

    # queries ------------------------------------------------------------------------------------
    @property
    def free_pages(self) -> int:
        return len(self._free)

    @property
    def sequences(self) -> list[int]:
        return sorted(self._seqs)

    def length(self, seq_id: int) -> int:
        return self._get(seq_id).length

    def pages(self, seq_id: int) -> list[int]:
        return list(self._get(seq_id).pages)

    def slot(self, seq_id: int, position: int) -> int:
        """Flat row index ``page * page_size + offset`` of ``position`` (which must be allocated)."""
        seq = self._get(seq_id)
        index = position // self.page_size
        if not 0 <= position < len(seq.pages) * self.page_size:
            raise KVCacheError(f"sequence {seq_id}: position {position} is not allocated (length {seq.length})")
        return seq.pages[index] * self.page_size + position % self.page_size

    def pages_needed(self, rows: int) -> int:
        return -(-rows // self.page_size)

    # mutations ----------------------------------------------------------------------------------
    def create(self, seq_id: int) -> None:
        if seq_id in self._seqs:
            raise KVCacheError(f"sequence {seq_id} already exists; free it first or use another id")
        self._seqs[seq_id] = _Sequence()
        self._freed.discard(seq_id)

    def reserve(self, lengths: dict[int, int]) -> None:
        """Grow several sequences to the given lengths, all or nothing (pages allocated lazily)."""
        need = 0
        for seq_id, length in lengths.items():
            seq = self._get(seq_id)
            if length > self.max_seq_len:
                raise KVCacheError(
                    f"sequence {seq_id}: {length} rows exceed max_seq_len {self.max_seq_len}; "
                    "rebuild with a larger --max-seq-len or roll the sequence back"
                )
            need += max(0, self.pages_needed(length) - len(seq.pages))
        if need > len(self._free):
            raise KVCacheError(
                f"KV cache exhausted: {need} pages needed, {len(self._free)} free of {self.num_pages - 1}; "
                "free finished sequences or rebuild with a larger --max-batch / KV budget"
            )
        for seq_id, length in lengths.items():
            seq = self._seqs[seq_id]
            while len(seq.pages) < self.pages_needed(length):
                seq.pages.append(self._free.pop())
            seq.length = max(seq.length, length)

    def rollback(self, seq_id: int, length: int) -> None:
        """Keep the first ``length`` rows; pages past them go back to the pool."""
        seq = self._get(seq_id)
        if not 0 <= length <= seq.length:
            raise KVCacheError(f"sequence {seq_id}: cannot roll back to {length}, it holds {seq.length} rows")
        keep = self.pages_needed(length)
        self._free.extend(reversed(seq.pages[keep:]))
        del seq.pages[keep:]
        seq.length = length

    def free(self, seq_id: int) -> None:
        seq = self._get(seq_id)
        self._free.extend(reversed(seq.pages))
        del self._seqs[seq_id]
        self._freed.add(seq_id)

    def _get(self, seq_id: int) -> _Sequence:
        if seq_id in self._freed:
            raise KVCacheError(f"sequence {seq_id} was already freed (double free or use after free)")
        if seq_id not in self._seqs:
            raise KVCacheError(f"unknown sequence id {seq_id} (live: {sorted(self._seqs)}); create it first")
        return self._seqs[seq_id]

    def check_invariants(self) -> None:
        """Every page is either free or owned by exactly one sequence; lengths fit their pages."""
        owned = [p for s in self._seqs.values() for p in s.pages]
        all_pages = owned + self._free
        assert len(all_pages) == len(set(all_pages)), "a page is owned twice"
        assert set(all_pages) == set(range(1, self.num_pages)), "pages leaked or invented"
        for seq in self._seqs.values():
            assert len(seq.pages) == self.pages_needed(seq.length), "page count does not match length"
            assert seq.length <= self.max_seq_len


class PagedSequences:
    """The sequence half of a drafter's API, over its page allocator (`self.pages`)."""

    pages: PageAllocator

    def create(self, seq_id: int) -> None:
        self.pages.create(seq_id)

    def free(self, seq_id: int) -> None:
        self.pages.free(seq_id)

    def rollback(self, seq_id: int, length: int) -> None:
        self.pages.rollback(seq_id, length)

    def length(self, seq_id: int) -> int:
        return self.pages.length(seq_id)
