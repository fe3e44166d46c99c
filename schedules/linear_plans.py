"""The linear kernels' plans: which kernel and shape each call of a weight takes on a target, from the
weight's shape and the target's record, and the fitting of knobs given (a tuning database's or the defaults) to
the spec. `linear_rules.py` turns the plans into kernels; the figures behind each default are in its docstring.
"""

from __future__ import annotations

from collections.abc import Mapping

from dflash_compiler.cluster import MAX_PORTABLE
from dflash_compiler.targets import Target

from .base import ScheduleError
from .linear import ITEM_BYTES, LinearSpec
from .linear_mma import MMA_ROWS, WARP, MmaPlan
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

MMA_RULE = "linear_mma"  # the rule whose knobs these plans fit (LinearMmaRule); their errors name it
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


def mma_step(spec: LinearSpec) -> int:
    """k elements per k step of the mma kernel: 4 threads × one 16-byte weight vector each."""
    return 4 * (16 // ITEM_BYTES[spec.weight_dtype])


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
        raise ScheduleError(f"{MMA_RULE}: no warpgroup GEMM shape fits {target.name}'s shared memory")
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
    rule = MMA_RULE
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
    rule = MMA_RULE
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
    rule = MMA_RULE
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
