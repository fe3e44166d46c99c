"""CPU oracle for kernel specs: build the unscheduled PrimFunc for llvm, run it, compare with numpy.

Every family test uses `assert_spec_matches_numpy(spec, sizes)`: the spec samples inputs, the llvm build of
its TVM computation runs on them, and every written parameter must match the spec's numpy reference.
"""

from __future__ import annotations

from collections.abc import Mapping
from functools import cache
from typing import Any

import numpy as np
import pytest

from dflash_compiler.schedules.attention import BlockAttentionSpec
from dflash_compiler.schedules.base import Kernel, KernelSpec
from dflash_compiler.schedules.check import mismatches
from dflash_compiler.schedules.linear import FP8, LinearSpec
from dflash_compiler.schedules.linear_plans import fit_wgmma_plan
from dflash_compiler.schedules.linear_rules import LinearArgmaxRule, LinearMmaRule, LinearSiluRule
from dflash_compiler.schedules.linear_wgmma import WGMMA_KNOBS, WgmmaPlan
from dflash_compiler.targets import SM90

# block-attention shapes the tensor-core attention tests (mma.sync and warpgroup) share
QWEN3_8B = BlockAttentionSpec(block=16, heads=32, kv_heads=8, head_dim=128, causal=False)
DFLASH2_SWA = BlockAttentionSpec(block=16, heads=32, kv_heads=8, head_dim=128, causal=False, window=2048)
# 7 block rows x 4 heads = 28 query rows per kv head: a ragged last warp (mma.sync), 28 of a warpgroup's 64
DSPARK = BlockAttentionSpec(block=7, heads=32, kv_heads=8, head_dim=128, causal=False)
SMALL = BlockAttentionSpec(block=8, heads=8, kv_heads=8, head_dim=64, causal=True, window=24)  # 8 rows, no GQA

# a warpgroup GEMM plan's knobs by name (fit_wgmma_plan): one warpgroup, 128-row x tiles, four slots of one atom,
# four k splits through a merge kernel; tests of one knob override it
WGMMA_PLAN = {"warpgroups": 1, "block_m": 128, "stages": 4, "k_atoms": 1, "k_splits": 4, "mma_groups": 1, "k_reduce": 1,
              "roles": 1, "convert": 1}  # fmt: skip

# the linears whose epilogue takes whole sums (lm_head + argmax, gate_up + silu on FP8 weights), as a test's
# (rule, spec) parameters
FUSED_EPILOGUES = pytest.mark.parametrize(
    ("rule", "spec"),
    [
        (LinearArgmaxRule(), LinearSpec("lm_head_argmax", 151936, 4096)),
        (LinearSiluRule(), LinearSpec("matmul_silu", 24576, 4096, FP8)),
    ],
    ids=["argmax", "silu-fp8"],
)


@cache
def _llvm_build(spec: KernelSpec):
    import tvm

    return tvm.compile(spec.prim_func(), target=tvm.target.Target({"kind": "llvm"}))


