"""The graph container: frozen node records, dataflow edges in networkx.

A node is identified by a readable name (``l0.q_proj``). Its record (:class:`Node`) holds the op, the
attributes and the type of each output; the edges of a ``networkx.MultiDiGraph`` carry which output
port of the producer feeds which argument of the consumer. Symbolic dims are strings over the phase's
named dims (``nb``, ``blk``, ``ctx``, ``pages``, ``maxp``), e.g. ``"nb*blk"``.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, NamedTuple

import networkx as nx

from dflash_compiler.ir.ops import Op

Dim = int | str

_MISSING = object()


@dataclass(frozen=True)
class TensorType:
    dtype: str
    shape: tuple[Dim, ...]

    def render(self) -> str:
        return f"{self.dtype}[{', '.join(str(d) for d in self.shape)}]"


class Ref(NamedTuple):
    """One output of a node: (node name, output port)."""

    node: str
    port: int = 0

    def render(self) -> str:
        return self.node if self.port == 0 else f"{self.node}:{self.port}"


def _freeze(value: Any) -> Any:
    if isinstance(value, list | tuple):
        return tuple(_freeze(v) for v in value)
    if isinstance(value, Mapping):
        return tuple(sorted((k, _freeze(v)) for k, v in value.items()))
    return value


@dataclass(frozen=True)
class Node:
    """An immutable op record. ``attrs`` are sorted (key, value) pairs of hashable values."""

    op: Op
    outputs: tuple[TensorType, ...]
    attrs: tuple[tuple[str, Any], ...] = ()

    @staticmethod
    def make(op: Op, outputs: Sequence[TensorType], **attrs: Any) -> Node:
        return Node(op, tuple(outputs), tuple(sorted((k, _freeze(v)) for k, v in attrs.items())))

    def attr(self, key: str, default: Any = _MISSING) -> Any:
        for k, v in self.attrs:
            if k == key:
                return v
        if default is _MISSING:
            raise KeyError(f"{self.op.value} node has no attribute {key!r}")
        return default

    def has(self, key: str) -> bool:
        return any(k == key for k, _ in self.attrs)

    @property
    def attr_dict(self) -> dict[str, Any]:
        return dict(self.attrs)

    def with_attrs(self, **updates: Any) -> Node:
        merged = dict(self.attrs)
        merged.update({k: _freeze(v) for k, v in updates.items()})
        return replace(self, attrs=tuple(sorted(merged.items())))

    @property
    def type(self) -> TensorType:
        return self.outputs[0]


@dataclass
class Graph:
    """One phase of the drafter (``append_context`` or ``propose``) as a dataflow graph.

    ``dims`` names the symbolic dims of this phase with a description; ``meta`` holds plans and
    records that passes attach (RoPE tables, precision map, memory plan, KV-cache plan).
    """

    name: str
    dims: dict[str, str] = field(default_factory=dict)
    meta: dict[str, Any] = field(default_factory=dict)
    _g: nx.MultiDiGraph = field(default_factory=nx.MultiDiGraph, repr=False)
    _order: dict[str, int] = field(default_factory=dict, repr=False)
    _next: int = 0

    # construction -------------------------------------------------------------------------------
    def add(self, name: str, node: Node, inputs: Sequence[Ref | str] = ()) -> Ref:
        if name in self._g:
            raise ValueError(f"graph {self.name}: node {name!r} already exists")
        self._g.add_node(name, node=node)
        self._order[name] = self._next
        self._next += 1
        for arg, ref in enumerate(inputs):
            ref = ref if isinstance(ref, Ref) else Ref(ref)
            if ref.node not in self._g:
                self._g.remove_node(name)
                raise ValueError(f"graph {self.name}: {name!r} reads unknown node {ref.node!r}")
            self._g.add_edge(ref.node, name, arg=arg, port=ref.port)
        return Ref(name)

    def copy(self) -> Graph:
        g = Graph(self.name, dict(self.dims), dict(self.meta))
        g._g = self._g.copy()
        g._order = dict(self._order)
        g._next = self._next
        return g

    # queries ------------------------------------------------------------------------------------
    def __contains__(self, name: str) -> bool:
        return name in self._g

    def __len__(self) -> int:
        return self._g.number_of_nodes()

    def node(self, name: str) -> Node:
        return self._g.nodes[name]["node"]

    def inputs(self, name: str) -> list[Ref]:
        edges = sorted(self._g.in_edges(name, data=True), key=lambda e: e[2]["arg"])
        return [Ref(src, data["port"]) for src, _, data in edges]

    def users(self, ref: Ref | str) -> list[tuple[str, int]]:
        """(consumer, argument index) pairs reading ``ref``."""
        ref = ref if isinstance(ref, Ref) else Ref(ref)
        return sorted(
            (dst, data["arg"]) for _, dst, data in self._g.out_edges(ref.node, data=True) if data["port"] == ref.port
        )

    def type_of(self, ref: Ref | str) -> TensorType:
        ref = ref if isinstance(ref, Ref) else Ref(ref)
        return self.node(ref.node).outputs[ref.port]

    def names(self) -> list[str]:
        """Node names in insertion order."""
        return sorted(self._g.nodes, key=self._order.__getitem__)

    def topo(self) -> list[str]:
        """A deterministic topological order (ties broken by insertion order)."""
        return list(nx.lexicographical_topological_sort(self._g, key=self._order.__getitem__))

    def nodes_of(self, *ops: Op) -> Iterator[tuple[str, Node]]:
        for name in self.topo():
            node = self.node(name)
            if node.op in ops:
                yield name, node

    def outputs(self) -> list[str]:
        return [name for name, _ in self.nodes_of(Op.OUTPUT)]

    def is_acyclic(self) -> bool:
        return nx.is_directed_acyclic_graph(self._g)

    # rewriting ----------------------------------------------------------------------------------
    def set_node(self, name: str, node: Node) -> None:
        self._g.nodes[name]["node"] = node

    def redirect(self, old: Ref, new: Ref, keep: Iterable[str] = ()) -> None:
        """Make every reader of ``old`` read ``new`` instead, except the nodes named in ``keep``
        (e.g. ``new`` itself when it was inserted after ``old``)."""
        keep = set(keep)
        for dst, arg in self.users(old):
            if dst in keep:
                continue
            keys = [k for _, d, k, data in self._g.out_edges(old.node, keys=True, data=True)
                    if d == dst and data["arg"] == arg and data["port"] == old.port]  # fmt: skip
            for key in keys:
                self._g.remove_edge(old.node, dst, key)
            self._g.add_edge(new.node, dst, arg=arg, port=new.port)

    def remove(self, names: Iterable[str]) -> None:
        for name in list(names):
            if any(dst not in names for _, dst in self._g.out_edges(name)):
                raise ValueError(f"graph {self.name}: cannot remove {name!r}, it still has readers")
        self._g.remove_nodes_from(list(names))
        for name in list(names):
            self._order.pop(name, None)

    def prune(self) -> list[str]:
        """Remove nodes no output depends on; returns the removed names."""
        live: set[str] = set()
        for out in self.outputs():
            live.add(out)
            live |= nx.ancestors(self._g, out)
        dead = [n for n in self.names() if n not in live]
        self._g.remove_nodes_from(dead)
        for name in dead:
            self._order.pop(name)
        return dead


def eval_dim(dim: Dim, bindings: Mapping[str, int]) -> int:
    """Evaluate a symbolic dim (``"nb*(blk-1)"``) with integer bindings."""
    if isinstance(dim, int):
        return dim
    tree = ast.parse(dim, mode="eval")

    def ev(node: ast.AST) -> int:
        if isinstance(node, ast.Expression):
            return ev(node.body)
        if isinstance(node, ast.Constant) and isinstance(node.value, int):
            return node.value
        if isinstance(node, ast.Name):
            if node.id not in bindings:
                raise KeyError(f"symbolic dim {node.id!r} of {dim!r} has no binding")
            return int(bindings[node.id])
        if isinstance(node, ast.BinOp):
            a, b = ev(node.left), ev(node.right)
            if isinstance(node.op, ast.Mult):
                return a * b
            if isinstance(node.op, ast.Add):
                return a + b
            if isinstance(node.op, ast.Sub):
                return a - b
            if isinstance(node.op, ast.FloorDiv):
                return a // b
        raise ValueError(f"unsupported symbolic dim expression {dim!r}")

    return ev(tree)


def dim_symbols(dim: Dim) -> set[str]:
    if isinstance(dim, int):
        return set()
    return {n.id for n in ast.walk(ast.parse(dim, mode="eval")) if isinstance(n, ast.Name)}
