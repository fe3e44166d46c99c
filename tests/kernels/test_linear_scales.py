"""The e4m3 linears' row scales (linear_tiled.row_scales_macro): every GEMM kernel of an FP8 linear (the 16-row
small tiled kernel, the warpgroup GEMMs, the silu and argmax epilogues) reads a thread's scales into registers
with its first weight copies, before its wait for inputs, and its epilogue reads none from memory: in the
machine code no global load follows the last mma. The values against numpy: tests/gpu over a bench/kernels.py
bundle.
"""

from __future__ import annotations

import re

import pytest

from dflash_compiler.dependent_launch import WAIT, kernel_bodies
from dflash_compiler.schedules.linear import FP8, LinearSpec
from dflash_compiler.schedules.linear_rules import LinearArgmaxRule, LinearMmaRule, LinearSiluRule
from dflash_compiler.schedules.linear_tiled import row_scale_count
from dflash_compiler.targets import SM90

tvm = pytest.importorskip("tvm")
pytest.importorskip("cuda.bindings")

from dflash_compiler.codegen import lower_to_cuda  # noqa: E402 - needs TVM
from dflash_compiler.nvrtc import compile_cubin  # noqa: E402 - after the TVM skip, as the other kernel tests
from dflash_compiler.sass import kernel_opcodes  # noqa: E402

CASES = [  # Qwen3-8B drafter shapes: o_proj (small tiled kernel, 64- and 128-row GEMMs), gate_up, lm_head
    (LinearMmaRule(), LinearSpec("matmul_fp8", 4096, 4096, weight_dtype=FP8, tiles=64)),
    (LinearSiluRule(), LinearSpec("matmul_silu", 24576, 4096, weight_dtype=FP8, tiles=64)),
    (LinearArgmaxRule(), LinearSpec("lm_head_argmax", 151936, 4096, weight_dtype=FP8, tiles=64)),
]
MMAS = ("HMMA", "HGMMA")


@pytest.fixture(scope="module")
def built():
    kernels = [rule.apply(spec, SM90) for rule, spec in CASES]
    cuda = lower_to_cuda(tvm.IRModule({k.name: k.func for k in kernels}), SM90)
    return cuda, kernel_opcodes(compile_cubin(cuda.source, SM90.arch))


def _gemms(source: str) -> dict[str, str]:
    """The kernels that multiply (their merges and pick merges read no weight): name → CUDA body."""
    bodies = {name: source[start:end] for name, (start, end) in kernel_bodies(source).items()}
    return {name: body for name, body in bodies.items() if "mma" in body}


def test_a_thread_holds_two_scales_per_weight_tile():
    assert row_scale_count(type("Plan", (), {"n_tiles": 4})) == 8


def test_scales_are_read_before_the_wait_and_never_in_the_epilogue(built):
    cuda, opcodes = built
    gemms = _gemms(cuda.source)
    # o_proj: small tiled, mid and large GEMMs; gate_up: few rows, mid, large; lm_head: the same
    assert len(gemms) == 9, sorted(gemms)
    for name, body in gemms.items():
        reads = [m.start() for m in re.finditer(r"scale_ptr\[", body)]
        assert reads and max(reads) < body.index(f"{WAIT}();"), name
        code = opcodes[name]
        last_mma = max(i for i, op in enumerate(code) if op in MMAS)
        assert "LDG" not in code[last_mma:], (name, code[last_mma:].count("LDG"))


def test_bf16_weights_read_no_scales():
    kernel = LinearMmaRule().apply(LinearSpec("matmul", 4096, 4096, tiles=64), SM90)
    cuda = lower_to_cuda(tvm.IRModule({kernel.name: kernel.func}), SM90)
    assert "scale_ptr" not in cuda.source and "sc_ptr" not in cuda.source
