"""fuse_qkv: one GEMM per layer for the block's q, k and v projections.

Precondition: a phase where each BLOCK_ATTENTION reads q and k through their head norm / RoPE chains and v
directly, and the three come from MATMULs over one shared input with WEIGHT operands (``propose`` as
lowered). Attention nodes whose q/k/v do not match that shape are left alone; a phase with none (e.g.
``append_context``) is returned unchanged.

Invariant established: each matched layer has ONE matmul ``l<i>.qkv`` over ``l<i>.qkv.weight`` declared
``concat_rows(q_proj, k_proj, v_proj)`` ([(Hq + 2·Hkv)·D, H]); the old matmul names ``l<i>.q``, ``l<i>.k``,
``l<i>.v`` now name SLICE nodes of it (columns in that order), so every reader sees the same values.
"""

from __future__ import annotations

from dflash_compiler.ir.graph import Graph
from dflash_compiler.ir.ops import Op

from ._rewrite import fusable, fuse_matmuls, in_original_order, sibling_name, through_head_chain
from .context import PassContext


def _qkv(graph: Graph, attention: str) -> list[str] | None:
    """The q, k, v matmuls feeding ``attention``, if they are fusable."""
    refs = [through_head_chain(graph, ref) for ref in graph.inputs(attention)[:3]]
    if any(ref.port != 0 for ref in refs):
        return None
    names = [ref.node for ref in refs]
    return names if fusable(graph, names) else None


def fuse_qkv(graph: Graph, ctx: PassContext) -> Graph:
    """Fuse each layer's q/k/v projections into one matmul plus three slices (module docstring)."""
    out = graph.copy()
    anchors: dict[str, str] = {}
    for attention, _ in graph.nodes_of(Op.BLOCK_ATTENTION):
        matmuls = _qkv(out, attention)
        if matmuls is None:
            continue
        anchors |= fuse_matmuls(out, matmuls, sibling_name(matmuls[0], "qkv"))[1]
    return in_original_order(out, graph, anchors)
