"""Linear layers: matmul, matmul_fp8 and lm_head, `y[i, j] = sum_k x[i, k] * W[j, k]` (times scale[j] for FP8),
lm_head_argmax, `ids[i] = argmax_j y[i, j]` (lowest j on ties), and matmul_silu, silu(gate) · up of a gate|up
projection whose weight rows alternate 8 gate and 8 up rows (`silu_out[i, c]` from y[i, 16 (c // 8) + c % 8]
and y[i, 16 (c // 8) + 8 + c % 8]), y never stored for either.

`x` is bf16 `[m, k]` with `m` rows symbolic (int32: block rows nb*blk, or context rows ctx), `W` is `[n, k]`
bf16 or float8_e4m3fn (then a float32 per-output-row `scale[n]` follows it), the sum is f32, and `y` is bf16
(matmul, matmul_fp8, matmul_silu), float32 (lm_head logits) or int32 `[m]` (lm_head_argmax's ids). The numpy
reference is the graph interpreter's.

Four rules:

* `LinearMmaRule` — the hot path: a tensor-core GEMV (`linear_mma.py`) that streams the weight once with
  16-byte loads and feeds the rows of `x` to `mma.sync.m16n8k16` as its 8-wide N dimension, and above
  `gemm_rows` rows a tensor-core GEMM with both operands tiled through shared memory (`linear_tiled.py` on
  `mma.sync`; on targets with warpgroup MMA, `linear_wgmma.py` on `wgmma.mma_async`).
  It takes every n and any k that is a multiple of one k step (32 for bf16 weights, 64 for FP8), on targets
  with bf16 mma.
* `LinearArgmaxRule` — lm_head_argmax: LinearMmaRule's small tiled kernel and GEMM with the argmax
  epilogue of `linear_argmax.py` instead of the store (the logits never reach memory).
* `LinearSiluRule` — matmul_silu: the same kernels, whose store writes silu(gate) · up.
* `LinearGemvRule` — the generic fallback (SIMT): one block per (column, group of rows), threads split k
  with vector loads and meet in a cross-thread reduction (TVM_NOTES §3b). Any n, k and m.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from dflash_compiler.cluster import MAX_PORTABLE
from dflash_compiler.ir.graph import Node, TensorType
from dflash_compiler.ir.ops import Op
from dflash_compiler.targets import Target
from dflash_compiler.weight_tiles import TILE, tile_index, tileable, to_tiles

from .argmax import RANK_BASE, chunk_partials, coarse_bf16, default_chunk, index_of, merge_partials
from .base import EXACT, FamilyRule, Kernel, KernelSpec, OpInstance, Param, ScheduleError, Tolerance
from .linear_mma import MMA_ROWS, WARP, MmaPlan, mma_gemv_func, x_ring_bytes
from .linear_tiled import TILED_KNOBS, TiledPlan
from .linear_wgmma import (
    CLUSTER_REDUCE,
    CONVERT_REGISTERS,
    CONVERT_TILE,
    KERNEL_REDUCE,
    LAST_REDUCE,
    PRODUCER_ROLES,
    PRODUCER_WARPS,
    SHARED_ROLES,
    WGMMA_KNOBS,
    WgmmaPlan,
)

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
# the small tiled kernel's knobs (calls of at most gemm_rows rows; `small_tiled_plan`)
FEW_ROWS_KNOBS = ("gemv_tiled_stages", "gemv_tiled_k_steps", "gemv_tiled_k_warps", "gemv_tiled_n_tiles")
FEW_ROWS_TILE = 16  # x rows per tile of the kernels of calls up to gemm_rows rows: one draft block
FEW_ROWS_DEEP_STAGES = 6  # the few-rows warpgroup GEMM's slots where its call is one wave (few_rows_wgmma_stages)
# the shape knobs of the warpgroup GEMM of calls up to mid_rows rows (LinearMmaRule takes them as mid_<name>)
MID_KNOBS = ("warpgroups", "stages", "k_splits", "mma_groups")
MID_ROWS = 64  # the calls of 33-64 rows (three or four draft blocks) take a GEMM of 64-row x tiles
HALF_TILE_ROWS = 64  # the x tiles of the GEMM up to tall_rows unless tall_block_m says
# the shape knobs of the warpgroup GEMM of calls above mid_rows up to tall_rows (LinearMmaRule: tall_<name>)
TALL_KNOBS = ("block_m", "warpgroups", "stages", "k_splits", "mma_groups")
TALL_ROWS = 128  # qkv-like weights: the calls of 65-128 rows (five to eight draft blocks) take 64-row x tiles
# how the warpgroup GEMMs' k splits add up unless knob wgmma_k_reduce says: a merge kernel (the tile's last block,
# LAST_REDUCE, lost: linear_wgmma.last_store_macro has the figures)
DEFAULT_K_REDUCE = KERNEL_REDUCE
REGISTER_CONVERT_ROWS = 128  # the tallest x tile whose e4m3 weights convert in registers by default


def few_rows_knobs(stages: int, k_steps: int, k_warps: int, n_tiles: int = 1) -> dict[str, int]:
    """The small tiled kernel's knobs by value (stages 0: GEMV mode)."""
    return dict(zip(FEW_ROWS_KNOBS, (stages, k_steps, k_warps, n_tiles), strict=True))


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


# ------------------------------------------------------------------------------------ tensor-core rule


