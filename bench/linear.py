"""Linear-family benchmark: check and time the drafter's GEMVs on a GPU, against the copy bandwidth.

Two steps, because the build box has TVM and no GPU and the GPU box has no TVM:

    # build box: schedule + compile the linear kernels (Qwen3-8B-DFlash shapes, bf16 and FP8 weights)
    python bench/linear.py build -o build/linear [--sweep]
    # GPU box (numpy, ml_dtypes, pydantic, cuda-python)
    PYTHONPATH=. python bench/linear.py run build/linear [--log linear.log]

`run` first checks every (kernel, row count m) against the spec's numpy reference (a mismatch, judged by
schedules/check.py, fails the run), then times the timed ones in `--rounds` rounds: each round measures the
device-to-device copy bandwidth and times every case once (the median µs per call of `--repeats` graph
replays), round-robin, so drift of clocks and temperature falls on all variants alike. Per case it prints
the median over rounds, the min and max across rounds and their spread ((max - min) / median), the bytes
the call must move (weight + scale + x + y) as GB/s and as % of the median copy bandwidth (bytes read +
written), and the largest error. Every timed launch reads another copy of the weight, with enough copies
to exceed the L2 several times over, so the figure is a DRAM stream as in the model, where every layer's
weight is distinct; all groups' copies stay in device memory for the rounds. `--dependent-launch` launches
them as the drafter does (dependent_launch.py): each call's weight stream starts while the previous call
drains. `--sweep` adds knob variants of the big shapes to pick per-target defaults from, named
`<kernel>__w<warps>r<row_tiles>u<unroll>m<m_tile>s<stages>` (plus `x<x_stages>n<n_warps>` in GEMM mode); `--small`
and `--fp8` add variants of the small bf16 weights and of the FP8 weights at one or two draft blocks. `--gemm`
builds instead the tiled GEMM that takes calls above gemm_rows rows (linear_tiled.py), default and variants
named `<kernel>__t<n_warps>x<m_warps>t<n_tiles>x<m_tiles>s<stages>k<k_splits>x<k_steps>[w<k_warps>]`
(`--gemm-variant`, repeated, picks them; `--shapes` the weights), and on sm_90 the warpgroup
GEMM (linear_wgmma.py), variants named
`<kernel>__g<warpgroups>n<block_m>s<stages>a<k_atoms>k<k_splits>[q<mma_groups>[r<k_reduce>[p<roles>[c<convert>]]]]`
(`--wgmma-variant`), and with `--mid-rows R` each weight with its calls up to R rows on a second one of R-row
x tiles (`<kernel>__mid<R>`), against GEMV mode alone and linear_mma's x-ring GEMM mode at 16-256 rows (1-16
sequences of 16 block rows; `--wgmma-only` leaves those two and the tiled GEMM out), plus correctness cases
of odd shapes.
`--few-rows` builds instead the kernel of calls of at most gemm_rows rows at 1-32 rows: the default (the small
tiled kernel for bf16 weights), GEMV mode, and variants named
`<kernel>__s<gemv_tiled_stages>x<gemv_tiled_k_steps>k<gemv_tiled_k_warps>[n<gemv_tiled_n_tiles>]`
(`--few-variant S,K,W[,N]`, repeated, picks them; `--shapes` the weights):

    python bench/linear.py build --gemm -o build/linear_gemm
    PYTHONPATH=. python bench/linear.py run build/linear_gemm --json build/linear_gemm/results.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import numpy as np  # noqa: E402 - after the path setup, like the other bench scripts

from dflash_compiler.schedules.linear import BF16, FP8, LinearSpec  # noqa: E402

# Qwen3-8B-DFlash-b16 linears (n, k): block-row layers, context layers and the target's lm_head.
SHAPES: dict[str, tuple[str, int, int]] = {
    "qkv": ("matmul", 6144, 4096),
    "o_proj": ("matmul", 4096, 4096),
    "gate_up": ("matmul", 24576, 4096),
    "down": ("matmul", 4096, 12288),
    "fc": ("matmul", 4096, 20480),
    "ctx_kv": ("matmul", 10240, 4096),
    "lm_head": ("lm_head", 151936, 4096),
}
BLOCK_ROWS = (1, 8, 16, 32, 64, 128)
CONTEXT_ROWS = (7, 512)  # fc and ctx_kv also run on context rows: 7 per step, up to 512 at prefill
SWEEP_SHAPES = ("qkv", "o_proj", "gate_up", "down", "fc", "lm_head")
SWEEP_ROWS = (16, 32, 64)
# (warps, row_tiles, unroll, m_tile, stages) around the default (4, 1, 4, 16, 2)
SWEEP_KNOBS = (
    (8, 1, 4, 16, 1), (8, 1, 2, 16, 2), (8, 1, 8, 16, 1), (16, 1, 2, 16, 2), (16, 1, 4, 16, 1),
    (16, 1, 4, 16, 2), (4, 1, 8, 16, 2), (8, 2, 2, 16, 2), (16, 2, 2, 16, 1), (8, 1, 4, 16, 2),
    (8, 1, 2, 32, 2), (8, 1, 4, 32, 1), (8, 1, 2, 64, 1), (4, 1, 2, 64, 2), (16, 1, 2, 32, 2),
)  # fmt: skip
# --small: variants for the weights that fill the H200 in less than one wave of the default blocks (qkv,
# o_proj, ctx_kv) and the borderline ones, around the default (4, 1, 4, 16, 2): more warps per block split k
# finer (more loads in flight at once), a shorter unroll shortens each warp's serial chain
SMALL_SHAPES = ("qkv", "o_proj", "ctx_kv", "down", "gate_up", "fc")
SMALL_KNOBS = (
    (4, 1, 2, 16, 2), (4, 1, 1, 16, 2), (8, 1, 1, 16, 2), (8, 1, 2, 16, 2), (8, 1, 4, 16, 2), (16, 1, 1, 16, 2),
    (16, 1, 2, 16, 2), (2, 1, 2, 16, 2), (2, 2, 2, 16, 2), (4, 2, 2, 16, 2), (8, 2, 1, 16, 2),
)  # fmt: skip
# --fp8: FP8-weight variants at one and two draft blocks, around the FP8 default (8, 1, 4, 16, 1): fewer warps
# with a second stage, two row tiles (x fragments serve 32 weight rows), shorter and longer unrolls, and the
# GEMM mode with n warps sharing x from shared memory (x out of the registers, the weight double-buffered)
FP8_SHAPES = ("qkv", "o_proj", "gate_up", "down", "lm_head")
FP8_ROWS = (16, 32)
FP8_KNOBS = (
    (4, 1, 4, 16, 1), (4, 1, 2, 16, 2), (8, 1, 2, 16, 2), (16, 1, 2, 16, 1), (16, 1, 4, 16, 1), (8, 1, 8, 16, 1),
    (8, 2, 2, 16, 1), (4, 2, 2, 16, 1), (4, 2, 1, 16, 2), (2, 1, 4, 16, 2, 3, 4), (4, 1, 4, 16, 2, 3, 2),
    (1, 1, 4, 16, 2, 3, 4), (2, 1, 4, 32, 2, 3, 4),
)  # fmt: skip
# Small and odd shapes: the mma path with ragged rows and short k, and the SIMT fallback (correctness only).
ODD: tuple[tuple[str, str, int, int, str], ...] = (
    ("mma", "matmul", 8, 64, BF16),
    ("mma", "matmul", 16, 64, BF16),
    ("mma", "matmul", 192, 64, BF16),
    ("mma", "matmul", 200, 96, BF16),
    ("mma", "lm_head", 384, 64, BF16),
    ("mma", "matmul_fp8", 72, 128, FP8),
    ("mma", "lm_head", 512, 64, FP8),
    ("gemv", "matmul", 8, 100, BF16),
    ("gemv", "matmul", 13, 1001, BF16),
    ("gemv", "matmul_fp8", 192, 96, FP8),
    ("gemv", "lm_head", 384, 64, BF16),
    ("gemv", "matmul", 4096, 4096, BF16),
)
ODD_ROWS = (1, 7, 16, 33)
# --gemm (instead of the above): the tiled GEMM kernel (linear_tiled.py) that takes calls above gemm_rows rows,
# default and variants of (n_warps, m_warps, n_tiles, m_tiles, stages, k_splits, k_steps), against GEMV mode alone and
# GEMM mode through linear_mma's x ring (x_stages), at 1-16 sequences of 16 block rows
GEMM_SHAPES = ("qkv", "o_proj", "gate_up", "down", "lm_head")
GEMM_ROWS = (16, 64, 128, 256)
TILED_VARIANTS = (
    (2, 2, 4, 8, 4, 1, 1),
    (2, 2, 2, 8, 4, 1, 1),
    (2, 2, 4, 8, 4, 8, 1),
    (2, 2, 2, 8, 4, 4, 1),
    (2, 2, 2, 8, 3, 1, 2),
    (2, 2, 4, 8, 3, 1, 2),
    (2, 2, 4, 8, 3, 8, 2),
    (2, 2, 2, 8, 4, 1, 2),
)
RING_KNOBS = ((1, 1, 4, 128, 2, 3, 4), (4, 1, 4, 128, 2, 3, 2))  # linear_mma's GEMM mode, as KNOB_NAMES
# tiled-GEMM correctness (not timed): ragged n, rows of x past m in the last tile, k splits, FP8's swizzled x,
# one and two warps per block, a two-slot pipeline, slots of two and three k steps (swizzled rows)
GEMM_ODD = (("matmul", 200, 96, BF16), ("lm_head", 384, 256, BF16), ("matmul_fp8", 72, 128, FP8),
            ("lm_head", 520, 256, FP8))  # fmt: skip
GEMM_ODD_VARIANTS = ((2, 2, 4, 8, 4, 1, 2), (1, 1, 2, 4, 2, 3, 1), (2, 1, 1, 8, 3, 2, 2), (1, 2, 4, 2, 4, 1, 4))
GEMM_ODD_ROWS = (33, 70, 130, 300)
# the warpgroup GEMM (linear_wgmma.py, on sm_90a): (warpgroups, block_m, stages, k_atoms, k_splits[, mma_groups
# [, k_reduce[, roles[, convert]]]]) variants with --gemm (--wgmma-variant replaces them), and its correctness
# cases: ragged n (one not a multiple of 4), rows of x past m, k splits (through a merge kernel, added in a
# cluster: k_reduce 2, 2 to 8 splits, and by a tile's last block: k_reduce 3), slots of two atoms, one to three
# warpgroups, 40-, 64- and 256-row x tiles, a producer warp (roles 2) with one or two groups in flight, two to
# four slots, fewer slots than a split has and more, and e4m3 weights converted into a shared bf16 tile
# (convert 1; their default converts into register fragments), built for e4m3 weights only: bf16 ones have
# nothing to convert
WGMMA_VARIANTS = ((2, 128, 3, 1, 1), (2, 128, 4, 1, 1), (1, 128, 4, 1, 1), (2, 256, 3, 1, 1), (2, 128, 3, 1, 2))
WGMMA_ODD = (("matmul", 200, 256, BF16), ("lm_head", 384, 512, BF16), ("matmul_fp8", 200, 256, FP8),
             ("lm_head", 384, 512, FP8), ("matmul_fp8", 202, 256, FP8))  # fmt: skip
WGMMA_ODD_VARIANTS = ((1, 128, 2, 1, 1), (2, 64, 3, 2, 2), (2, 256, 2, 1, 4), (1, 40, 3, 2, 1), (3, 128, 3, 1, 1, 2),
                      (1, 64, 4, 2, 2, 2), (2, 64, 3, 2, 2, 1, 2), (1, 40, 3, 1, 4, 2, 2), (3, 128, 3, 1, 8, 1, 2),
                      (2, 256, 2, 1, 4, 1, 2), (1, 40, 3, 2, 1, 1, 1, 2), (2, 64, 3, 2, 2, 2, 1, 2),
                      (3, 128, 4, 1, 1, 2, 1, 2), (1, 128, 2, 1, 4, 1, 1, 2), (2, 256, 3, 1, 2, 1, 1, 2),
                      (1, 128, 2, 1, 1, 1, 1, 1, 1), (2, 64, 3, 2, 2, 2, 1, 1, 1), (1, 40, 3, 1, 1, 2, 1, 1, 1),
                      (3, 128, 3, 1, 1, 2, 1, 1, 1), (1, 256, 3, 1, 4, 2, 1, 1, 1), (2, 64, 3, 1, 4, 2, 2, 1, 1),
                      (1, 40, 3, 2, 2, 2, 1, 2, 1), (2, 128, 3, 1, 2, 1, 1, 2, 1),
                      (2, 64, 3, 2, 2, 2, 3), (1, 40, 3, 1, 4, 2, 3), (3, 128, 3, 1, 4, 1, 3), (2, 256, 2, 1, 2, 1, 3),
                      (1, 128, 3, 1, 4, 2, 3, 1, 1))  # fmt: skip
# --few-rows (instead of the above): the kernel for calls of at most gemm_rows rows, the small tiled kernel
# (default for bf16) against GEMV mode, with variants of its knobs for both dtypes
FEW_SHAPES = ("qkv", "o_proj", "gate_up", "down", "lm_head")
FEW_ROWS = (1, 8, 16, 32)
# (gemv_tiled_stages, gemv_tiled_k_steps, gemv_tiled_k_warps[, gemv_tiled_n_tiles]); --few-variant replaces them
FEW_VARIANTS = ((4, 8, 1), (3, 8, 1), (4, 4, 1), (4, 8, 4), (4, 4, 4), (3, 16, 8), (3, 16, 4), (2, 16, 4))
FEW_ODD = (("matmul", 200, 96, BF16), ("lm_head", 384, 256, BF16), ("matmul_fp8", 72, 128, FP8))
KNOB_NAMES = ("warps", "row_tiles", "unroll", "m_tile", "stages", "x_stages", "n_warps")
FILES = ("kernels.cubin", "kernels.cu", "table.json", "entries.json")


# ------------------------------------------------------------------------------------------ build side


def _knob_values(counts: tuple[int, ...], example: str) -> Callable[[str], tuple[int, ...]]:
    """An argparse type: comma-separated integers, as many as one of `counts`."""

    def parse(text: str) -> tuple[int, ...]:
        try:
            values = tuple(int(v) for v in text.split(","))
        except ValueError:
            values = ()
        if len(values) not in counts:
            raise argparse.ArgumentTypeError(
                f"expected {' or '.join(map(str, counts))} comma-separated integers such as {example}, found {text!r}"
            )
        return values

    return parse


def _spec_fields(spec: LinearSpec) -> dict[str, Any]:
    return {"op": spec.op, "n": spec.n, "k": spec.k, "weight_dtype": spec.weight_dtype,
            "out_dtype": spec.out_dtype, "name": spec.name}  # fmt: skip


def build(args: argparse.Namespace) -> None:
    import tvm

    from dflash_compiler.codegen import lower_to_cuda
    from dflash_compiler.nvrtc import compile_cubin
    from dflash_compiler.schedules.base import ScheduleError
    from dflash_compiler.schedules.linear_plans import few_rows_knobs
    from dflash_compiler.schedules.linear_rules import LinearGemvRule, LinearMmaRule
    from dflash_compiler.schedules.linear_tiled import TILED_KNOBS
    from dflash_compiler.schedules.linear_wgmma import WGMMA_KNOBS
    from dflash_compiler.targets import get_target

    target = get_target(args.target)
    mma, gemv = LinearMmaRule(), LinearGemvRule()
    entries: list[dict[str, Any]] = []
    funcs: dict[str, Any] = {}

    def add(label: str, spec: LinearSpec, rule: Any, rows: Iterable[int], knobs: dict[str, int] | None = None,
            timed: bool = True) -> None:  # fmt: skip
        kernel = rule.apply(spec, target, knobs)
        if kernel is None:
            raise SystemExit(f"{rule.name} declined {spec.name}")
        funcs[kernel.name] = kernel.func
        entries.append({"label": label, "spec": _spec_fields(spec), "rule": kernel.rule, "knobs": dict(kernel.knobs),
                        "rows": list(rows), "timed": timed})  # fmt: skip

    def add_variant(label: str, spec: LinearSpec, tag: str, rows: Iterable[int], knobs: dict[str, int],
                    timed: bool = True) -> None:  # fmt: skip
        """`spec` under `knobs` as kernel `<name>__<tag>`, labelled `<label> <tag>`; knobs that do not fit
        the target are reported and skipped."""
        variant = LinearSpec(spec.op, spec.n, spec.k, spec.weight_dtype, name=f"{spec.name}__{tag}")
        try:
            add(f"{label} {tag}", variant, mma, rows, knobs, timed)
        except ScheduleError as exc:
            print(f"skip {variant.name}: {exc}")

    def add_variants(label: str, spec: LinearSpec, knob_sets: Iterable[tuple[int, ...]], rows: Iterable[int],
                     timed: bool = True) -> None:  # fmt: skip
        for values in knob_sets:
            tag = "".join(f"{c}{v}" for c, v in zip("wrumsxn", values, strict=False))
            add_variant(label, spec, tag, rows, dict(zip(KNOB_NAMES, values, strict=False)), timed)

    def linear(label: str, wdtype: str) -> tuple[str, LinearSpec]:
        op, n, k = SHAPES[label]
        op_w = "matmul_fp8" if (op == "matmul" and wdtype == FP8) else op
        return f"{label}{'_fp8' if wdtype == FP8 else ''}", LinearSpec(op=op_w, n=n, k=k, weight_dtype=wdtype)

    def add_tiled(label: str, spec: LinearSpec, variants: Iterable[tuple[int, ...]], rows: Iterable[int],
                  timed: bool = True) -> None:  # fmt: skip
        for values in variants:
            knobs = {"gemm_rows": 32, **{f"gemm_{key}": v for key, v in zip(TILED_KNOBS, values, strict=False)}}
            tag = "t{}x{}t{}x{}s{}k{}x{}".format(*values) + ("w{}".format(*values[7:]) if len(values) > 7 else "")
            add_variant(label, spec, tag, rows, {**knobs, "gemm_wgmma": 0}, timed)

    def add_wgmma(label: str, spec: LinearSpec, variants: Iterable[tuple[int, ...]], rows: Iterable[int],
                  timed: bool = True) -> None:  # fmt: skip
        for values in variants:
            if values[8:] and spec.weight_dtype != FP8:
                continue
            knobs = {
                "gemm_rows": 32,
                "gemm_wgmma": 1,
                **{f"wgmma_{key}": v for key, v in zip(WGMMA_KNOBS, values, strict=False)},
            }
            # mma_groups, k_reduce, roles, convert
            extra = "".join(f"{c}{v}" for c, v in zip("qrpc", values[5:], strict=False))
            tag = "g{}n{}s{}a{}k{}".format(*values) + extra
            add_variant(label, spec, tag, rows, knobs, timed)

    if args.gemm:
        for label in args.shapes or GEMM_SHAPES:
            for wdtype in (BF16, FP8):
                name, spec = linear(label, wdtype)
                add(name, spec, mma, GEMM_ROWS)
                if not args.wgmma_only:
                    add_variant(name, spec, "gemv", GEMM_ROWS[1:], {"gemm_rows": 0})
                    add_variants(name, spec, RING_KNOBS, GEMM_ROWS[1:])
                    add_tiled(name, spec, args.gemm_variant or TILED_VARIANTS, GEMM_ROWS[1:])
                add_wgmma(name, spec, args.wgmma_variant or WGMMA_VARIANTS, GEMM_ROWS[1:])
                if args.mid_rows:
                    add_variant(name, spec, f"mid{args.mid_rows}", GEMM_ROWS[1:], {"mid_rows": args.mid_rows})
        for op, n, k, wdtype in GEMM_ODD:
            add_tiled(f"odd {op} {n}x{k}", LinearSpec(op, n, k, wdtype), GEMM_ODD_VARIANTS, GEMM_ODD_ROWS, False)
        for op, n, k, wdtype in WGMMA_ODD:
            add_wgmma(f"odd {op} {n}x{k}", LinearSpec(op, n, k, wdtype), WGMMA_ODD_VARIANTS, GEMM_ODD_ROWS, False)
            if args.mid_rows:  # the calls up to mid_rows rows on their own GEMM, and the ones just above it
                rows = (33, 40, args.mid_rows, args.mid_rows + 1, 130)
                add_variant(f"odd {op} {n}x{k}", LinearSpec(op, n, k, wdtype), f"mid{args.mid_rows}", rows,
                            {"mid_rows": args.mid_rows}, False)  # fmt: skip
        shapes, odd = (), ()
    elif args.few_rows:
        for label in args.shapes or FEW_SHAPES:
            for wdtype in (BF16, FP8):
                name, spec = linear(label, wdtype)
                add(name, spec, mma, FEW_ROWS)
                add_variant(name, spec, "gemv", FEW_ROWS, {"gemv_tiled_stages": 0})
                for values in args.few_variant or FEW_VARIANTS:
                    tag = "s{}x{}k{}".format(*values) + ("n{}".format(*values[3:]) if len(values) > 3 else "")
                    add_variant(name, spec, tag, FEW_ROWS, few_rows_knobs(*values))
        for op, n, k, wdtype in FEW_ODD:  # ragged n, rows past m, FP8 weights through the small tiled kernel
            add_variant(f"odd {op} {n}x{k}", LinearSpec(op, n, k, wdtype), "few", (1, 7, 16, 32),
                        {"gemv_tiled_stages": 3}, False)  # fmt: skip
            # warps along k where the slot's k steps allow two
            add_variant(f"odd {op} {n}x{k}", LinearSpec(op, n, k, wdtype), "few_k2", (1, 7, 16, 32),
                        {"gemv_tiled_stages": 3, "gemv_tiled_k_warps": 2}, False)  # fmt: skip
            # two weight tiles per block sharing each x tile (a ragged last block where n is not a multiple of 32)
            add_variant(f"odd {op} {n}x{k}", LinearSpec(op, n, k, wdtype), "few_n2", (1, 7, 16, 32),
                        {"gemv_tiled_stages": 3, "gemv_tiled_n_tiles": 2}, False)  # fmt: skip
        shapes, odd = (), ()
    else:
        shapes, odd = SHAPES, ODD
    for label in shapes:
        rows = BLOCK_ROWS + (CONTEXT_ROWS if label in ("fc", "ctx_kv") else ())
        for wdtype in (BF16, FP8):
            name, spec = linear(label, wdtype)
            add(name, spec, mma, rows)
            if args.sweep and label in SWEEP_SHAPES:
                add_variants(name, spec, SWEEP_KNOBS, SWEEP_ROWS)
            if args.small and label in SMALL_SHAPES and wdtype == BF16:
                add_variants(name, spec, SMALL_KNOBS, (1, 16))
            if args.fp8 and label in FP8_SHAPES and wdtype == FP8:
                add_variants(name, spec, FP8_KNOBS, FP8_ROWS)
    for path, op, n, k, wdtype in odd:
        spec = LinearSpec(op=op, n=n, k=k, weight_dtype=wdtype)
        rule = mma if path == "mma" else gemv
        if path == "gemv":
            spec = LinearSpec(op=op, n=n, k=k, weight_dtype=wdtype, name=f"{spec.name}__simt")
        add(f"odd {path} {op} {n}x{k}", spec, rule, ODD_ROWS, timed=(n, k) == (4096, 4096))

    t0 = time.time()
    cuda = lower_to_cuda(tvm.IRModule(funcs), target)
    t1 = time.time()
    cubin = compile_cubin(cuda.source, target.arch)
    t2 = time.time()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "kernels.cubin").write_bytes(cubin)
    (out / "kernels.cu").write_text(cuda.source)
    table = {name: fn.model_dump(mode="json") for name, fn in cuda.functions.items()}
    (out / "table.json").write_text(json.dumps({"arch": target.arch, "functions": table}, indent=1))
    (out / "entries.json").write_text(json.dumps(entries, indent=1))
    print(f"{len(funcs)} kernels for {target.arch}: codegen {t1 - t0:.1f} s, NVRTC {t2 - t1:.1f} s, "
          f"cubin {len(cubin)} B -> {out}")  # fmt: skip


# -------------------------------------------------------------------------------------------- GPU side


class Log:
    """Print every line and append it to the --log file as it goes (a timed-out run keeps its lines)."""

    def __init__(self, path: str | None) -> None:
        self.path = Path(path) if path else None
        if self.path:
            self.path.write_text("")

    def __call__(self, line: str = "") -> None:
        print(line, flush=True)
        if self.path:
            with self.path.open("a") as f:
                f.write(line + "\n")


def _time(record: Callable[[Any], None], launches: int, repeats: int) -> list[float]:
    """µs per launch: `record` (`launches` kernel launches) captured in a CUDA graph, replayed `repeats` times."""
    from dflash_compiler.runtime.cuda import CudaGraph, EventTimer, Stream

    stream = Stream()
    graph = CudaGraph(stream, record)
    try:
        graph.launch(stream)  # warm-up
        samples = []
        for _ in range(repeats):
            with EventTimer(stream.handle) as timer:
                graph.launch(stream)
            samples.append(timer.elapsed_ms() * 1e3 / launches)
        return samples
    finally:
        stream.synchronize()
        graph.destroy()
        stream.destroy()


@dataclass
class Case:
    """One (entry, m): its check against numpy and, when timed, its launches and one µs figure per round."""

    entry: dict[str, Any]
    spec: LinearSpec
    m: int
    err: float
    problems: list[str]
    record: Callable[[Any], None] | None = None  # None: checked, not timed
    launches: int = 0
    us: list[float] = field(default_factory=list)


class Bench:
    """The GPU side: one loaded cubin, every group's buffers (kept until `close`), the checked cases."""

    def __init__(self, bundle: Path, repeats: int, log: Log, dependent_launch: bool) -> None:
        from cuda.bindings import driver as cu

        from dflash_compiler.codegen import HostFunction
        from dflash_compiler.runtime.cuda import Device, Module, check

        missing = [f for f in FILES if not (bundle / f).is_file()]
        if missing:
            raise SystemExit(f"{bundle}: not a linear bench bundle, missing {', '.join(missing)}; run `build` first")
        table = json.loads((bundle / "table.json").read_text())
        self.functions = {name: HostFunction.model_validate(fn) for name, fn in table["functions"].items()}
        self.device = Device()
        self.module = Module((bundle / "kernels.cubin").read_bytes(), dependent_launch=dependent_launch)
        attr = cu.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_L2_CACHE_SIZE
        self.l2 = int(check(cu.cuDeviceGetAttribute(attr, self.device.handle), "cuDeviceGetAttribute(L2)"))
        self.repeats, self.log = repeats, log
        self.cases: list[Case] = []
        self.copy_bw: list[float] = []  # one figure per round
        self.buffers: list[int] = []
        log(f"device: {self.device.name} (cc {self.device.compute_capability}), L2 {self.l2 >> 20} MiB, "
            f"cubin {table['arch']}, {'dependent' if dependent_launch else 'plain'} launches")  # fmt: skip

    def group(self, base: LinearSpec, members: list[dict[str, Any]], rng: np.random.Generator) -> None:
        """Check every entry computing `base`: one sample at the largest m (rows are independent, so the first
        m rows of x give the first m rows of the reference) and one set of weight copies in device memory,
        kept for the timing rounds."""
        from cuda.bindings import driver as cu

        from dflash_compiler.runtime.cuda import check

        device = self.device
        t0 = time.time()
        arrays = base.sample(rng, {"m": max(max(e["rows"]) for e in members)})
        ref = base.reference(arrays)["y"]
        t_ref = time.time() - t0
        w_bytes = arrays["w"].nbytes
        # enough weight copies that a replay never finds the previous read of the same copy in L2
        copies = max(1, -(-4 * self.l2 // w_bytes)) if any(e["timed"] for e in members) else 1
        ptr = {"x": device.upload(arrays["x"]), "y": device.alloc(arrays["y"].nbytes)}
        if base.fp8:
            ptr["scale"] = device.upload(arrays["scale"])
        weights = [device.upload(arrays["w"])]
        for _ in range(copies - 1):
            weights.append(device.alloc(w_bytes))
            device.copy(weights[-1], weights[0], w_bytes)
        self.buffers += [*ptr.values(), *weights]
        device.synchronize()
        for e in members:
            for m in e["rows"]:
                check(cu.cuMemsetD8(ptr["y"], 0xFF, arrays["y"].nbytes), "cuMemsetD8")  # NaN where unwritten
                self.check(e, m, ptr, weights, ref[:m], arrays["y"].dtype)
        self.log(f"# {base.op} {base.n}x{base.k} {base.weight_dtype}: sample+reference {t_ref:.1f} s, "
                 f"{copies} weight copies")  # fmt: skip

    def check(self, e: dict[str, Any], m: int, ptr: dict[str, int], weights: list[int], ref: np.ndarray,
              out_type: Any) -> None:  # fmt: skip
        from dflash_compiler.plans import dtype_bytes
        from dflash_compiler.runtime.expr import evaluate
        from dflash_compiler.schedules.check import max_relative_error, mismatches

        spec = LinearSpec(**e["spec"])
        env = {"m": m}
        function = self.functions[spec.name]
        launches = function.launches(env)  # GEMV or GEMM mode by m; a k-split GEMM adds its merge kernel
        pointers = dict(ptr)
        for ws in function.workspaces:  # allocated per case; kept (with the weights) until close()
            count = int(np.prod([evaluate(d, env) for d in ws.shape]))
            pointers[ws.name] = self.device.alloc(count * dtype_bytes(ws.dtype))
            self.buffers.append(pointers[ws.name])

        def call(w_ptr: int, stream: Any = 0) -> None:
            for launch in launches:
                self.module.launch(launch, {**pointers, "w": w_ptr}, env, stream)

        call(weights[0])
        self.device.synchronize()
        got = {"y": self.device.download(ptr["y"], (m, spec.n), out_type)}
        case = Case(e, spec, m, max_relative_error(spec, got, {"y": ref}), mismatches(spec, got, {"y": ref}))
        if case.problems:
            self.log(f"{e['label']:30s} {m:4d} MISMATCH {case.problems[0]}")
        if e["timed"]:
            per = max(1, -(-16 // len(weights)))  # at least 16 launches per replay

            def record(stream: Any) -> None:
                for _ in range(per):
                    for w_ptr in weights:
                        call(w_ptr, stream)

            case.record, case.launches = record, per * len(weights)
        self.cases.append(case)

    def measure(self, rounds: int) -> None:
        """`rounds` rounds; each measures the copy bandwidth and then times every timed case once, in bundle
        order (reversed every other round), so drift of clocks and temperature falls on all cases alike."""
        from dflash_compiler.kernel_check import copy_bandwidth

        timed = [c for c in self.cases if c.record is not None]
        for r in range(rounds):
            t0 = time.time()
            self.copy_bw.append(copy_bandwidth(self.device))
            for c in timed if r % 2 == 0 else reversed(timed):
                c.us.append(statistics.median(_time(c.record, c.launches, self.repeats)))
            self.log(f"# round {r + 1}/{rounds}: copy {self.copy_bw[-1] / 1e9:.0f} GB/s, {len(timed)} cases, "
                     f"{time.time() - t0:.1f} s")  # fmt: skip

    def report(self) -> list[dict[str, Any]]:
        """The table (median over rounds, min and max, spread = (max - min) / median) and the JSON rows."""
        copy_bw = statistics.median(self.copy_bw) if self.copy_bw else float("nan")
        self.log(f"copy bandwidth (D2D 1 GiB, read + write), median of {len(self.copy_bw)} rounds: "
                 f"{copy_bw / 1e9:.0f} GB/s")  # fmt: skip
        self.log(f"{'kernel':30s} {'m':>4s} {'us':>9s} {'min':>9s} {'max':>9s} {'spr%':>5s} {'GB/s':>7s} "
                 f"{'%copy':>6s} {'err':>8s}  knobs")  # fmt: skip
        rows = []
        for c in self.cases:
            us = statistics.median(c.us) if c.us else float("nan")
            lo, hi = (min(c.us), max(c.us)) if c.us else (float("nan"), float("nan"))
            spread = 100 * (hi - lo) / us
            gbps = c.spec.bytes_moved({"m": c.m}) / (us * 1e-6) / 1e9
            pct = 100 * gbps * 1e9 / copy_bw
            knobs = ",".join(f"{k}={v}" for k, v in c.entry["knobs"].items())
            status = "" if not c.problems else "  MISMATCH " + c.problems[0]
            self.log(f"{c.entry['label']:30s} {c.m:4d} {us:9.2f} {lo:9.2f} {hi:9.2f} {spread:5.1f} {gbps:7.0f} "
                     f"{pct:6.1f} {c.err:8.1e}  {knobs}{status}")  # fmt: skip
            rows.append({"label": c.entry["label"], "kernel": c.spec.name, "m": c.m, "us": us, "us_min": lo,
                         "us_max": hi, "spread_pct": spread, "us_rounds": c.us, "gbps": gbps, "pct_copy": pct,
                         "max_rel_err": c.err, "ok": not c.problems, "knobs": c.entry["knobs"]})  # fmt: skip
        return rows

    def close(self) -> None:
        for p in self.buffers:
            self.device.free(p)
        self.buffers = []


def run(args: argparse.Namespace) -> int:
    log = Log(args.log)
    bundle = Path(args.bundle)
    bench = Bench(bundle, args.repeats, log, args.dependent_launch)
    entries = json.loads((bundle / "entries.json").read_text())
    if args.only:
        entries = [e for e in entries if any(o in e["label"] for o in args.only)]
    groups: dict[tuple[Any, ...], list[dict[str, Any]]] = {}
    for e in entries:
        s = e["spec"]
        groups.setdefault((s["op"], s["n"], s["k"], s["weight_dtype"], s["out_dtype"]), []).append(e)
    rng = np.random.default_rng(0)
    try:
        for (op, n, k, wdtype, out_dtype), members in groups.items():
            bench.group(LinearSpec(op=op, n=n, k=k, weight_dtype=wdtype, out_dtype=out_dtype), members, rng)
        bench.measure(args.rounds)
    finally:
        bench.close()
    rows = bench.report()
    failed = sum(not r["ok"] for r in rows)
    log(f"{len(rows) - failed}/{len(rows)} checks match numpy")
    if args.json:
        payload = {"device": bench.device.name, "rounds": args.rounds,
                   "copy_gbps": statistics.median(bench.copy_bw) / 1e9 if bench.copy_bw else float("nan"),
                   "copy_gbps_rounds": [bw / 1e9 for bw in bench.copy_bw], "results": rows}  # fmt: skip
        Path(args.json).write_text(json.dumps(payload, indent=1))
    return 1 if failed else 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    b = sub.add_parser("build", help="build box: schedule + compile the linear kernels")
    b.add_argument("--target", default="sm_90")
    b.add_argument("--sweep", action="store_true", help="add knob variants of the big shapes")
    b.add_argument("--small", action="store_true", help="add warps/unroll variants of the block-row layers")
    b.add_argument("--fp8", action="store_true", help="add knob variants of the FP8-weight linears at 16-32 rows")
    b.add_argument("--gemm", action="store_true", help="only the tiled GEMM's variants vs GEMV mode at 16-256 rows")
    b.add_argument(
        "--few-rows",
        action="store_true",
        help="only the kernel for calls of at most gemm_rows rows: small tiled vs GEMV mode at 1-32 rows",
    )
    b.add_argument(
        "--shapes",
        nargs="*",
        choices=FEW_SHAPES,
        default=(),
        help="with --few-rows or --gemm: only these weights (default: all of them)",
    )
    b.add_argument(
        "--few-variant",
        action="append",
        type=_knob_values((3, 4), "3,16,8"),
        metavar="S,K,W[,N]",
        help="with --few-rows: a (stages, k_steps, k_warps[, n_tiles]) variant instead of the built-in ones",
    )
    b.add_argument(
        "--gemm-variant",
        action="append",
        type=_knob_values((7, 8), "2,2,4,8,4,1,1"),
        metavar="NW,MW,NT,MT,S,KS,KST[,KW]",
        help="with --gemm: a tiled GEMM variant (gemm_ knobs in TILED_KNOBS order) instead of the built-in ones",
    )
    b.add_argument(
        "--wgmma-variant",
        action="append",
        type=_knob_values((5, 6, 7, 8, 9), "2,128,3,1,1"),
        metavar="G,BM,S,A,KS[,MG[,KR[,R[,C]]]]",
        help="with --gemm: a warpgroup GEMM variant (wgmma_ knobs in WGMMA_KNOBS order) instead of the built-in ones",
    )
    b.add_argument(
        "--mid-rows",
        type=int,
        default=0,
        metavar="R",
        help="with --gemm on sm_90: also each weight with the calls up to R rows on a GEMM of R-row x tiles (mid_rows)",
    )
    b.add_argument(
        "--wgmma-only",
        action="store_true",
        help="with --gemm: only the default and the warpgroup GEMM's variants (no GEMV mode, x ring or tiled GEMM)",
    )
    b.add_argument("-o", "--out", required=True)
    r = sub.add_parser("run", help="GPU box: check and time every kernel")
    r.add_argument("bundle")
    r.add_argument("--repeats", type=int, default=30, help="graph replays per case and round (their median)")
    r.add_argument("--rounds", type=int, default=5, help="rounds of timing every case once, round-robin")
    r.add_argument("--only", nargs="*", default=(), help="substrings of the labels to run (default: all)")
    r.add_argument("--log", help="also write the table here")
    r.add_argument("--json", help="also write the results here as JSON")
    r.add_argument(
        "--dependent-launch",
        action="store_true",
        help="launch each kernel as a programmatic dependent of the last, as the drafter does by default",
    )
    args = parser.parse_args()
    if args.command == "build":
        build(args)
        return 0
    return run(args)


if __name__ == "__main__":
    raise SystemExit(main())
