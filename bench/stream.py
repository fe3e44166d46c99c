"""The ceiling a weight-streaming kernel can reach: one read-only stream of S bytes per launch, on a GPU.

A linear at a few rows is a weight stream, and a short one pays fixed costs (launch, the first DRAM round
trip, the tail) that the 1 GiB copy bandwidth does not see. This bench times the simplest kernel that
streams a buffer (16-byte non-coherent loads, `UNROLL` of them in flight per thread, XOR-folded so they are
not dead code) at the Qwen3-8B drafter's weight sizes, for several grids, i.e. bytes in flight per SM, and
in three launch modes:

* `plain`: an ordinary launch;
* `dep-first`: a programmatic dependent launch (dependent_launch.py) that waits before its first load;
* `dep-early`: a dependent launch that issues its first loads before the wait, as a weight stream may.

Every timed launch reads another copy of the buffer than the launch before it, with enough copies to
exceed the L2 several times, and a replay holds at least `LAUNCHES` launches, so that the graph's own
launch cost is spread thin; the figure is the median µs per launch over graph replays, as GB/s and as %
of the device-to-device copy bandwidth measured in the same run. A chain that alternates each stream with a
small dependent kernel (128 KB in, 128 KB out, like a norm) shows what overlap a drafter step's sequence
could win.

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
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

THREADS = 256
UNROLL = 8  # 16-byte loads in flight per thread: 128 B
SIZES = {"o_proj": 4096 * 4096 * 2, "qkv": 6144 * 4096 * 2, "down": 4096 * 12288 * 2, "gate_up": 24576 * 4096 * 2}
BLOCKS_PER_SM = (1, 2, 4, 8)
MODES = {"plain": ("stream_plain", False), "dep-first": ("stream_wait_first", True),
         "dep-early": ("stream_loads_first", True)}  # fmt: skip
SMALL = 32768  # floats the small kernel reads and writes
LAUNCHES = 64  # stream launches per graph replay, cycling over the copies

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
"""


def build(args: argparse.Namespace) -> None:
    from dflash_compiler.nvrtc import compile_cubin
    from dflash_compiler.targets import get_target

    target = get_target(args.target)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "stream.cu").write_text(SOURCE)
    (out / "stream.cubin").write_bytes(compile_cubin(SOURCE, target.arch, name="stream.cu"))
    (out / "meta.json").write_text(json.dumps({"arch": target.arch, "sm_count": target.sm_count}))
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

    def launch(self, stream: Any, kernel: str, dependent: bool, grid: int, args: list[Any]) -> None:
        from cuda.bindings import driver as cu

        from dflash_compiler.runtime.cuda import check

        argv = (ctypes.c_void_p * len(args))(*[ctypes.addressof(a) for a in args])
        config = cu.CUlaunchConfig()
        config.gridDimX, config.gridDimY, config.gridDimZ = grid, 1, 1
        config.blockDimX, config.blockDimY, config.blockDimZ = THREADS, 1, 1
        config.sharedMemBytes, config.hStream = 0, stream
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


def run(args: argparse.Namespace) -> None:
    from dflash_compiler.kernel_check import copy_bandwidth

    runner = Runner(Path(args.bundle), args.repeats)
    copy = copy_bandwidth(runner.device)
    print(f"device: {runner.device.name}, {runner.sm_count} SMs; copy bandwidth (D2D 1 GiB, read + write): "
          f"{copy / 1e9:.0f} GB/s")  # fmt: skip
    print(f"{'weight':8s} {'MiB':>5s} {'KiB/SM':>7s} " + " ".join(f"{m:>16s}" for m in MODES) + "   (µs, % of copy)")
    rows = []
    for label, size in SIZES.items():
        copies = max(4, (3 * 60 << 20) // size)  # several L2s' worth
        buffers = [runner.device.alloc(size) for _ in range(copies)]
        for w in buffers:
            runner.device.zero(w, size)
        for per_sm in BLOCKS_PER_SM:
            grid = per_sm * runner.sm_count
            in_flight = per_sm * THREADS * UNROLL * 16
            cells, row = [], {"weight": label, "bytes": size, "blocks": grid, "in_flight_per_sm": in_flight}
            for mode, (kernel, dependent) in MODES.items():
                us = runner.streams(buffers, size, kernel, dependent, grid, chain=False)
                row[mode] = us
                cells.append(f"{us:8.2f} {100 * size / (us * 1e-6) / copy:6.1f}%")
            rows.append(row)
            print(f"{label:8s} {size >> 20:5d} {in_flight >> 10:7d} " + " ".join(cells))
        grid = 4 * runner.sm_count
        plain = runner.streams(buffers, size, "stream_plain", False, grid, chain=True)
        early = runner.streams(buffers, size, "stream_loads_first", True, grid, chain=True)
        print(f"{label:8s} chain of stream + small kernel, µs per pair: plain {plain:.2f}, dependent (loads "
              f"first) {early:.2f} ({early / plain:.3f}x)")  # fmt: skip
        rows.append({"weight": label, "bytes": size, "chain_plain_us": plain, "chain_dependent_us": early})
        for w in buffers:
            runner.device.free(w)
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
