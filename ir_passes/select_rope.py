"""select_rope: resolve each RoPE node's config-level spec into the table its kernel reads.

Precondition: ROPE nodes carry the lowering's ``rope`` attribute (a :class:`RopeSpec` as sorted pairs)
and two inputs (x, positions). Every such node of a phase has the same spec and head_dim (a drafter has
one RoPE); a phase without such nodes (already selected) is returned unchanged.

Invariant established: no ROPE node carries ``rope``. Each reads a third input, the WEIGHT node
``rope.inv_freq`` (float32 [head_dim/2], declared ``rope_inv_freq`` with the values as a parameter, one
node shared by all), and has an ``attention_factor`` attribute (YaRN's mscale, 1 otherwise). The choice
is recorded in ``graph.meta["rope"]`` as a :class:`RopeChoice`. Variants the compiler cannot tabulate
(``llama3``, ``dynamic``, …) are refused with :class:`UnsupportedRopeError`, never approximated.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from pydantic import BaseModel, ConfigDict, ValidationError

from dflash_compiler.errors import DFlashError
from dflash_compiler.ir.graph import Graph, Node, Ref, TensorType
from dflash_compiler.ir.ops import Op
from dflash_compiler.ir.weights import WeightDecl
from dflash_compiler.rope import RopeSpec, RopeType, rope_tables

from ._rewrite import fresh_name, in_original_order, replace_node
from .context import PassContext

TABLE = "rope.inv_freq"
ALLOWED = tuple(t.value for t in RopeType)


class UnsupportedRopeError(DFlashError):
    """A ROPE node's spec cannot be turned into an inv_freq table and attention factor."""

    def __init__(self, graph: str, node: str, found: str, detail: str = "") -> None:
        self.node, self.found = node, found
        allowed = ", ".join(repr(a) for a in ALLOWED)
        super().__init__(
            f"graph {graph}: node {node!r} has RoPE variant {found}{detail}; select_rope supports {allowed}. "
            f"Fix: give the drafter config a rope_type among {allowed} (rope_scaling / rope_parameters), or "
            f"add the variant to dflash_compiler.rope (RopeType and rope_tables) so it lowers to an inv_freq "
            f"table and an attention factor."
        )


class MixedRopeError(DFlashError):
    """Two ROPE nodes of one phase disagree; a phase has one table and one recorded choice."""


class RopeChoice(BaseModel):
    """What ``select_rope`` decided for a phase (recorded in ``graph.meta["rope"]`` and the manifest)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    rope_type: RopeType
    theta: float
    factor: float
    attention_factor: float
    head_dim: int
    table_length: int
    table: str  # the WEIGHT node holding inv_freq

    def summary(self) -> str:
        return (
            f"{self.rope_type.value} theta={self.theta:g} factor={self.factor:g} "
            f"attention_factor={self.attention_factor:.6g} inv_freq=%{self.table}[{self.table_length}]"
        )


def _spec(graph: Graph, name: str, raw: dict[str, Any]) -> RopeSpec:
    """The node's spec, refusing variants (and broken specs) that have no table."""
    variant = raw.get("rope_type")
    if variant not in ALLOWED:
        raise UnsupportedRopeError(graph.name, name, repr(variant))
    try:
        spec = RopeSpec(**raw)
        rope_tables(spec, 2)  # YaRN without original_max_position_embeddings fails here
    except (ValidationError, ValueError) as exc:
        detail = f" with an unusable spec ({str(exc).splitlines()[0]})"
        raise UnsupportedRopeError(graph.name, name, repr(variant), detail) from exc
    return spec


def _choose(graph: Graph, ropes: list[tuple[str, Node]]) -> RopeChoice:
    """One choice for the phase: every RoPE node must agree on spec and head_dim."""
    choices = {(_spec(graph, name, dict(node.attr("rope"))), int(node.attr("head_dim"))) for name, node in ropes}
    if len(choices) != 1:
        found = "; ".join(f"{s.describe()} head_dim={d}" for s, d in choices)
        raise MixedRopeError(
            f"graph {graph.name}: RoPE nodes disagree ({found}). Fix: lower one RoPE spec per phase; a drafter "
            f"has one rope_theta / rope_scaling."
        )
    ((spec, head_dim),) = choices
    _, attention_factor = rope_tables(spec, head_dim)
    table = fresh_name(graph, TABLE)
    return RopeChoice(
        rope_type=spec.rope_type,
        theta=spec.theta,
        factor=spec.factor,
        attention_factor=attention_factor,
        head_dim=head_dim,
        table_length=head_dim // 2,
        table=table,
    )


def _table_node(spec: RopeSpec, choice: RopeChoice) -> Node:
    inv_freq, _ = rope_tables(spec, choice.head_dim)
    decl = WeightDecl("rope_inv_freq", (), (("inv_freq", tuple(float(v) for v in np.asarray(inv_freq))),))
    return Node.make(Op.WEIGHT, [TensorType("float32", (choice.table_length,))], decl=decl)


def select_rope(graph: Graph, ctx: PassContext) -> Graph:
    """Give every RoPE node its inv_freq table and attention factor (module docstring)."""
    ropes = [(name, node) for name, node in graph.nodes_of(Op.ROPE) if node.has("rope")]
    if not ropes:
        return graph.copy()
    choice = _choose(graph, ropes)
    out = graph.copy()
    spec = RopeSpec(**dict(ropes[0][1].attr("rope")))
    table = out.add(choice.table, _table_node(spec, choice))
    for name, node in ropes:
        attrs = {k: v for k, v in node.attr_dict.items() if k != "rope"}
        new = Node.make(Op.ROPE, node.outputs, **attrs, attention_factor=choice.attention_factor)
        replace_node(out, name, new, [*out.inputs(name)[:2], Ref(table.node)])
    out.meta["rope"] = choice
    return in_original_order(out, graph, {choice.table: ropes[0][0]})
