"""Text dump (one line per node, deterministic) and Graphviz DOT export of a graph."""

from __future__ import annotations

from typing import Any

from dflash_compiler.ir.graph import Graph
from dflash_compiler.ir.weights import WeightDecl


def _attr_text(value: Any) -> str:
    if isinstance(value, WeightDecl):
        return value.render()
    if isinstance(value, float):
        return f"{value:.6g}"
    if isinstance(value, tuple) and value and all(isinstance(v, tuple) and len(v) == 2 for v in value):
        return "{" + ", ".join(f"{k}: {_attr_text(v)}" for k, v in value) + "}"
    if isinstance(value, tuple) and len(value) > 8:
        return f"({_attr_text(value[0])}, ... {len(value)} values)"
    return str(value)


def dump(graph: Graph) -> str:
    """``%name = op(args) {attrs} : types`` per node in topological order, with a header."""
    lines = [f"graph {graph.name} dims({', '.join(graph.dims)})"]
    for name in graph.topo():
        node = graph.node(name)
        args = ", ".join("%" + ref.render() for ref in graph.inputs(name))
        attrs = ", ".join(f"{k}={_attr_text(v)}" for k, v in node.attrs)
        types = ", ".join(t.render() for t in node.outputs)
        lines.append(f"%{name} = {node.op.value}({args})" + (f" {{{attrs}}}" if attrs else "") + f" : {types}")
    for key in sorted(graph.meta):
        value = graph.meta[key]
        text = value.summary() if hasattr(value, "summary") else _attr_text(value)
        lines.append(f"meta {key} = {text}")
    return "\n".join(lines) + "\n"


def to_dot(graph: Graph) -> str:
    """A DOT digraph: one box per node (op and output types), edges labelled by argument index."""
    out = [f'digraph "{graph.name}" {{', "  node [shape=box, fontname=monospace, fontsize=10];"]
    for name in graph.topo():
        node = graph.node(name)
        label = f"{name}\\n{node.op.value}\\n" + ", ".join(t.render() for t in node.outputs)
        out.append(f'  "{name}" [label="{label}"];')
    for name in graph.topo():
        for arg, ref in enumerate(graph.inputs(name)):
            port = f":{ref.port}" if ref.port else ""
            out.append(f'  "{ref.node}" -> "{name}" [label="{arg}{port}"];')
    out.append("}")
    return "\n".join(out) + "\n"
