"""The dependent-launch rewrite of generated CUDA source (dependent_launch.py)."""

from __future__ import annotations

import pytest

from dflash_compiler.dependent_launch import (
    LAUNCH_DEPENDENTS,
    PRELUDE,
    WAIT,
    DependentLaunchError,
    add_dependent_launch,
    kernel_bodies,
)

SOURCE = """#include <cuda_bf16.h>
extern "C" __global__ void __launch_bounds__(64) first(float* __restrict__ a_ptr, int m);
extern "C" __global__ void __launch_bounds__(64) first(float* __restrict__ a_ptr, int m) {
  a_ptr[threadIdx.x] = 1.0f;
  if (m > 0) {
    a_ptr[0] = 2.0f;
  }
}

extern "C" __global__ void second(float* __restrict__ b_ptr) {
  dflash_prefetch_l2(b_ptr);
  dflash_wait_for_inputs();
  b_ptr[0] = 3.0f;
  dflash_launch_dependents();
}

extern "C" __global__ void third(float* __restrict__ c_ptr) {
  float acc[4];
  dflash_wait_for_inputs();
  c_ptr[0] = 4.0f;
}
"""


def _body(source: str, name: str) -> str:
    start, end = kernel_bodies(source)[name]
    return source[start:end]


def test_short_kernels_wait_then_let_the_next_in_and_scheduled_ones_keep_their_own_placement():
    out = add_dependent_launch(SOURCE)
    assert out.startswith(PRELUDE) and out.count(PRELUDE) == 1
    assert sorted(kernel_bodies(out)) == ["first", "second", "third"]  # the declaration is not a definition
    # a kernel whose schedule does not wait: the wait, then the trigger, before anything else
    first = _body(out, "first")
    assert first.split("\n")[1:4] == [f"  {WAIT}();", f"  {LAUNCH_DEPENDENTS}();", "  a_ptr[threadIdx.x] = 1.0f;"]
    # a weight stream: its prefetch before its own wait, its trigger where it put it, nothing added
    second = _body(out, "second")
    assert second.split("\n")[1:3] == ["  dflash_prefetch_l2(b_ptr);", f"  {WAIT}();"]
    assert second.count(f"{WAIT}();") == 1 and second.count(f"{LAUNCH_DEPENDENTS}();") == 1
    # a long kernel that waits and never triggers: its dependents come in as its blocks exit
    third = _body(out, "third")
    assert third.count(f"{WAIT}();") == 1 and LAUNCH_DEPENDENTS not in third
    assert out.replace(PRELUDE, "").replace(f"\n  {WAIT}();\n  {LAUNCH_DEPENDENTS}();", "", 1) == SOURCE
    assert "griddepcontrol.wait;" in PRELUDE and "griddepcontrol.launch_dependents;" in PRELUDE


def test_the_rewrite_refuses_what_it_cannot_read():
    with pytest.raises(DependentLaunchError, match="already"):
        add_dependent_launch(add_dependent_launch(SOURCE))
    with pytest.raises(DependentLaunchError, match="no 'extern"):
        add_dependent_launch("__device__ int f() { return 1; }\n")
    with pytest.raises(DependentLaunchError, match="kernel first has no closing line"):
        kernel_bodies(SOURCE.split("}\n\n")[0])


def test_a_trigger_before_the_wait_is_refused():
    early = SOURCE.replace(
        "  dflash_prefetch_l2(b_ptr);\n  dflash_wait_for_inputs();",
        "  dflash_launch_dependents();\n  dflash_wait_for_inputs();",
    )
    with pytest.raises(DependentLaunchError, match=r"kernel second calls dflash_launch_dependents\(\) before"):
        add_dependent_launch(early)
    alone = SOURCE.replace("  dflash_wait_for_inputs();\n  b_ptr[0] = 3.0f;", "  b_ptr[0] = 3.0f;")
    with pytest.raises(DependentLaunchError, match="kernel second"):
        add_dependent_launch(alone)
