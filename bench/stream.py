"""The ceiling a weight-streaming kernel can reach: one read-only stream of S bytes per launch, on a GPU.

A linear at a few rows is a weight stream, and a short one pays fixed costs (launch, the first DRAM round
trip, the tail) that the 1 GiB copy bandwidth does not see. This bench times the simplest kernel that
streams a buffer (16-byte non-coherent loads, `UNROLL` of them in flight per thread, XOR-folded so they are
not dead code) at the Qwen3-8B drafter's weight sizes (bf16, and e4m3 as an FP8 build streams them), for
several grids, i.e. bytes in flight per SM, and in three launch modes:

* `plain`: an ordinary launch;
* `dep-first`: a programmatic dependent launch (dependent_launch.py) that waits before its first load;
* `dep-early`: a dependent launch that issues its first loads before the wait, as a weight stream may.

Every timed launch reads another copy of the buffer than the launch before it, with enough copies to
exceed the L2 several times, and a replay holds at least `LAUNCHES` launches, so that the graph's own
launch cost is spread thin; the figure is the median µs per launch over graph replays, as GB/s and as %
of the device-to-device copy bandwidth measured in the same run. A chain that alternates each stream with a
small dependent kernel (128 KB in, 128 KB out, like a norm) shows what overlap a drafter step's sequence
could win.

A second table is the ceiling of the split attention's K/V stream (schedules/attention_wgmma.py): one warpgroup
per (split, kv head, sequence) copies groups of `KEYS` keys' K and V rows with 16-byte `cp.async`s into a ring
of `DEFAULT_STAGES` slots, `DEFAULT_STAGES - 1` groups ahead of the one it reads, and reads one vector of each
K and V slot it waits for. It streams one Qwen3-8B layer's cache (`KV_ROWS` rows of every sequence) with the
grid the step uses at 1 and 8 sequences (the rule's default splits and slots on the build target), from two
layouts of a 16-row page: `token`, the cache's (`[row][kv head][head dim]`, so a head's key row is 256 bytes,
2 KiB from the next), and `head` (`[kv head][row][head dim]`, 4 KiB of a head's rows in one piece). Its µs
against the attention's in the step (`propose.py --timeline`) says how much of the attention's time is its
schedule rather than its reads.

    # build box (no GPU): the kernels through NVRTC
    python bench/stream.py build -o build/stream [--target sm_90]
    # GPU box
    PYTHONPATH=. python bench/stream.py run build/stream [--json build/stream/results.json]
"""

from __future__ import annotations

import argparse
import ctypes
import json
import statistics
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

# the split attention's group, ring and block (no TVM needed to import them)
from dflash_compiler.schedules.attention_wgmma import DEFAULT_STAGES, KEYS, WARPGROUP  # noqa: E402

THREADS = 256
UNROLL = 8  # 16-byte loads in flight per thread: 128 B
# the weights' bytes, bf16 and e4m3 (an FP8 build streams half of each)
_WEIGHTS = {"o_proj": 4096 * 4096, "qkv": 6144 * 4096, "down": 4096 * 12288, "gate_up": 24576 * 4096}
SIZES = {**{name: 2 * n for name, n in _WEIGHTS.items()}, **{f"{name}_fp8": n for name, n in _WEIGHTS.items()}}
BLOCKS_PER_SM = (1, 2, 4, 8)
MODES = {"plain": ("stream_plain", False), "dep-first": ("stream_wait_first", True),
         "dep-early": ("stream_loads_first", True)}  # fmt: skip
SMALL = 32768  # floats the small kernel reads and writes
LAUNCHES = 64  # stream launches per graph replay, cycling over the copies
# the K/V stream: one layer of the Qwen3-8B drafter's cache, paged as the runtime pages it
KV_HEADS, KV_DIM, KV_ROWS, KV_PAGE = 8, 128, 4096, 16
KV_BATCHES = (1, 8)  # sequences
KV_LAYOUTS = {"token": "kv_token", "head": "kv_head"}  # name -> kernel
KV_LAUNCHES = 12  # K/V stream launches per graph replay
KV_VECTORS = KV_DIM * 2 // 16  # 16-byte vectors of one head's key row
KV_SLOT_BYTES = 2 * KEYS * KV_DIM * 2  # one group's K and V rows

