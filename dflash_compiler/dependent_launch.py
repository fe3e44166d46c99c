"""Programmatic dependent launch (sm_90 and newer) in the generated CUDA source.

A drafter step is a chain of ~100 short kernels, and between two of them the GPU idles: the next grid is
scheduled only when the previous one has drained, and its first loads then wait a full DRAM latency. With
programmatic dependent launch the next grid's blocks start as soon as every block of the previous grid has
let them in (or exited), run up to `griddepcontrol.wait` (which returns once the previous grid has
completed and its writes are visible), and only then read what it produced. A kernel may issue loads of data no kernel
writes (weights) before the wait, so its first weight bytes are in flight while the previous grid's tail
drains.

`add_dependent_launch` makes every kernel of a CUDA source safe to launch that way. Two calls split the
protocol: `dflash_wait_for_inputs()` (`griddepcontrol.wait`) and `dflash_launch_dependents()`
(`griddepcontrol.launch_dependents`, which lets the next grid in once every block of this one has called it
or exited). A kernel whose schedule does not call the wait itself gets both, first thing: it is short (an
elementwise op, a gather, a cache write, an argmax), and the kernel after it, usually a weight stream,
starts its weight loads while it runs. A kernel whose schedule calls the wait itself also places its
trigger, or has none, so that its dependents come in only as its blocks exit:

* the tensor-core linears issue their first weight loads (`dflash_prefetch_l2`, or `cp.async` into their
  shared-memory slots) before the wait, since weights are never written by a kernel, and trigger once
  their weight is out (the tiled ones at the step that issues their last copies, GEMV mode after its last
  pass's multiplies): the next grid arrives for the stream's tail only;
* the norms (rmsnorm.py) and head_prep load their weights, head_prep also its RoPE angles from the
  host-written positions, and the attention merge kernel locates its spans from the host-written lengths
  and positions, before the wait, and trigger right after it;
* the attention split kernels do not trigger (the warpgroup one with knob `trigger` does, once its blocks
  have issued their last K/V copies), and before the wait only prefetch their first groups' cached K/V rows
  into L2: the addresses come from the step's lengths and block tables, which the host
  writes before the step's graph and no kernel of the step does. By default everything is read again after
  the wait; with the warpgroup kernel's knob `early` the span, length and first table entries read before it
  are kept and used after it (schedules/attention_wgmma.py), and the cache itself is still read only after.

Measured on the H200 (`bench/propose.py --timeline`, Qwen3-8B drafter, bf16; ms at nb = 1 / 4 / 8 / 16,
against plain launches in the same run):

* every kernel triggering right after its wait: 1.109 / 2.104 / 2.551 / 4.234 against 1.099 / 2.025 /
  2.415 / 4.273; the attention split kernel took 29 µs instead of 19 at nb = 1 and the tiled GEMMs 30-37
  µs instead of 23 at nb = 4-8;
* no kernel triggering (every grid comes in as the blocks before it exit): 1.086 / 1.980 / 2.370 / 4.280
  against 1.104 / 2.027 / 2.432 / 4.273; no kernel slower, but no weight stream starts early either;
* short kernels triggering first thing and long ones late or never, as here: the attention and the tiled
  GEMMs were still as slow, with nothing waiting beside them; their blocks had piled up on the SMs the
  kernel before left free first (runtime/placement.py);
* the same with such grids spread over the SMs (runtime/placement.py): 1.061 / 1.972 / 2.396 / 4.293
  against 1.097 / 1.987 / 2.428 / 4.266;
* the norms, head_prep and the attention merge triggering before their wait instead of right after it (so
  the weight stream after them comes in while the kernel before them drains; on an H100, one run, ms at
  nb = 1 / 4 / 8): bf16 1.294 / 1.548 / 1.809 → 1.299 / 1.551 / 1.816, FP8 0.798 / 1.172 / 1.488 → 0.790 /
  1.170 / 1.485, within the step's noise, so no kernel triggers before its wait.

The long kernels keep their late trigger, so that no grid holds warps, registers and shared memory beside
them for their whole run; what an early one would cost them once grids are spread is not measured.

ptxas treats the wait as an acquire: no load written after it moves above it, but it may schedule a load
written before it below it, and it does so with the non-coherent loads (`ld.global.nc`) the read-only
parameters get, in straight-line code (the norms' weights and the attention merge's lengths sat after the
wait in the sm_90 machine code; those behind a branch, `cp.async` copies and prefetches kept their place).
A relaxed load (`dflash_load_before_wait`) is ordered with the wait, so such prologues use it;
`sass.loads_before_wait` reads what a cubin does.

A kernel launched without the attribute has no prerequisite grid, and both instructions do nothing there,
so the same cubin serves plain launches. Every kernel waits, unconditionally and before it exits, so a grid
completes only after its predecessor did, and a kernel that reads the output of any earlier kernel of the
chain reads it complete. The runtime launches with the attribute only when the artifact's options ask for
it (`BuildOptions.dependent_launch`).
"""

