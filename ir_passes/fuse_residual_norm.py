"""fuse_residual_norm: a residual add and the RMSNorm of its sum become one RMSNORM_RESIDUAL.

Precondition: ``s = add(h, o)`` read (at argument 0) by exactly one RMSNORM ``rmsnorm(s, w)``; other
readers of ``s`` are allowed (the residual stream goes on). In ``propose`` as lowered that is every
``l<i>.attn_residual`` → ``l<i>.post_norm``, every ``l<i>.mlp_residual`` → the next layer's
``input_norm``, and the last one → ``final_norm``. An add read by two RMSNorms is left alone (the fused
op has one norm output). A phase without the pattern (``append_context``) is returned unchanged.

Invariant established: each matched pair is one ``rmsnorm_residual(h, o, w)`` node that keeps the
add's name. Its port 0 is the sum (every other reader of ``s`` reads it) and its port 1 the
normalised sum (the rmsnorm's readers read it); the rmsnorm node is gone.
"""

from __future__ import annotations

from dflash_compiler.ir.graph import Graph, Node, Ref
from dflash_compiler.ir.ops import Op

from ._rewrite import in_original_order, replace_node
from .context import PassContext


def _residual_add(graph: Graph, norm: str) -> str | None:
    """The add whose sum ``norm`` normalises, when ``norm`` is that sum's only RMSNorm reader."""
    if norm not in graph:
        return None
    src = graph.inputs(norm)[0]
    if src.port != 0 or graph.node(src.node).op is not Op.ADD:
        return None
    norm_readers = [(dst, arg) for dst, arg in graph.users(src) if graph.node(dst).op is Op.RMSNORM]
    return src.node if norm_readers == [(norm, 0)] else None


def _fuse(graph: Graph, add: str, norm: str) -> None:
    norm_node = graph.node(norm)
    fused = Node.make(Op.RMSNORM_RESIDUAL, [graph.node(add).type, norm_node.type], **norm_node.attr_dict)
    inputs = [*graph.inputs(add), graph.inputs(norm)[1]]
    replace_node(graph, add, fused, inputs, also={Ref(norm): 1})
    graph.remove([norm])


def fuse_residual_norm(graph: Graph, ctx: PassContext) -> Graph:
    """Fuse every residual add with the RMSNorm of its sum (module docstring)."""
    out = graph.copy()
    for norm, _ in graph.nodes_of(Op.RMSNORM):
        add = _residual_add(out, norm)
        if add is not None:
            _fuse(out, add, norm)
    return in_original_order(out, graph, {})