SOURCE = f"""\
// bench/stream.py: a read-only stream; MODE 0 plain, 1 wait then load, 2 first loads then wait
__device__ __forceinline__ void dep_wait() {{
  asm volatile("griddepcontrol.wait;" ::: "memory");
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
}}
__device__ __forceinline__ uint4 load16(const uint4* p) {{
  uint4 r;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {{%0,%1,%2,%3}}, [%4];"
               : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w) : "l"(p));
  return r;
}}
__device__ __forceinline__ uint4 load_or_zero(const uint4* w, long long i, long long n16) {{
  return i < n16 ? load16(w + i) : make_uint4(0, 0, 0, 0);
}}
template <int MODE>
__device__ void stream(const uint4* __restrict__ w, float* __restrict__ out, long long n16) {{
  long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x, stride = (long long)gridDim.x * blockDim.x;
  uint4 buf[{UNROLL}];
  if (MODE == 1) dep_wait();
  #pragma unroll
  for (int u = 0; u < {UNROLL}; ++u) buf[u] = load_or_zero(w, i + u * stride, n16);
  if (MODE == 2) dep_wait();
  unsigned fold = 0;
  for (i += {UNROLL} * stride;; i += {UNROLL} * stride) {{
    #pragma unroll
    for (int u = 0; u < {UNROLL}; ++u) fold ^= buf[u].x ^ buf[u].y ^ buf[u].z ^ buf[u].w;
    if (i >= n16) break;
    #pragma unroll
    for (int u = 0; u < {UNROLL}; ++u) buf[u] = load_or_zero(w, i + u * stride, n16);
  }}
  out[blockIdx.x * blockDim.x + threadIdx.x] = __uint_as_float(fold & 0x3f7fffffu);
}}
extern "C" __global__ void __launch_bounds__({THREADS}) stream_plain(const uint4* w, float* out, long long n16) {{
  stream<0>(w, out, n16);
}}
extern "C" __global__ void __launch_bounds__({THREADS}) stream_wait_first(const uint4* w, float* out, long long n16) {{
  stream<1>(w, out, n16);
}}
extern "C" __global__ void __launch_bounds__({THREADS}) stream_loads_first(const uint4* w, float* out, long long n16) {{
  stream<2>(w, out, n16);
}}
extern "C" __global__ void __launch_bounds__({THREADS}) small_plain(const float* a, float* b) {{
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  b[i] = a[i] * 1.5f + 1.0f;
}}
extern "C" __global__ void __launch_bounds__({THREADS}) small_dependent(const float* a, float* b) {{
  dep_wait();
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  b[i] = a[i] * 1.5f + 1.0f;
}}
// the split attention's K/V reads: block (split, kv head, sequence) of {WARPGROUP} threads; kv is [2][seqs][rows
// of one sequence's pages][heads][{KV_VECTORS} vectors] (LAYOUT 0) or [2][seqs][pages][heads][{KV_PAGE}][vectors] (1)
__device__ __forceinline__ void copy16(void* dst, const void* src) {{
  unsigned d = static_cast<unsigned>(__cvta_generic_to_shared(dst));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" :: "r"(d), "l"(src) : "memory");
}}
template <int LAYOUT>
__device__ void kv_read(const uint4* __restrict__ kv, int rows, float* __restrict__ out) {{
  extern __shared__ uint4 ring[];  // per slot: the group's K rows, then its V rows
  const int group_vectors = {KEYS} * {KV_VECTORS}, per_thread = group_vectors / {WARPGROUP};
  int g = blockIdx.y, s = blockIdx.z, tid = threadIdx.x, heads = gridDim.y;
  int span = rows / gridDim.x, first = blockIdx.x * span, groups = span / {KEYS};
  auto at = [&](int half, int row, int v) -> long long {{
    long long seq = (long long)(half * gridDim.z + s) * rows * heads * {KV_VECTORS};
    if (LAYOUT == 0) return seq + ((long long)row * heads + g) * {KV_VECTORS} + v;
    return seq + (((long long)(row / {KV_PAGE}) * heads + g) * {KV_PAGE} + row % {KV_PAGE}) * {KV_VECTORS} + v;
  }};
  auto issue = [&](int grp) {{
    if (grp < groups) {{
      uint4* slot = ring + (grp % {DEFAULT_STAGES}) * 2 * group_vectors;
      #pragma unroll
      for (int i = 0; i < per_thread; ++i) {{
        int c = i * {WARPGROUP} + tid, row = first + grp * {KEYS} + c / {KV_VECTORS}, v = c % {KV_VECTORS};
        copy16(slot + c, kv + at(0, row, v));
        copy16(slot + group_vectors + c, kv + at(1, row, v));
      }}
    }}
    asm volatile("cp.async.commit_group;" ::: "memory");
  }};
  for (int j = 0; j < {DEFAULT_STAGES} - 1; ++j) issue(j);
  unsigned fold = 0;
  for (int grp = 0; grp < groups; ++grp) {{
    asm volatile("cp.async.wait_group %0;" :: "n"({DEFAULT_STAGES} - 2) : "memory");
    __syncthreads();  // everyone's copies of the group landed; every read of the slot refilled next is done
    issue(grp + {DEFAULT_STAGES} - 1);
    const uint4* slot = ring + (grp % {DEFAULT_STAGES}) * 2 * group_vectors;
    fold ^= slot[tid].x ^ slot[group_vectors + tid].y;
  }}
  out[(blockIdx.z * gridDim.y + blockIdx.y) * gridDim.x + blockIdx.x] = __uint_as_float(fold & 0x3f7fffffu);
}}
extern "C" __global__ void __launch_bounds__({WARPGROUP}) kv_token(const uint4* kv, int rows, float* out) {{
  kv_read<0>(kv, rows, out);
}}
extern "C" __global__ void __launch_bounds__({WARPGROUP}) kv_head(const uint4* kv, int rows, float* out) {{
  kv_read<1>(kv, rows, out);
}}
"""


