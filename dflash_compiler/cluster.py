"""Thread block clusters (sm_90 and newer) in the generated CUDA source.

A kernel that wants its blocks launched in clusters calls `dflash_cluster_dims(x, y, z)` with integer
literals (a no-op); `add_cluster_dims` gives the kernel the compile-time `__cluster_dims__(x, y, z)` that
`cluster_dims` reads off the call, so that every launch of the cubin, plain, dependent or captured in a CUDA
graph, groups the grid's blocks that way, and the kernel table records the shape. Blocks of a cluster run at the
same time on the SMs of one GPC and read each other's shared memory:

* `dflash_cluster_sync()`: every thread of every block of the cluster arrives, then waits; the arrive
  releases and the wait acquires, so the shared (and global) memory writes of every block before it are
  visible to every block after it. A block must not exit while another may still read its shared memory:
  a kernel that reads remote shared memory syncs once more after its last such read;
* `dflash_cluster_add4(acc, p, rank)`: `acc[0..3] += ` the four floats at `p`'s offset in the shared memory
  of block `rank` of the cluster (`mapa` + one 16-byte `ld.shared::cluster`); `p` must be 16-byte aligned;
* `dflash_cluster_load4(dst, p, rank)`: `dst[0..3] = ` those four floats.

A portable cluster has at most 8 blocks (`MAX_PORTABLE`). Hopper runs clusters of up to 16 (`MAX_CLUSTER`)
once the kernel is opted in (`CU_FUNC_ATTRIBUTE_NON_PORTABLE_CLUSTER_SIZE_ALLOWED`), which the runtime does
for every launch whose recorded cluster is larger than portable (`non_portable`). An H100 held 14 clusters of
16 blocks of 128 threads and 112 KiB of shared memory at once (`cuOccupancyMaxActiveClusters`), 7 with one
such block per SM.
"""

from __future__ import annotations

import re

from dflash_compiler.dependent_launch import DependentLaunchError, kernel_bodies

DIMS = "dflash_cluster_dims"
SYNC = "dflash_cluster_sync"
ADD4 = "dflash_cluster_add4"
MAX_PORTABLE = 8
MAX_CLUSTER = 16  # sm_90's largest cluster, non-portable: the runtime opts each such kernel in
LOAD4 = "dflash_cluster_load4"

PRELUDE = f"""\
// thread block clusters (dflash_compiler.cluster)
__device__ __forceinline__ void {DIMS}(int, int, int) {{}}
__device__ __forceinline__ void {SYNC}() {{
  asm volatile("barrier.cluster.arrive.release.aligned;\\n\\tbarrier.cluster.wait.acquire.aligned;" ::: "memory");
}}
__device__ __forceinline__ void {LOAD4}(float* dst, const float* p, unsigned rank) {{
  unsigned local = static_cast<unsigned>(__cvta_generic_to_shared(p)), remote;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(local), "r"(rank));
  asm volatile("ld.shared::cluster.v4.f32 {{%0, %1, %2, %3}}, [%4];"
               : "=f"(dst[0]), "=f"(dst[1]), "=f"(dst[2]), "=f"(dst[3]) : "r"(remote) : "memory");
}}
__device__ __forceinline__ void {ADD4}(float* acc, const float* p, unsigned rank) {{
  float v[4];
  {LOAD4}(v, p, rank);
  acc[0] += v[0]; acc[1] += v[1]; acc[2] += v[2]; acc[3] += v[3];
}}
"""

_CALL = re.compile(rf"\b{DIMS}\((\d+), (\d+), (\d+)\);")
_SIGNATURE = 'extern "C" __global__ void '


class ClusterError(DependentLaunchError):
    """A kernel's cluster shape is missing, ambiguous or past the portable size."""


def non_portable(dims: tuple[int, int, int]) -> bool:
    """Whether a launch of clusters of `dims` needs the driver's non-portable opt-in (more than 8 blocks)."""
    return dims[0] * dims[1] * dims[2] > MAX_PORTABLE


def cluster_dims(source: str) -> dict[str, tuple[int, int, int]]:
    """`{kernel: (x, y, z)}` of every kernel of `source` that calls `dflash_cluster_dims` (once, with literals)."""
    out = {}
    for name, (start, end) in kernel_bodies(source).items():
        calls = {tuple(int(v) for v in m.groups()) for m in _CALL.finditer(source, start, end)}
        if len(calls) > 1:
            raise ClusterError(f"kernel {name} asks for clusters of {sorted(calls)}; expected one shape")
        if calls:
            dims = calls.pop()
            size = dims[0] * dims[1] * dims[2]
            if not 1 <= size <= MAX_CLUSTER:
                raise ClusterError(
                    f"kernel {name} asks for clusters of {dims} ({size} blocks); expected 1 to {MAX_CLUSTER} blocks "
                    f"({MAX_PORTABLE} portable, up to {MAX_CLUSTER} on sm_90 with the runtime's opt-in). Fix: fewer "
                    "k splits or attention splits"
                )
            out[name] = (dims[0], dims[1], dims[2])
    return out


def add_cluster_dims(source: str, clusters: dict[str, tuple[int, int, int]]) -> str:
    """`source` with `__cluster_dims__(x, y, z)` in the signature of every kernel of `clusters` (`cluster_dims`
    of `source`), its forward declaration included; other kernels are unchanged."""
    for name, (x, y, z) in clusters.items():
        head = re.compile(rf"^{re.escape(_SIGNATURE)}((?:__launch_bounds__\(\d+\) )?){name}\(", re.MULTILINE)
        source, count = head.subn(rf"{_SIGNATURE}\1__cluster_dims__({x}, {y}, {z}) {name}(", source)
        if count not in (1, 2):
            raise ClusterError(
                f"kernel {name}: found {count} signatures to give __cluster_dims__; expected its definition and at "
                "most one declaration"
            )
    return source
