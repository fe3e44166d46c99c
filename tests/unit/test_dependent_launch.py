"""The dependent-launch rewrite of generated CUDA source (dependent_launch.py)."""

from __future__ import annotations

import pytest

from dflash_compiler.dependent_launch import (
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
}
"""


def _body(source: str, name: str) -> str:
    start, end = kernel_bodies(source)[name]
    return source[start:end]


def test_every_kernel_waits_for_its_inputs_first_unless_it_schedules_the_wait():
    out = add_dependent_launch(SOURCE)
    assert out.startswith(PRELUDE) and out.count(PRELUDE) == 1
    assert sorted(kernel_bodies(out)) == ["first", "second"]  # the declaration line is not a definition
    first = _body(out, "first")
    assert first.split("\n")[1:3] == [f"  {WAIT}();", "  a_ptr[threadIdx.x] = 1.0f;"]
    second = _body(out, "second")  # schedules its own wait after the weight prefetch: not a second one
    assert second.split("\n")[1:3] == ["  dflash_prefetch_l2(b_ptr);", f"  {WAIT}();"]
    assert second.count(f"{WAIT}();") == 1
    assert out.replace(PRELUDE, "").replace(f"\n  {WAIT}();", "", 1) == SOURCE
    assert "griddepcontrol.wait;" in PRELUDE and "griddepcontrol.launch_dependents;" in PRELUDE


def test_the_rewrite_refuses_what_it_cannot_read():
    with pytest.raises(DependentLaunchError, match="already"):
        add_dependent_launch(add_dependent_launch(SOURCE))
    with pytest.raises(DependentLaunchError, match="no 'extern"):
        add_dependent_launch("__device__ int f() { return 1; }\n")
    with pytest.raises(DependentLaunchError, match="kernel first has no closing line"):
        kernel_bodies(SOURCE.split("}\n\n")[0])