def run_llvm(spec: KernelSpec, arrays: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The written parameters after running the llvm build of `spec.prim_func()` on `arrays`."""
    import tvm

    dev = tvm.cpu()
    tensors = {p.name: tvm.runtime.tensor(np.ascontiguousarray(arrays[p.name]), dev) for p in spec.params()}
    _llvm_build(spec)[spec.name](*[tensors[p.name] for p in spec.params()])
    return {p.name: tensors[p.name].numpy() for p in spec.params() if p.written}


def assert_spec_matches_numpy(spec: KernelSpec, sizes: Mapping[str, int], seed: int = 0) -> dict[str, np.ndarray]:
    """Sample, run on llvm, compare with the numpy reference; returns the llvm outputs for further checks."""
    arrays = spec.sample(np.random.default_rng(seed), sizes)
    assert set(arrays) == {p.name for p in spec.params()}, "sample() must give every parameter"
    for p in spec.params():
        shape = tuple(sizes[d] if isinstance(d, str) else d for d in p.shape)
        assert arrays[p.name].shape == shape, f"{p.name}: sampled {arrays[p.name].shape}, declared {shape}"
    got = run_llvm(spec, arrays)
    ref = spec.reference({k: v.copy() for k, v in arrays.items()})
    problems = mismatches(spec, got, ref, arrays)
    assert not problems, "\n".join(problems)
    return got


def wgmma_kernel(spec: LinearSpec, plan: WgmmaPlan) -> Kernel:
    """`spec` under LinearMmaRule with the warpgroup GEMM of `plan` taking every call above gemm_rows rows (no
    64-row GEMM below mid_rows) on sm_90; the kernel's reported knobs give `plan` back."""
    knobs = {f"wgmma_{name}": getattr(plan, name) for name in WGMMA_KNOBS}
    kernel = LinearMmaRule().apply(spec, SM90, {**knobs, "mid_rows": 0})
    assert fit_wgmma_plan(spec, SM90, {name: kernel.knobs[f"wgmma_{name}"] for name in WGMMA_KNOBS}) == plan
    return kernel


def kernel_body(source: str, name: str) -> str:
    """The CUDA body of `<name>_kernel` in a module's source (its definition, not the forward declaration)."""
    bodies = kernel_bodies(source)
    assert f"{name}_kernel" in bodies, f"no definition of {name}_kernel in the CUDA source"
    return bodies[f"{name}_kernel"]


def before_the_wait(source: str, name: str) -> tuple[str, str, set[str]]:
    """Kernel `name`'s body, the part of it before its one wait for inputs, and the pointer parameters that
    part mentions."""
    import re

    from dflash_compiler.dependent_launch import WAIT, kernel_bodies

    start, end = kernel_bodies(source)[name]
    body = source[start:end]
    assert body.count(f"{WAIT}();") == 1, name
    early = body[: body.index(f"{WAIT}();")]
    signature = source[source.rfind("\n", 0, start - 1) + 1 : start]
    params = set(re.findall(r"(\w+_ptr)\b", signature))
    return body, early, params & set(re.findall(r"(\w+_ptr)\b", early))


def assert_only_weights_before_the_wait(
    source: str, name: str, unwritten: frozenset[str] = frozenset({"w_ptr", "scale_ptr"})
) -> None:
    """Kernel `name` of `source` waits once for its inputs (dependent_launch.py) and, before that wait,
    touches no pointer parameter but those in `unwritten` (bound to what no kernel writes: weights, graph
    inputs the host writes; by default the weight `w` and its FP8 row scales): under a dependent launch
    everything else may still be in the making. A kernel that waits first touches nothing before it; one that
    lets its dependents in does so after its wait."""
    from dflash_compiler.dependent_launch import LAUNCH_DEPENDENTS

    body, early, touched = before_the_wait(source, name)
    trigger = body.find(f"{LAUNCH_DEPENDENTS}();")
    assert trigger == -1 or trigger > len(early), name
    assert touched <= unwritten, (name, touched - unwritten)


def assert_only_prefetches_before_the_wait(source: str, name: str) -> None:
    """Attention split kernel `name` waits once for its inputs; before that wait it reads only the step's
    host-written lengths, block tables and positions (no kernel of the step writes them) and touches the K/V
    cache only through L2 prefetches (dependent_launch.py): no value it computes with comes from a kernel's
    output before the wait."""
    from dflash_compiler.dependent_launch import PREFETCH_L2

    _, early, touched = before_the_wait(source, name)
    assert touched <= {"cache_lens_ptr", "block_table_ptr", "blk_positions_ptr", "kv_ptr"}, (name, touched)
    assert early.count("kv_ptr[") == early.count(f"{PREFETCH_L2}((&(kv_ptr["), name


def assert_split_waits_and_merge_triggers(
    source: str, split: str, merge: str, prefetch: bool = False, trigger: bool = False
) -> None:
    """An attention split kernel waits for its inputs before it reads any (with `prefetch`: before it
    computes with any) and lets its dependents in only with its knob `trigger`, after its wait (else they
    would sit resident beside it for its whole run); its merge kernel, a short one, reads only the step's
    lengths and positions before its wait, those with relaxed loads (which stay above the wait in the machine
    code), and lets the next grid in right after the wait (dependent_launch.py)."""
    import re

    from dflash_compiler.dependent_launch import LAUNCH_DEPENDENTS, LOAD_BEFORE_WAIT, WAIT, kernel_bodies

    bodies = {name: source[slice(*span)] for name, span in kernel_bodies(source).items()}
    if prefetch:
        assert_only_prefetches_before_the_wait(source, split)
    else:
        assert_only_weights_before_the_wait(source, split)
    assert (LAUNCH_DEPENDENTS in bodies[split]) == trigger, split
    body, early, touched = before_the_wait(source, merge)
    assert touched and touched <= {"cache_lens_ptr", "blk_positions_ptr"}, (merge, touched)
    reads = re.findall(r"\b(?:cache_lens|blk_positions)_ptr\[", early)
    assert len(reads) == early.count(f"{LOAD_BEFORE_WAIT}("), merge  # every one a relaxed load
    assert body[len(early) :].startswith(f"{WAIT}();\n  {LAUNCH_DEPENDENTS}();"), merge


def assert_split_grid_is_the_used_spans(split, spec, splits: int, slots: int, env: Mapping[str, int]) -> None:
    """The split kernel's grid is (used spans, kv heads, sequences) at several batch sizes: `splits`, or with
    `slots` the spans `slots // (nb · kv_heads)` a batch uses, at least one and at most `splits`; never a
    block that would only exit."""
    for nb in (1, 3, 8, 16):
        used = splits if slots == 0 else max(1, min(splits, slots // (nb * spec.kv_heads)))
        grid, _, _ = split.launch_dims({**env, "nb": nb, "m": nb * spec.block})
        assert grid == (used, spec.kv_heads, nb), (nb, grid, used)


def lowered_per_target(rule, cases):
    """`get(target)`: the CUDA module of `rule` applied to every `(spec, knobs, ...)` case, lowered once per target."""
    import tvm

    from dflash_compiler.codegen import lower_to_cuda

    cache = {}

    def get(target):
        if target.name not in cache:
            kernels = [rule.apply(spec, target, knobs) for spec, knobs, *_ in cases]
            cache[target.name] = lower_to_cuda(tvm.IRModule({k.name: k.func for k in kernels}), target)
        return cache[target.name]

    return get


def assert_imports_without_tvm(module: str) -> None:
    """Importing `module` in a fresh interpreter must not import TVM (the GPU box has none)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[2]
    code = f"import sys, {module}; assert 'tvm' not in sys.modules, 'importing {module} imported TVM'"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(repo), os.environ.get("PYTHONPATH", "")])}
    subprocess.run([sys.executable, "-c", code], check=True, cwd=repo, env=env, timeout=60)


def assert_nvrtc_builds(cuda, arch: str = "sm_90a") -> None:
    """NVRTC compiles a lowered module for `arch`; the cubin's ELF says so and holds every kernel."""
    from dflash_compiler.cubin import cubin_arch, kernel_names
    from dflash_compiler.nvrtc import compile_cubin

    cubin = compile_cubin(cuda.source, arch)
    assert cubin_arch(cubin) == arch
    assert set(cuda.kernel_names()) <= set(kernel_names(cubin))


def assert_rule_schedules_node(rule, inst, target, name: str, knobs: dict[str, int]):
    """`rule` takes the real node `inst`: its spec is named `name`, is a fixed point of `spec_of`, and the
    scheduled kernel keeps the spec's parameters (the node's inputs in order, then its output)."""
    spec = rule.spec_of(inst)
    assert spec is not None and spec.name == name
    assert rule.spec_of(spec) is spec
    kernel = rule.apply(inst, target)
    assert kernel is not None and kernel.name == name and kernel.rule == rule.name
    assert dict(kernel.knobs) == knobs
    assert kernel.func.attrs["tirx.is_scheduled"]
    assert "tirx.is_scheduled" not in kernel.reference.attrs
    assert [p.name for p in kernel.func.params] == [p.name for p in spec.params()]
    assert len(spec.params()) == len(inst.inputs) + 1
    return kernel


def kernel_bodies(source: str) -> dict[str, str]:
    """Every kernel definition's body in a module's CUDA source, by kernel name, in source order."""
    import re

    pattern = r"__global__ void __launch_bounds__\(\d+\) (\w+)\([^)]*\) \{\n(.*?)\n\}\n"
    return {m.group(1): m.group(2) for m in re.finditer(pattern, source, re.S)}


def _python(expr: str) -> str:
    """A CUDA integer expression of TVM's output as Python (ints are non-negative there: / and % agree)."""
    import re

    expr = re.sub(r"\(\(int\)(threadIdx|blockIdx)\.([xyz])\)", lambda m: f"{m.group(1)[0]}{m.group(2)}", expr)
    expr = expr.replace("(int)", "").replace("/", "//").replace("&&", " and ").replace("||", " or ")
    return re.sub(r"!(?!=)", " not ", expr)


def _enclosed(line: str, start: int, pair: str) -> str:
    depth, end = 1, start
    while depth:
        depth += {pair[0]: 1, pair[1]: -1}.get(line[end], 0)
        end += 1
    return line[start : end - 1]


def weight_reads(body: str) -> list[tuple[Any, dict[str, int], list[Any]]]:
    """(address, loop extents, enclosing conditions) of each read of `w_ptr` in a kernel body, in order: the
    address and each condition as a function of the indices (tx .. bz, loop variables, m), from the
    braces' nesting of TVM's CUDA (`for (int v = 0; v < N; ++v) {`, `if (c) {`, `} else {`)."""
    import re

    def compiled(expr: str) -> Any:
        code = compile(_python(expr), "<cuda>", "eval")
        return lambda env: eval(code, {"min": min, "max": max}, dict(env))

    out, stack = [], []
    for line in body.splitlines():
        text = line.strip()
        for m in re.finditer(r"w_ptr(\[|\s*\+\s*)", line):
            address = _enclosed(line, m.end(), "[]" if m.group(1) == "[" else "()")
            loops = {e[1]: e[2] for e in stack if e[0] == "for"}
            out.append((compiled(address), loops, [compiled(e[1]) for e in stack if e[0] == "if"]))
        if text.startswith("} else {"):
            kind = stack.pop()
            stack.append(("if", f"!({kind[1]})") if kind[0] == "if" else ("other",))
            continue
        for _ in range(text.count("}") if text.startswith("}") else 0):
            stack.pop()
        if text.endswith("{"):
            loop = re.match(r"for \(int (\w+) = 0; \1 < (\d+); \+\+\1\) \{", text)
            if loop:
                stack.append(("for", loop.group(1), int(loop.group(2))))
            elif text.startswith("if ("):
                stack.append(("if", text[3:-1].strip()))
            else:
                stack.append(("other",))
    return out
