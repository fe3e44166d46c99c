"""fuse_context_kv: one GEMM computes the context K and V of every layer (vLLM's ``_fused_kv_weight``).

Precondition: a phase whose KV_WRITE nodes receive their values from MATMULs with WEIGHT operands, K
through its head norm / RoPE chain and V directly, all over one shared input (``append_context`` as
lowered: every layer's ``matmul(hidden_norm, k_proj)`` and ``matmul(hidden_norm, v_proj)``). A phase
without KV writes fed that way (``propose``, or one already fused) is returned unchanged.

Invariant established: those 2·L matmuls are ONE matmul ``ctx_kv`` over ``ctx_kv.weight``, declared
``concat_rows(K0, V0, K1, V1, …)`` with shape [L·2·Hkv·D, H] (the row order of DFLASH.md §2), ordered by
the writes' (layer, which) so the layout is the cache's and not the lowering's node order. The old
matmul names (``l<i>.ctx_k``, ``l<i>.ctx_v``) now name SLICE nodes of its columns; the old weights are
gone.
"""

from __future__ import annotations

from dflash_compiler.ir.graph import Graph, Ref
from dflash_compiler.ir.ops import Op

from ._rewrite import fusable, fuse_matmuls, in_original_order, through_head_chain
from .context import PassContext

FUSED = "ctx_kv"


def _written_projections(graph: Graph) -> dict[Ref, list[tuple[tuple[int, int], str]]]:
    """Per shared input: ((layer, which), matmul) for every KV write fed by a matmul."""
    groups: dict[Ref, list[tuple[tuple[int, int], str]]] = {}
    for name, node in graph.nodes_of(Op.KV_WRITE):
        value = through_head_chain(graph, graph.inputs(name)[1])
        if value.port != 0 or graph.node(value.node).op is not Op.MATMUL:
            continue
        key = (int(node.attr("layer")), int(node.attr("which")))
        groups.setdefault(graph.inputs(value.node)[0], []).append((key, value.node))
    return groups


def fuse_context_kv(graph: Graph, ctx: PassContext) -> Graph:
    """Fuse the context K/V projections of all layers into one matmul plus slices (module docstring)."""
    out = graph.copy()
    anchors: dict[str, str] = {}
    for group in _written_projections(graph).values():
        matmuls = [m for _, m in sorted(group)]
        if fusable(out, matmuls):
            anchors |= fuse_matmuls(out, matmuls, FUSED)[1]
    return in_original_order(out, graph, anchors)
