"""The target record: what one GPU generation can do, as data.

Schedules size their tiles, thread counts and shared-memory use from these numbers and never from the
target's name, so a new GPU is a new record, not new `if` branches. The roofline (predicted latency in
the manifest) reads `dram_bandwidth_bytes_per_s`. Nothing here imports TVM: the deploy side loads target
records too (the loader compares the device's compute capability with the artifact's).
"""

from __future__ import annotations

import re
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

from dflash_compiler.errors import InputError, Problem

# CUDA caps *static* `__shared__` arrays at 48 KiB on every architecture; more than that needs dynamic shared
# memory and cuFuncSetAttribute(MAX_DYNAMIC_SHARED_SIZE_BYTES), which the runtime does for TVM's `shared.dyn`.
STATIC_SHARED_MEMORY_LIMIT = 48 * 1024

_NAME = re.compile(r"^sm_(\d+)$")
_ARCH = re.compile(r"^sm_(\d+)a$")


class TargetError(InputError):
    """The requested build target is unknown or cannot be determined."""


class Target(BaseModel):
    """One frozen capability record per GPU generation (a build target).

    `name` is what users pass (`--target sm_90`); `arch` is the architecture the cubin is built for (the
    arch-specific `a` variant, so sm_90a code may use wgmma/setmaxnreg); `schedule_arch` is what TVM
    schedules see (see there).
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str = Field(description="target name users pass, e.g. 'sm_90'")
    description: str = Field(description="the GPUs this record describes")
    arch: str = Field(description="cubin architecture, e.g. 'sm_90a' (arch-specific features enabled)")
    compute_capability: tuple[int, int] = Field(description="(major, minor) the device reports, e.g. (9, 0)")
    sm_count: int = Field(gt=0, description="streaming multiprocessors")
    max_shared_memory_per_block: int = Field(gt=0, description="opt-in dynamic shared memory per block, bytes")
    max_static_shared_memory_per_block: int = Field(
        default=STATIC_SHARED_MEMORY_LIMIT, gt=0, description="static __shared__ limit per block, bytes"
    )
    shared_memory_per_sm: int = Field(gt=0, description="shared memory per SM, bytes")
    registers_per_sm: int = Field(gt=0, description="32-bit registers per SM")
    max_registers_per_block: int = Field(gt=0, description="32-bit registers one thread block may use")
    max_registers_per_thread: int = Field(gt=0, description="32-bit registers one thread may use")
    max_threads_per_block: int = Field(gt=0)
    max_threads_per_sm: int = Field(gt=0)
    warp_size: int = Field(gt=0)
    l2_bytes: int = Field(gt=0, description="L2 cache size, bytes")
    dram_bandwidth_bytes_per_s: float = Field(gt=0, description="peak DRAM bandwidth, bytes/s (roofline)")
    fp8_mma: bool = Field(description="tensor-core MMA on float8 e4m3/e5m2 inputs")
    bf16_mma: bool = Field(description="tensor-core MMA on bfloat16 inputs")
    wgmma: bool = Field(
        description="warpgroup MMA from shared-memory descriptors (wgmma.mma_async; sm_90a only, not sm_12x)"
    )

    @model_validator(mode="after")
    def _consistent(self) -> Target:
        major, minor = self.compute_capability
        sm = f"{major}{minor}"
        problems: list[Problem] = []
        name = _NAME.match(self.name)
        if name is None or name.group(1) != sm:
            problems.append(
                Problem(
                    "target.name",
                    repr(self.name),
                    f"'sm_{sm}' for compute capability {major}.{minor}",
                    "name the record after its compute capability",
                )
            )
        arch = _ARCH.match(self.arch)
        if arch is None or arch.group(1) != sm:
            problems.append(
                Problem("target.arch", repr(self.arch), f"'sm_{sm}a'", "build cubins for the arch-specific variant")
            )
        if self.max_shared_memory_per_block > self.shared_memory_per_sm:
            problems.append(
                Problem(
                    "target.max_shared_memory_per_block",
                    str(self.max_shared_memory_per_block),
                    f"at most shared_memory_per_sm ({self.shared_memory_per_sm})",
                    "check the CUDA guide's table",
                )
            )
        if self.max_threads_per_block % self.warp_size:
            problems.append(
                Problem(
                    "target.max_threads_per_block",
                    str(self.max_threads_per_block),
                    f"a multiple of warp_size ({self.warp_size})",
                    "check the CUDA guide's table",
                )
            )
        if problems:
            raise TargetError(f"target record {self.name!r}", problems)
        return self

    @property
    def schedule_arch(self) -> str:
        """The arch TVM schedules against: 'sm_90', not 'sm_90a'.

        dlight's `check_sm_version` does `int("90a")`, which fails and disables tensor-core rules, so
        schedules see the plain arch; the cubin is still built for `arch` (TVM's CUDA source does not
        depend on it).
        """
        return self.arch.removesuffix("a")

    def tvm_target_dict(self) -> dict[str, Any]:
        """The TVM target as the dict form TVM 0.27 accepts (the CLI string form is gone).

        `max_shared_memory_per_block` is the opt-in size: schedules that use more than 48 KiB must put it in
        `shared.dyn`, and the runtime raises the kernel's dynamic shared-memory limit before launching.
        """
        return {
            "kind": "cuda",
            "arch": self.schedule_arch,
            "max_shared_memory_per_block": self.max_shared_memory_per_block,
            "max_threads_per_block": self.max_threads_per_block,
            "max_num_threads": self.max_threads_per_block,
            "thread_warp_size": self.warp_size,
            "registers_per_block": self.max_registers_per_block,
            "l2_cache_size_bytes": self.l2_bytes,
        }

    def tvm_target(self) -> Any:
        """A `tvm.target.Target` for scheduling and CUDA codegen (imports TVM, so build side only)."""
        import tvm

        return tvm.target.Target(self.tvm_target_dict())