def kv_splits(target: Any) -> dict[int, int]:
    """Sequences -> spans per (sequence, kv head) of the split attention at its default knobs on `target`."""
    from dflash_compiler.schedules.attention import BlockAttentionSpec
    from dflash_compiler.schedules.attention_merge import span_count
    from dflash_compiler.schedules.attention_wgmma import AttentionWgmmaRule

    knobs = AttentionWgmmaRule().default_knobs(target)
    spec = BlockAttentionSpec(block=16, heads=32, kv_heads=KV_HEADS, head_dim=KV_DIM, causal=False)
    return {nb: int(span_count(spec, knobs["splits"], knobs["slots"], nb)) for nb in KV_BATCHES}


def build(args: argparse.Namespace) -> None:
    from dflash_compiler.nvrtc import compile_cubin
    from dflash_compiler.targets import get_target

    target = get_target(args.target)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "stream.cu").write_text(SOURCE)
    (out / "stream.cubin").write_bytes(compile_cubin(SOURCE, target.arch, name="stream.cu"))
    meta = {"arch": target.arch, "sm_count": target.sm_count, "kv_splits": kv_splits(target)}
    (out / "meta.json").write_text(json.dumps(meta))
    print(f"stream kernels for {target.arch} -> {out}")


class Runner:
    """Launches and times the stream kernels (cuda-python driver API, one context)."""

    def __init__(self, bundle: Path, repeats: int) -> None:
        from dflash_compiler.runtime.cuda import Device, Module, _dependent_attribute

        self.device = Device()
        self.module = Module((bundle / "stream.cubin").read_bytes())
        self.attrs = [_dependent_attribute()]
        self.repeats = repeats
        self.sm_count = self._sm_count()
        self.out = self.device.alloc(4 * THREADS * self.sm_count * max(BLOCKS_PER_SM))
        self.a, self.b = self.device.alloc(4 * SMALL), self.device.alloc(4 * SMALL)
        self.device.zero(self.a, 4 * SMALL)

    def _sm_count(self) -> int:
        from cuda.bindings import driver as cu

        from dflash_compiler.runtime.cuda import check

        attr = cu.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT
        return int(check(cu.cuDeviceGetAttribute(attr, self.device.handle), "cuDeviceGetAttribute"))

    def launch(
        self,
        stream: Any,
        kernel: str,
        dependent: bool,
        grid: int | tuple[int, int, int],
        args: list[Any],
        threads: int = THREADS,
        smem: int = 0,
    ) -> None:
        from cuda.bindings import driver as cu

        from dflash_compiler.runtime.cuda import check

        argv = (ctypes.c_void_p * len(args))(*[ctypes.addressof(a) for a in args])
        config = cu.CUlaunchConfig()
        config.gridDimX, config.gridDimY, config.gridDimZ = (grid, 1, 1) if isinstance(grid, int) else grid
        config.blockDimX, config.blockDimY, config.blockDimZ = threads, 1, 1
        config.sharedMemBytes, config.hStream = smem, stream
        config.attrs = self.attrs if dependent else []
        config.numAttrs = len(config.attrs)
        check(cu.cuLaunchKernelEx(config, self.module.function(kernel), ctypes.addressof(argv), 0), kernel)

    def time(self, record: Any, launches: int) -> float:
        """Median µs per launch of `record` captured as one graph."""
        from dflash_compiler.runtime.cuda import CudaGraph, EventTimer, Stream

        stream = Stream()
        graph = CudaGraph(stream, record)
        graph.launch(stream)
        stream.synchronize()
        times = []
        for _ in range(self.repeats):
            with EventTimer(stream.handle) as timer:
                graph.launch(stream)
            times.append(timer.elapsed_ms() * 1e3 / launches)
        graph.destroy()
        stream.destroy()
        return statistics.median(times)

    def streams(self, buffers: list[int], size: int, kernel: str, dependent: bool, grid: int, chain: bool) -> float:
        launches = max(LAUNCHES, len(buffers))

        def record(stream: Any) -> None:
            for i in range(launches):
                w = buffers[i % len(buffers)]
                args = [ctypes.c_uint64(w), ctypes.c_uint64(self.out), ctypes.c_int64(size // 16)]
                self.launch(stream, kernel, dependent, grid, args)
                if chain:
                    small = "small_dependent" if dependent else "small_plain"
                    self.launch(stream, small, dependent, SMALL // THREADS,
                                [ctypes.c_uint64(self.a), ctypes.c_uint64(self.b)])  # fmt: skip

        return self.time(record, launches)

    @contextmanager
    def copies(self, size: int, count: int) -> Iterator[list[int]]:
        """`count` zeroed device buffers of `size` bytes, freed on exit."""
        buffers = [self.device.alloc(size) for _ in range(count)]
        try:
            for b in buffers:
                self.device.zero(b, size)
            yield buffers
        finally:
            for b in buffers:
                self.device.free(b)

    def kv_streams(self, buffers: list[int], kernel: str, seqs: int, splits: int) -> float:
        """Median µs per launch of the K/V stream `kernel` over `seqs` sequences' caches, `splits` per head."""
        smem = DEFAULT_STAGES * KV_SLOT_BYTES
        self.module.allow_shared(self.module.function(kernel), kernel, smem)

        def record(stream: Any) -> None:
            for i in range(KV_LAUNCHES):
                args = [ctypes.c_uint64(buffers[i % len(buffers)]), ctypes.c_int32(KV_ROWS), ctypes.c_uint64(self.out)]
                self.launch(stream, kernel, False, (splits, KV_HEADS, seqs), args, WARPGROUP, smem)

        return self.time(record, KV_LAUNCHES)


def _weight_rows(runner: Runner, copy: float, label: str, size: int, buffers: list[int]) -> list[dict[str, Any]]:
    """The stream table's rows of one weight size (printed as they come): each grid in each launch mode, then
    the chain with a small kernel."""
    rows = []
    for per_sm in BLOCKS_PER_SM:
        grid = per_sm * runner.sm_count
        in_flight = per_sm * THREADS * UNROLL * 16
        cells, row = [], {"weight": label, "bytes": size, "blocks": grid, "in_flight_per_sm": in_flight}
        for mode, (kernel, dependent) in MODES.items():
            us = runner.streams(buffers, size, kernel, dependent, grid, chain=False)
            row[mode] = us
            cells.append(f"{us:8.2f} {100 * size / (us * 1e-6) / copy:6.1f}%")
        rows.append(row)
        print(f"{label:11s} {size >> 20:5d} {in_flight >> 10:7d} " + " ".join(cells))
    grid = 4 * runner.sm_count
    plain = runner.streams(buffers, size, "stream_plain", False, grid, chain=True)
    early = runner.streams(buffers, size, "stream_loads_first", True, grid, chain=True)
    print(f"{label:11s} chain of stream + small kernel, µs per pair: plain {plain:.2f}, dependent (loads "
          f"first) {early:.2f} ({early / plain:.3f}x)")  # fmt: skip
    rows.append({"weight": label, "bytes": size, "chain_plain_us": plain, "chain_dependent_us": early})
    return rows


def run_kv(runner: Runner, copy: float, splits_of: dict[int, int]) -> list[dict[str, Any]]:
    """The K/V stream's table: µs per layer and % of the copy bandwidth, per layout and batch (`splits_of`:
    sequences -> splits per (sequence, kv head))."""
    print(f"\nK/V stream of one layer ({KV_ROWS} rows a sequence, {KV_HEADS} kv heads of {KV_DIM}), "
          f"{DEFAULT_STAGES}-slot ring of {KEYS}-key groups")  # fmt: skip
    print(f"{'layout':6s} {'nb':>3s} {'blocks':>6s} {'MB':>7s} {'µs':>8s} {'GB/s':>6s} {'% copy':>7s}")
    rows = []
    for seqs, splits in splits_of.items():
        size = 2 * seqs * KV_ROWS * KV_HEADS * KV_DIM * 2
        with runner.copies(size, max(2, -(-(3 * 60 << 20) // size))) as buffers:  # several L2s' worth
            for layout, kernel in KV_LAYOUTS.items():
                us = runner.kv_streams(buffers, kernel, seqs, splits)
                pct = 100 * size / (us * 1e-6) / copy
                print(f"{layout:6s} {seqs:3d} {splits * KV_HEADS * seqs:6d} {size / 1e6:7.1f} {us:8.2f} "
                      f"{size / us / 1e3:6.0f} {pct:6.1f}%")  # fmt: skip
                rows.append({"kv_layout": layout, "seqs": seqs, "splits": splits, "bytes": size, "us": us})
    return rows


def run(args: argparse.Namespace) -> None:
    from dflash_compiler.kernel_check import copy_bandwidth

    runner = Runner(Path(args.bundle), args.repeats)
    copy = copy_bandwidth(runner.device)
    print(f"device: {runner.device.name}, {runner.sm_count} SMs; copy bandwidth (D2D 1 GiB, read + write): "
          f"{copy / 1e9:.0f} GB/s")  # fmt: skip
    print(f"{'weight':11s} {'MiB':>5s} {'KiB/SM':>7s} " + " ".join(f"{m:>16s}" for m in MODES) + "   (µs, % of copy)")
    rows = []
    for label, size in SIZES.items():
        with runner.copies(size, max(4, (3 * 60 << 20) // size)) as buffers:  # several L2s' worth
            rows += _weight_rows(runner, copy, label, size, buffers)
    meta = json.loads((Path(args.bundle) / "meta.json").read_text())
    rows += run_kv(runner, copy, {int(nb): splits for nb, splits in meta["kv_splits"].items()})
    if args.json:
        Path(args.json).write_text(json.dumps({"device": runner.device.name, "copy_gbps": copy / 1e9,
                                               "rows": rows}, indent=1))  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build")
    b.add_argument("--target", default="sm_90")
    b.add_argument("-o", "--out", required=True)
    r = sub.add_parser("run")
    r.add_argument("bundle")
    r.add_argument("--repeats", type=int, default=15, help="graph replays per case (their median)")
    r.add_argument("--json")
    args = parser.parse_args()
    build(args) if args.cmd == "build" else run(args)


if __name__ == "__main__":
    main()
