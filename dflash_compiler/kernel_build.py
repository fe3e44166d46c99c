"""Schedule both phases of an optimized program and build their kernels into one cubin for a target.

All distinct kernels of a build go into one IRModule, so TVM emits one CUDA source and NVRTC runs once
per target. The cubin's SM is read back from its ELF header and must be the target's arch.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from dflash_compiler.codegen import CodegenError, CudaModule, lower_to_cuda
from dflash_compiler.cubin import cubin_arch
from dflash_compiler.kernel_plan import KernelPlan, check_knob_rules, schedule_graph
from dflash_compiler.lower import Program
from dflash_compiler.nvrtc import compile_cubin
from dflash_compiler.schedules import RULES
from dflash_compiler.schedules.base import Kernel
from dflash_compiler.targets import Target


@dataclass(frozen=True)
class KernelBuild:
    """The kernel plans of both phases, the CUDA source with its kernel table, and the cubin."""

    target: Target
    plans: Mapping[str, KernelPlan]
    kernels: Mapping[str, Kernel]
    cuda: CudaModule
    cubin: bytes


def schedule_program(
    program: Program, target: Target, knobs: Mapping[str, Mapping[str, int]] | None = None
) -> tuple[dict[str, KernelPlan], dict[str, Kernel]]:
    """Kernel plans of both phases; kernels with equal specs are shared between the phases. `knobs` (rule name →
    knob overrides) must name rules of `RULES` that some kernel of the program uses (`check_knob_rules`)."""
    check_knob_rules(knobs or {}, RULES)
    kernels: dict[str, Kernel] = {}
    plans = {
        phase: schedule_graph(graph, target, knobs=knobs, kernels=kernels) for phase, graph in program.phases.items()
    }
    check_knob_rules(knobs or {}, RULES, kernels.values())
    return plans, kernels


def build_kernels(
    program: Program,
    target: Target,
    knobs: Mapping[str, Mapping[str, int]] | None = None,
    on_step: Callable[[str], None] | None = None,
) -> KernelBuild:
    """Schedule, generate CUDA and compile the cubin for `target` (no GPU needed)."""
    import tvm

    plans, kernels = schedule_program(program, target, knobs)
    if on_step is not None:
        on_step("schedule")
    module: Any = tvm.IRModule({name: kernels[name].func for name in sorted(kernels)})
    cuda = lower_to_cuda(module, target)
    if on_step is not None:
        on_step("codegen")
    cubin = compile_cubin(cuda.source, target.arch)
    found = cubin_arch(cubin)
    if found != target.arch:
        raise CodegenError(f"the cubin built for {target.name} holds {found} code, expected {target.arch}")
    if on_step is not None:
        on_step("nvrtc")
    return KernelBuild(target=target, plans=plans, kernels=kernels, cuda=cuda, cubin=cubin)
