"""fuse_gate_up_silu: a gate|up projection and the silu_mul of its halves become one MATMUL_SILU.

Precondition: ``fuse_gate_up`` and ``choose_precision`` ran, so the projection is one MATMUL ``(x, W)`` or
MATMUL_FP8 ``(x, W8, scale)`` whose weight rows are gate then up, and the pattern is that projection read by
exactly one node, a one-input SILU_MUL (``l<i>.gate_up`` → ``l<i>.silu_mul`` in ``propose``). Its weight
(and scale) must be WEIGHT nodes only it reads, with a number of rows that is a multiple of 2 · GROUP, and
its k a multiple of K_STEP (the only kernels with this epilogue are the tensor-core ones, whose k step is at
most 64). Anything else is left alone, as is a phase without the pattern (``append_context``).

Invariant established: each matched pair is one ``matmul_silu(x, W'[, scale'])`` node under the silu_mul's
name (its readers are unchanged), with attribute ``group`` = GROUP; the projection node is gone. W' and
scale' keep their WEIGHT nodes' names, and their declarations become ``interleave_rows(decl; group)``:
GROUP gate rows, then the GROUP up rows of the same features, and so on. A tensor-core tile of 16 weight rows
then holds 8 features' gate and up rows, so one thread holds both values of a feature and the kernel writes
silu(gate) · up; the ``[rows, 2 · features]`` projection never goes to memory.

Measured on the H200 (bench/propose.py, Qwen3-8B-DFlash bf16, same run, this pass with fuse_lm_head_argmax
and fuse_block_embed against none of them): 0.954 → 0.948 ms at nb = 1, 1.401 → 1.369 at nb = 8, 2.352 → 2.323
at nb = 16; matmul_silu against numpy at nb = 1 and 8, bf16 and FP8 (bench/kernels.py), and the tiny
drafters' GPU tests pass.
"""

from __future__ import annotations

from dflash_compiler.ir.graph import Graph, Node, Ref
from dflash_compiler.ir.ops import Op
from dflash_compiler.ir.weights import WeightDecl

from ._rewrite import K_STEP, in_original_order, replace_node
from .context import PassContext

GROUP = 8  # half an mma.sync / wgmma tile of weight rows (the m16n8 accumulator's row halves)


def _interleavable(graph: Graph, ref: Ref, projection: str) -> bool:
    node = graph.node(ref.node)
    rows = node.outputs[0].shape[0] if node.outputs and node.outputs[0].shape else None
    return (
        node.op is Op.WEIGHT
        and graph.users(ref) == [(projection, graph.inputs(projection).index(ref))]
        and isinstance(rows, int)
        and rows % (2 * GROUP) == 0
    )


def fuse_gate_up_silu(graph: Graph, ctx: PassContext) -> Graph:
    """Fuse every gate|up projection with the silu_mul that alone reads it (module docstring)."""
    out = graph.copy()
    for name, _ in graph.nodes_of(Op.MATMUL, Op.MATMUL_FP8):
        readers = out.users(Ref(name))
        if len(readers) != 1 or out.node(readers[0][0]).op is not Op.SILU_MUL or len(out.inputs(readers[0][0])) != 1:
            continue
        silu = readers[0][0]
        weights = out.inputs(name)[1:]
        k = out.node(weights[0].node).outputs[0].shape[-1]
        if not isinstance(k, int) or k % K_STEP or not all(_interleavable(out, ref, name) for ref in weights):
            continue
        for ref in weights:
            w = out.node(ref.node)
            decl = WeightDecl("interleave_rows", (w.attr("decl"),), (("group", GROUP),))
            out.set_node(ref.node, Node.make(Op.WEIGHT, list(w.outputs), **{**w.attr_dict, "decl": decl}))
        fused = Node.make(Op.MATMUL_SILU, list(out.node(silu).outputs), group=GROUP)
        replace_node(out, silu, fused, out.inputs(name))
        out.remove([name])
    return in_original_order(out, graph, {})