from __future__ import annotations

import re

from dflash_compiler.errors import DFlashError

WAIT = "dflash_wait_for_inputs"
LAUNCH_DEPENDENTS = "dflash_launch_dependents"
PREFETCH_L2 = "dflash_prefetch_l2"
LOAD_BEFORE_WAIT = "dflash_load_before_wait"

PRELUDE = f"""\
// programmatic dependent launch (dflash_compiler.dependent_launch): no-ops for a plain launch
__device__ __forceinline__ void {WAIT}() {{ asm volatile("griddepcontrol.wait;" ::: "memory"); }}
__device__ __forceinline__ void {LAUNCH_DEPENDENTS}() {{
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
}}
__device__ __forceinline__ void {PREFETCH_L2}(const void* p) {{ asm volatile("prefetch.global.L2 [%0];" :: "l"(p)); }}
// `bytes` (2, 4, 8 or 16, aligned) from global `src` to `dst` as a relaxed load: ptxas keeps it above the wait
__device__ __forceinline__ void {LOAD_BEFORE_WAIT}(void* dst, const void* src, int bytes) {{
  if (bytes == 16) {{
    uint4 v;
    asm volatile("ld.relaxed.gpu.global.v4.b32 {{%0, %1, %2, %3}}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(src) : "memory");
    *(uint4*)dst = v;
  }} else if (bytes == 8) {{
    uint2 v;
    asm volatile("ld.relaxed.gpu.global.v2.b32 {{%0, %1}}, [%2];" : "=r"(v.x), "=r"(v.y) : "l"(src) : "memory");
    *(uint2*)dst = v;
  }} else if (bytes == 4) {{
    unsigned v;
    asm volatile("ld.relaxed.gpu.global.b32 %0, [%1];" : "=r"(v) : "l"(src) : "memory");
    *(unsigned*)dst = v;
  }} else {{
    unsigned short v;
    asm volatile("ld.relaxed.gpu.global.b16 %0, [%1];" : "=h"(v) : "l"(src) : "memory");
    *(unsigned short*)dst = v;
  }}
}}
"""

# a definition's signature line: launch bounds and a cluster shape (cluster.py) are optional
_KERNEL = re.compile(
    r'^extern "C" __global__ void (?:__launch_bounds__\(\d+\) )?(?:__cluster_dims__\(\d+, \d+, \d+\) )?'
    r"(\w+)\([^;{]*\{[ \t]*$",
    re.MULTILINE,
)


class DependentLaunchError(DFlashError):
    """The CUDA source does not have the shape the rewrite expects."""


def kernel_bodies(source: str) -> dict[str, tuple[int, int]]:
    """`{kernel name: (start, end)}` of every `extern "C" __global__` definition's body in `source`.

    Expects TVM's CUDA codegen layout: a definition's signature ends its line with `{` and its body ends
    at the next line that is exactly `}`; raises when a definition has no such end.
    """
    out = {}
    for match in _KERNEL.finditer(source):
        end = source.find("\n}\n", match.end())
        if end < 0:
            raise DependentLaunchError(
                f"kernel {match.group(1)} has no closing line '}}'; expected TVM's CUDA layout (signature line "
                "ending in '{', body closed by a line '}')"
            )
        out[match.group(1)] = (match.end(), end)
    return out


def add_dependent_launch(source: str) -> str:
    """`source` with the prelude and, first in every `extern "C" __global__` kernel that does not call the
    wait itself, the wait and the trigger (see above).

    Raises when the source has no kernel definition or already has the prelude, and when a kernel triggers
    its dependents without waiting first (a cascade of grids could then sit resident, waiting).
    """
    if PRELUDE in source:
        raise DependentLaunchError("add_dependent_launch: the source already has the dependent-launch prelude")
    bodies = sorted(kernel_bodies(source).items(), key=lambda kv: kv[1])
    if not bodies:
        raise DependentLaunchError("add_dependent_launch: no 'extern \"C\" __global__' kernel definition found")
    out, pos = [PRELUDE], 0
    for name, (start, end) in bodies:
        body = source[start:end]
        trigger = body.find(f"{LAUNCH_DEPENDENTS}()")
        if trigger >= 0 and not 0 <= body.find(f"{WAIT}()") < trigger:
            raise DependentLaunchError(
                f"kernel {name} calls {LAUNCH_DEPENDENTS}() before any {WAIT}(); expected its schedule to wait "
                "for its inputs first"
            )
        call = "" if f"{WAIT}()" in body else f"\n  {WAIT}();\n  {LAUNCH_DEPENDENTS}();"
        out.append(source[pos:start] + call)
        pos = start
    out.append(source[pos:])
    return "".join(out)
