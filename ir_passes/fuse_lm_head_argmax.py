"""fuse_lm_head_argmax: an lm_head whose logits only feed an ARGMAX becomes one LM_HEAD_ARGMAX.

Precondition: the precision is chosen (``choose_precision`` ran), so the LM_HEAD has its final form:
``(x, W)`` or the FP8 ``(x, W8, scale)``. The pattern is ``logits = lm_head(...)`` read by exactly one node,
an ARGMAX (DFlash v1's ``lm_head`` → ``argmax`` in ``propose``), with k a multiple of K_STEP (the fused op's
only kernels are the tensor-core ones) and fewer than 2^24 ids (float32 ranks). Logits read by anything else
(a top-k, a walk, an output multiplier or softcap, a graph output) are left alone, as is a phase without an
lm_head (``append_context``).

Invariant established: each matched pair is one ``lm_head_argmax`` node with the LM_HEAD's inputs and the
ARGMAX's int32 ``[rows]`` output, under the ARGMAX's name (its readers are unchanged); the LM_HEAD node is
gone. The ids equal the pair's: the fused kernels rank the same float32 logits by the same (value, lower
index) order, they only never write the ``[rows, vocab]`` logits to memory.

Measured on the H200 (bench/kernels.py): the fused kernels pick exactly numpy's ids at nb = 1 and 8, bf16
and FP8; lm_head_argmax bf16 runs 300.8 µs at nb = 1 (4139 GB/s, 99 % of copy) and 367.0 at nb = 8. With the
other two fusions the step went from 0.954 to 0.948 ms at nb = 1 and from 1.401 to 1.369 at nb = 8.
"""

from __future__ import annotations

from dflash_compiler.ir.graph import Graph, Node
from dflash_compiler.ir.ops import Op

from ._rewrite import K_STEP, fuse_into_sole_reader
from .context import PassContext

RANK_LIMIT = 1 << 24  # ids ranked as float32 are exact below this


def _tensor_core_sized(graph: Graph, lm_head: str) -> bool:
    vocab, k = graph.node(graph.inputs(lm_head)[1].node).outputs[0].shape
    return isinstance(k, int) and k % K_STEP == 0 and isinstance(vocab, int) and vocab < RANK_LIMIT


def _lm_head_argmax(lm_head: Node, argmax: Node) -> Node:
    return Node.make(Op.LM_HEAD_ARGMAX, list(argmax.outputs))


def fuse_lm_head_argmax(graph: Graph, ctx: PassContext) -> Graph:
    """Fuse every lm_head with the ARGMAX that alone reads its logits (module docstring)."""
    return fuse_into_sole_reader(graph, Op.LM_HEAD, Op.ARGMAX, 0, _lm_head_argmax, _tensor_core_sized)
