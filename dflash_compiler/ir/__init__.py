"""Typed drafter graph IR: frozen node records, networkx edges, a spec, a verifier and a numpy interpreter."""

from dflash_compiler.ir.dump import dump, to_dot
from dflash_compiler.ir.graph import Dim, Graph, Node, Ref, TensorType, eval_dim
from dflash_compiler.ir.interpret import evaluate_node, interpret
from dflash_compiler.ir.ops import Op, OpKind
from dflash_compiler.ir.spec import VerifyError, verify
from dflash_compiler.ir.weights import WeightCache, WeightDecl

__all__ = [
    "Dim", "Graph", "Node", "Op", "OpKind", "Ref", "TensorType", "VerifyError", "WeightCache", "WeightDecl",
    "dump", "eval_dim", "evaluate_node", "interpret", "to_dot", "verify",
]  # fmt: skip
