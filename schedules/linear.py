"""Linear layers: matmul, matmul_fp8 and lm_head, `y[i, j] = sum_k x[i, k] * W[j, k]` (times scale[j] for FP8),
lm_head_argmax, `ids[i] = argmax_j y[i, j]` (lowest j on ties), and matmul_silu, silu(gate) · up of a gate|up
projection whose weight rows alternate 8 gate and 8 up rows (`silu_out[i, c]` from y[i, 16 (c // 8) + c % 8]
and y[i, 16 (c // 8) + 8 + c % 8]), y never stored for either.

`x` is bf16 `[m, k]` with `m` rows symbolic (int32: block rows nb*blk, or context rows ctx), `W` is `[n, k]`
bf16 or float8_e4m3fn (then a float32 per-output-row `scale[n]` follows it), the sum is f32, and `y` is bf16
(matmul, matmul_fp8, matmul_silu), float32 (lm_head logits) or int32 `[m]` (lm_head_argmax's ids). The numpy
reference is the graph interpreter's.

This module holds what a linear kernel computes (`LinearSpec`, its numpy reference and samples);
`linear_plans.py` the kernel shapes by weight and target, `linear_rules.py` the rules that schedule them.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from dflash_compiler.ir.graph import Node, TensorType
from dflash_compiler.ir.ops import Op
from dflash_compiler.weight_tiles import TILE, tile_index, tileable, to_tiles

from .argmax import RANK_BASE, chunk_partials, coarse_bf16, default_chunk, index_of, merge_partials
from .base import EXACT, KernelSpec, OpInstance, Param, ScheduleError, Tolerance

ROWS = "m"  # the symbolic row count; the launch plan binds it to the node's row dim (nb*blk, ctx, ...)
BF16, FP8, F32, I32 = "bfloat16", "float8_e4m3fn", "float32", "int32"
ITEM_BYTES = {BF16: 2, FP8: 1, F32: 4, I32: 4}
_OPS = {
    Op.MATMUL.value: (BF16,),
    Op.MATMUL_FP8.value: (FP8,),
    Op.LM_HEAD.value: (BF16, FP8),
    Op.LM_HEAD_ARGMAX.value: (BF16, FP8),
    Op.MATMUL_SILU.value: (BF16, FP8),
}
_DEFAULT_OUT = {
    Op.MATMUL.value: BF16,
    Op.MATMUL_FP8.value: BF16,
    Op.LM_HEAD.value: F32,
    Op.LM_HEAD_ARGMAX.value: I32,
    Op.MATMUL_SILU.value: BF16,
}
# ops whose FP8 form keeps the op: named _fp8
_FP8_NAMED = (Op.LM_HEAD.value, Op.LM_HEAD_ARGMAX.value, Op.MATMUL_SILU.value)
SILU_GROUP = 8  # matmul_silu: gate and up rows interleaved 8 at a time (ir_passes/fuse_gate_up_silu.py)
_OP_ATTR = "dflash.op"


@dataclass(frozen=True)
class LinearSpec(KernelSpec):
    """What one linear kernel computes: `op` (the graph op's name), output features `n`, reduction `k`."""

    op: str
    n: int
    k: int
    weight_dtype: str = BF16
    out_dtype: str = ""
    tiles: int = 0  # the weight's layout: 0 row-major, TILE 64 x 64 tiles (weight_tiles.py)
    name: str = ""

    def __post_init__(self) -> None:
        if self.op not in _OPS:
            raise ScheduleError(f"linear: op {self.op!r} is not one of {', '.join(_OPS)}")
        if self.n <= 0 or self.k <= 0:
            raise ScheduleError(f"linear: n and k must be positive, found n={self.n}, k={self.k}")
        if self.weight_dtype not in _OPS[self.op]:
            raise ScheduleError(
                f"linear: {self.op} takes a {' or '.join(_OPS[self.op])} weight, found {self.weight_dtype}"
            )
        if not self.out_dtype:
            object.__setattr__(self, "out_dtype", _DEFAULT_OUT[self.op])
        if self.picks != (self.out_dtype == I32) or self.out_dtype not in (BF16, F32, I32):
            expected = "int32 ids" if self.picks else "bfloat16 or float32"
            raise ScheduleError(f"linear: {self.op}'s output dtype must be {expected}, found {self.out_dtype}")
        if self.silu and (self.n % (2 * SILU_GROUP) or self.out_dtype != BF16):
            raise ScheduleError(
                f"linear: {self.op} takes gate|up rows interleaved {SILU_GROUP} at a time into bf16 outputs; found "
                f"n={self.n} (expected a multiple of {2 * SILU_GROUP}), output {self.out_dtype}"
            )
        if self.picks and self.n >= RANK_BASE:
            raise ScheduleError(
                f"linear: {self.op} ranks ids as float32 (exact below 2^24), found n={self.n}. Fix: keep the lm_head "
                "and its argmax apart (their kernels split the vocabulary)"
            )
        if self.n * self.k >= 2**31:
            raise ScheduleError(
                f"linear: the weight has {self.n * self.k} elements; the kernels index it with int32 (< 2^31). "
                "Fix: split the linear along n"
            )
        if self.tiles not in (0, TILE) or (self.tiles and not tileable(self.n, self.k)):
            raise ScheduleError(
                f"linear: weight layout tiles={self.tiles} for a [{self.n}, {self.k}] weight; expected 0 (row-major) "
                f"or {TILE} (tiled: n and k multiples of {TILE})"
            )
        if not self.name:
            fp8 = "_fp8" if self.op in _FP8_NAMED and self.fp8 else ""
            out = "" if self.out_dtype == _DEFAULT_OUT[self.op] else "_f32" if self.out_dtype == F32 else "_bf16"
            tiles = f"_t{self.tiles}" if self.tiles else ""
            object.__setattr__(self, "name", f"{self.op}{fp8}_n{self.n}_k{self.k}{out}{tiles}")

    @property
    def fp8(self) -> bool:
        return self.weight_dtype == FP8

    @property
    def picks(self) -> bool:
        """The output is each row's argmax over the n outputs (lm_head_argmax), not the outputs."""
        return self.op == Op.LM_HEAD_ARGMAX.value

    @property
    def silu(self) -> bool:
        """The output is silu(gate) * up of the n outputs' interleaved gate and up rows (matmul_silu)."""
        return self.op == Op.MATMUL_SILU.value

    @property
    def tiled_only(self) -> bool:
        """Its epilogue is the tiled kernels' (small tiled and GEMM, one k split): not GEMV mode's."""
        return self.picks or self.silu

    @property
    def out_shape(self) -> tuple[Any, ...]:
        return self.out_dims(ROWS)

    def out_dims(self, rows: Any) -> tuple[Any, ...]:
        """The output's shape for `rows` rows of x (a count, a name or a TVM variable)."""
        return (rows,) if self.picks else (rows, self.n // 2) if self.silu else (rows, self.n)

    def params(self) -> tuple[Param, ...]:
        scale = (Param("scale", F32, (self.n,)),) if self.fp8 else ()
        return (
            Param("x", BF16, (ROWS, self.k)),
            Param("w", self.weight_dtype, (self.n, self.k)),
            *scale,
            Param("y", self.out_dtype, self.out_shape, "out"),  # lm_head_argmax: the ids
        )

    def prim_func(self) -> Any:
        return linear_func(self)

    def bytes_moved(self, sizes: Mapping[str, int]) -> int:
        """DRAM bytes one call must move: the weight (and FP8 scales) once, x read, y (or the ids) written."""
        rows = sizes[ROWS]
        weight = self.n * self.k * ITEM_BYTES[self.weight_dtype] + (4 * self.n if self.fp8 else 0)
        out = int(np.prod(self.out_dims(rows))) * ITEM_BYTES[self.out_dtype]
        return weight + rows * self.k * ITEM_BYTES[BF16] + out

    def node(self) -> Node:
        """The graph node this spec computes (the reference evaluates it with the graph interpreter)."""
        attrs = {"group": SILU_GROUP} if self.silu else {}
        if self.tiles:
            attrs["weight_tiles"] = self.tiles
        return Node.make(Op(self.op), [TensorType(self.out_dtype, self.out_shape)], **attrs)

    def reference(self, arrays: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        from dflash_compiler.ir import evaluate_node

        args = [arrays["x"], arrays["w"], *([arrays["scale"]] if self.fp8 else [])]
        (y,) = evaluate_node(self.node(), args)
        return {"y": y}

    def tolerance(self, param: str) -> Tolerance:
        # ids are picked from exact sums (sample's coarse values), so they must agree bit for bit
        return EXACT if self.picks else super().tolerance(param)

    def sample(self, rng: np.random.Generator, sizes: Mapping[str, int]) -> dict[str, np.ndarray]:
        import ml_dtypes

        rows = sizes[ROWS]
        if self.picks:
            # multiples of 1/8 in [-1, 1] (exact in e4m3 too): every sum is exact in f32 whatever its order,
            # so a kernel's ids agree with numpy's bit for bit, the many ties included
            x = coarse_bf16(rng, (rows, self.k))
            w = coarse_bf16(rng, (self.n, self.k)).astype(ml_dtypes.float8_e4m3fn if self.fp8 else ml_dtypes.bfloat16)
        else:
            x = rng.standard_normal((rows, self.k), dtype=np.float32).astype(ml_dtypes.bfloat16)
            w = random_weight(rng, (self.n, self.k), self.weight_dtype)
        arrays = {"x": x, "w": w}
        if self.fp8:
            arrays["scale"] = rng.uniform(0.005, 0.02, self.n).astype(np.float32)
        if self.picks:
            tie_at_the_max(arrays, self.n)
            arrays["y"] = np.full(self.out_dims(rows), -7, np.int32)
        else:
            arrays["y"] = np.zeros(self.out_dims(rows), ml_dtypes.bfloat16 if self.out_dtype == BF16 else np.float32)
        if self.tiles:  # drawn row-major (tie_at_the_max places rows), stored as the kernels read it
            arrays["w"] = to_tiles(arrays["w"])
        return arrays


def tie_at_the_max(arrays: dict[str, np.ndarray], n: int) -> None:
    """Copy the best weight row (and scale) of x rows 0, 1 and 2 to another row, half the weight, 8 and 1 rows
    on: their best logit then ties across blocks, across the two halves of a 16-row tile and across lanes,
    and only the lower id is right."""
    w = arrays["w"].astype(np.float32)
    for row, offset in zip(range(len(arrays["x"])), (n // 2, 8, 1), strict=False):
        logits = w @ arrays["x"][row].astype(np.float32) * arrays.get("scale", 1.0)
        best = int(np.argmax(logits))
        twin = (best + offset) % n
        arrays["w"][twin], w[twin] = arrays["w"][best], w[best]
        if "scale" in arrays:
            arrays["scale"][twin] = arrays["scale"][best]


def random_weight(rng: np.random.Generator, shape: tuple[int, int], dtype: str) -> np.ndarray:
    """Random finite weights drawn as bit patterns, so an lm_head-sized matrix (6e8 values) takes seconds.

    bf16: random sign and mantissa, exponent 120..123 (|w| in [2^-7, 2^-3)). e4m3: random sign, exponent
    0..7 and mantissa (zero, subnormals, up to 1.875), never the NaN pattern (exponent 15, mantissa 7).
    """
    import ml_dtypes

    if dtype == FP8:
        bits8 = rng.integers(0, 256, size=shape, dtype=np.uint8)
        bits8 &= np.uint8(0xBF)
        return bits8.view(ml_dtypes.float8_e4m3fn)
    bits = rng.integers(0, 1 << 16, size=shape, dtype=np.uint16)
    bits &= np.uint16(0x81FF)
    bits |= np.uint16(0x3C00)
    return bits.view(ml_dtypes.bfloat16)


def linear_func(spec: LinearSpec) -> Any:
    """The unscheduled TE PrimFunc (params x, w[, scale], y): the CPU oracle and the SIMT schedule's input."""
    from tvm import te, tirx

    m = tirx.Var(ROWS, "int32")  # int32: an int64 row var mixed with int32 constants breaks schedules
    x = te.placeholder((m, spec.k), BF16, name="x")
    w = te.placeholder((spec.n, spec.k), spec.weight_dtype, name="w")
    r = te.reduce_axis((0, spec.k), name="r")

    def weight(j: Any, kk: Any) -> Any:
        value = w[tile_index(spec.tiles, j, kk, spec.k)]
        return e4m3_to_f32(value) if spec.fp8 else value.astype(F32)

    acc = te.compute((m, spec.n), lambda i, j: te.sum(x[i, r].astype(F32) * weight(j, r), axis=r), name="acc")
    out = F32 if spec.tiled_only else spec.out_dtype
    if spec.fp8:
        scale = te.placeholder((spec.n,), F32, name="scale")
        y = te.compute((m, spec.n), lambda i, j: (acc[i, j] * scale[j]).astype(out), name="y")
        inputs = [x, w, scale]
    else:
        y = te.compute((m, spec.n), lambda i, j: acc[i, j].astype(out), name="y")
        inputs = [x, w]
    if spec.silu:  # silu(gate) * up of each feature's interleaved gate and up outputs

        def act(i: Any, c: Any) -> Any:
            gate, up = (
                y[i, c // SILU_GROUP * 2 * SILU_GROUP + c % SILU_GROUP],
                y[i, c // SILU_GROUP * 2 * SILU_GROUP + SILU_GROUP + c % SILU_GROUP],
            )
            return (gate / (1.0 + te.exp(-gate)) * up).astype(spec.out_dtype)

        y = te.compute((m, spec.n // 2), act, name="act")
    if spec.picks:  # the argmax of the logits y, as ARGMAX computes it
        chunk = default_chunk(spec.n)
        part = chunk_partials("part", (m,), spec.n, chunk, lambda i, j: y[i, j])
        best = merge_partials("best", (m,), part, -(-spec.n // chunk))
        y = te.compute((m,), lambda i: index_of(best[0][i]), name="y")
    func = te.create_prim_func([*inputs, y])
    attrs = {"global_symbol": spec.name, _OP_ATTR: spec.op, "dflash.n": spec.n, "dflash.k": spec.k}
    for key, value in attrs.items():
        func = func.with_attr(key, value)
    return func


def e4m3_to_f32(value: Any) -> Any:
    """An e4m3 value as f32, decoded from its bits (exact for every non-NaN value).

    Why not `astype`: TVM 0.27's llvm lowering of the e4m3 → f32 cast treats exponent 0 as a normal
    exponent (0x00 → 2^-7, every subnormal off), so the CPU oracle would disagree with the graph on zero
    and subnormal weights. Bits: sign, 4-bit exponent (bias 7), 3-bit mantissa; exponent 0 is m · 2^-9.
    """
    from tvm import tirx

    bits = tirx.reinterpret("uint8", value).astype("int32")
    exponent = (bits >> 3) & 15
    mantissa = (bits & 7).astype(F32)
    step = tirx.reinterpret(F32, (tirx.max(exponent, 1) + 117) << 23)  # 2^(max(e, 1) - 10) from its f32 bits
    magnitude = tirx.Select(exponent == 0, mantissa, mantissa + 8.0) * step
    return tirx.Select((bits & 128) != 0, -magnitude, magnitude)


def spec_of(subject: Any) -> LinearSpec | None:
    """The LinearSpec of a linear graph node (bf16 x, bf16 or e4m3 W [n, k] with static n, k), else None."""
    if isinstance(subject, LinearSpec):
        return subject
    if not isinstance(subject, OpInstance) or subject.op.value not in _OPS:
        return None
    inputs, outputs = subject.inputs, subject.outputs
    if len(inputs) not in (2, 3) or len(outputs) != 1:
        return None
    x, w, out = inputs[0], inputs[1], outputs[0]
    picks, silu = subject.op is Op.LM_HEAD_ARGMAX, subject.op is Op.MATMUL_SILU
    if len(x.shape) != 2 or len(w.shape) != 2 or len(out.shape) != (1 if picks else 2):
        return None
    n, k = w.shape
    if not isinstance(n, int) or not isinstance(k, int) or x.dtype != BF16 or x.shape[1] != k:
        return None
    fp8 = len(inputs) == 3
    if fp8 != (w.dtype == FP8) or (fp8 and (inputs[2].dtype != F32 or inputs[2].shape != (n,))):
        return None
    if picks and out.dtype != I32:
        return None
    if not picks and (out.dtype not in (BF16, F32) or out.shape[1] != (n // 2 if silu else n)):
        return None
    try:
        tiles = int(subject.attr("weight_tiles", 0))
        return LinearSpec(op=subject.op.value, n=n, k=k, weight_dtype=w.dtype, out_dtype=out.dtype, tiles=tiles)
    except ScheduleError:
        return None  # e.g. a bf16 weight under matmul_fp8: not a linear this family computes
