"""fuse_kv_writes: one launch for a chain of KV cache writes that share their slots.

``append_context`` writes every layer's K and V rows into the same page slots: ten KV_WRITE nodes for a
5-layer drafter, each a launch that moves a few KB at 7 context rows.

Precondition: KV_WRITE nodes ``(cache, rows, slots)`` threaded through the cache state (each reads the
previous one's output at argument 0), as lowered.

Invariant established: every maximal chain of two or more KV_WRITEs in which each write is the only reader
of the previous one's cache and all read the same slots is one KV_WRITES node ``(cache, slots, rows...)``
with ``targets = ((layer, which), ...)`` in chain order, named after the chain's last write; readers of the
chain's end read it. Writes to the same slots of different (layer, which) pairs touch different bytes, so
their order does not matter; within the node they run in chain order anyway.
"""

from __future__ import annotations

from dflash_compiler.ir.graph import Graph, Node, Ref
from dflash_compiler.ir.ops import Op

from ._rewrite import in_original_order, replace_node
from .context import PassContext


def _next_write(graph: Graph, name: str, slots: Ref) -> str | None:
    """The KV_WRITE that is the only reader of `name`'s cache and writes the same slots, if any."""
    users = graph.users(Ref(name))
    if len(users) != 1 or users[0][1] != 0:
        return None
    nxt = users[0][0]
    if graph.node(nxt).op is not Op.KV_WRITE or graph.inputs(nxt)[2] != slots:
        return None
    return nxt


def fuse_kv_writes(graph: Graph, ctx: PassContext) -> Graph:
    """Replace each chain of KV_WRITEs over the same slots by one KV_WRITES (module docstring)."""
    out = graph.copy()
    for name, node in graph.nodes_of(Op.KV_WRITE):
        if name not in out or out.node(name).op is not Op.KV_WRITE:
            continue  # already folded into a chain that started earlier
        cache, _, slots = out.inputs(name)
        if out.node(cache.node).op is Op.KV_WRITE and _next_write(out, cache.node, slots) == name:
            continue  # not the start of its chain
        chain = [name]
        while (nxt := _next_write(out, chain[-1], slots)) is not None:
            chain.append(nxt)
        if len(chain) < 2:
            continue
        targets = tuple((int(out.node(w).attr("layer")), int(out.node(w).attr("which"))) for w in chain)
        rows = [out.inputs(w)[1] for w in chain]
        fused = Node.make(Op.KV_WRITES, out.node(chain[-1]).outputs, targets=targets,
                          page_size=int(node.attr("page_size")))  # fmt: skip
        last = chain[-1]
        replace_node(out, last, fused, [cache, slots, *rows])
        for w in reversed(chain[:-1]):
            out.remove([w])
    return in_original_order(out, graph, {})
