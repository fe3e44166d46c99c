"""Programmatic dependent launch (sm_90 and newer) in the generated CUDA source.

A drafter step is a chain of ~100 short kernels, and between two of them the GPU idles: the next grid is
scheduled only when the previous one has drained, and its first loads then wait a full DRAM latency. With
programmatic dependent launch the next grid's blocks start as soon as every block of the previous grid has
started, run up to `griddepcontrol.wait` (which returns once the previous grid has completed and its
writes are visible), and only then read what it produced. A kernel may issue loads of data no kernel
writes (weights) before the wait, so its first weight bytes are in flight while the previous grid's tail
drains.

`add_dependent_launch` makes every kernel of a CUDA source safe to launch that way: unless the kernel's own
schedule calls it, `dflash_wait_for_inputs()` is the first thing every thread does. It runs
`griddepcontrol.wait` and then `griddepcontrol.launch_dependents`, so the kernel after this one is let in
only once this one is past its wait: at most one grid at a time sits resident waiting, instead of a cascade
of waiting grids holding registers and shared memory that the running one's later waves need. The
tensor-core GEMV calls it itself, after it has prefetched its first weight batches into L2
(`dflash_prefetch_l2`); weights are never written by a kernel. A kernel launched without the attribute has
no prerequisite grid, and both instructions do nothing there, so the same cubin serves plain launches.

Every kernel waits, unconditionally and before it exits, so a grid completes only after its predecessor
did, and a kernel that reads the output of any earlier kernel of the chain reads it complete. The runtime
launches with the attribute only when the artifact's options ask for it (`BuildOptions.dependent_launch`).
"""

from __future__ import annotations

import re

from dflash_compiler.errors import DFlashError

WAIT = "dflash_wait_for_inputs"
PREFETCH_L2 = "dflash_prefetch_l2"

PRELUDE = f"""\
// programmatic dependent launch (dflash_compiler.dependent_launch): no-ops for a plain launch
__device__ __forceinline__ void {WAIT}() {{
  asm volatile("griddepcontrol.wait;" ::: "memory");
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
}}
__device__ __forceinline__ void {PREFETCH_L2}(const void* p) {{ asm volatile("prefetch.global.L2 [%0];" :: "l"(p)); }}
"""

_KERNEL = re.compile(r'^extern "C" __global__ void (?:__launch_bounds__\(\d+\) )?(\w+)\([^;{]*\{[ \t]*$', re.MULTILINE)


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
    """`source` with the prelude and, first in every `extern "C" __global__` kernel that does not call it
    itself, the wait (see above).

    Raises when the source has no kernel definition or already has the prelude.
    """
    if PRELUDE in source:
        raise DependentLaunchError("add_dependent_launch: the source already has the dependent-launch prelude")
    bodies = sorted(kernel_bodies(source).values())
    if not bodies:
        raise DependentLaunchError("add_dependent_launch: no 'extern \"C\" __global__' kernel definition found")
    out, pos = [PRELUDE], 0
    for start, end in bodies:
        call = "" if f"{WAIT}()" in source[start:end] else f"\n  {WAIT}();"
        out.append(source[pos:start] + call)
        pos = start
    out.append(source[pos:])
    return "".join(out)
