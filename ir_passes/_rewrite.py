"""Rewrite helpers the passes share: replace a node keeping its name and place, fuse matmuls, prune.

The Graph API adds and removes nodes; these keep dumps stable (a rewritten node keeps its name and its
position in insertion order) so golden dumps show only what a pass changed.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence

import networkx as nx

from dflash_compiler.ir.graph import Graph, Node, Ref, TensorType
from dflash_compiler.ir.ops import Op
from dflash_compiler.ir.weights import WeightDecl

# Per-head ops that sit between a projection and its consumer (q/k norm, RoPE): values pass through arg 0.
HEAD_CHAIN = (Op.HEAD_RMSNORM, Op.ROPE)
_KEEP = (Op.INPUT, Op.STATE, Op.OUTPUT)
# The largest k step of the tensor-core linear kernels (an FP8 mma.sync step, a wgmma atom): a fused linear
# whose only kernels are those (their epilogues) needs k a multiple of it.
K_STEP = 64


def fresh_name(graph: Graph, base: str) -> str:
    """``base`` or ``base_<n>``: new nodes never collide with a name the graph already uses."""
    name, n = base, 1
    while name in graph:
        name, n = f"{base}_{n}", n + 1
    return name


def has_readers(graph: Graph, name: str) -> bool:
    return any(graph.users(Ref(name, port)) for port in range(len(graph.node(name).outputs)))


def replace_node(
    graph: Graph, name: str, node: Node, inputs: Sequence[Ref], also: Mapping[Ref, int] | None = None
) -> None:
    """Put ``node`` (reading ``inputs``) in place of ``name`` under the same name.

    Readers of ``name``'s port p read the new node's port p; readers of each ref in ``also`` read the port it
    maps to. Keeping the name keeps every reader's dump line and every lookup by name stable. The Graph API
    has neither rename nor edge rewiring, so this goes through a temporary node.
    """
    tmp = fresh_name(graph, f"{name}.replacing")
    graph.add(tmp, node, inputs)
    for ref, port in (also or {}).items():
        graph.redirect(ref, Ref(tmp, port))
    for port in range(len(graph.node(name).outputs)):
        graph.redirect(Ref(name, port), Ref(tmp, port))
    graph.remove([name])
    graph.add(name, node, inputs)
    for port in range(len(node.outputs)):
        graph.redirect(Ref(tmp, port), Ref(name, port))
    graph.remove([tmp])


def remove_dead(graph: Graph, names: Iterable[str]) -> None:
    """Remove ``names`` once they have no readers, then any producer that this leaves unread.

    Unlike ``Graph.prune`` it touches only what the rewrite orphaned; graph inputs and state stay.
    """
    work = list(names)
    while work:
        name = work.pop()
        if name not in graph or graph.node(name).op in _KEEP or has_readers(graph, name):
            continue
        producers = [ref.node for ref in graph.inputs(name)]
        graph.remove([name])
        work.extend(producers)


def through_head_chain(graph: Graph, ref: Ref) -> Ref:
    """The value ``ref`` was derived from before per-head norms and RoPE (a projection's output)."""
    while graph.node(ref.node).op in HEAD_CHAIN:
        ref = graph.inputs(ref.node)[0]
    return ref


def weight_source(decl: WeightDecl) -> str | WeightDecl:
    """A checkpoint name for a plain tensor, else the nested declaration (keeps fused decls readable)."""
    plain = decl.transform == "identity" and decl.output == 0 and not decl.params and len(decl.sources) == 1
    return decl.sources[0] if plain and isinstance(decl.sources[0], str) else decl


def fusable(graph: Graph, matmuls: Sequence[str]) -> bool:
    """Distinct MATMULs over one input whose WEIGHT operands can be stacked by rows into one matrix."""
    if len(matmuls) < 2 or len(set(matmuls)) != len(matmuls):
        return False
    nodes = [graph.node(m) for m in matmuls]
    if any(n.op is not Op.MATMUL for n in nodes) or len({graph.inputs(m)[0] for m in matmuls}) != 1:
        return False
    weights = [graph.inputs(m)[1].node for m in matmuls]
    if any(graph.node(w).op is not Op.WEIGHT for w in weights):
        return False
    shapes = [graph.node(w).type.shape for w in weights]
    if any(len(s) != 2 or not isinstance(s[0], int) for s in shapes):
        return False
    same = {(graph.node(w).type.dtype, s[1]) for w, s in zip(weights, shapes, strict=True)}
    outs = {(n.type.dtype, n.type.shape[0]) for n in nodes}
    return len(same) == 1 and len(outs) == 1


def fuse_matmuls(graph: Graph, matmuls: Sequence[str], name: str) -> tuple[Ref, dict[str, str]]:
    """Replace ``matmuls`` (see :func:`fusable`) by one MATMUL ``name`` over ``name.weight``.

    The weight is ``concat_rows`` of the old weights in the given order; each old matmul name becomes a
    SLICE of the fused output's columns, so readers are untouched. Old matmuls and weights are removed.
    Returns the fused matmul and the new nodes' anchors (the old nodes they stand in for), for
    :func:`in_original_order`.
    """
    x = graph.inputs(matmuls[0])[0]
    weights = [graph.inputs(m)[1].node for m in matmuls]
    wtypes = [graph.node(w).type for w in weights]
    rows = sum(int(t.shape[0]) for t in wtypes)
    decl = WeightDecl("concat_rows", tuple(weight_source(graph.node(w).attr("decl")) for w in weights))
    wtype = TensorType(wtypes[0].dtype, (rows, wtypes[0].shape[1]))
    w = graph.add(fresh_name(graph, f"{name}.weight"), Node.make(Op.WEIGHT, [wtype], decl=decl))
    out = graph.node(matmuls[0]).type
    y = graph.add(fresh_name(graph, name), Node.make(Op.MATMUL, [TensorType(out.dtype, (out.shape[0], rows))]), [x, w])
    start = 0
    for m, t in zip(matmuls, wtypes, strict=True):
        stop = start + int(t.shape[0])
        replace_node(graph, m, Node.make(Op.SLICE, [graph.node(m).type], start=start, stop=stop), [y])
        start = stop
    remove_dead(graph, weights)
    return y, {y.node: matmuls[0], w.node: weights[0]}


def in_original_order(graph: Graph, original: Graph, anchors: Mapping[str, str]) -> Graph:
    """``graph`` re-inserted so its topological order follows ``original``'s node order.

    Ties in ``Graph.topo`` break by insertion order, so nodes a rewrite adds would otherwise sink to the
    end of every dump. A node keeps its original place by name; a new node takes the place of its anchor
    (just before it). Same nodes, edges, dims and meta; only the insertion order differs.
    """
    rank = {n: (i, 0) for i, n in enumerate(original.names())}
    for new, anchor in anchors.items():
        rank[new] = (rank[anchor][0], -1) if anchor in rank else (len(rank), 0)
    last = len(rank)
    dag = nx.DiGraph()
    for name in graph.names():
        dag.add_node(name)
        dag.add_edges_from((ref.node, name) for ref in graph.inputs(name))
    order = nx.lexicographical_topological_sort(dag, key=lambda n: (*rank.get(n, (last, 0)), n))
    out = Graph(graph.name, dict(graph.dims), dict(graph.meta))
    for name in order:
        out.add(name, graph.node(name), graph.inputs(name))
    return out


def sibling_name(name: str, leaf: str) -> str:
    """``l0.q`` → ``l0.<leaf>``: a fused node lives in the scope of the nodes it fuses."""
    head, dot, _ = name.rpartition(".")
    return f"{head}.{leaf}" if dot else leaf


# the pass ------------------------------------------------------------------------------------------------


def fuse_into_sole_reader(
    graph: Graph,
    producer: Op,
    reader: Op,
    arg: int,
    make: Callable[[Node, Node], Node],
    fits: Callable[[Graph, str], bool] = lambda graph, name: True,
) -> Graph:
    """Every ``producer`` node for which ``fits(graph, name)`` holds and whose one output is read by exactly
    one node, a ``reader`` at argument ``arg``, merged with it: ``make(producer node, reader node)`` under the
    reader's name (its readers are untouched), reading the producer's inputs and then the reader's other
    arguments; the producer is gone. Returns a new graph in ``graph``'s node order."""
    out = graph.copy()
    for name, node in graph.nodes_of(producer):
        readers = out.users(Ref(name)) if len(node.outputs) == 1 else []
        if len(readers) != 1 or readers[0][1] != arg or out.node(readers[0][0]).op is not reader:
            continue
        if not fits(out, name):
            continue
        target = readers[0][0]
        rest = [ref for i, ref in enumerate(out.inputs(target)) if i != arg]
        replace_node(out, target, make(node, out.node(target)), [*out.inputs(name), *rest])
        out.remove([name])
    return in_original_order(out, graph, {})
