"""Per-op rules of the IR and ``verify(graph)``, run between passes in tests and in debug builds.

Each op states its arity, its required attributes and a shape rule relating its inputs to its
outputs. ``verify`` also checks the graph is acyclic, every OUTPUT is reachable, dims use only the
phase's named symbols, and WEIGHT nodes carry a declaration.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from dflash_compiler.ir.graph import Dim, Graph, Node, TensorType, dim_symbols
from dflash_compiler.ir.ops import Op
from dflash_compiler.ir.weights import TRANSFORMS, WeightDecl


class VerifyError(ValueError):
    def __init__(self, graph: str, errors: list[str]) -> None:
        self.errors = errors
        super().__init__(f"graph {graph}: {len(errors)} IR error(s):\n" + "\n".join(f"  - {e}" for e in errors))


ShapeRule = Callable[[Node, list[TensorType]], list[str]]


@dataclass(frozen=True)
class OpSpec:
    arity: tuple[int, int]  # (min, max) inputs
    attrs: tuple[str, ...] = ()
    outputs: int | None = 1  # None: as many as the shape rule checks
    rule: ShapeRule | None = None


def _same(a: Dim, b: Dim) -> bool:
    return str(a).replace(" ", "") == str(b).replace(" ", "")


def _expect(cond: bool, msg: str) -> list[str]:
    return [] if cond else [msg]


def _linear_operands(node: Node, ins: list[TensorType]) -> list[str]:
    """x [.., K] @ W [N, K].T, and the FP8 form's e4m3 weight and f32 [N] scale."""
    x, w = ins[0], ins[1]
    errs = _expect(len(w.shape) == 2, f"weight must be 2-D, got {w.render()}")
    if errs:
        return errs
    errs += _expect(_same(x.shape[-1], w.shape[1]), f"x {x.render()} @ W{w.render()}.T: inner dims differ")
    if node.op is Op.MATMUL_FP8 or len(ins) == 3:  # MATMUL_FP8, or an lm_head's FP8 form
        errs += _expect(w.dtype == "float8_e4m3fn", f"fp8 weight has dtype {w.dtype}")
        errs += _expect(ins[2].dtype == "float32" and _same(ins[2].shape[0], w.shape[0]), "scale must be f32[N]")
    return errs


def _matmul(node: Node, ins: list[TensorType]) -> list[str]:
    x, w, out = ins[0], ins[1], node.outputs[0]
    errs = _linear_operands(node, ins)
    if errs:
        return errs
    return _expect(
        _same(out.shape[-1], w.shape[0]) and _same(out.shape[0], x.shape[0]),
        f"output {out.render()} is not [{x.shape[0]}, {w.shape[0]}]",
    )


def _lm_head_argmax(node: Node, ins: list[TensorType]) -> list[str]:
    x, out = ins[0], node.outputs[0]
    return _linear_operands(node, ins) + _expect(
        out.dtype == "int32" and len(out.shape) == 1 and _same(out.shape[0], x.shape[0]),
        f"output {out.render()} is not int32[{x.shape[0]}] (one id per row of x)",
    )


