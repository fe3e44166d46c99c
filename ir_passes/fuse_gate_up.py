"""fuse_gate_up: one GEMM for the MLP's gate and up projections, read by a one-input SILU_MUL.

Precondition: a two-input ``silu_mul(gate, up)`` whose operands are MATMULs over one shared input with
WEIGHT operands, each read only by that silu_mul (``propose`` as lowered, DFlash2's conv-wrapped MLP
included). A phase without such a pair is returned unchanged.

Invariant established: each matched pair is ONE matmul ``l<i>.gate_up`` over ``l<i>.gate_up.weight``,
declared ``concat_rows(gate_proj, up_proj)`` ([2·I, H]); the silu_mul keeps its name and now has one
input, whose left half is the gate and right half the up projection (the op's one-input meaning). No
slices; the old matmuls and weights are gone.
"""

from __future__ import annotations

from dflash_compiler.ir.graph import Graph, Node, Ref
from dflash_compiler.ir.ops import Op

from ._rewrite import fusable, fuse_matmuls, in_original_order, remove_dead, replace_node, sibling_name
from .context import PassContext


def _gate_up(graph: Graph, silu_mul: str) -> list[str] | None:
    """The (gate, up) matmuls of a two-input silu_mul, if they can be fused into one."""
    refs = graph.inputs(silu_mul)
    if len(refs) != 2 or any(ref.port != 0 for ref in refs):
        return None
    names = [ref.node for ref in refs]
    sole_reader = all(graph.users(Ref(n)) == [(silu_mul, arg)] for arg, n in enumerate(names))
    return names if sole_reader and fusable(graph, names) else None


def fuse_gate_up(graph: Graph, ctx: PassContext) -> Graph:
    """Fuse gate/up into one matmul feeding a one-input silu_mul (module docstring)."""
    out = graph.copy()
    anchors: dict[str, str] = {}
    for silu_mul, node in graph.nodes_of(Op.SILU_MUL):
        pair = _gate_up(out, silu_mul)
        if pair is None:
            continue
        fused, new = fuse_matmuls(out, pair, sibling_name(pair[0], "gate_up"))
        replace_node(out, silu_mul, Node.make(Op.SILU_MUL, node.outputs, **node.attr_dict), [fused])
        remove_dead(out, pair)  # the slices fuse_matmuls left under the old names: the halves need none
        anchors |= new
    return in_original_order(out, graph, anchors)
