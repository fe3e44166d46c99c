"""Every bundled drafter builds for every target: one kernel call per compute node, a cubin holding code
for the target's SM (read from the ELF), and no kernel over the target's shared memory; so does the Qwen3-8B
drafter with every tensor-core linear in GEMM mode (x through dynamic shared memory).

Options are the serving shapes the benchmarks use (8 sequences, 4096 cached rows, 512 context rows per
append), so the real-shape examples build the kernels they would deploy.
"""

from __future__ import annotations

import pytest
from kernel_harness import (
    assert_only_prefetches_before_the_wait,
    assert_only_weights_before_the_wait,
    before_the_wait,
)

from dflash_compiler.checkpoint import example_config_path, list_examples
from dflash_compiler.config import load_drafter_config
from dflash_compiler.ir.graph import eval_dim
from dflash_compiler.ir.ops import Op
from dflash_compiler.options import BuildOptions
from dflash_compiler.runtime.expr import evaluate
from dflash_compiler.sass import WAIT as WAIT_SASS
from dflash_compiler.sass import kernel_opcodes, loads_before_wait
from dflash_compiler.schedules.linear_wgmma import CONVERT_REGISTERS, CONVERT_TILE
from dflash_compiler.targets import SM90, SM120, SM121, STATIC_SHARED_MEMORY_LIMIT

pytest.importorskip("tvm")

OPTIONS = BuildOptions(max_batch=8, max_seq_len=4096, max_ctx_rows=512)
BOUNDARY = {Op.INPUT, Op.WEIGHT, Op.STATE, Op.OUTPUT}


@pytest.fixture(scope="module")
def programs():
    from dflash_compiler.pipeline import optimize

    cache = {}

    def get(example: str):
        if example not in cache:
            cache[example] = optimize(load_drafter_config(example_config_path(example)), OPTIONS)
        return cache[example]

    return get


@pytest.mark.parametrize("target", [SM90, SM120, SM121], ids=lambda t: t.name)
@pytest.mark.parametrize("example", list_examples())
def test_example_builds_for_target(programs, example, target):
    from dflash_compiler.kernel_build import build_kernels

    program = programs(example)
    _check_build(program, build_kernels(program, target), target)


@pytest.mark.parametrize("target", [SM90, SM120, SM121], ids=lambda t: t.name)
def test_gemm_mode_linears_build_for_target(programs, target):
    """Every linear in the tensor-core kernel's GEMM mode (x through dynamic shared memory) still fits."""
    from dflash_compiler.kernel_build import build_kernels

    program = programs("qwen3-8b-dflash-b16")
    build = build_kernels(program, target, knobs={"linear_mma": {"x_stages": 2}})
    linears = [k for k in build.kernels.values() if k.rule == "linear_mma"]
    assert linears and all(k.knobs["x_stages"] == 2 for k in linears)
    for kernel in linears:
        (launch,) = build.cuda.functions[kernel.name].kernels
        assert int(launch.dynamic_smem) > 0, kernel.name
    _check_build(program, build, target)


@pytest.mark.parametrize("convert", [None, CONVERT_TILE], ids=["registers-by-default", "tile-by-knob"])
def test_knobbed_fp8_build_is_safe_to_launch_dependent(convert):
    """The Qwen3-8B drafter in FP8, its warpgroup GEMMs converting e4m3 into register fragments (the default)
    or into a shared bf16 tile (wgmma_convert 1), and the attention locating early and letting its merge in
    once its copies are out (early 1, trigger 1): the same checks, the dependent-launch ones included, and
    the knobs reach every kernel they apply to."""
    from dflash_compiler.dependent_launch import kernel_bodies
    from dflash_compiler.fp8_convert import E4M3_A_FRAGMENT, E4M3X4_TO_BF16
    from dflash_compiler.kernel_build import build_kernels
    from dflash_compiler.pipeline import optimize
    from dflash_compiler.schedules.attention_wgmma import AttentionWgmmaRule
    from dflash_compiler.schedules.linear_rules import LinearArgmaxRule, LinearMmaRule, LinearSiluRule

    program = optimize(
        load_drafter_config(example_config_path("qwen3-8b-dflash-b16")),
        BuildOptions(**{**OPTIONS.model_dump(), "precision": "fp8"}),
    )
    rules = (LinearMmaRule, LinearArgmaxRule, LinearSiluRule)
    knobs = {rule.name: {"wgmma_convert": convert} for rule in rules} if convert else {}
    knobs[AttentionWgmmaRule.name] = {"early": 1, "trigger": 1}
    build = build_kernels(program, SM90, knobs=knobs)
    gemms = [k for k in build.kernels.values() if "wgmma_convert" in k.knobs and k.spec.fp8]
    assert len(gemms) >= 5 and all(k.knobs["wgmma_convert"] == (convert or CONVERT_REGISTERS) for k in gemms)
    attention = [k for k in build.kernels.values() if k.rule == AttentionWgmmaRule.name]
    assert attention and all(k.knobs["early"] == k.knobs["trigger"] == 1 for k in attention)
    assert (build.cuda.source.count(f"{E4M3_A_FRAGMENT}((&") > 0) == (convert is None)
    # the tile form converts in the warpgroup GEMMs' k loops (the few-rows kernels convert e4m3 either way)
    bodies = [build.cuda.source[slice(*span)] for span in kernel_bodies(build.cuda.source).values()]
    assert any(f"{E4M3X4_TO_BF16}(" in body and "wgmma" in body for body in bodies) == (convert == CONVERT_TILE)
    _check_build(program, build, SM90)


