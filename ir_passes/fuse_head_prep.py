"""fuse_head_prep: one kernel for the per-head work between a fused projection and its readers.

After fuse_qkv and fuse_context_kv a layer's q, k and v (or every layer's context K and V) are SLICEs of one
projection, each followed by its own q/k norm and RoPE: seven launches per layer in ``propose`` that each
move a few hundred KB, and six per layer in ``append_context``. This pass gives each such projection one
HEAD_PREP node that reads it once and writes every window.

Precondition: RoPE selected (select_rope: every ROPE reads ``(x, positions, inv_freq)`` and carries
``attention_factor``). Per value X that SLICE nodes read, a slice's *chain* is the slice, then optionally a
HEAD_RMSNORM, then optionally a ROPE, each the only reader of the one before (at argument 0).

Invariant established: for every X whose chains include at least one ROPE, the chains that agree with the
first ROPE's (head_dim, positions, table, attention_factor) and the first norm's eps, and that cover whole
heads, are replaced by one HEAD_PREP ``<X>.heads`` reading ``(X, positions, inv_freq, norm weights...)``
with ``windows = ((start, stop, norm, rope), ...)`` in slice order: output j holds window j's values, and
every reader of a chain's last node reads it instead. Chains that do not agree keep their nodes. Head dims
whose halves are not whole 16-byte vectors spread over a power-of-two number of lanes of one warp (other
than 16·2^i up to 512: 64, 128, 256 are) keep their separate kernels. The values are the same; only where
they are computed changes.
"""

from __future__ import annotations

from dataclasses import dataclass

from dflash_compiler.ir.graph import Graph, Node, Ref
from dflash_compiler.ir.ops import HEAD_PREP_HEAD_DIMS, Op

from ._rewrite import fresh_name, in_original_order, remove_dead
from .context import PassContext


@dataclass(frozen=True)
class _Chain:
    slice: str
    start: int
    stop: int
    norm: str | None
    rope: str | None

    @property
    def end(self) -> str:
        return self.rope or self.norm or self.slice


def _only_reader(graph: Graph, name: str, op: Op) -> str | None:
    users = graph.users(Ref(name))
    if len(users) == 1 and users[0][1] == 0 and graph.node(users[0][0]).op is op:
        return users[0][0]
    return None


def _chain(graph: Graph, name: str) -> _Chain:
    node = graph.node(name)
    norm = _only_reader(graph, name, Op.HEAD_RMSNORM)
    rope = _only_reader(graph, norm or name, Op.ROPE)
    if rope is not None and len(graph.inputs(rope)) != 3:
        rope = None  # not selected yet: no table to read
    return _Chain(name, int(node.attr("start")), int(node.attr("stop")), norm, rope)


def _group(graph: Graph, chains: list[_Chain]) -> tuple[list[_Chain], dict[str, object]] | None:
    """The chains that can share one HEAD_PREP and its attributes, or None when none has a RoPE."""
    first_rope = next((c.rope for c in chains if c.rope), None)
    if first_rope is None:
        return None
    rope = graph.node(first_rope)
    d, rope_inputs = int(rope.attr("head_dim")), graph.inputs(first_rope)[1:]
    if d not in HEAD_PREP_HEAD_DIMS:
        return None
    factor = float(rope.attr("attention_factor"))
    first_norm = next((c.norm for c in chains if c.norm), None)
    eps = float(graph.node(first_norm).attr("eps")) if first_norm else 0.0

    def agrees(c: _Chain) -> bool:
        if (c.stop - c.start) % d or graph.node(c.slice).type.dtype != rope.type.dtype:
            return False
        if c.norm and (int(graph.node(c.norm).attr("head_dim")) != d or float(graph.node(c.norm).attr("eps")) != eps):
            return False
        rope_node = graph.node(c.rope) if c.rope else None
        return rope_node is None or (
            int(rope_node.attr("head_dim")) == d
            and graph.inputs(c.rope)[1:] == rope_inputs
            and float(rope_node.attr("attention_factor")) == factor
        )

    return [c for c in chains if agrees(c)], {"head_dim": d, "eps": eps, "attention_factor": factor}


def fuse_head_prep(graph: Graph, ctx: PassContext) -> Graph:
    """Replace the per-head chains of each sliced projection by one HEAD_PREP (module docstring)."""
    out = graph.copy()
    by_source: dict[Ref, list[str]] = {}
    for name, _ in graph.nodes_of(Op.SLICE):
        by_source.setdefault(graph.inputs(name)[0], []).append(name)
    anchors: dict[str, str] = {}
    for source, slices in by_source.items():
        found = _group(out, [_chain(out, s) for s in slices])
        if found is None:
            continue
        chains, attrs = found
        rope = next(c.rope for c in chains if c.rope)
        inputs = [source, *out.inputs(rope)[1:], *(out.inputs(c.norm)[1] for c in chains if c.norm)]
        windows = tuple((c.start, c.stop, c.norm is not None, c.rope is not None) for c in chains)
        node = Node.make(Op.HEAD_PREP, [out.node(c.end).type for c in chains], windows=windows, **attrs)
        name = fresh_name(out, f"{source.node}.heads")
        out.add(name, node, inputs)
        for port, chain in enumerate(chains):
            out.redirect(Ref(chain.end), Ref(name, port))
        remove_dead(out, [c.end for c in chains])
        anchors[name] = chains[0].slice
    return in_original_order(out, graph, anchors)
