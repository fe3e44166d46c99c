"""`sass`: a cubin's machine code per kernel, read with nvdisasm; the relaxed load that keeps a read above
the dependent-launch wait (dependent_launch.py)."""

from __future__ import annotations

import pytest

pytest.importorskip("cuda.bindings.nvrtc")

from dflash_compiler.dependent_launch import LAUNCH_DEPENDENTS, LOAD_BEFORE_WAIT, PRELUDE, WAIT
from dflash_compiler.nvrtc import compile_cubin
from dflash_compiler.sass import TRIGGER, kernel_opcodes, loads_before_wait
from dflash_compiler.sass import WAIT as WAIT_SASS

KERNELS = f"""
extern "C" __global__ void __launch_bounds__(128) relaxed(const float* __restrict__ w, const float* __restrict__ x,
                                                           float* __restrict__ y, int n) {{
  float wv[4];
  {LOAD_BEFORE_WAIT}(wv, w + 4 * threadIdx.x, 16);
  {WAIT}();
  {LAUNCH_DEPENDENTS}();
  if (threadIdx.x < n) y[threadIdx.x] = (wv[0] + wv[1] + wv[2] + wv[3]) * x[threadIdx.x];
}}
extern "C" __global__ void __launch_bounds__(128) waits_first(const float* __restrict__ x, float* __restrict__ y) {{
  {WAIT}();
  y[threadIdx.x] = x[threadIdx.x] * 2.0f;
}}
"""


@pytest.fixture(scope="module")
def opcodes():
    return kernel_opcodes(compile_cubin(PRELUDE + KERNELS, "sm_90a"))


def test_every_kernel_is_read_with_its_opcodes_in_issue_order(opcodes):
    assert set(opcodes) == {"relaxed", "waits_first"}
    relaxed = opcodes["relaxed"]
    # predicates and modifiers dropped: the guarded store reads as STG, the 16-byte relaxed load as LDG
    assert relaxed.count(WAIT_SASS) == relaxed.count(TRIGGER) == 1 and relaxed.index(WAIT_SASS) < relaxed.index(TRIGGER)
    assert relaxed.count("LDG") == 2 and relaxed.count("STG") == 1 and "EXIT" in relaxed
    assert all(op.isupper() and "." not in op for op in relaxed)


def test_a_relaxed_load_stays_above_the_wait(opcodes):
    assert loads_before_wait(opcodes["relaxed"]) == 1  # w's, not x's
    assert loads_before_wait(opcodes["waits_first"]) == 0
    assert loads_before_wait(("LDG", "CCTL", "LDGSTS", "FFMA")) == 3  # no wait: every load counts


def test_a_missing_or_failing_disassembler_says_what_to_do(monkeypatch):
    import cuda.pathfinder as pf

    from dflash_compiler.sass import SassError

    with pytest.raises(SassError, match="nvdisasm failed on a 64-byte cubin"):
        kernel_opcodes(b"\x7fELF" + bytes(60))
    monkeypatch.setattr(pf, "find_nvidia_binary_utility", lambda name: None)
    with pytest.raises(SassError, match="pip install nvidia-cuda-nvdisasm"):
        kernel_opcodes(b"")