def mma_step(spec: LinearSpec) -> int:
    """k elements per k step of the mma kernel: 4 threads × one 16-byte weight vector each."""
    return 4 * (16 // ITEM_BYTES[spec.weight_dtype])


class LinearMmaRule(FamilyRule):
    """Linears on tensor cores (targets with bf16 mma; k a multiple of 32, or 64 for FP8 weights).

    Knobs: `warps` per block that split k, `n_warps` per block that split n (each with its own `row_tiles` 16-row
    weight tiles), `unroll` (k steps per batch of loads), `stages` (1: load a batch, then multiply it; 2: double
    buffer), `m_tile` (rows of x per pass over the weight, a multiple of 8), `x_stages` (0: x fragments straight
    from global memory into registers, the GEMV mode; n >= 1: x through a ring of n shared-memory slots, the GEMM
    mode, which keeps the registers for accumulators so that m_tile can cover 64-256 rows and the weight is streamed
    once per pass) and `gemm_rows` (with x_stages 0: calls with more rows than this go to the tiled GEMM of
    `linear_tiled.py`, picked by the host code per call; 0: the one kernel for every m). The tiled GEMM's knobs are
    `gemm_n_warps`, `gemm_m_warps`, `gemm_n_tiles`, `gemm_m_tiles`, `gemm_stages`, `gemm_k_splits`, `gemm_k_steps`
    and `gemm_k_warps` (TiledPlan); 0 takes `tiled_defaults`. `gemm_wgmma` 1 (the default on targets with wgmma)
    makes that GEMM the warpgroup one instead, with knobs `wgmma_warpgroups`, `wgmma_block_m`, `wgmma_stages`,
    `wgmma_k_atoms`, `wgmma_k_splits`, `wgmma_mma_groups`, `wgmma_k_reduce`, `wgmma_roles` and `wgmma_convert`
    (WgmmaPlan; 0 takes `wgmma_defaults`; k_reduce 2 adds the k splits in a thread block cluster of at most 8,
    3 by each tile's last block to finish, for the mid and tall GEMMs too (`tier_reduce`),
    roles 2 copies on a producer warpgroup, convert 2 turns e4m3 weights into the wgmmas' A fragments in
    registers, for both warpgroup GEMMs, and bf16 weights report 1); the other GEMM's knobs are refused. With
    the warpgroup GEMM, `mid_rows` > gemm_rows gives the calls of gemm_rows + 1 to mid_rows rows a second one of
    x tiles that many rows tall, with knobs
    `mid_warpgroups`, `mid_stages`, `mid_k_splits` and `mid_mma_groups` (0 takes `mid_defaults`; MID_ROWS by
    default); 0 leaves them on the first. `tall_rows` above those gives the calls up to tall_rows rows a third
    one, of x tiles `tall_block_m` rows tall, with knobs `tall_warpgroups`, `tall_stages`, `tall_k_splits` and
    `tall_mma_groups` (0 takes `tall_defaults`; TALL_ROWS by default where `tall_wanted`, else none).
    `gemv_tiled_stages` > 0 puts the calls of at most gemm_rows rows on a
    tiled kernel too (`small_tiled_plan`: 16 · `gemv_tiled_n_tiles` weight rows and 16 rows of x per block, that
    many slots of `gemv_tiled_k_steps` k steps, `gemv_tiled_k_warps` warps along k, no k split), whose weight stream
    is in flight in shared memory rather than in registers; 0 keeps them on GEMV mode. `gemv_wgmma` 1 (targets
    with wgmma) gives those calls a warpgroup GEMM of 16-row x tiles instead (`few_rows_wgmma_plan`; the
    gemv_tiled_ knobs then report 0). `warps`, `unroll`,
    `gemm_k_splits`, `gemm_k_steps`, `gemm_k_warps`, `gemv_tiled_k_steps` and `gemv_tiled_k_warps` are upper bounds:
    the largest values that divide the k steps evenly are used, and the Kernel reports the values used.
    """

    name = "linear_mma"
    knob_names = ("warps", "row_tiles", "unroll", "m_tile", "stages", "x_stages", "n_warps", "gemm_rows",
                  *(f"gemm_{name}" for name in TILED_KNOBS), *FEW_ROWS_KNOBS, "gemv_wgmma", "gemv_wgmma_stages",
                  "gemm_wgmma", *(f"wgmma_{name}" for name in WGMMA_KNOBS), "mid_rows",
                  *(f"mid_{name}" for name in MID_KNOBS), "tall_rows",
                  *(f"tall_{name}" for name in TALL_KNOBS))  # fmt: skip

    def default_knobs(self, target: Target) -> dict[str, int]:
        # Measured on an H200 (bench/linear.py --sweep): 4 warps of ~200 registers make two resident
        # blocks per SM (64K registers); each thread keeps 2 stages x 4 k steps x 2 rows x 16 B = 256 B of
        # weight in flight, 64 KB per SM, above the ~36 KB that bandwidth x latency (4.8 TB/s / 132 SMs x
        # ~1 us) asks for. m_tile 16 is one draft block of rows per pass; larger m re-streams the weight.
        return {
            "warps": min(4, target.max_threads_per_block // target.warp_size),
            "row_tiles": 1,
            "unroll": 4,
            "m_tile": 16,
            "stages": 2,
            "x_stages": 0,
            "n_warps": 1,
            # above 32 rows (3+ draft blocks) the tiled GEMM takes the call: on the H200 GEMV mode wins at
            # 16 rows by 2-3x, the GEMM at 64 rows by 1.25-1.9x (qkv 40.2 vs 50.2 µs, down 56.2 vs 101.6,
            # lm_head 602 vs 1152; bench/linear.py --gemm)
            "gemm_rows": 32,
            # the tiled GEMM's shape (linear_tiled.py); 0: by the weight's shape (tiled_defaults)
            **{f"gemm_{name}": 0 for name in TILED_KNOBS},
            # calls of at most gemm_rows rows: GEMV mode (0) or the small tiled kernel; by the weight
            **few_rows_knobs(0, 8, 1),
            # calls of at most gemm_rows rows on a warpgroup GEMM of 16-row x tiles instead (1); by the weight
            "gemv_wgmma": 0,
            # and its slots (0: few_rows_wgmma_stages)
            "gemv_wgmma_stages": 0,
            # calls above gemm_rows rows: the tiled mma.sync GEMM (0) or the warpgroup GEMM (1, on targets
            # with wgmma); knobs_for picks by weight and target, and 0 takes wgmma_defaults
            "gemm_wgmma": 0,
            **{f"wgmma_{name}": 0 for name in WGMMA_KNOBS},
            # calls of gemm_rows + 1 to mid_rows rows: a warpgroup GEMM of x tiles that tall (0: none; with
            # the warpgroup GEMM only; knobs_for sets MID_ROWS there), whose other knobs 0 takes from
            # mid_defaults
            "mid_rows": 0,
            **{f"mid_{name}": 0 for name in MID_KNOBS},
            # calls of mid_rows + 1 to tall_rows rows: a third warpgroup GEMM (0: none; knobs_for sets TALL_ROWS
            # where tall_wanted), whose knobs 0 takes from tall_defaults
            "tall_rows": 0,
            **{f"tall_{name}": 0 for name in TALL_KNOBS},
        }

    def spec_of(self, subject: Any) -> LinearSpec | None:
        spec = spec_of(subject)
        return None if spec is None or spec.tiled_only else spec  # LinearArgmaxRule, LinearSiluRule

    def apply(self, subject: Any, target: Target, knobs: Mapping[str, int] | None = None) -> Kernel | None:
        spec = self.spec_of(subject)
        if spec is None or not mma_fits(spec, target):
            return None
        chosen = self.knobs_for(spec, target, knobs)
        plan, gemm, small, mid, tall, func = self._func(spec, target, chosen)
        used = gemm_knobs(gemm)
        tiled = isinstance(small, TiledPlan)
        few = (few_rows_knobs(small.stages, small.k_steps, small.k_warps, small.n_tiles) if tiled
               else few_rows_knobs(0, 0, 0, 0))  # fmt: skip
        few["gemv_wgmma"] = int(isinstance(small, WgmmaPlan))
        few["gemv_wgmma_stages"] = small.stages if isinstance(small, WgmmaPlan) else 0
        mid_used = {"mid_rows": mid.block_m, **{f"mid_{name}": getattr(mid, name) for name in MID_KNOBS}} if mid else {}
        tall_used = (
            {"tall_rows": tall[0], **{f"tall_{name}": getattr(tall[1], name) for name in TALL_KNOBS}} if tall else {}
        )
        return Kernel(name=spec.name, func=func, reference=spec.prim_func(), rule=self.name,
                      knobs={**plan.knobs(), "gemm_rows": chosen["gemm_rows"], **used, **few, **mid_used,
                             **tall_used},
                      spec=spec)  # fmt: skip

    def _tier_knobs(
        self, spec: LinearSpec, knobs: Mapping[str, int], tier: str, names: tuple[str, ...]
    ) -> tuple[int, dict[str, int]]:
        """(`<tier>_rows`, the `<tier>_<name>` knobs given, by name) of the mid or tall GEMM; its shape knobs
        without its rows are refused."""
        rows = knobs[f"{tier}_rows"]
        given = {name: knobs[f"{tier}_{name}"] for name in names if knobs[f"{tier}_{name}"] != 0}
        if given and not rows:
            raise ScheduleError(
                f"{self.name} knobs {', '.join(f'{tier}_{name}' for name in given)} on {spec.name}: they shape the "
                f"GEMM of the calls up to {tier}_rows rows, and {tier}_rows is 0. Fix: drop them, or set {tier}_rows"
            )
        return rows, given

    def _few_plan(self, spec: LinearSpec, target: Target, knobs: Mapping[str, int]) -> TiledPlan | WgmmaPlan | None:
        """The kernel of the calls of at most gemm_rows rows beside the GEMM above them (None: GEMV mode): with
        `gemv_wgmma` 1 a warpgroup GEMM of 16-row x tiles (`few_rows_wgmma_plan`), else with `gemv_tiled_stages`
        > 0 the small tiled kernel."""
        if knobs["gemv_wgmma"] not in (0, 1):
            raise ScheduleError(
                f"{self.name} knob gemv_wgmma={knobs['gemv_wgmma']}: expected 0 (the small tiled kernel or GEMV mode "
                "takes the calls of at most gemm_rows rows) or 1 (a warpgroup GEMM of 16-row x tiles)"
            )
        if knobs["gemv_wgmma"]:
            if not wgmma_fits(spec, target):
                raise ScheduleError(
                    f"{self.name} knob gemv_wgmma=1 on {spec.name} for {target.name}: the warpgroup GEMM takes weights "
                    f"with k a multiple of 64 on targets with wgmma (found k={spec.k}, wgmma={target.wgmma}). Fix: "
                    "gemv_wgmma 0"
                )
            return few_rows_wgmma_plan(spec, target, knobs["wgmma_convert"], knobs["gemv_wgmma_stages"])
        if knobs["gemv_wgmma_stages"]:
            raise ScheduleError(
                f"{self.name} knob gemv_wgmma_stages={knobs['gemv_wgmma_stages']} on {spec.name}: it sets the slots of "
                "the warpgroup GEMM of gemv_wgmma 1, and gemv_wgmma is 0. Fix: drop it, or set gemv_wgmma 1"
            )
        return small_tiled_plan(spec, target, knobs) if knobs["gemv_tiled_stages"] else None

    def _mid_plan(self, spec: LinearSpec, target: Target, knobs: Mapping[str, int]) -> WgmmaPlan | None:
        """The warpgroup GEMM of the calls of gemm_rows + 1 to mid_rows rows (None: mid_rows 0): x tiles of
        mid_rows rows, the knobs given, the rest `mid_defaults`."""
        rows, given = self._tier_knobs(spec, knobs, "mid", MID_KNOBS)
        if not rows:
            return None
        beside = knobs["gemm_rows"] and knobs["gemm_wgmma"] == 1  # the warpgroup GEMM takes the calls above it
        if not beside or rows % 8 or not knobs["gemm_rows"] < rows <= 256:
            raise ScheduleError(
                f"{self.name} knob mid_rows={rows} on {spec.name} (gemm_rows={knobs['gemm_rows']}, gemm_wgmma="
                f"{knobs['gemm_wgmma']}): expected a multiple of 8 above gemm_rows, at most 256, beside the warpgroup "
                "GEMM. Fix: mid_rows 0, or gemm_wgmma 1 and gemm_rows > 0 below it"
            )
        shape = {**mid_defaults(spec, target, rows), **given}
        # the e4m3 conversion as the GEMM above mid_rows has it (wgmma_convert)
        convert = knobs["wgmma_convert"] or default_convert(spec, rows)
        return fit_wgmma_plan(spec, target, {**shape, "block_m": rows, "k_atoms": 1,
                                             "k_reduce": tier_reduce(knobs), "roles": SHARED_ROLES,
                                             "convert": convert})  # fmt: skip

    def _tall_plan(
        self, spec: LinearSpec, target: Target, knobs: Mapping[str, int], below: int
    ) -> tuple[int, WgmmaPlan] | None:
        """(tall_rows, plan) of the warpgroup GEMM of the calls of `below` + 1 (mid_rows, or gemm_rows without a
        mid GEMM) to tall_rows rows (None: tall_rows 0): the knobs given, the rest `tall_defaults`."""
        rows, given = self._tier_knobs(spec, knobs, "tall", TALL_KNOBS)
        if not rows:
            return None
        beside = knobs["gemm_rows"] and knobs["gemm_wgmma"] == 1
        if not beside or rows % 8 or not below < rows <= 256 or given.get("block_m", 8) % 8:
            raise ScheduleError(
                f"{self.name} knobs tall_rows={rows}, tall_block_m={knobs['tall_block_m']} on {spec.name} "
                f"(gemm_rows={knobs['gemm_rows']}, mid_rows={knobs['mid_rows']}, gemm_wgmma={knobs['gemm_wgmma']}): "
                f"expected multiples of 8, tall_rows above {below} and at most 256, beside the warpgroup GEMM. Fix: "
                "tall_rows 0, or gemm_wgmma 1 and tall_rows above gemm_rows and mid_rows"
            )
        shape = {**tall_defaults(spec, target, rows, given.get("block_m", HALF_TILE_ROWS)), **given}
        if shape["block_m"] > rows:
            raise ScheduleError(
                f"{self.name} knob tall_block_m={shape['block_m']} on {spec.name}: x tiles taller than the "
                f"tall_rows={rows} rows they take. Fix: tall_block_m at most tall_rows"
            )
        convert = knobs["wgmma_convert"] or default_convert(spec, shape["block_m"])
        plan = fit_wgmma_plan(spec, target, {**shape, "k_atoms": 1, "k_reduce": tier_reduce(knobs),
                                             "roles": SHARED_ROLES, "convert": convert})  # fmt: skip
        return rows, plan

    def _gemm_plan(self, spec: LinearSpec, target: Target, knobs: Mapping[str, int]) -> TiledPlan | WgmmaPlan | None:
        """The GEMM kernel's plan where calls above gemm_rows rows go to one: the knobs given, the rest by
        the weight's shape."""
        if not knobs["gemm_rows"]:
            return None
        if knobs["gemm_wgmma"] not in (0, 1):
            raise ScheduleError(
                f"{self.name} knob gemm_wgmma={knobs['gemm_wgmma']}: expected 0 (tiled mma.sync GEMM) or 1 "
                "(warpgroup GEMM)"
            )
        wgmma = bool(knobs["gemm_wgmma"])
        # the other GEMM's knobs would do nothing: refuse them rather than drop them
        unused = [f"{prefix}{name}" for prefix, names in (("gemm_", TILED_KNOBS), ("wgmma_", WGMMA_KNOBS))
                  for name in names if knobs[f"{prefix}{name}"] and (prefix == "gemm_") == wgmma]  # fmt: skip
        if unused:
            kind, other = ("warpgroup", 0) if wgmma else ("tiled mma.sync", 1)
            raise ScheduleError(
                f"{self.name} knobs {', '.join(unused)} on {spec.name} for {target.name}: the GEMM above gemm_rows "
                f"rows is the {kind} GEMM (gemm_wgmma={int(wgmma)}), which does not read them. Fix: drop them, "
                f"or set gemm_wgmma {other}"
            )
        if wgmma:
            given = {name: knobs[f"wgmma_{name}"] for name in WGMMA_KNOBS if knobs[f"wgmma_{name}"] != 0}
            shape = {**wgmma_defaults(spec, target), **given}
            if "convert" not in given:  # the default for the tile's rows as given
                shape["convert"] = default_convert(spec, shape["block_m"])
            return fit_wgmma_plan(spec, target, shape)
        given = {name: knobs[f"gemm_{name}"] for name in TILED_KNOBS if knobs[f"gemm_{name}"] != 0}
        return fit_tiled_plan(spec, target, {**tiled_defaults(spec, target), **given})

    def _func(
        self, spec: LinearSpec, target: Target, knobs: Mapping[str, int]
    ) -> tuple[
        MmaPlan,
        TiledPlan | WgmmaPlan | None,
        TiledPlan | WgmmaPlan | None,
        WgmmaPlan | None,
        tuple[int, WgmmaPlan] | None,
        Any,
    ]:
        """(GEMV-mode plan, GEMM above gemm_rows, the kernel up to gemm_rows (small tiled or warpgroup GEMM; None:
        GEMV mode), GEMM up to mid_rows, (tall_rows, GEMM up to them), PrimFunc)."""
        plan = fit_mma_plan(spec, target, knobs)
        rows = knobs["gemm_rows"]
        if rows < 0:
            raise ScheduleError(f"{self.name} knob gemm_rows={rows}: expected 0 (one kernel) or a row count")
        if rows and plan.x_stages:
            raise ScheduleError(
                f"{self.name} knobs x_stages={plan.x_stages}, gemm_rows={rows}: gemm_rows adds a GEMM-mode kernel "
                "above that many rows to a GEMV-mode one, and x_stages > 0 makes the kernel GEMM mode already. "
                "Fix: gemm_rows 0, or x_stages 0"
            )
        gemm = self._gemm_plan(spec, target, knobs)
        small = self._few_plan(spec, target, knobs) if gemm else None
        mid = self._mid_plan(spec, target, knobs)
        tall = self._tall_plan(spec, target, knobs, mid.block_m if mid else rows)
        for tier, tier_plan in (("mid", mid), ("tall", tall[1] if tall else None)):
            if spec.tiled_only and tier_plan is not None and tier_plan.k_splits != 1:
                raise ScheduleError(
                    f"{self.name} knob {tier}_k_splits={tier_plan.k_splits} on {spec.name}: its epilogue takes whole "
                    f"sums. Fix: {tier}_k_splits 1"
                )
        if spec.tiled_only and (small is None or gemm is None or gemm.k_splits != 1):
            raise ScheduleError(
                f"{self.name} knobs x_stages={plan.x_stages}, gemm_rows={rows}, gemv_tiled_stages="
                f"{knobs['gemv_tiled_stages']}, k splits {gemm.k_splits if gemm else None} on {spec.name}: its "
                "epilogue runs on the small tiled kernel (or the few rows' warpgroup GEMM) and the GEMM, whose blocks "
                "each hold whole sums. Fix: x_stages 0, gemm_rows > 0, gemv_tiled_stages > 0 (or gemv_wgmma 1) and "
                "gemm_k_splits / wgmma_k_splits 1"
            )
        func = mma_gemv_func(spec, plan, (rows, gemm) if gemm else None, small, mid, tall)
        return plan, gemm, small, mid, tall, func

    def gemm_defaults(self, target: Target) -> dict[str, int]:
        """GEMM-mode knobs (x_stages >= 1) where not given: x is out of the registers, so FP8 double-buffers
        its weight with 4 warps like bf16 (~170-195 registers at m_tile 128), and m_tile is the largest of
        128 and 64 whose double-buffered x ring (x_stages x m_tile x warps x 64 B) lets three blocks share
        an SM: 128 on sm_90 (64 KiB of 228), 64 on sm_120/121 (32 KiB of 100)."""
        m_tile = 128 if 3 * x_ring_bytes(2, 128, 4) <= target.shared_memory_per_sm else 64
        return {"warps": 4, "stages": 2, "m_tile": m_tile}

    def gemv_defaults(self, spec: LinearSpec, target: Target) -> dict[str, int]:
        """GEMV-mode knobs by weight shape, from the H200 sweeps at 16 rows (bench/linear.py --small --fp8, µs,
        default → chosen):

        * wide weights (n / 32 at least 4 blocks per SM: gate_up, lm_head) with FP8: two row tiles, so one x
          fragment serves 32 weight rows and x's L2 traffic halves (an FP8 k step reads twice the weight's
          bytes of x), 4 warps, 2-step batches, one stage (lm_head 252 → 185, gate_up 41.4 → 34.4);
        * narrow weights with k <= 4096 (qkv, ctx_kv, o_proj): 2-step batches for either dtype, fewer
          registers and so more resident blocks (qkv 16.6 → 16.1, ctx_kv 26.1 → 23.7; FP8 qkv 14.4 → 10.8);
        * other FP8 weights (down, fc): 8 warps of one stage (the registers of a 64-wide k step's x fragments
          leave no room for a second); bf16 keeps the target defaults.
        """
        wide = wide_weight(spec, target)
        if spec.fp8 and wide:
            return {"warps": 4, "row_tiles": 2, "unroll": 2, "stages": 1}
        if not wide and spec.k <= 4096:
            return {"unroll": 2}
        return {"warps": 8, "stages": 1} if spec.fp8 else {}

    def few_rows_defaults(self, spec: LinearSpec, target: Target) -> dict[str, int]:
        """Which kernel takes the calls of at most gemm_rows rows, by weight shape, from H200 runs of
        bench/linear.py --few-rows (µs at 16 rows, plain launches → launched as dependents of the last call,
        with the trigger then right after the wait; GEMV mode → chosen; with the trigger at the last weight
        copies, as now, o_proj is 10.60 → 9.57, qkv 14.34 → 13.28, down 26.17 → 25.21):

        * narrow bf16 weights: the small tiled kernel with its warps along k (`gemv_tiled_k_warps`), at the
          deepest of three slots of 16 k steps (96 KiB, eight warps) and four of 8 (64 KiB, four warps) whose
          16-row call fits one wave of the target's shared memory, else the second: o_proj 12.09 → 10.68
          (dependent 12.11 → 9.52) and down 29.02 → 26.45 (34.97 → 24.96) with three of 16 (256 blocks), qkv
          16.18 → 14.55 (19.01 → 13.18) with four of 8 (its 384 blocks would take two waves of three of 16:
          17.64). One warp per block runs one chain of dependent mmas through every slot and set the pace
          before: o_proj 12.18, qkv 15.21 at four of 8;
        * wide weights (as in gemv_defaults): slots of 4 k steps, four warps along k and four weight tiles
          per block (`gemv_tiled_n_tiles`, 64 weight rows sharing each x tile, so that x's reads from L2 are
          a quarter of the weight's bytes for bf16 and half for FP8, against once and twice with one tile);
          three slots for bf16, two for FP8. Dependent launches, µs at 1 / 8 / 16 / 32 rows, one tile of one
          warp in four slots (bf16) or GEMV mode (FP8) → chosen, from one run:
          gate_up 50.1 / 51.2 / 53.4 / 94.3 → 47.0 / 47.8 / 48.4 / 58.0,
          lm_head 286.7 / 292.3 / 305.0 / 591.5 → 276.5 / 282.1 / 287.5 / 396.2,
          gate_up FP8 31.7 / 32.0 / 33.3 / 61.9 → 26.8 / 27.3 / 28.8 / 49.5,
          lm_head FP8 167.7 / 169.2 / 191.0 / 385.2 → 149.6 / 156.3 / 178.6 / 327.7.
          Two tiles per block gained less (gate_up FP8 at 16 rows 31.1), eight lost (45.2);
        * wide FP8 weights on targets with wgmma: the warpgroup GEMM of 16-row x tiles (`gemv_wgmma`), whose
          small blocks (24 KiB, 80 registers a thread; two slots of copies in flight each) fit six to an SM,
          against three of the small tiled kernel (48 KiB, 142 registers). H100, one run of both builds in
          bench/propose.py (FP8 step, ms at nb = 1 / 4 / 8 / 16; µs the kernel adds in the timeline at nb = 1):
          0.772 / 1.001 / 1.343 / 2.440 → 0.755 / 1.002 / 1.328 / 2.447; lm_head 219.2 → 200.9, gate_up's five
          calls 198.2 → 193.2 with four slots (an earlier run with every FP8 linear on it: lm_head 219.1 →
          200.7, gate_up 203.6 → 200.5); six where a call is one wave took gate_up to 184.0 (`few_rows_wgmma_plan`
          has the figures). The narrow FP8 weights lost on it (the step 0.770 → 0.774 ms): their 64 to 96 blocks of 64
          rows need k splits and a merge launch (µs added at nb = 1, kernel + merge: o_proj 40.1 → 36.3 + 8.2,
          qkv 52.4 → 51.9 + 6.2, down 93.7 → 87.0 + 7.5). Standalone (bench/kernels.py, µs at 16 rows, the
          lm_head's 15): lm_head 236.7 → 218.7, gate_up 50.7 → 49.5.
          The small tiled kernel's e4m3 conversion does not set its pace: with it cut to one byte permute a
          pair (wrong values, a probe) the calls took as long (gate_up 50.7 → 51.4, lm_head 236.7 → 232.6), and
          so did f16 products (e4m3 → f16 by `cvt.rn.f16x2.e4m3x2`, x rounded to f16: 50.4, 233.9). Nsight
          Compute on its gate_up call: DRAM 74 % busy, 2.8 warps a scheduler, 0.43 of them eligible, an issue
          every 8.3 cycles of which 4.4 wait on the slots' copies (long scoreboard);
        * narrow FP8 weights: four slots of 4 k steps (an FP8 k step is 64 wide), four warps along k: qkv
          11.33 → 10.00, o_proj 9.40 → 7.53, down 19.46 → 17.93 (dependent within ±0.4 µs of GEMV mode).
          More weight tiles per block lost here (fewer blocks: o_proj FP8 6.69 → 8.90 with two).
          On an H100 (one run, µs at 16 rows, dependent launches) eight slots made down FP8 20.42 → 19.25 and
          three slots gate_up FP8 36.66 → 36.07, but in the step neither moved (bench/propose.py, one run, FP8
          at nb = 1: 0.772 ms → 0.775 with eight slots for down and fc, 0.775 with both, though down's five
          calls added 98.1 → 88.6 µs to the timeline). Two weight tiles per block lost at every ring depth
          tried (o_proj FP8 7.29 → 8.79-11.35 with 3-12 slots of 4-16 k steps).
          Six or eight slots for every narrow FP8 weight (H100, one run, two copies of each build alternating;
          µs the calls add at nb = 1, timeline, four → six → eight): down 94.5 / 96.4 → 89.6 / 91.2 → 89.6 /
          89.3, fc 34.7 / 34.4 → 32.7 / 33.3 → 33.3 / 31.8, ctx_kv 19.4 / 20.8 → 17.8 / 18.3 → 20.4 / 20.3, o_proj
          and qkv unchanged at six (qkv's 384 blocks take two waves at eight: 75.0 / 76.5), while gate_up, after
          them, took 185.1 / 184.1 → 190.9 / 187.1; the timeline's span 745.8 / 746.8 → 738.3 / 738.7 µs, but the
          step 0.739 / 0.749 → 0.742 / 0.750 ms (0.768 at eight). As before, the step did not see it: not kept.
          More warps along k did not help the narrow FP8 weights either (H100, one run, µs at 16 rows, default →
          2-4 slots of 8 k steps and 8 warps, 2 of 16 and 16 warps): qkv 10.22 → 10.76-12.32, o_proj 7.28 →
          7.40-8.30, down 20.40 → 19.62-21.07 (the step did not see down's gain with eight slots, above);
          gate_up FP8 with 8 warps of 8 k steps 36.61 → 42.96, two tiles 36.75. These kernels are not bound by
          x's reads from L2: at 1 row (x's copies past m zero-filled, no read) they take as long (o_proj FP8 7.14,
          qkv 10.12). Nsight Compute on o_proj FP8 at 16 rows: 1.9 warps per scheduler, one issued every 2.8
          cycles; stalls 25 % long scoreboard, 23 % fixed-latency waits, 19 % issuing, 11 % the slot barrier;
          a warp's k step was ~143 instructions, 80 of them the e4m3 conversion at five a pair. With four a pair
          (fp8_convert.py) the 16-row calls took as long in the step (H100, one run, timeline at nb = 1, µs five
          calls add, two copies of the five-a-pair build → four a pair: gate_up 208.2 / 210.5 → 208.5, down
          98.5 / 98.1 → 96.7, o_proj 40.6 / 41.0 → 40.3), so the conversion does not set their pace. Nor are they
          bound by DRAM: with its whole e4m3 weight (16.8 MB) prefetched into L2 while head_prep and the
          attention ran (a kernel of `cp.async.bulk.prefetch.L2` added to the step after qkv), o_proj FP8 took
          8.5 µs in the step against 9.4 (H100, timeline, nb = 1): the kernel's own pace, ~2 TB/s, is the
          limit. The prefetch kernel itself lost more than that (its grid completes only once its prefetches
          have landed, which held head_prep 2.6 µs): the FP8 step 0.796 → 0.808 ms.
        """
        wide = wide_weight(spec, target)
        if wide:
            wgmma = int(spec.fp8 and wgmma_fits(spec, target))
            return {**few_rows_knobs(2 if spec.fp8 else 3, 4, 4, 4), "gemv_wgmma": wgmma}
        if spec.fp8:
            return few_rows_knobs(4, 4, 4)
        blocks = -(-spec.n // MMA_ROWS)
        for candidate in ((3, 16, 8), (4, 8, 4)):
            knobs = few_rows_knobs(*candidate)
            plan = small_tiled_plan(spec, target, knobs)
            if target.shared_memory_per_sm // plan.shared_bytes() * target.sm_count >= blocks:
                break
        return knobs

    def knobs_for(self, spec: LinearSpec, target: Target, knobs: Mapping[str, int] | None) -> dict[str, int]:
        """The target's defaults, then the GEMM-mode or the shape's GEMV-mode and few-rows ones, then `knobs`."""
        gemm = self.resolve_knobs(target, knobs)["x_stages"] > 0  # also refuses unknown names and non-ints
        mode = (
            {**self.gemm_defaults(target), "gemm_rows": 0}
            if gemm
            else {
                **self.gemv_defaults(spec, target),
                **self.few_rows_defaults(spec, target),
                "gemm_wgmma": int(wgmma_fits(spec, target)),
            }
        )
        resolved = self.resolve_knobs(target, {**mode, **(knobs or {})})
        # where the warpgroup GEMM takes the calls above gemm_rows, those up to MID_ROWS take 64-row tiles
        # (mid_defaults), unless the knobs say otherwise
        if not gemm and resolved["gemm_wgmma"] == 1 and "mid_rows" not in (knobs or {}):
            resolved["mid_rows"] = MID_ROWS if 0 < resolved["gemm_rows"] < MID_ROWS else 0
        # and those above them, up to TALL_ROWS, a third GEMM where the weight wants one (tall_wanted)
        if not gemm and resolved["gemm_wgmma"] == 1 and "tall_rows" not in (knobs or {}):
            wanted = 0 < resolved["mid_rows"] < TALL_ROWS and tall_wanted(spec, target)
            resolved["tall_rows"] = TALL_ROWS if wanted else 0
        return resolved

    def schedule(self, spec: LinearSpec, target: Target, knobs: Mapping[str, int]) -> Any:
        return self._func(spec, target, knobs)[-1]


class _TiledEpilogueRule(LinearMmaRule):
    """LinearMmaRule's tiled kernels (the small tiled kernel up to gemm_rows rows, the tiled or warpgroup GEMM
    above) for one op whose epilogue replaces the store. Same knobs and defaults as LinearMmaRule, under the
    subclass's own name so that knobs chosen for the linears (GEMM mode, k splits) do not reach it. Refused:
    `x_stages` > 0 and `gemv_tiled_stages` 0 (the kernels that keep their accumulators in GEMV-mode registers
    have no such epilogue) and k splits (an epilogue takes whole sums)."""

    op: Op

    def spec_of(self, subject: Any) -> LinearSpec | None:
        spec = spec_of(subject)
        return spec if spec is not None and spec.op == self.op.value else None


class LinearArgmaxRule(_TiledEpilogueRule):
    """lm_head_argmax with the argmax epilogue of `linear_argmax.py`, each kernel followed by its merge of the
    blocks' picks."""

    name = "linear_argmax"
    op = Op.LM_HEAD_ARGMAX


class LinearSiluRule(_TiledEpilogueRule):
    """matmul_silu, the store writing silu(gate) · up of each feature's interleaved gate and up rows
    (linear_tiled.store_macro)."""

    name = "linear_silu"
    op = Op.MATMUL_SILU


def tiled_defaults(spec: LinearSpec, target: Target) -> dict[str, int]:
    """The GEMM kernel's shape by weight, from the H200 sweeps (bench/linear.py --gemm; µs at 128 / 256 rows,
    against linear_mma's x-ring GEMM mode). Every block has 4 warps, 2 along n by 2 along m, and 128 rows of x.

    * bf16 weights take 64-row blocks (warp tiles of 2 x 8 mma tiles): x crosses from L2 once per 64
      weight rows, so blocks stay small enough for three to share an SM. Wide weights (64-row blocks at
      least two per SM) take two k steps per slot and three slots (gate_up 96 / 186 against 147 / 323,
      lm_head 650 / 1221 against 797 / 1592); narrow ones one k step, four slots and k splits toward three
      blocks per SM, at most 8 (qkv 34 / 63 against 58 / 115, o_proj 26 / 42 against 37 / 70, down 65 /
      103 against 93 / 181).
    * FP8 weights take 128-row blocks (4 x 8 tiles), whose x share per weight byte is half (an FP8 k step
      reads twice the weight's bytes of x), four slots, and for narrow weights k splits toward two blocks
      per SM (lm_head 595 / 1161 against 875 / 1733 with 64-row blocks; gate_up 136 / 224; qkv 41 / 68,
      down 57 / 111). A wide weight's split only adds its merge: gate_up at 256 rows took 206 + 34 µs with
      two splits in the drafter step against 224 alone.
    """
    vector = 16 // ITEM_BYTES[spec.weight_dtype]
    wide = spec.n >= 2 * target.sm_count * 64
    if spec.fp8:
        shape = {"n_tiles": 4, "k_steps": 1, "stages": 4, "per_sm": 0 if wide else 2}
    elif wide:
        shape = {"n_tiles": 2, "k_steps": 2, "stages": 3, "per_sm": 0}
    else:
        shape = {"n_tiles": 2, "k_steps": 1, "stages": 4, "per_sm": 3}
    plan = TiledPlan(n_warps=2, m_warps=2, n_tiles=shape["n_tiles"], m_tiles=8, stages=1, k_splits=1,
                     k_steps=shape["k_steps"], vector=vector)  # fmt: skip
    stages = max(2, min(shape["stages"], target.shared_memory_per_sm // 2 // plan.stage_bytes()))
    blocks = -(-spec.n // plan.block_n)
    # the argmax and silu epilogues (tiled_only) take whole sums: no k split
    splits = min(8, -(-shape["per_sm"] * target.sm_count // blocks)) if shape["per_sm"] and not spec.tiled_only else 1
    return {**plan.knobs(), "stages": stages, "k_splits": splits}


def gemm_knobs(plan: TiledPlan | WgmmaPlan | None) -> dict[str, int]:
    """The knobs a Kernel reports for its GEMM above gemm_rows rows (none without one)."""
    if plan is None:
        return {}
    wgmma = isinstance(plan, WgmmaPlan)
    prefix = "wgmma_" if wgmma else "gemm_"
    return {"gemm_wgmma": int(wgmma), **{f"{prefix}{key}": value for key, value in plan.knobs().items()}}


def wgmma_fits(spec: LinearSpec, target: Target) -> bool:
    """The warpgroup GEMM takes weights whose k is whole 64-wide atoms, on targets with wgmma."""
    return target.wgmma and spec.k % 64 == 0


def wgmma_defaults(
    spec: LinearSpec,
    target: Target,
    rows: int = 128,
    shapes: tuple[tuple[int, int, int], ...] = (),
    tile_rows: int = 0,
) -> dict[str, int]:
    """The warpgroup GEMM's shape by weight: 128 rows of x per block (one draft batch of 8 blocks), one
    64-wide k atom per slot, and the warpgroups, slots and k splits whose blocks fill the SMs' block slots
    most evenly.

    Every candidate streams the weight at about the same rate per SM once the SMs are full, so the cost of
    one is the rows it pads to, counted in whole waves of block slots, over n (1 / fill), plus the partial
    sums' traffic against the weight's (each split writes and reads back m · n f32 at m = 128: 4 · 128 ·
    splits / k of a bf16 weight's bytes, twice that of an e4m3 one's). Candidates, by shared memory: one
    warpgroup of four slots and two of three (two blocks per SM on sm_90), three or four warpgroups of
    four slots (one); ties go to fewer splits, then in that order of warpgroups 2, 3, 4, 1. FP8 weights
    keep one slot's wgmmas in flight (mma_groups 2) with a slot more for three or four warpgroups: their
    conversion of the next slot then runs beside the wgmmas instead of before them; their ties go to one
    warpgroup first (measured best on the narrow weights), two last (four slots of it take one block per SM).

    H200, µs at 128 rows (bench/linear.py --gemm; candidate chosen → others): gate_up 59.7 with three
    warpgroups (128 blocks, one wave) → 65.5 with two (192 of 264 slots) and 65.6 with four; lm_head 377.7
    (792 blocks, six waves exactly) → 406.7 and 406.3; qkv 26.3 with two warpgroups and 4 splits → 26.7
    with four, 31.0 with one, 39.8 unsplit; o_proj 17.5 with one and 4 splits → 19.3 with two; down 37.5
    with one and 4 splits → 39.8 with two and 8, 111.8 unsplit. The tiled mma.sync GEMM took 94.6, 640,
    52.7, 52.1 and 152.7. FP8, one group in flight against none: gate_up_fp8 76.2 µs (five slots) against
    103.6, lm_head_fp8 458.1 against 572.3, down_fp8 48.5 against 50.4 (the tiled GEMM: 137.2, 591.9,
    285.8); bf16 gained nothing from it at 128 rows (gate_up 59.5 against 59.3, lm_head 367.3 against 365.8).

    Every warp copies (roles 1): a producer warpgroup (roles 2) was no faster at 64 or 128 rows. H100, µs at
    64 / 128 / 256 rows, these shapes with roles 1 → 2 (bench/linear.py --gemm, dependent launches, two
    rounds, 388/388 numpy checks): qkv 27.5 / 32.4 / 44.6 → 29.0 / 35.0 / 47.0, o_proj 17.8 / 21.4 / 32.1 →
    19.2 / 23.5 / 35.2, down 43.9 / 48.3 / 68.7 → 44.9 / 50.7 / 73.0, gate_up 77.3 / 80.5 / 107.8 → 76.4 /
    79.4 / 100.2, lm_head 461.8 / 486.8 / 705.8 → 461.0 / 486.9 / 684.0; FP8 gate_up 75.9 / 76.8 / 152.5 →
    75.8 / 75.3 / 153.5, lm_head 435.0 / 486.5 / 918.7 → 445.0 / 502.0 / 954.7, qkv 32.8 / 34.3 / 66.4 →
    35.6 / 38.9 / 74.5. A single producer warp issued the copies too slowly (the bf16 step at nb = 16 on an
    H200: 3.108 against 2.338 ms). Only the wide bf16 weights at 256 rows gain (3-7 %), so roles 2 is a knob.

    Nor did one slot's wgmmas in flight for bf16, two atoms a slot, six slots or eight splits, with one to
    three warpgroups, beat the choice at 128 rows. H100, µs (bench/linear.py --gemm --wgmma-only, dependent
    launches, three rounds, 520/520 numpy checks; the default → the best of eight such variants): qkv 29.04
    → 29.10, o_proj 19.46 → 19.75, down 45.84 → 45.66; FP8 qkv 22.90 → 21.77 (three warpgroups, four
    splits), o_proj 13.88 → 14.09, down 38.43 → 37.86. Nsight Compute on the bf16 qkv GEMM at 128 rows (three
    warpgroups, one block per SM by registers and shared memory): DRAM 61 % busy, a third of the warps'
    stalls at the slot's block barrier. Neither DRAM nor L2 is saturated by any of them at 128 rows, so x's
    reads from L2 (twice the weight's bytes with one warpgroup) are not what bounds them; their few warps'
    waits are. Nsight Compute, H100, one cold launch each, bf16 (µs; DRAM %; L2 %; warps per scheduler;
    cycles without an eligible warp): o_proj 19.1; 58; 64; 1.9; 79 %, down 45.0; 70; 74; 1.9; 81 %, qkv 26.1;
    62; 69; 3.1; 78 %, gate_up 82.5; 74; 74; 3.1; 79 %.
    cuBLAS streams the narrow weights faster at 128 rows (torch's F.linear in a CUDA graph over weight copies
    past L2, H100, µs a call; ours standalone through bench/linear.py, dependent launches): qkv 21.8 against
    28.8, o_proj 15.8 against 19.6; at 16 rows ours are faster (qkv 18.2 against 22.0, o_proj 12.2 against
    16.5). 64-row x tiles of one warpgroup, four slots and two splits for every linear above 64 rows (knobs,
    one run; µs a call adds in the bf16 step at nb = 8, GEMM + merge) gained only on qkv, whose default is one
    block of three warpgroups per SM: qkv 28.6 → 25.3, o_proj 20.5 → 20.6, down 43.2 → 47.9; the step 1.794 →
    1.798 ms at nb = 8 and 2.516 → 2.768 at nb = 16 (four tiles each read the weight); four splits 1.881 at
    nb = 8. So qkv's calls of 65-128 rows take such tiles on a GEMM of their own (`tall_wanted`).
    Five slots instead of four for the three-warpgroup GEMMs of gate_up (silu) and lm_head (argmax), bf16, lost in
    the step (H100, one run, two copies of each build alternating; µs the calls add at nb = 8, timeline): gate_up
    376.5 / 375.9 → 379.7 / 377.6, lm_head 443.6 / 446.1 → 451.3 / 467.7; the step 1.684 / 1.693 → 1.706 / 1.711 ms.
    """
    atoms, tile_rows = spec.k // 64, tile_rows or rows
    m_tiles = -(-rows // tile_rows)  # x tiles of a call of `rows` rows (tile_rows: the tiles' rows, as given)
    # per weight row and split: m = rows f32 partial sums written and read back, against the row's weight
    partial_bytes, weight_bytes = 2 * 4 * rows, spec.k * ITEM_BYTES[spec.weight_dtype]
    best: tuple[tuple[float, int, int], dict[str, int]] | None = None
    if not shapes:  # (warpgroups, stages, mma_groups), in the order ties go to
        fp8_shapes = ((1, 4, 2), (3, 5, 2), (4, 5, 2), (2, 4, 2))
        shapes = fp8_shapes if spec.fp8 else ((2, 3, 1), (3, 4, 1), (4, 4, 1), (1, 4, 1))
    for order, (groups, stages, mma_groups) in enumerate(shapes):
        plan = WgmmaPlan(groups, tile_rows, stages, 1, 1, mma_groups, ITEM_BYTES[spec.weight_dtype])
        blocks_per_sm = plan.blocks_per_sm(target)
        if blocks_per_sm < 1 or plan.threads > target.max_threads_per_block:
            continue
        slots = blocks_per_sm * target.sm_count
        tiles = -(-spec.n // plan.block_n) * m_tiles
        # the argmax and silu epilogues (tiled_only) take whole sums: no k split
        for splits in (s for s in range(1, 2 if spec.tiled_only else 9) if atoms % s == 0):
            blocks = tiles * splits
            cost = -(-blocks // slots) * slots / blocks + partial_bytes * splits / weight_bytes
            key = (round(cost, 3), splits, order)
            if best is None or key < best[0]:
                best = (key, {"warpgroups": groups, "block_m": tile_rows, "stages": stages, "k_atoms": 1,
                              "k_splits": splits, "mma_groups": mma_groups,
                              "k_reduce": DEFAULT_K_REDUCE})  # fmt: skip
    if best is None:
        raise ScheduleError(f"{LinearMmaRule.name}: no warpgroup GEMM shape fits {target.name}'s shared memory")
    return {**best[1], "roles": SHARED_ROLES, "convert": default_convert(spec, tile_rows)}


def tier_reduce(knobs: Mapping[str, int]) -> int:
    """The mid and tall GEMMs' k_reduce: the tile's last block (LAST_REDUCE) where the knob wgmma_k_reduce or
    DEFAULT_K_REDUCE says so, else the merge kernel (clusters are the GEMM above them only)."""
    reduce = knobs["wgmma_k_reduce"] or DEFAULT_K_REDUCE
    return LAST_REDUCE if reduce == LAST_REDUCE else KERNEL_REDUCE


def default_convert(spec: LinearSpec, block_m: int) -> int:
    """Where both warpgroup GEMMs turn e4m3 weights into bf16 unless knob wgmma_convert says: into the wgmmas'
    A fragments in registers (CONVERT_REGISTERS), which skips the bf16 tile's shared-memory round trip and
    its second barrier per slot. The FP8 drafter step, one run on an H100 (bench/propose.py, both builds in
    one process, ms at nb 1 / 4 / 8; a shared tile → registers): 0.787 → 0.796, 1.377 → 1.179,
    1.814 → 1.512. nb = 1 (16 rows) takes no warpgroup GEMM. bf16 weights have nothing to convert.

    Only x tiles of up to REGISTER_CONVERT_ROWS rows (the default GEMMs' 64 and 128) convert in registers:
    a block_m-row tile's accumulators take block_m / 2 registers a thread, and at 256 rows ptxas serialised
    the wgmmas of a producer-role GEMM with register fragments for want of registers (C7512), which the
    build refuses (nvrtc.py); larger tiles keep the shared tile."""
    return CONVERT_REGISTERS if spec.fp8 and block_m <= REGISTER_CONVERT_ROWS else CONVERT_TILE


def mid_defaults(spec: LinearSpec, target: Target, rows: int) -> dict[str, int]:
    """The warpgroup GEMM of the calls up to mid_rows rows: one warpgroup of 64 weight rows, four slots, x
    tiles `rows` tall (a 128-row tile multiplies and, FP8, converts for half padding at 64 rows), one slot's
    wgmmas in flight for FP8 weights, and the k splits whose blocks fill the SMs' block slots most evenly
    (wgmma_defaults' cost).

    H100, µs at 64 rows (bench/linear.py --gemm, one round; the 128-row default → 64-row tiles of one
    warpgroup and 4 splits): qkv 27.6 → 24.8, o_proj 17.6 → 17.1, down 43.5 → 42.5, FP8 qkv 32.6 → 20.8,
    o_proj 18.0 → 15.3, down 49.9 → 39.0. The drafter step at nb = 4 (bench/propose.py, one run, A/B in
    one process): bf16 1.600 → 1.554 ms, FP8 1.619 → 1.396 ms.
    """
    shape = wgmma_defaults(spec, target, rows, ((1, 4, 2 if spec.fp8 else 1),))
    return {name: shape[name] for name in MID_KNOBS}


def tall_wanted(spec: LinearSpec, target: Target) -> bool:
    """Whether the calls of MID_ROWS + 1 to TALL_ROWS rows get a GEMM of their own (knob tall_rows): bf16 weights
    whose 128-row GEMM (wgmma_defaults) is one block of three or more warpgroups an SM with k splits: qkv's, and
    the context K/V projection's (its calls of 65-128 rows append 7 rows for 10-18 sequences).
    Its blocks, one warpgroup of 64-row x tiles (tall_defaults), share the SM three at a time instead, and the
    SM's few warps wait less (wgmma_defaults' Nsight Compute figures): H100, bf16 step at nb = 8 (knobs for every
    linear above 64 rows, one run, µs a call adds, GEMM + merge) qkv 28.6 → 25.3, while o_proj (20.5 → 20.6)
    and down (43.2 → 47.9), one warpgroup already, gained nothing. e4m3 weights lost at 128 rows with any such
    shape (bench/linear.py --wgmma-only), and the fused epilogues keep their tiles (not measured).
    With this GEMM (H100, bench/propose.py, one run, the build between two copies of the build without it, bf16;
    timeline at nb = 8): qkv's five calls add 138.7 / 137.8 → 129.4 µs (GEMM 25.0 → 23.9 µs a call, merge 2.7
    → 1.9); the step takes 1.739 / 1.750 → 1.725 ms at nb = 8, and at nb = 4 (no call in its rows) 1.487 /
    1.497 → 1.499 and at nb = 16 2.482 / 2.509 → 2.502. bench/kernels.py: qkv at 128 rows matches numpy."""
    if spec.fp8 or spec.tiled_only or not wgmma_fits(spec, target):
        return False
    large = wgmma_defaults(spec, target)
    return large["warpgroups"] >= 3 and large["k_splits"] > 1


def tall_defaults(spec: LinearSpec, target: Target, rows: int, block_m: int) -> dict[str, int]:
    """The GEMM of the calls up to tall_rows = `rows` rows in x tiles of `block_m`: one warpgroup of 64 weight
    rows, four slots, and the k splits whose blocks at `rows` rows fill the SMs' block slots most evenly
    (wgmma_defaults' cost): qkv's 96 tiles of 64 rows by two x tiles split 2 ways at 128 rows, 384 blocks of
    three to an SM (the best of seven shapes at 128 rows, bench/linear.py on an H100: 26.1 µs against 28.8)."""
    shape = wgmma_defaults(spec, target, rows, ((1, 4, 2 if spec.fp8 else 1),), block_m)
    return {name: shape[name] for name in TALL_KNOBS}


def fit_wgmma_plan(spec: LinearSpec, target: Target, knobs: Mapping[str, int]) -> WgmmaPlan:
    """The warpgroup GEMM's knobs checked against `spec` and the target (k_splits: the largest divisor of
    the k atoms up to the knob; k_atoms: the largest power of two up to the knob dividing a split's atoms;
    convert: CONVERT_TILE for bf16 weights)."""
    rule = LinearMmaRule.name
    if not wgmma_fits(spec, target):
        raise ScheduleError(
            f"{rule} knob gemm_wgmma=1 on {spec.name} for {target.name}: the warpgroup GEMM takes weights with k "
            f"a multiple of 64 on targets with wgmma (found k={spec.k}, wgmma={target.wgmma}). Fix: gemm_wgmma 0"
        )
    values = {name: knobs[name] for name in WGMMA_KNOBS}
    if any(v < 1 for v in values.values()) or values["stages"] < 2:
        raise ScheduleError(
            f"{rule} wgmma knobs {values}: expected positive values and stages >= 2 (one slot copied while one "
            "is multiplied)"
        )
    if values["mma_groups"] > 2 or values["stages"] <= values["mma_groups"]:
        raise ScheduleError(
            f"{rule} knobs wgmma_mma_groups={values['mma_groups']}, wgmma_stages={values['stages']}: expected 1 "
            "(wait for each slot's wgmmas) or 2 (one slot's stay in flight) groups, and more slots than groups "
            "(a slot's copies fly while the groups' slots are read)"
        )
    if values["roles"] not in (SHARED_ROLES, PRODUCER_ROLES):
        raise ScheduleError(
            f"{rule} knob wgmma_roles={values['roles']}: expected {SHARED_ROLES} (every warp copies and multiplies) or "
            f"{PRODUCER_ROLES} (one more warpgroup copies, the others multiply)"
        )
    if values["roles"] == PRODUCER_ROLES and values["k_reduce"] in (CLUSTER_REDUCE, LAST_REDUCE):
        raise ScheduleError(
            f"{rule} knobs wgmma_roles={PRODUCER_ROLES}, wgmma_k_reduce={values['k_reduce']}: the cluster's or the "
            "last block's sum is the multiplying threads' alone, and the producer warpgroup has no accumulators. "
            f"Fix: wgmma_k_reduce {KERNEL_REDUCE}, or wgmma_roles {SHARED_ROLES}"
        )
    if values["convert"] not in (CONVERT_TILE, CONVERT_REGISTERS):
        raise ScheduleError(
            f"{rule} knob wgmma_convert={values['convert']}: expected {CONVERT_TILE} (e4m3 weights converted into a "
            f"shared bf16 tile) or {CONVERT_REGISTERS} (into the wgmmas' A fragments in registers)"
        )
    if values["k_reduce"] not in (KERNEL_REDUCE, CLUSTER_REDUCE, LAST_REDUCE):
        raise ScheduleError(
            f"{rule} knob wgmma_k_reduce={values['k_reduce']}: expected {KERNEL_REDUCE} (the k splits' partial sums "
            f"through a workspace and a merge kernel), {CLUSTER_REDUCE} (added in a thread block cluster) or "
            f"{LAST_REDUCE} (added by the tile's last block to finish)"
        )
    if values["block_m"] % 8 or values["block_m"] > 256:
        raise ScheduleError(f"{rule} knob wgmma_block_m={values['block_m']}: wgmma's N is a multiple of 8 up to 256")
    producer = PRODUCER_WARPS if values["roles"] == PRODUCER_ROLES else 0
    if WARP * (4 * values["warpgroups"] + producer) > target.max_threads_per_block:
        raise ScheduleError(
            f"{rule} knob wgmma_warpgroups={values['warpgroups']}: at most "
            f"{(target.max_threads_per_block // WARP - producer) // 4} warpgroups per block on {target.name}"
            + (" beside the producer's" if producer else "")
        )
    atoms = spec.k // 64
    cluster = values["k_reduce"] == CLUSTER_REDUCE
    # a cluster holds at most MAX_PORTABLE blocks; a single split has nothing to add (reported as KERNEL_REDUCE)
    splits = _largest_divisor(atoms, min(values["k_splits"], MAX_PORTABLE) if cluster else values["k_splits"])
    per_slot = max(p for p in (1, 2, 4, 8) if p <= values["k_atoms"] and (atoms // splits) % p == 0)
    reduce = values["k_reduce"] if splits > 1 else KERNEL_REDUCE
    # bf16 weights have nothing to convert: they report CONVERT_TILE whatever the knob (one rule's knobs serve
    # the bf16 and e4m3 linears of a mixed-precision build alike)
    convert = values["convert"] if spec.fp8 else CONVERT_TILE
    plan = WgmmaPlan(**{**values, "k_splits": splits, "k_atoms": per_slot, "k_reduce": reduce, "convert": convert},
                     weight_bytes=ITEM_BYTES[spec.weight_dtype])  # fmt: skip
    limit = target.max_shared_memory_per_block
    if plan.reduce_bytes() > limit:
        raise ScheduleError(
            f"{rule}: the cluster's f32 tile of {plan.block_m} rows of x by {plan.block_n} weight rows needs "
            f"{plan.reduce_bytes()} bytes of shared memory; {target.name} allows {limit}. Fix: lower wgmma_block_m "
            "or wgmma_warpgroups, or wgmma_k_reduce 1"
        )
    if plan.shared_bytes() > limit:
        raise ScheduleError(
            f"{rule}: wgmma stages {plan.stages} x {plan.stage_bytes()} bytes of {plan.block_n} weight rows and "
            f"{plan.block_m} rows of x need {plan.shared_bytes()} bytes of shared memory; {target.name} allows "
            f"{limit}. Fix: lower wgmma_stages, wgmma_k_atoms or wgmma_block_m"
        )
    return plan


def wide_weight(spec: LinearSpec, target: Target) -> bool:
    """At least 4 blocks per SM of 32 weight rows (16896 rows on the H200's 132 SMs, 6144 on GB10's 48)."""
    return spec.n >= 4 * target.sm_count * 2 * MMA_ROWS


def few_rows_wgmma_plan(spec: LinearSpec, target: Target, convert: int = 0, stages: int = 0) -> WgmmaPlan:
    """The warpgroup GEMM of the calls of at most gemm_rows rows under knob gemv_wgmma: x tiles of one draft
    block (FEW_ROWS_TILE rows; a call of 17-32 rows takes two, the second reading the weight from L2, as the
    small tiled kernel does), one warpgroup of 64 weight rows, slots of one 64-wide k atom, one slot's wgmmas in
    flight for e4m3 weights, no k split (no workspace, no merge launch); `convert` as knob wgmma_convert (0:
    `default_convert`). Its blocks are small (24 KiB of four slots for e4m3 weights), so an SM fits twice as
    many as of the small tiled kernel (`LinearMmaRule.few_rows_defaults` has the figures).

    `stages` slots (knob gemv_wgmma_stages; 0: FEW_ROWS_DEEP_STAGES where a 16-row call's blocks at that depth
    fit one wave of the target's SMs, else the mid GEMM's four). A call of one wave leaves SM slots empty, which
    deeper rings fill with bytes in flight; one of several waves has every slot taken, and deeper rings only
    leave fewer blocks an SM. H100, one run of three builds between two copies of the four-slot one
    (bench/propose.py, FP8 step at nb = 1, µs the calls add in the timeline): gate_up's five calls (384 blocks,
    one wave) 198.0 / 193.9 with four slots, 184.0 with six, 187.5 with eight; lm_head (2,374 blocks, three
    waves or more) 200.0 / 198.9, 202.1 and 211.1. This rule against four slots everywhere, another run: gate_up
    194.5 → 184.0 / 184.1 (two builds), the FP8 step at nb = 1 0.757 / 0.754 → 0.747 / 0.748 ms."""
    shape = {**mid_defaults(spec, target, FEW_ROWS_TILE), "k_splits": 1}  # the mid GEMM's shape, unsplit

    def plan_of(slots: int) -> WgmmaPlan:
        return fit_wgmma_plan(spec, target, {**shape, "stages": slots, "block_m": FEW_ROWS_TILE, "k_atoms": 1,
                                             "k_reduce": KERNEL_REDUCE, "roles": SHARED_ROLES,
                                             "convert": convert or default_convert(spec, FEW_ROWS_TILE)})  # fmt: skip

    if stages:
        return plan_of(stages)
    deep = plan_of(FEW_ROWS_DEEP_STAGES)
    one_wave = -(-spec.n // deep.block_n) <= deep.blocks_per_sm(target) * target.sm_count
    return deep if one_wave else plan_of(shape["stages"])


def small_tiled_plan(spec: LinearSpec, target: Target, knobs: Mapping[str, int]) -> TiledPlan:
    """The tiled kernel for calls of at most gemm_rows rows: 16 · `gemv_tiled_n_tiles` weight rows by 16 rows
    of x per block (a call of 17-32 rows takes two x tiles, the second reading the weight from L2),
    `gemv_tiled_stages` slots of up to `gemv_tiled_k_steps` k steps, `gemv_tiled_k_warps` warps each
    multiplying its share of every slot, no k split (no merge launch). More weight tiles per block share
    each x tile: a block reads x's k range once per 16 · n_tiles weight rows, which is twice the weight's
    bytes per 16 rows for FP8 weights (an e4m3 k step is 64 wide, its x 128 bytes a row).

    Why shared memory: a short weight stream is bound by the bytes in flight per SM (a read-only stream
    kernel on the H200, as in bench/stream.py: 32 MiB per launch reach 67 % of the copy bandwidth with
    32 KiB in flight per SM, 84 % with 64 KiB and 88 % with 128 KiB). GEMV mode holds its loads in
    registers, ~32-48 KiB per SM; here the weight half of every slot in flight is held in shared memory at
    no register cost. Deeper is not better past a point: the blocks of the call must still fit one wave,
    or the second wave waits for the first. With one warp per block, one chain of dependent mmas runs
    through every slot and paces the stream (o_proj at four slots of 8: 12.2 µs with one warp, 10.9 with
    four along k).
    """
    return fit_tiled_plan(spec, target, {"n_warps": 1, "m_warps": 1, "n_tiles": knobs["gemv_tiled_n_tiles"],
                                         "m_tiles": 2, "k_splits": 1,
                                         "stages": knobs["gemv_tiled_stages"],
                                         "k_steps": knobs["gemv_tiled_k_steps"],
                                         "k_warps": knobs["gemv_tiled_k_warps"]}, few_rows=True)  # fmt: skip


def fit_tiled_plan(spec: LinearSpec, target: Target, knobs: Mapping[str, int], few_rows: bool = False) -> TiledPlan:
    """The tiled GEMM's knobs fitted to `spec` (k_splits: the largest divisor of the k steps up to the knob;
    k_steps: the largest power of two up to the knob that divides a split's steps; k_warps: the largest
    power of two up to the knob that divides a slot's steps) and checked against the target's limits.
    `few_rows`: the plan is the small one of `small_tiled_plan`, whose errors name its gemv_tiled_ knobs."""
    rule = LinearMmaRule.name
    gemm_fix = "gemm_stages, gemm_k_steps, gemm_n_tiles or gemm_m_tiles"
    fix = "gemv_tiled_stages or gemv_tiled_k_steps" if few_rows else gemm_fix
    values = {name: knobs[name] for name in TILED_KNOBS}
    if any(v < 1 for v in values.values()) or values["stages"] < 2:
        raise ScheduleError(
            f"{rule} GEMM knobs {values}: expected positive values and stages >= 2 (one slot copied while one "
            "is multiplied)"
        )
    warps = values["n_warps"] * values["m_warps"] * values["k_warps"]
    if WARP * warps > target.max_threads_per_block:
        raise ScheduleError(
            f"{rule} GEMM knobs n_warps={values['n_warps']} x m_warps={values['m_warps']} x "
            f"k_warps={values['k_warps']}: at most "
            f"{target.max_threads_per_block // WARP} warps per block on {target.name}"
        )
    steps = spec.k // mma_step(spec)
    splits = _largest_divisor(steps, values["k_splits"])
    # k steps per slot: a power of two, so that the swizzle's xor stays inside a row of 8 * 2^j chunks
    per_slot = max(p for p in (1, 2, 4, 8, 16) if p <= values["k_steps"] and (steps // splits) % p == 0)
    # warps along k: a power of two up to the knob that splits the slot's k steps evenly
    k_warps = max(p for p in (1, 2, 4, 8, 16) if p <= values["k_warps"] and per_slot % p == 0)
    plan = TiledPlan(**{**values, "k_splits": splits, "k_steps": per_slot, "k_warps": k_warps},
                     vector=16 // ITEM_BYTES[spec.weight_dtype])  # fmt: skip
    if plan.shared_bytes() > target.max_shared_memory_per_block:
        raise ScheduleError(
            f"{rule}: GEMM stages {plan.stages} x {plan.stage_bytes()} bytes of {plan.block_n} weight rows and "
            f"{plan.block_m} rows of x need {plan.shared_bytes()} bytes of shared memory; {target.name} allows "
            f"{target.max_shared_memory_per_block}. Fix: lower {fix}"
        )
    if plan.registers() > target.max_registers_per_thread:
        raise ScheduleError(
            f"{rule}: GEMM warp tiles of {plan.n_tiles} x {plan.m_tiles} need about {plan.registers()} registers "
            f"per thread; {target.name} allows {target.max_registers_per_thread}. Fix: lower gemm_n_tiles or "
            "gemm_m_tiles"
        )
    return plan


def mma_fits(spec: LinearSpec, target: Target) -> bool:
    return target.bf16_mma and target.warp_size == WARP and spec.k % mma_step(spec) == 0


def fit_mma_plan(spec: LinearSpec, target: Target, knobs: Mapping[str, int]) -> MmaPlan:
    """The knobs fitted to `spec`: divisors of the k steps, checked against the target's limits."""
    warps, row_tiles, unroll, m_tile = knobs["warps"], knobs["row_tiles"], knobs["unroll"], knobs["m_tile"]
    stages, x_stages, n_warps = knobs["stages"], knobs["x_stages"], knobs["n_warps"]
    rule = LinearMmaRule.name
    if warps < 1 or n_warps < 1 or WARP * warps * n_warps > target.max_threads_per_block:
        raise ScheduleError(
            f"{rule} knobs warps={warps} x n_warps={n_warps}: expected positive values with at most "
            f"{target.max_threads_per_block // WARP} warps per block on {target.name}"
        )
    if row_tiles < 1 or unroll < 1:
        raise ScheduleError(f"{rule} knobs row_tiles={row_tiles}, unroll={unroll}: expected positive values")
    if m_tile < 8 or m_tile % 8:
        raise ScheduleError(f"{rule} knob m_tile={m_tile}: expected a positive multiple of 8")
    if stages not in (1, 2):
        raise ScheduleError(f"{rule} knob stages={stages}: expected 1 (load, then multiply) or 2 (double buffer)")
    if not 0 <= x_stages <= 8:
        raise ScheduleError(
            f"{rule} knob x_stages={x_stages}: expected 0 (x into registers) or 1 to 8 shared-memory slots"
        )
    if n_warps > 1 and x_stages == 1:
        raise ScheduleError(
            f"{rule} knobs n_warps={n_warps}, x_stages=1: warps that share x need a ring of at least 2 slots "
            "(one is copied while the other is read). Fix: x_stages >= 2, or n_warps 1"
        )
    if (m_tile // 8) % n_warps:
        raise ScheduleError(
            f"{rule} knobs m_tile={m_tile}, n_warps={n_warps}: the n warps split the m_tile / 8 = {m_tile // 8} "
            "row groups of x evenly. Fix: an n_warps that divides m_tile / 8"
        )
    steps = spec.k // mma_step(spec)
    warps = _largest_divisor(steps, warps)
    unroll = _largest_divisor(steps // warps, unroll)
    row_tiles = min(row_tiles, -(-spec.n // MMA_ROWS))  # no warp wider than the weight
    plan = MmaPlan(warps=warps, row_tiles=row_tiles, unroll=unroll, m_tile=m_tile, stages=stages,
                   vector=16 // ITEM_BYTES[spec.weight_dtype], x_stages=x_stages, n_warps=n_warps)  # fmt: skip
    # GEMV mode: static shared memory (partial sums only); GEMM mode: dynamic, up to the opt-in size
    limit = target.max_shared_memory_per_block if x_stages else target.max_static_shared_memory_per_block
    if plan.shared_bytes() > limit:
        raise ScheduleError(
            f"{rule}: warps {warps} x m_tile {m_tile} need {plan.shared_bytes()} bytes of shared memory ("
            f"{plan.reduction_bytes()} of f32 partial sums for {plan.block_rows} rows, {plan.x_ring_bytes()} of "
            f"x ring for x_stages {x_stages}); {target.name} allows {limit} "
            f"{'dynamic' if x_stages else 'static'}. Fix: lower warps, m_tile, row_tiles or x_stages"
        )
    registers = _register_estimate(plan)
    if registers > target.max_registers_per_thread:
        raise ScheduleError(
            f"{rule}: unroll {unroll} x row_tiles {row_tiles} with m_tile {m_tile} (x_stages {x_stages}) needs "
            f"about {registers} registers per thread; {target.name} allows {target.max_registers_per_thread}. "
            "Fix: lower unroll, stages, row_tiles or m_tile"
        )
    return plan


def _largest_divisor(total: int, at_most: int) -> int:
    return max(d for d in range(1, min(total, at_most) + 1) if total % d == 0)


def _register_estimate(plan: MmaPlan) -> int:
    """32-bit registers the fragments take (loads in flight, A/B fragments, accumulators) plus addressing.

    GEMV mode holds the x fragments of `stages` batches. GEMM mode holds one x vector (4 registers, twice
    for the copy into the mma's operand) plus about one register per row group (its predicate, the shared
    loads ptxas hoists), so beyond that its registers grow with m_tile through the accumulators. ptxas
    (NVRTC 13.5, 4 warps) used 147-158 registers at m_tile 64, 168-195 at 128 and 168-183 at 256 with
    unroll 1 and one stage; 2 warps at 256 took 222-255, FP8 spilling 12-44 bytes.
    """
    weight = plan.stages * plan.unroll * plan.row_tiles * 2 * 4  # 16-byte loads, 4 registers each
    groups = plan.m_tile // 8
    x = 16 + groups if plan.x_stages else plan.stages * plan.unroll * groups * plan.vector // 2
    frag_a = plan.row_tiles * (plan.vector // 4) * 4
    acc = plan.row_tiles * groups * 4
    return weight + x + frag_a + acc + 32


# -------------------------------------------------------------------------------- generic SIMT fallback


class LinearGemvRule(FamilyRule):
    """Any linear of the family on CUDA cores: the correct generic path (odd k, no bf16 mma).

    Knobs: `threads` per block (they split k), `rows_per_block` (rows of x sharing one read of a weight
    row) and `vector_bytes` of weight per load (the widest that divides k is used; the Kernel reports it).
    """

    name = "linear_gemv"
    knob_names = ("threads", "rows_per_block", "vector_bytes")

    def default_knobs(self, target: Target) -> dict[str, int]:
        return {"threads": 4 * target.warp_size, "rows_per_block": 4, "vector_bytes": 16}

    def spec_of(self, subject: Any) -> LinearSpec | None:
        spec = spec_of(subject)
        return None if spec is None or spec.tiled_only else spec  # their epilogues are the tiled kernels'

    def apply(self, subject: Any, target: Target, knobs: Mapping[str, int] | None = None) -> Kernel | None:
        spec = self.spec_of(subject)
        if spec is None:
            return None
        threads, rows, vector = self._fit(spec, target, self.resolve_knobs(target, knobs))
        used = {"threads": threads, "rows_per_block": rows, "vector_bytes": vector * ITEM_BYTES[spec.weight_dtype]}
        return Kernel(name=spec.name, func=schedule_gemv(spec.prim_func(), threads, rows, vector),
                      reference=spec.prim_func(), rule=self.name, knobs=used, spec=spec)  # fmt: skip

    def schedule(self, spec: LinearSpec, target: Target, knobs: Mapping[str, int]) -> Any:
        return schedule_gemv(spec.prim_func(), *self._fit(spec, target, knobs))

    def _fit(self, spec: LinearSpec, target: Target, knobs: Mapping[str, int]) -> tuple[int, int, int]:
        """(threads, rows per block, weight elements per load); knob values out of range are errors."""
        threads, rows, vector_bytes = knobs["threads"], knobs["rows_per_block"], knobs["vector_bytes"]
        if threads <= 0 or threads % target.warp_size or threads > target.max_threads_per_block:
            raise ScheduleError(
                f"{self.name} knob threads={threads}: expected a multiple of {target.warp_size} up to "
                f"{target.max_threads_per_block} on {target.name}"
            )
        if not 1 <= rows <= 64:
            raise ScheduleError(f"{self.name} knob rows_per_block={rows}: expected 1 to 64")
        if vector_bytes not in (1, 2, 4, 8, 16):
            raise ScheduleError(f"{self.name} knob vector_bytes={vector_bytes}: expected 1, 2, 4, 8 or 16")
        vector = max(1, vector_bytes // ITEM_BYTES[spec.weight_dtype])
        while spec.k % vector:  # the widest load that tiles k exactly
            vector //= 2
        while threads > target.warp_size and threads * vector > spec.k:  # no idle warps on short rows
            threads -= target.warp_size
        return threads, rows, vector


def schedule_gemv(func: Any, threads: int, rows: int, vector: int) -> Any:
    """SIMT GEMV: block (column j, `rows` rows of x); `threads` split k into per-thread partial sums of
    `vector`-wide weight loads, which TVM's cross-thread reduction adds (warp shuffles + shared memory).
    """
    from tvm import s_tir

    sch = s_tir.Schedule(func)
    acc = sch.get_sblock("acc")
    sch.pad_einsum(acc, [rows, 1, 1])  # static local buffers under a symbolic m (else INT_MAX-sized arrays)
    sch.compute_inline(sch.get_producers(acc)[0])  # x_pad: if_then_else(i < m, x, 0)
    sch.compute_inline(sch.get_consumers(acc)[0])  # acc_pad: read directly by "y"
    i, j, k = sch.get_loops(acc)
    io, ii = sch.split(i, factors=[None, rows])
    ko, kt, kv = sch.split(k, factors=[None, threads, vector])
    sch.reorder(j, io, kt, ko, ii, kv)
    partial = sch.rfactor(kt, factor_axis=0)
    rj, rio, rkt, rko, rii, rkv = sch.get_loops(partial)
    sch.bind(rj, "blockIdx.x")  # columns on x: n can exceed gridDim.y's 65535
    sch.bind(rio, "blockIdx.y")
    sch.bind(rkt, "threadIdx.x")
    sch.set_scope(partial, 0, "local")
    if vector > 1:
        reads = [r.source.name for r in sch.get(partial).reads]
        weight = sch.cache_read(partial, reads.index("w"), "local")
        sch.compute_at(weight, rko)
        sch.vectorize(sch.get_loops(weight)[-1])
    sch.unroll(rii)
    sch.unroll(rkv)
    sch.decompose_reduction(partial, rko)
    sch.reverse_compute_at(acc, rio)
    sch.set_scope(acc, 0, "local")
    fkt, fii = sch.get_loops(acc)[-2:]
    sch.reorder(fii, fkt)
    sch.bind(fkt, "threadIdx.x")
    sch.reverse_compute_at(sch.get_sblock("y"), fii)
    return sch.mod["main"].with_attr("tirx.is_scheduled", True)
