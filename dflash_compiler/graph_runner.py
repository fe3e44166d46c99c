"""Run a lowered (and optionally rewritten) :class:`Program` with the numpy interpreter.

It owns a paged KV cache exactly as the GPU runtime does (:class:`PageAllocator`, page slots, block
tables, cache lengths as inputs), so comparing it with the reference over many steps checks the
graphs *and* the cache protocol: lazily allocated pages, rollback, free and page reuse.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from dflash_compiler.ir.graph import eval_dim
from dflash_compiler.ir.interpret import interpret
from dflash_compiler.ir.weights import WeightCache
from dflash_compiler.lower import PAGE_SIZE, Program
from dflash_compiler.protocol import ContextRows
from dflash_compiler.runtime.pages import PageAllocator, PagedSequences
from dflash_compiler.runtime.steps import context_step, propose_step


@dataclass(frozen=True)
class Drafts:
    tokens: np.ndarray  # int32 [nb, gamma]
    confidences: np.ndarray | None  # float32 [nb, gamma] (DSpark with a confidence head)


class GraphDrafter(PagedSequences):
    """``append_context`` / ``propose`` over interpreted phase graphs with a paged fp32 KV cache."""

    def __init__(
        self,
        program: Program,
        tensors: Mapping[str, np.ndarray] | Callable[[str], np.ndarray],
        num_pages: int,
        max_seq_len: int,
    ) -> None:
        self.program = program
        self.cfg = program.config
        self.weights = WeightCache(tensors)
        self.pages = PageAllocator(num_pages, PAGE_SIZE, max_seq_len)
        shape = self.program.append_context.node("kv_cache").type.shape
        self.kv = np.zeros(tuple(eval_dim(d, {"pages": num_pages}) for d in shape), np.float32)
        # Every node's value in the last call of each phase, by phase name then node name.
        self.last_values: dict[str, dict[str, np.ndarray]] = {"append_context": {}, "propose": {}}

    # phases -------------------------------------------------------------------------------------
    def append_context(
        self, seq_ids: Sequence[int], taps: Sequence[np.ndarray], positions: Sequence[np.ndarray]
    ) -> None:
        """Append each sequence's new context rows (``taps[i] [C_i, T*H_t]`` at ``positions[i]``)."""
        step = context_step(self.pages, seq_ids, positions)
        slots, all_pos = step.slots, step.positions
        all_taps = np.concatenate([np.asarray(t, np.float32) for t in taps])
        interpret(
            self.program.append_context,
            {"taps": all_taps, "ctx_positions": all_pos, "ctx_slots": slots},
            self.weights,
            {"kv_cache": self.kv},
            {"ctx": len(slots), "pages": self.pages.num_pages},
            capture=self.last_values["append_context"],
        )

    def step(self, rows: ContextRows, seq_ids: Sequence[int], anchors: Sequence[int]) -> Drafts:
        """``append_context`` of ``rows``, their rollbacks, then ``propose``: the GPU runtime's one-replay step
        (``Drafter.step``) as the calls it stands for."""
        rows.append_to(self)
        return self.propose(seq_ids, anchors)

    def propose(self, seq_ids: Sequence[int], anchors: Sequence[int]) -> Drafts:
        """Draft ``gamma`` tokens per sequence; the anchor sits at the sequence's cached length."""
        blk = self.cfg.block_size
        step = propose_step(self.pages, seq_ids, blk)
        lens, table, positions = step.cache_lens, step.block_table, step.positions
        maxp = table.shape[1]
        out = interpret(
            self.program.propose,
            {
                "anchors": np.asarray(anchors, np.int32),
                "blk_positions": positions,
                "block_table": table,
                "cache_lens": lens,
            },
            self.weights,
            {"kv_cache": self.kv},
            {"nb": len(seq_ids), "blk": blk, "pages": self.pages.num_pages, "maxp": maxp},
            capture=self.last_values["propose"],
        )
        gamma = blk - 1
        conf = out.get("confidences")
        return Drafts(
            out["tokens"].reshape(len(seq_ids), gamma),
            None if conf is None else conf.reshape(len(seq_ids), gamma),
        )
