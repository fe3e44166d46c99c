"""tile_weights: the weights the linear kernels stream are stored as 64 x 64 tiles (weight_tiles.py).

Precondition: the fusions and ``choose_precision`` ran, so each linear's weight is the WEIGHT node it streams
(arg 1 of an op of kind LINEAR: MATMUL, MATMUL_FP8, LM_HEAD, LM_HEAD_ARGMAX, MATMUL_SILU). A weight is tiled
when ``options.weight_tiles`` is on (the default), its rows and columns are multiples of 64, every reader of
it is such a linear reading it as its weight, and it is not a target tensor taken as it is (``identity`` of
``target.*``: the serving engine may lend that one, row-major, in place of the stored copy). Anything else is
left alone.

Invariant established: each tiled WEIGHT keeps its name, type and readers, and its declaration becomes
``tiles(decl)``; each of its readers carries attribute ``weight_tiles`` = 64, by which its kernels and the
interpreter read the weight. A linear without the attribute reads a row-major weight. The FP8 scales stay
one per row, in row order.

Why: a warpgroup GEMM's slot of a row-major weight is 64 runs of 128 bytes a weight row apart; tiled it is one
run. The Qwen3-8B step on an H100 (bench/propose.py, one run, the tiled build between two row-major copies, ms
at nb = 1 / 4 / 8 / 16): bf16 1.288 / 1.511 / 1.742 / 2.512 against 1.288-1.315 / 1.543-1.551 / 1.784-1.791 /
2.517-2.522; FP8 0.812 / 1.025 / 1.382 / 2.522 against 0.797-0.798 / 1.178-1.179 / 1.487-1.488 / 2.562-2.570.
At nb = 8 (timeline, µs a call, row-major → tiled) bf16 matmul_silu 82.7 → 76.5, down 40.6 → 39.8, qkv 24.4 →
23.5; FP8 matmul_silu 64.0 → 54.6, down 32.3 → 29.4, FP8 lm_head_argmax 373.5 → 346.9 (the bf16 lm_head is
lent, so row-major in both). The FP8 step at nb = 1 lost ~2 % (in the timeline most of its GEMVs took 0.5-2 µs
a call more, lm_head_argmax 225.1 → 226.7); the layout is kept for all row counts because one weight serves
them all. Spreading the blocks' k offsets instead (each block starting its k loop elsewhere, rows still
row-major) lost: 1.804 ms at nb = 8 and 2.679 at nb = 16.
"""

from __future__ import annotations

from dflash_compiler.ir.graph import Graph, Node, Ref
from dflash_compiler.ir.ops import Op, OpKind
from dflash_compiler.ir.weights import WeightDecl
from dflash_compiler.weight_tiles import TILE, tileable

from .context import PassContext

WEIGHT_ARG = 1
TRANSFORM = "tiles"


def _lent(decl: WeightDecl) -> bool:
    """A target tensor as it is: the serving engine may lend it in place of the stored copy."""
    return decl.transform == "identity" and any(name.startswith("target.") for name in decl.checkpoint_names())


def _tileable(graph: Graph, weight: str) -> bool:
    node = graph.node(weight)
    shape = node.outputs[0].shape
    readers = graph.users(Ref(weight))
    return (
        len(shape) == 2
        and all(isinstance(d, int) for d in shape)
        and tileable(*shape)
        and bool(readers)
        and all(graph.node(user).op.kind is OpKind.LINEAR and arg == WEIGHT_ARG for user, arg in readers)
        and not _lent(node.attr("decl"))
        and node.attr("decl").transform != TRANSFORM
    )


def tile_weights(graph: Graph, ctx: PassContext) -> Graph:
    """Tile every weight the linear kernels alone stream (module docstring)."""
    if not ctx.options.weight_tiles:
        return graph
    out = graph.copy()
    for weight, node in graph.nodes_of(Op.WEIGHT):
        if not _tileable(out, weight):
            continue
        decl = WeightDecl(TRANSFORM, (node.attr("decl"),))
        out.set_node(weight, Node.make(Op.WEIGHT, list(node.outputs), **{**node.attr_dict, "decl": decl}))
        for user, _ in out.users(Ref(weight)):
            out.set_node(user, out.node(user).with_attrs(weight_tiles=TILE))
    return out
