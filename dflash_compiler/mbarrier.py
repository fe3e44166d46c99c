"""Shared-memory barriers for warp-specialized kernels (sm_90 and newer) in the generated CUDA source.

A kernel whose warps split into a producer that copies and consumers that multiply cannot meet at a block
barrier per pipeline slot: the producer would wait for the slowest consumer before every copy, and the
consumers for the copies of every slot. Each slot instead has two `mbarrier` objects in shared memory, a
"full" one the producer arrives on once the slot's copies have landed and a "free" one the consumers
arrive on once they have read the slot; a thread that needs a slot waits for the barrier's phase of that
use (`parity` = use index mod 2), so neither side waits for more than the slot it needs.

* `dflash_mbar_init(bar, count)`: one thread, before a block barrier; `count` arrivals complete a phase;
* `dflash_mbar_arrive(bar)`: release semantics, so the thread's shared-memory writes before it are seen
  by a thread whose wait returns for that phase;
* `dflash_mbar_wait(bar, parity)`: spins on `try_wait.parity` until the phase of that parity has
  completed (a fresh barrier is in phase 0, so waiting for parity 1 returns at once), acquire semantics;
* `dflash_named_sync(id, count)`: `bar.sync id, count`, a barrier of `count` threads (a multiple of 32)
  under id 1-15, for a subset of the block's warps (id 0 is `__syncthreads`).

`PRELUDE` is prepended to every generated CUDA source (codegen.py). Barrier pointers are generic
addresses of shared memory, 8-byte aligned.
"""

from __future__ import annotations

INIT = "dflash_mbar_init"
ARRIVE = "dflash_mbar_arrive"
WAIT_PARITY = "dflash_mbar_wait"
NAMED_SYNC = "dflash_named_sync"
BARRIER_BYTES = 8

PRELUDE = f"""\
// shared-memory barriers (dflash_compiler.mbarrier)
__device__ __forceinline__ void {INIT}(void* bar, unsigned count) {{
  unsigned a = (unsigned)__cvta_generic_to_shared(bar);
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" :: "r"(a), "r"(count) : "memory");
}}
__device__ __forceinline__ void {ARRIVE}(void* bar) {{
  unsigned a = (unsigned)__cvta_generic_to_shared(bar);
  asm volatile("mbarrier.arrive.release.cta.shared::cta.b64 _, [%0];" :: "r"(a) : "memory");
}}
__device__ __forceinline__ void {WAIT_PARITY}(void* bar, unsigned parity) {{
  unsigned a = (unsigned)__cvta_generic_to_shared(bar);
  asm volatile(
      "{{\\n.reg .pred done;\\nwait:\\n"
      "mbarrier.try_wait.parity.acquire.cta.shared::cta.b64 done, [%0], %1;\\n"
      "@!done bra wait;\\n}}\\n" :: "r"(a), "r"(parity) : "memory");
}}
__device__ __forceinline__ void {NAMED_SYNC}(unsigned id, unsigned count) {{
  asm volatile("bar.sync %0, %1;" :: "r"(id), "r"(count) : "memory");
}}
"""
