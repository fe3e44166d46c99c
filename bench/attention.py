"""Block-attention variants for the GPU check: every mask, head dims 64 and 128, ragged warps, long and
short sequences, built by one rule (the mma.sync one by default, the warpgroup one of sm_90, or the SIMT one
to compare against).

    # build box
    python bench/attention.py -o build/attn_mma [--rule block_attention_wgmma | block_attention]
    # GPU box: check against numpy and time (same runner as the drafter's kernels)
    PYTHONPATH=. python bench/kernels.py run build/attn_mma

Cases: 1 and 8 sequences with up to 4096 + 16 cached rows each (the first one full, the others random
lengths), and 3 sequences of at most 80 rows (empty splits, chunks cut by the split's end). The timings
flatter every kernel: the random lengths read about half of the cache, and one sequence's cache fits L2;
the drafter step (`bench/propose.py --timeline`) is where schedules are compared.

`--variant` instead builds the Qwen3-8B drafter's attention once per knob set, each kernel named after its
knobs, at 1, 3, 8 and 16 sequences and at three lengths of one sequence, to compare schedules in one run:

    python bench/attention.py -o build/attn_knobs --variant splits=16 --variant splits=16,slots=528

`--knobs` sets knobs of every mask variant instead (the check of a schedule across masks and shapes):

    python bench/attention.py -o build/attn_ring --knobs stages=3
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

# (block, heads, kv_heads, head_dim, causal, window, page_size)
VARIANTS = (
    (16, 32, 8, 128, False, None, 16),  # the Qwen3 DFlash drafters
    (16, 32, 8, 128, False, 2048, 16),  # DFlash2's sliding layers: symmetric window
    (16, 32, 8, 128, True, None, 16),
    (16, 32, 8, 128, True, 40, 16),
    (7, 32, 8, 128, False, None, 16),  # DSpark's block of 7: 28 rows per kv head, a ragged second warp
    (16, 16, 4, 64, False, 24, 16),
    (8, 8, 8, 64, True, None, 16),  # no GQA: 8 rows per kv head, one half-empty warp
    (16, 32, 8, 128, False, 300, 8),  # pages of 8: a chunk of 16 keys spans up to 3 pages (window: unaligned)
)
# (label, nb, pages per sequence)
SIZES = (("long nb=1", 1, 258), ("short nb=3", 3, 5), ("long nb=8", 8, 258))
# --variant adds: 16 sequences, and one sequence at shorter lengths (what a length costs, what is fixed)
VARIANT_SIZES = (("long nb=16", 16, 258), ("nb=1 1k", 1, 66), ("nb=1 256", 1, 18))


def _knobs(text: str) -> dict[str, int]:
    return {k: int(v) for k, v in (item.split("=", 1) for item in text.split(",") if item)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default="sm_90")
    parser.add_argument(
        "--rule",
        default="block_attention_mma",
        choices=["block_attention_wgmma", "block_attention_mma", "block_attention"],
    )
    parser.add_argument(
        "--variant", action="append", default=[], help="knob set 'name=value,...' of the Qwen3-8B kernel (repeatable)"
    )
    parser.add_argument(
        "--knobs", default="", help="knob set 'name=value,...' applied to every mask variant (without --variant)"
    )
    parser.add_argument("-o", "--out", required=True)
    args = parser.parse_args()

    import tvm

    from dflash_compiler.codegen import lower_to_cuda
    from dflash_compiler.kernel_check import CheckCase, write_bundle
    from dflash_compiler.nvrtc import compile_cubin
    from dflash_compiler.schedules import RULES
    from dflash_compiler.schedules.attention import BlockAttentionSpec
    from dflash_compiler.targets import get_target

    target = get_target(args.target)
    rule = next(r for r in RULES if r.name == args.rule)
    kernels, cases = [], []
    if args.variant:
        spec = BlockAttentionSpec(*VARIANTS[0])
        for text in args.variant:
            knobs = _knobs(text)
            kernel = rule.apply(spec, target, knobs)
            if kernel is None:
                raise SystemExit(f"{args.rule} does not take {spec.name} on {target.name}")
            name = f"{spec.name}__" + "_".join(f"{k}{v}" for k, v in sorted(knobs.items()))
            kernels.append(replace(kernel, name=name, func=kernel.func.with_attr("global_symbol", name)))
            for label, nb, maxp in (*SIZES, *VARIANT_SIZES):
                sizes = {"m": nb * spec.block, "pages": nb * maxp + 1, "nb": nb, "maxp": maxp}
                cases.append(CheckCase(name, sizes, label))
    for block, heads, kv_heads, dim, causal, window, page_size in () if args.variant else VARIANTS:
        spec = BlockAttentionSpec(block, heads, kv_heads, dim, causal, window, page_size)
        kernel = rule.apply(spec, target, _knobs(args.knobs))
        if kernel is None:
            raise SystemExit(f"{args.rule} does not take {spec.name} on {target.name}")
        kernels.append(kernel)
        for label, nb, maxp in SIZES:
            sizes = {"m": nb * block, "pages": nb * maxp + 1, "nb": nb, "maxp": maxp}
            cases.append(CheckCase(kernel.name, sizes, label))
    cuda = lower_to_cuda(tvm.IRModule({k.name: k.func for k in kernels}), target)
    cubin = compile_cubin(cuda.source, target.arch)
    write_bundle(Path(args.out), target.arch, cubin, cuda, {k.name: k.spec for k in kernels}, cases)
    print(f"{len(kernels)} kernels ({args.rule}), {len(cases)} cases, cubin {len(cubin)} B -> {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