def _check_build(program, build, target):
    from dflash_compiler.cubin import cubin_arch, kernel_names, static_shared_bytes

    assert cubin_arch(build.cubin) == target.arch
    for phase, graph in program.phases.items():
        compute = [name for name in graph.topo() if graph.node(name).op not in BOUNDARY]
        assert [c.node for c in build.plans[phase].calls] == compute, phase
    static = static_shared_bytes(build.cubin)
    launched = {k.name for fn in build.cuda.functions.values() for k in fn.kernels}
    assert launched <= set(kernel_names(build.cubin)), "every kernel of the table is in the cubin"
    # safe to launch as a programmatic dependent (dependent_launch.py): weights only before the wait, or
    # for a tensor-core attention split kernel with the prefetch knob, prefetches of the cached K/V
    prefetching = {
        f"{kernel.name}_kernel"
        for kernel in build.kernels.values()
        if kernel.rule in ("block_attention_mma", "block_attention_wgmma")
        and (kernel.knobs.get("prefetch", 0) > 0 or kernel.knobs.get("early", 0) == 1)
    }
    unwritten = _unwritten(program, build)
    for name in launched:
        if name in prefetching:
            assert_only_prefetches_before_the_wait(build.cuda.source, name)
        else:
            assert_only_weights_before_the_wait(build.cuda.source, name, unwritten.get(name, frozenset()))
    # what a kernel reads before its wait in the source, its machine code issues before the wait too
    opcodes = kernel_opcodes(build.cubin)
    for name in launched:
        _, _, reads_early = before_the_wait(build.cuda.source, name)  # the pointer parameters it touches
        assert opcodes[name].count(WAIT_SASS) == 1, name
        assert (loads_before_wait(opcodes[name]) > 0) == bool(reads_early), (name, reads_early)
    for phase, plan in build.plans.items():
        maxima = dict(program.phases[phase].meta["memory"].bindings)
        for call in plan.calls:
            sizes = {var: eval_dim(expr, maxima) for var, expr in call.sizes}
            for launch in build.cuda.functions[call.kernel].kernels:
                dynamic = evaluate(launch.dynamic_smem, sizes)
                own = static.get(launch.name, 0)
                assert own <= STATIC_SHARED_MEMORY_LIMIT, launch.name
                assert own + dynamic <= target.max_shared_memory_per_block, (
                    f"{launch.name} at {sizes}: {own} static + {dynamic} dynamic bytes of shared memory, "
                    f"{target.name} allows {target.max_shared_memory_per_block}"
                )
                _, block, _ = launch.launch_dims(sizes)
                assert block[0] * block[1] * block[2] <= target.max_threads_per_block, launch.name


def _unwritten(program, build) -> dict[str, frozenset[str]]:
    """Per kernel launch, the pointer parameters that every call binds to a weight or a graph input: values
    no kernel of the step writes, which a kernel may read before its wait."""
    out: dict[str, frozenset[str]] = {}
    for phase, plan in build.plans.items():
        graph = program.phases[phase]
        for call in plan.calls:
            safe = frozenset(
                f"{param}_ptr"
                for param, view in call.buffers
                if graph.node(view.value.split(":")[0]).op in (Op.WEIGHT, Op.INPUT)
            )
            for launch in build.cuda.functions[call.kernel].kernels:
                out[launch.name] = out.get(launch.name, safe) & safe
    return out