def _matmul_silu(node: Node, ins: list[TensorType]) -> list[str]:
    x, w, out = ins[0], ins[1], node.outputs[0]
    errs = _linear_operands(node, ins)
    if errs:
        return errs
    group, rows = int(node.attr("group")), w.shape[0]
    return _expect(
        isinstance(rows, int)
        and rows % (2 * group) == 0
        and _same(out.shape[-1], rows // 2)
        and _same(out.shape[0], x.shape[0]),
        f"output {out.render()} is not [{x.shape[0]}, {w.shape[0]} / 2] of gate|up blocks of {group} rows",
    )


def _same_as_input(node: Node, ins: list[TensorType]) -> list[str]:
    return _expect(
        all(_same(a, b) for a, b in zip(node.outputs[0].shape, ins[0].shape, strict=False))
        and len(node.outputs[0].shape) == len(ins[0].shape),
        f"output {node.outputs[0].render()} must have the input's shape {ins[0].render()}",
    )


def _norm(node: Node, ins: list[TensorType]) -> list[str]:
    x, w = ins[0], ins[-1]
    width = int(node.attr("head_dim")) if node.op is Op.HEAD_RMSNORM else x.shape[-1]
    errs = _same_as_input(node, ins)
    errs += _expect(len(w.shape) == 1 and _same(w.shape[0], width), f"norm weight {w.render()} is not [{width}]")
    if node.op is Op.HEAD_RMSNORM:
        errs += _expect(isinstance(x.shape[-1], int) and x.shape[-1] % width == 0, "width not a multiple of head_dim")
    return errs


def _rope(node: Node, ins: list[TensorType]) -> list[str]:
    errs = _same_as_input(node, ins)
    errs += _expect(ins[1].dtype == "int32" and _same(ins[1].shape[0], ins[0].shape[0]), "positions must be i32[rows]")
    if len(ins) == 3:
        half = int(node.attr("head_dim")) // 2
        errs += _expect(_same(ins[2].shape[0], half), f"inv_freq table must be [{half}]")
        errs += _expect(node.has("attention_factor"), "a RoPE table input needs attention_factor")
    else:
        errs += _expect(node.has("rope"), "RoPE without a table needs the rope spec attribute")
    return errs


def _head_prep(node: Node, ins: list[TensorType]) -> list[str]:
    x, positions, inv_freq, norm_weights = ins[0], ins[1], ins[2], ins[3:]
    d, windows = int(node.attr("head_dim")), node.attr("windows")
    width = x.shape[-1] if len(x.shape) == 2 else None
    errs = _expect(isinstance(width, int), f"x {x.render()} is not [rows, width] with a static width")
    errs += _expect(positions.dtype == "int32" and _same(positions.shape[0], x.shape[0]), "positions must be i32[rows]")
    errs += _expect(_same(inv_freq.shape[0], d // 2), f"inv_freq table must be [{d // 2}]")
    errs += _expect(len(node.outputs) == len(windows), f"{len(node.outputs)} outputs for {len(windows)} windows")
    errs += _expect(
        len(norm_weights) == sum(bool(w[2]) for w in windows), "one norm weight per window that norms, in order"
    )
    errs += [f"norm weight {w.render()} is not [{d}]" for w in norm_weights if not _same(w.shape, (d,))]
    for (start, stop, _norm_it, _rope_it), out in zip(windows, node.outputs, strict=False):
        ok = isinstance(width, int) and 0 <= start < stop <= width and (stop - start) % d == 0
        errs += _expect(ok, f"window [{start}:{stop}] of {x.render()} is not whole heads of {d}")
        errs += _expect(
            len(out.shape) == 2 and _same(out.shape[0], x.shape[0]) and _same(out.shape[1], stop - start)
            and out.dtype == x.dtype,
            f"output {out.render()} of window [{start}:{stop}] is not {x.dtype}[{x.shape[0]}, {stop - start}]",
        )  # fmt: skip
    return errs


def _kv_writes(node: Node, ins: list[TensorType]) -> list[str]:
    cache, slots, rows = ins[0], ins[1], ins[2:]
    targets = node.attr("targets")
    errs = _same_as_input(node, ins)
    errs += _expect(len(cache.shape) == 6, f"cache {cache.render()} is not [layers, 2, pages, page, heads, dim]")
    errs += _expect(len(rows) == len(targets), f"{len(rows)} row inputs for {len(targets)} (layer, which) targets")
    errs += _expect(slots.dtype == "int32" and len(slots.shape) == 1, "slots must be i32[rows]")
    if len(cache.shape) == 6:
        width = f"{cache.shape[4]}*{cache.shape[5]}"
        for r in rows:
            ok = _same(r.shape[0], slots.shape[0]) and isinstance(r.shape[-1], int)
            ok = ok and r.shape[-1] == int(cache.shape[4]) * int(cache.shape[5])
            errs += _expect(ok, f"rows {r.render()} are not [{slots.shape[0]}, {width}]")
        for layer, which in targets:
            errs += _expect(0 <= layer < int(cache.shape[0]) and which in (0, 1), f"target ({layer}, {which})")
    return errs


def _rmsnorm_residual(node: Node, ins: list[TensorType]) -> list[str]:
    a, b, w = ins
    errs = _expect(all(_same(x, y) for x, y in zip(a.shape, b.shape, strict=True)), "residual operands differ")
    errs += _expect(len(w.shape) == 1 and _same(w.shape[0], a.shape[-1]), f"norm weight {w.render()} mismatch")
    for out in node.outputs:
        errs += _expect(all(_same(x, y) for x, y in zip(out.shape, a.shape, strict=True)), "outputs must match a")
    return errs


def _attention(node: Node, ins: list[TensorType]) -> list[str]:
    q, k, v = ins[0], ins[1], ins[2]
    hq, hkv, d = (int(node.attr(a)) for a in ("heads", "kv_heads", "head_dim"))
    errs = _expect(hq % hkv == 0, f"heads {hq} not a multiple of kv_heads {hkv}")
    errs += _expect(_same(q.shape[-1], hq * d), f"q {q.render()} is not [rows, {hq * d}]")
    errs += _expect(_same(k.shape[-1], hkv * d) and _same(v.shape[-1], hkv * d), "k/v are not [rows, kv_heads*D]")
    return errs


def _elementwise2(node: Node, ins: list[TensorType]) -> list[str]:
    if len(ins) == 1:  # silu_mul over the two halves of one input
        ok = isinstance(ins[0].shape[-1], int) and _same(node.outputs[0].shape[-1], ins[0].shape[-1] // 2)
        return _expect(ok, f"fused silu_mul output {node.outputs[0].render()} is not half of {ins[0].render()}")
    return _expect(
        all(_same(a, b) for a, b in zip(ins[0].shape, ins[1].shape, strict=True)), "operand shapes differ"
    ) + _same_as_input(node, ins)


def _slice(node: Node, ins: list[TensorType]) -> list[str]:
    start, stop = int(node.attr("start")), int(node.attr("stop"))
    width = ins[0].shape[-1]
    return _expect(
        isinstance(width, int) and 0 <= start < stop <= width and _same(node.outputs[0].shape[-1], stop - start),
        f"slice [{start}:{stop}] of {ins[0].render()} into {node.outputs[0].render()}",
    )


def _weight(node: Node, ins: list[TensorType]) -> list[str]:
    decl = node.attr("decl", None)
    if not isinstance(decl, WeightDecl):
        return ["weight has no WeightDecl"]
    return _expect(decl.transform in TRANSFORMS, f"unknown weight transform {decl.transform!r}")


SPECS: dict[Op, OpSpec] = {
    Op.INPUT: OpSpec((0, 0)),
    Op.WEIGHT: OpSpec((0, 0), ("decl",), rule=_weight),
    Op.STATE: OpSpec((0, 0)),
    Op.OUTPUT: OpSpec((1, 1), rule=_same_as_input),
    Op.EMBED: OpSpec((2, 2), ("scale",)),
    Op.BLOCK_IDS: OpSpec((1, 1), ("block", "mask_token_id")),
    Op.BLOCK_EMBED: OpSpec((2, 2), ("block", "mask_token_id", "scale")),  # (anchors int32 [nb], table [V, H])
    Op.SLICE: OpSpec((1, 1), ("start", "stop"), rule=_slice),
    Op.DROP_ANCHOR: OpSpec((1, 1), ("block",)),
    Op.KV_WRITE: OpSpec((3, 3), ("layer", "which", "page_size"), rule=_same_as_input),
    # (cache, slots, rows...): targets = ((layer, which), ...), one per rows input
    Op.KV_WRITES: OpSpec((3, 2 + 256), ("targets", "page_size"), rule=_kv_writes),
    Op.MATMUL: OpSpec((2, 2), rule=_matmul),
    Op.MATMUL_FP8: OpSpec((3, 3), rule=_matmul),
    Op.LM_HEAD: OpSpec((2, 3), rule=_matmul),  # (x, W) or FP8 (x, W8 e4m3 [V, H], scale f32[V])
    Op.LM_HEAD_ARGMAX: OpSpec((2, 3), rule=_lm_head_argmax),  # LM_HEAD's inputs; int32 [rows] ids
    # (x, W) or FP8 (x, W8, scale) with gate|up rows interleaved `group` at a time; [rows, N / 2]
    Op.MATMUL_SILU: OpSpec((2, 3), ("group",), rule=_matmul_silu),
    Op.RMSNORM: OpSpec((2, 2), ("eps",), rule=_norm),
    Op.RMSNORM_RESIDUAL: OpSpec((3, 3), ("eps",), outputs=2, rule=_rmsnorm_residual),
    Op.HEAD_RMSNORM: OpSpec((2, 2), ("eps", "head_dim"), rule=_norm),
    Op.ROPE: OpSpec((2, 3), ("head_dim",), rule=_rope),
    # (x, positions, inv_freq, norm weights...): windows = ((start, stop, norm, rope), ...)
    Op.HEAD_PREP: OpSpec(
        (3, 3 + 256), ("windows", "head_dim", "eps", "attention_factor"), outputs=None, rule=_head_prep
    ),
    Op.BLOCK_ATTENTION: OpSpec(
        (7, 7), ("layer", "heads", "kv_heads", "head_dim", "block", "causal", "window", "page_size"), rule=_attention
    ),
    Op.SILU_MUL: OpSpec((1, 2), rule=_elementwise2),
    Op.ADD: OpSpec((2, 2), rule=_elementwise2),
    Op.SCALE: OpSpec((1, 1), ("factor",), rule=_same_as_input),
    Op.SOFTCAP: OpSpec((1, 1), ("cap",), rule=_same_as_input),
    Op.ARGMAX: OpSpec((1, 1)),
    Op.TOPK: OpSpec((1, 1), ("k",), outputs=2),
    Op.CONV2: OpSpec((3, 3), ("tap", "kernel", "group", "block"), rule=_same_as_input),
    Op.SELECTOR: OpSpec((6, 6), ("block",)),
    Op.MARKOV_WALK: OpSpec((4, 4), ("block",)),
    Op.CONFIDENCE: OpSpec((6, 6), ("block", "with_markov")),
}


def verify(graph: Graph) -> None:
    """Raise :class:`VerifyError` listing every violation of the IR rules in ``graph``."""
    errors: list[str] = []
    if not graph.is_acyclic():
        raise VerifyError(graph.name, ["graph has a cycle"])
    if not graph.outputs():
        errors.append("graph has no OUTPUT node")
    symbols = set(graph.dims)
    for name in graph.topo():
        node = graph.node(name)
        spec = SPECS[node.op]
        ins = graph.inputs(name)
        where = f"{name} ({node.op.value})"
        lo, hi = spec.arity
        if not lo <= len(ins) <= hi:
            errors.append(f"{where}: {len(ins)} inputs, expected {lo}..{hi}")
            continue
        if sorted(a for a in range(len(ins))) != [i for i, _ in enumerate(ins)]:
            errors.append(f"{where}: argument indices are not contiguous")
        missing = [a for a in spec.attrs if not node.has(a)]
        if missing:
            errors.append(f"{where}: missing attributes {missing}")
            continue
        if spec.outputs is not None and len(node.outputs) != spec.outputs:
            errors.append(f"{where}: {len(node.outputs)} outputs, expected {spec.outputs}")
        for out in node.outputs:
            unknown = set().union(*(dim_symbols(d) for d in out.shape)) - symbols if out.shape else set()
            if unknown:
                errors.append(f"{where}: shape {out.render()} uses undeclared dims {sorted(unknown)}")
        types = []
        for ref in ins:
            producer = graph.node(ref.node)
            if ref.port >= len(producer.outputs):
                errors.append(f"{where}: reads port {ref.port} of {ref.node}, which has {len(producer.outputs)}")
                break
            types.append(producer.outputs[ref.port])
        else:
            if spec.rule is not None:
                errors += [f"{where}: {e}" for e in spec.rule(node, types)]
    if errors:
        raise VerifyError(graph.name, errors)
