"""Row gathers of the drafter's input and output: embed, block_ids, drop_anchor.

* `embed`: `y[i, :] = table[ids[i], :] * scale` (ids int32 [m], table [V, H] bf16). A row-wise kernel whose
  one tap has a gathered row index, so it shares elementwise.py's computation builder and schedule:
  16-byte loads of the table row, 16-byte stores. Ids must be in [0, V) (the graph's semantics; the kernel
  does not check them). Flat indices are int32, so V * H must stay below 2^31 (refused otherwise).
  With `block` > 0 it is block_embed: the id of row `s * block + k` is `anchors[s]` for k = 0 and
  `mask_token_id` else, computed in the kernel (parameters `anchors` int32 [nb] and y [m = nb * block, H],
  bound as block_ids' are), so the ids never go to memory and block_ids' launch goes.
* `block_ids`: `ids[s * block + k] = anchors[s] if k == 0 else mask_token_id`. Parameters `anchors`
  (int32 [nb]) and `ids` (int32 [m]) with **m = nb * block**: two variables, because every dim is one
  variable name; the launch plan binds both (nb from the anchors, m from the node's `nb*blk` rows).
  One thread per id.
* `drop_anchor`: rows 1..block-1 of every sequence's block, `[nb*block, H] -> [nb*(block-1), H]`.
  Parameters `x` ([m, H], **m = nb * block**) and `y` ([n, H], **n = nb * (block - 1)**); output row r
  reads input row `r + r // (block - 1) + 1`. Row-wise schedule like embed.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from dflash_compiler.ir.graph import Node, TensorType
from dflash_compiler.ir.ops import Op
from dflash_compiler.targets import Target

from .base import FamilyRule, KernelSpec, OpInstance, Param, ScheduleError
from .elementwise import (
    FLOAT_DTYPES,
    ITEM_BYTES,
    check_knobs,
    dtype_tag,
    float_sample,
    launch_fit,
    number_tag,
    numpy_dtype,
    rowwise_func,
    schedule_rowwise,
)

ROWS = "m"  # embed: tokens; block_ids: ids (nb*block); drop_anchor: input rows (nb*block)
SEQUENCES = "nb"  # block_ids: anchors, one per sequence
KEPT_ROWS = "n"  # drop_anchor: output rows, nb*(block-1)
INT32_LIMIT = 2**31 - 1


def _check_block(op: str, block: int) -> None:
    if block < 2:
        raise ScheduleError(f"{op}: block must be at least 2 (an anchor and one draft position), found {block}")


def _check_ids(op: str, block: int, mask_token_id: int) -> None:
    _check_block(op, block)
    if not 0 <= mask_token_id <= INT32_LIMIT:
        raise ScheduleError(f"{op}: mask_token_id must be a non-negative int32, found {mask_token_id}")


def _check_rows(op: str, sizes: Mapping[str, int], block: int) -> None:
    if sizes[ROWS] != sizes[SEQUENCES] * block:
        raise ScheduleError(
            f"{op}: m={sizes[ROWS]} but nb={sizes[SEQUENCES]} sequences of block {block} give "
            f"{sizes[SEQUENCES] * block} rows. Fix: bind m = nb * block"
        )


# --------------------------------------------------------------------------------------------- embed


@dataclass(frozen=True)
class EmbedSpec(KernelSpec):
    """`y = table[ids] * scale`: `vocab` x `hidden` table, `m` ids; with `block` > 0 the ids of a block
    (block_embed: `anchors[s]`, then `mask_token_id` for the rest of sequence s's `block` rows)."""

    vocab: int
    hidden: int
    scale: float = 1.0
    table_dtype: str = "bfloat16"
    out_dtype: str = "bfloat16"
    block: int = 0
    mask_token_id: int = 0
    name: str = ""

    def __post_init__(self) -> None:
        if self.block:
            _check_ids("block_embed", self.block, self.mask_token_id)
        if self.vocab <= 0 or self.hidden <= 0:
            raise ScheduleError(f"embed: table [{self.vocab}, {self.hidden}] must have positive sizes")
        if self.block and self.mask_token_id >= self.vocab:
            raise ScheduleError(
                f"block_embed: mask_token_id {self.mask_token_id} is past the table's {self.vocab} rows. Fix: a "
                "mask token of the target's vocabulary"
            )
        if self.vocab * self.hidden > INT32_LIMIT:
            raise ScheduleError(
                f"embed: a [{self.vocab}, {self.hidden}] table has more than 2^31 elements and the kernel indexes "
                "with int32. Fix: split the table by rows into two embed nodes"
            )
        for dtype in (self.table_dtype, self.out_dtype):
            if dtype not in FLOAT_DTYPES:
                raise ScheduleError(f"embed: dtype {dtype} not supported; expected one of {FLOAT_DTYPES}")
        if not self.name:
            scale = "" if float(self.scale) == 1.0 else f"_scale{number_tag(self.scale)}"
            tag = dtype_tag(self.table_dtype, self.out_dtype)
            block = f"_b{self.block}_mask{self.mask_token_id}" if self.block else ""
            object.__setattr__(self, "name", f"embed{block}_v{self.vocab}_h{self.hidden}{scale}{tag}")

    @property
    def op(self) -> Op:
        return Op.BLOCK_EMBED if self.block else Op.EMBED

    def params(self) -> tuple[Param, ...]:
        ids = Param("anchors", "int32", (SEQUENCES,)) if self.block else Param("ids", "int32", (ROWS,))
        return (
            ids,
            Param("table", self.table_dtype, (self.vocab, self.hidden)),
            Param("y", self.out_dtype, (ROWS, self.hidden), "out"),
        )

    def prim_func(self) -> Any:
        from tvm import te, tirx

        rows = tirx.Var(ROWS, "int32")
        table = te.placeholder((self.vocab, self.hidden), self.table_dtype, name="table")
        scale = float(self.scale)
        if self.block:
            ids = te.placeholder((tirx.Var(SEQUENCES, "int32"),), "int32", name="anchors")
            mask = tirx.const(self.mask_token_id, "int32")

            def row_id(i: Any) -> Any:
                return tirx.if_then_else(tirx.floormod(i, self.block) == 0, ids[tirx.floordiv(i, self.block)], mask)
        else:
            ids = te.placeholder((rows,), "int32", name="ids")

            def row_id(i: Any) -> Any:
                return ids[i]

        def combine(values: list[Any]) -> Any:
            return values[0] if scale == 1.0 else values[0].astype("float32") * scale  # 1.0: an exact copy

        return rowwise_func(
            self.name,
            self.op,
            [ids, table],
            rows,
            self.hidden,
            [lambda i, j: table[row_id(i), j]],
            combine,
            self.out_dtype,
        )

    def node(self) -> Node:
        attrs = {"block": self.block, "mask_token_id": self.mask_token_id} if self.block else {}
        return Node.make(self.op, [TensorType(self.out_dtype, (ROWS, self.hidden))], scale=self.scale, **attrs)

    def reference(self, arrays: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        from dflash_compiler.ir import evaluate_node

        # Only the rows the ids name go to numpy: converting a 151936 x 4096 table to f32 takes seconds.
        ids = arrays["anchors" if self.block else "ids"]
        rows, index = np.unique(np.asarray(ids, np.int64), return_inverse=True)
        if self.block:  # the mask token's row too, after the anchors' (their indices are unchanged)
            rows = np.append(rows, self.mask_token_id)
        index = index.reshape(-1).astype(np.int32)
        # the node of the reduced table: the mask token is its last row
        node = Node.make(self.op, [TensorType(self.out_dtype, (ROWS, self.hidden))], scale=self.scale,
                         **({"block": self.block, "mask_token_id": len(rows) - 1} if self.block else {}))  # fmt: skip
        (y,) = evaluate_node(node, [index, arrays["table"][rows]])
        return {"y": np.asarray(y, np.float32)}

    def bytes_moved(self, sizes: Mapping[str, int]) -> int:
        """DRAM bytes of one call: the ids (anchors), the m table rows they name and the output (not the whole
        table)."""
        per_row = self.hidden * (ITEM_BYTES[self.table_dtype] + ITEM_BYTES[self.out_dtype])
        ids = sizes[SEQUENCES] if self.block else sizes[ROWS]
        return ITEM_BYTES["int32"] * ids + sizes[ROWS] * per_row

    def sample(self, rng: np.random.Generator, sizes: Mapping[str, int]) -> dict[str, np.ndarray]:
        rows = sizes[ROWS]
        if self.block:
            _check_rows("block_embed", sizes, self.block)
            # anchors differ from the mask id, so a swapped branch shows
            ids = {"anchors": (self.mask_token_id + 1 + rng.integers(0, self.vocab - 1, sizes[SEQUENCES],
                                                                     dtype=np.int32)) % self.vocab}  # fmt: skip
        else:
            ids = {"ids": rng.integers(0, self.vocab, rows, dtype=np.int32)}
        return {
            **ids,
            "table": _table_sample(rng, (self.vocab, self.hidden), self.table_dtype),
            "y": np.zeros((rows, self.hidden), numpy_dtype(self.out_dtype)),
        }


def _table_sample(rng: np.random.Generator, shape: tuple[int, int], dtype: str) -> np.ndarray:
    """Random table values; a real bf16 vocabulary table (151936 x 4096) is made from random bits in place.

    Sign and mantissa are random and the exponent fixed, so values lie in +-[1, 2): distinct enough that a
    wrong row or column shows, and 1.2 GB of bits instead of 5 GB of float64 normals.
    """
    if dtype != "bfloat16":
        return float_sample(rng, shape, dtype)
    count = shape[0] * shape[1]
    words = rng.integers(0, np.iinfo(np.uint64).max, -(-count // 4), dtype=np.uint64, endpoint=True)
    bits = words.view(np.uint16)[:count].reshape(shape)  # 64-bit draws: 4x faster than 16-bit ones
    bits &= 0x807F  # sign and mantissa
    bits |= 0x3F80  # exponent of 1.0
    return bits.view(numpy_dtype(dtype))


# ----------------------------------------------------------------------------------------- block_ids


@dataclass(frozen=True)
class BlockIdsSpec(KernelSpec):
    """`ids[s * block + k] = anchors[s] if k == 0 else mask_token_id` for `nb` sequences (m = nb * block)."""

    block: int
    mask_token_id: int
    name: str = ""

    def __post_init__(self) -> None:
        _check_ids("block_ids", self.block, self.mask_token_id)
        if not self.name:
            object.__setattr__(self, "name", f"block_ids_b{self.block}_mask{self.mask_token_id}")

    def params(self) -> tuple[Param, ...]:
        return (Param("anchors", "int32", (SEQUENCES,)), Param("ids", "int32", (ROWS,), "out"))

    def prim_func(self) -> Any:
        from tvm import te, tirx

        sequences, rows = tirx.Var(SEQUENCES, "int32"), tirx.Var(ROWS, "int32")
        anchors = te.placeholder((sequences,), "int32", name="anchors")
        block, mask = self.block, tirx.const(self.mask_token_id, "int32")
        ids = te.compute(
            (rows,),
            lambda r: tirx.if_then_else(tirx.floormod(r, block) == 0, anchors[tirx.floordiv(r, block)], mask),
            name="ids",
        )
        func = te.create_prim_func([anchors, ids])
        return func.with_attr("global_symbol", self.name).with_attr("dflash.op", Op.BLOCK_IDS.value)

    def reference(self, arrays: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        from dflash_compiler.ir import evaluate_node

        node = Node.make(
            Op.BLOCK_IDS, [TensorType("int32", (ROWS,))], block=self.block, mask_token_id=self.mask_token_id
        )
        (ids,) = evaluate_node(node, [arrays["anchors"]])
        return {"ids": ids}

    def sample(self, rng: np.random.Generator, sizes: Mapping[str, int]) -> dict[str, np.ndarray]:
        sequences = sizes[SEQUENCES]
        _check_rows("block_ids", sizes, self.block)
        # Anchors differ from the mask id so a swapped branch shows.
        anchors = rng.integers(0, max(self.mask_token_id, 2), sequences, dtype=np.int32)
        return {"anchors": anchors, "ids": np.full(sizes[ROWS], -1, np.int32)}


def schedule_block_ids(func: Any, threads: int) -> Any:
    """One thread per id: blocks of `threads` over the `m` ids (the last block predicated)."""
    from tvm import s_tir

    sch = s_tir.Schedule(func)
    (row,) = sch.get_loops(sch.get_sblock("ids"))
    outer, inner = sch.split(row, [None, threads])
    sch.bind(outer, "blockIdx.x")
    sch.bind(inner, "threadIdx.x")
    return sch.mod["main"].with_attr("tirx.is_scheduled", True)


# --------------------------------------------------------------------------------------- drop_anchor


@dataclass(frozen=True)
class DropAnchorSpec(KernelSpec):
    """`y = x.reshape(nb, block, H)[:, 1:].reshape(-1, H)`: x [m = nb*block, H] -> y [n = nb*(block-1), H]."""

    block: int
    hidden: int
    dtype: str = "bfloat16"
    out_dtype: str = "bfloat16"
    name: str = ""

    def __post_init__(self) -> None:
        _check_block("drop_anchor", self.block)
        if self.hidden <= 0:
            raise ScheduleError(f"drop_anchor: hidden size must be positive, found {self.hidden}")
        for dtype in (self.dtype, self.out_dtype):
            if dtype not in FLOAT_DTYPES:
                raise ScheduleError(f"drop_anchor: dtype {dtype} not supported; expected one of {FLOAT_DTYPES}")
        if not self.name:
            tag = dtype_tag(self.dtype, self.out_dtype)
            object.__setattr__(self, "name", f"drop_anchor_b{self.block}_h{self.hidden}{tag}")

    def params(self) -> tuple[Param, ...]:
        return (
            Param("x", self.dtype, (ROWS, self.hidden)),
            Param("y", self.out_dtype, (KEPT_ROWS, self.hidden), "out"),
        )

    def prim_func(self) -> Any:
        from tvm import te, tirx

        rows, kept = tirx.Var(ROWS, "int32"), tirx.Var(KEPT_ROWS, "int32")
        x = te.placeholder((rows, self.hidden), self.dtype, name="x")
        drafts = self.block - 1

        def tap(r: Any, j: Any) -> Any:  # sequence r // drafts, position r % drafts + 1 of its block
            return x[r + tirx.floordiv(r, drafts) + 1, j]

        return rowwise_func(self.name, Op.DROP_ANCHOR, [x], kept, self.hidden, [tap], lambda v: v[0], self.out_dtype)

    def reference(self, arrays: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        from dflash_compiler.ir import evaluate_node

        node = Node.make(Op.DROP_ANCHOR, [TensorType(self.out_dtype, (KEPT_ROWS, self.hidden))], block=self.block)
        (y,) = evaluate_node(node, [arrays["x"]])
        return {"y": np.asarray(y, np.float32)}

    def bytes_moved(self, sizes: Mapping[str, int]) -> int:
        """DRAM bytes of one call: the kept rows, read once and written once (anchor rows are not read)."""
        return sizes[KEPT_ROWS] * self.hidden * (ITEM_BYTES[self.dtype] + ITEM_BYTES[self.out_dtype])

    def sample(self, rng: np.random.Generator, sizes: Mapping[str, int]) -> dict[str, np.ndarray]:
        sequences, partial = divmod(sizes[ROWS], self.block)
        if partial or sizes[KEPT_ROWS] != sequences * (self.block - 1):
            raise ScheduleError(
                f"drop_anchor: m={sizes[ROWS]} and n={sizes[KEPT_ROWS]}, expected m = nb * {self.block} and "
                f"n = nb * {self.block - 1} for one nb. Fix: bind m = nb * block and n = nb * (block - 1)"
            )
        return {
            "x": float_sample(rng, (sizes[ROWS], self.hidden), self.dtype, 2.0),
            "y": np.zeros((sizes[KEPT_ROWS], self.hidden), numpy_dtype(self.out_dtype)),
        }


# ------------------------------------------------------------------------------------------- the rule

_SPECS = (EmbedSpec, BlockIdsSpec, DropAnchorSpec)


class EmbedRule(FamilyRule):
    """embed, block_embed, block_ids and drop_anchor nodes (bf16/f32 rows, int32 ids), or their specs.

    Knobs: `threads` per block (a multiple of the warp size) and `vector_bytes` per access (2, 4, 8, 16;
    block_ids writes one int32 per thread and ignores it).
    """

    name = "embed"
    knob_names = ("threads", "vector_bytes")

    def default_knobs(self, target: Target) -> dict[str, int]:
        # As elementwise: a quarter of the block limit keeps several blocks per row for 4096-wide rows.
        return {"threads": target.max_threads_per_block // 4, "vector_bytes": 16}

    def spec_of(self, subject: Any) -> KernelSpec | None:
        if isinstance(subject, _SPECS):
            return subject
        if not isinstance(subject, OpInstance):
            return None
        try:
            if subject.op in (Op.EMBED, Op.BLOCK_EMBED):
                return _embed_spec(subject)
            if subject.op is Op.BLOCK_IDS:
                return _block_ids_spec(subject)
            if subject.op is Op.DROP_ANCHOR:
                return _drop_anchor_spec(subject)
        except ScheduleError:
            return None  # sizes or dtypes this family does not implement
        return None

    def schedule(self, spec: KernelSpec, target: Target, knobs: Mapping[str, int]) -> Any:
        if isinstance(spec, BlockIdsSpec):
            check_knobs(self.name, target, knobs["threads"], knobs["vector_bytes"])
            return schedule_block_ids(spec.prim_func(), knobs["threads"])
        if isinstance(spec, EmbedSpec):
            dtypes, width = (spec.table_dtype, spec.out_dtype), spec.hidden
        elif isinstance(spec, DropAnchorSpec):
            dtypes, width = (spec.dtype, spec.out_dtype), spec.hidden
        else:
            raise ScheduleError(f"embed rule: cannot schedule a {type(spec).__name__}")
        threads, vector = launch_fit(self.name, target, knobs, width, dtypes, ())
        return schedule_rowwise(spec.prim_func(), threads, vector)


def _embed_spec(inst: OpInstance) -> EmbedSpec | None:
    if len(inst.inputs) != 2 or len(inst.outputs) != 1:
        return None
    ids, table = inst.inputs  # block_embed: the anchors
    (out,) = inst.outputs
    if ids.dtype != "int32" or len(ids.shape) != 1 or len(table.shape) != 2 or len(out.shape) != 2:
        return None
    vocab, hidden = table.shape
    block = inst.op is Op.BLOCK_EMBED
    if not isinstance(vocab, int) or not isinstance(hidden, int) or out.shape[1] != hidden:
        return None
    if not block and out.shape[0] != ids.shape[0]:
        return None
    ids_of = {"block": int(inst.attr("block")), "mask_token_id": int(inst.attr("mask_token_id"))} if block else {}
    return EmbedSpec(vocab=vocab, hidden=hidden, scale=float(inst.attr("scale")), table_dtype=table.dtype,
                     out_dtype=out.dtype, **ids_of)  # fmt: skip


def _block_ids_spec(inst: OpInstance) -> BlockIdsSpec | None:
    if len(inst.inputs) != 1 or len(inst.outputs) != 1:
        return None
    (anchors,), (out,) = inst.inputs, inst.outputs
    if anchors.dtype != "int32" or out.dtype != "int32" or len(anchors.shape) != 1 or len(out.shape) != 1:
        return None
    return BlockIdsSpec(block=int(inst.attr("block")), mask_token_id=int(inst.attr("mask_token_id")))


def _drop_anchor_spec(inst: OpInstance) -> DropAnchorSpec | None:
    if len(inst.inputs) != 1 or len(inst.outputs) != 1:
        return None
    (x,), (out,) = inst.inputs, inst.outputs
    if len(x.shape) != 2 or len(out.shape) != 2 or not isinstance(x.shape[1], int) or out.shape[1] != x.shape[1]:
        return None
    return DropAnchorSpec(block=int(inst.attr("block")), hidden=x.shape[1], dtype=x.dtype, out_dtype=out.dtype)
