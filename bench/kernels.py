"""Per-kernel check and micro-benchmark of a drafter's kernels on the GPU, against the copy bandwidth.

Two steps, because the build box has TVM and no GPU and the GPU box has no TVM:

    # build box: schedule + build the drafter's kernels for a target, with the size cases to run
    python bench/kernels.py build examples/qwen3-8b-dflash-b16 --target sm_90 -o build/kbench [--knob RULE.KNOB=INT]
    #   [--no-weight-tiles]  (row-major linear weights: an A/B)
    # GPU box (numpy, ml_dtypes, pydantic, cuda-python): check every case against numpy and time it
    PYTHONPATH=. python bench/kernels.py run build/kbench --json build/kbench/results.json

`run` prints one row per (kernel, sizes): the median µs of >= 30 launches, the DRAM bytes the kernel must
move, GB/s and % of the device-to-device copy bandwidth measured in the same run, and the largest error
against the spec's numpy reference (a mismatch fails the run).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

# Block rows per step and context rows per append that the bench covers (the serving shapes).
PROPOSE_BATCHES = (1, 4, 8)
CONTEXT_ROWS = (7, 512)
CACHED_ROWS = 4096


def _dims(cfg_block: int, max_seq_len: int) -> list[tuple[str, dict[str, int]]]:
    maxp = -(-(max_seq_len + cfg_block + 1) // 16)
    out = []
    for nb in PROPOSE_BATCHES:
        out.append((f"propose nb={nb}", {"nb": nb, "blk": cfg_block, "maxp": maxp, "pages": nb * maxp + 1, "ctx": 0}))
    for ctx in CONTEXT_ROWS:
        out.append((f"append ctx={ctx}", {"nb": 1, "blk": cfg_block, "maxp": maxp, "pages": maxp + 1, "ctx": ctx}))
    return out


def build(args: argparse.Namespace) -> None:
    from dflash_compiler.config import load_drafter_config
    from dflash_compiler.kernel_build import build_kernels
    from dflash_compiler.kernel_check import cases_from_plans, write_bundle
    from dflash_compiler.options import BuildOptions, Precision, knob_overrides
    from dflash_compiler.pipeline import optimize
    from dflash_compiler.targets import get_target

    cfg = load_drafter_config(Path(args.drafter) / "config.json")
    options = BuildOptions(
        precision=Precision(args.precision),
        max_batch=max(PROPOSE_BATCHES),
        max_seq_len=CACHED_ROWS + 64,
        max_ctx_rows=max(CONTEXT_ROWS),
        weight_tiles=args.weight_tiles,
        knobs=knob_overrides(args.knob),
    )
    program = optimize(cfg, options)
    target = get_target(args.target)
    kb = build_kernels(program, target, knobs=options.knobs)
    cases = cases_from_plans(kb.plans.values(), _dims(program.config.block_size, CACHED_ROWS))
    specs = {name: k.spec for name, k in kb.kernels.items()}
    write_bundle(Path(args.out), target.arch, kb.cubin, kb.cuda, specs, cases)
    print(f"{len(kb.kernels)} kernels, {len(cases)} cases, cubin {len(kb.cubin)} B -> {args.out}")


def run(args: argparse.Namespace) -> int:
    from dflash_compiler.kernel_check import load_bundle, run_bundle

    bundle = load_bundle(Path(args.bundle))
    results, copy_bw, device = run_bundle(bundle, repeats=args.repeats, only=args.only)
    print(f"device: {device}   copy bandwidth (D2D, read+write): {copy_bw / 1e9:.0f} GB/s")
    header = f"{'kernel':44s} {'case':18s} {'sizes':34s} {'us':>9s} {'MB':>9s} {'GB/s':>7s} {'%copy':>6s} {'err':>8s}"
    print(header)
    failed = 0
    rows = []
    for r in results:
        sizes = ",".join(f"{k}={v}" for k, v in r.case.sizes.items())
        pct = 100 * r.gbps * 1e9 / copy_bw
        status = "" if not r.problems else "  MISMATCH"
        failed += bool(r.problems)
        print(
            f"{r.case.kernel:44s} {r.case.label:18s} {sizes:34s} {r.median_us:9.1f} {r.bytes_moved / 1e6:9.2f} "
            f"{r.gbps:7.0f} {pct:6.1f} {r.max_rel_error:8.1e}{status}"
        )
        for p in r.problems:
            print(f"    {p}")
        rows.append(
            {
                "kernel": r.case.kernel,
                "label": r.case.label,
                "sizes": dict(r.case.sizes),
                "median_us": r.median_us,
                "bytes": r.bytes_moved,
                "gbps": r.gbps,
                "pct_copy": pct,
                "max_rel_error": r.max_rel_error,
                "problems": r.problems,
            }
        )
    if args.json:
        Path(args.json).write_text(
            json.dumps({"device": device, "copy_gbps": copy_bw / 1e9, "results": rows}, indent=1)
        )
    print(f"{len(results) - failed}/{len(results)} cases match numpy")
    return 1 if failed else 0


def main() -> int:
    from dflash_compiler.options import BuildOptions

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    b = sub.add_parser("build", help="build box: schedule + build kernels and the size cases")
    b.add_argument("drafter", help="drafter directory or bundled example directory (config.json)")
    b.add_argument("--target", default="sm_90")
    b.add_argument("--precision", default="bf16", choices=["bf16", "fp8"])
    b.add_argument("-o", "--out", required=True)
    b.add_argument(
        "--weight-tiles",
        action=argparse.BooleanOptionalAction,
        default=BuildOptions.model_fields["weight_tiles"].default,
        help="the linears' weights as 64 x 64 tiles, else row-major (an A/B: --no-weight-tiles)",
    )
    b.add_argument(
        "--knob", action="append", default=[], metavar="RULE.KNOB=INT", help="a schedule knob's value (repeatable)"
    )
    r = sub.add_parser("run", help="GPU box: check and time every case")
    r.add_argument("bundle")
    r.add_argument("--repeats", type=int, default=30)
    r.add_argument("--only", nargs="*", default=(), help="kernel names to run (default: all)")
    r.add_argument("--json", help="also write the results here")
    args = parser.parse_args()
    if args.command == "build":
        build(args)
        return 0
    return run(args)


if __name__ == "__main__":
    raise SystemExit(main())
