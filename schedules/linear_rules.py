"""The linear rules: each turns a linear op (`linear.LinearSpec`) into a scheduled kernel, with the plans of
`linear_plans.py`.

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
from typing import Any

from dflash_compiler.ir.ops import Op
from dflash_compiler.targets import Target

from .base import FamilyRule, Kernel, ScheduleError
from .linear import ITEM_BYTES, LinearSpec, spec_of
from .linear_mma import MMA_ROWS, MmaPlan, mma_gemv_func, x_ring_bytes
from .linear_plans import (
    FEW_ROWS_KNOBS,
    HALF_TILE_ROWS,
    MID_KNOBS,
    MID_ROWS,
    MMA_RULE,
    TALL_KNOBS,
    TALL_ROWS,
    default_convert,
    few_rows_knobs,
    few_rows_wgmma_plan,
    fit_mma_plan,
    fit_tiled_plan,
    fit_wgmma_plan,
    gemm_knobs,
    mid_defaults,
    mma_fits,
    small_tiled_plan,
    tall_defaults,
    tall_wanted,
    tier_reduce,
    tiled_defaults,
    wgmma_defaults,
    wgmma_fits,
    wide_weight,
)
from .linear_tiled import TILED_KNOBS, TiledPlan
from .linear_wgmma import (
    SHARED_ROLES,
    WGMMA_KNOBS,
    WgmmaPlan,
)


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

    name = MMA_RULE
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
        * narrow FP8 weights: slots of 4 k steps (an FP8 k step is 64 wide), four warps along k, at the deepest
          of 8, 6, 4 and 3 slots whose 16-row call fits one wave (sm_90: down, fc and o_proj 8, qkv 6, ctx_kv
          3; GB10 4), else four. Four slots against GEMV mode: qkv 11.33 → 10.00, o_proj 9.40 → 7.53, down
          19.46 → 17.93 (dependent within ±0.4 µs of GEMV mode). Four slots held 32 KiB of e4m3 weight in flight
          per SM for down and fc (two blocks an SM), where by Little's law an SM needs ~45 KiB (3 TB/s ÷ 132
          SMs × ~2 µs loaded latency). The rule against four slots everywhere, with each step queued behind a
          host gate (bench/propose.py; H100, one run, the candidate between two copies of the four-slot build;
          µs over the calls' bytes at copy speed at nb = 1, timeline): down +15.9 → +6.5, fc +8.0 → +6.1,
          ctx_kv +5.9 → +2.1, gate_up after them +15.5 → +19.2; the span 737.2 / 737.4 → 727.9 µs and the FP8
          step 0.737 / 0.739 → 0.731 ms at nb = 1, 0.994 / 0.996 → 1.000 at nb = 4, 1.307 / 1.308 → 1.310 at
          nb = 8, 2.423 / 2.395 → 2.420 at nb = 16.
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
          step 0.739 / 0.749 → 0.742 / 0.750 ms (0.768 at eight): the host's submission of the graph, then inside
          the timed span, hid gains of this size (the gated run above resolves them).
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
        # the deepest ring whose 16-row call is one wave; where none is, the fallback (several waves either way)
        if spec.fp8:
            candidates, fallback = ((8, 4, 4), (6, 4, 4), (4, 4, 4), (3, 4, 4)), (4, 4, 4)
        else:
            candidates, fallback = ((3, 16, 8), (4, 8, 4)), (4, 8, 4)
        blocks = -(-spec.n // MMA_ROWS)
        for candidate in candidates:
            knobs = few_rows_knobs(*candidate)
            plan = small_tiled_plan(spec, target, knobs)
            if target.shared_memory_per_sm // plan.shared_bytes() * target.sm_count >= blocks:
                return knobs
        return few_rows_knobs(*fallback)

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
