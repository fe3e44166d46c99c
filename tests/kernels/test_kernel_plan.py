"""Kernel plan: node → kernel, parameter → graph value, size variable → graph dim; shared kernels; errors."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from dflash_compiler.ir import Graph, Node, Op, TensorType
from dflash_compiler.kernel_plan import BufferView, KernelPlanError, schedule_graph
from dflash_compiler.schedules import RMSNormRule
from dflash_compiler.schedules.base import Param
from dflash_compiler.schedules.rmsnorm import RMSNormSpec
from dflash_compiler.targets import SM90

pytest.importorskip("tvm")

BF16 = "bfloat16"


def _norm_graph(width: int = 64, rows: str = "nb*blk") -> Graph:
    g = Graph("propose", {"nb": "", "blk": ""})
    x = g.add("x", Node.make(Op.INPUT, [TensorType(BF16, (rows, width))]))
    w0 = g.add("w0", Node.make(Op.WEIGHT, [TensorType(BF16, (width,))], decl="w0"))
    w1 = g.add("w1", Node.make(Op.WEIGHT, [TensorType(BF16, (width,))], decl="w1"))
    n0 = g.add("n0", Node.make(Op.RMSNORM, [TensorType(BF16, (rows, width))], eps=1e-6), [x, w0])
    n1 = g.add("n1", Node.make(Op.RMSNORM_RESIDUAL, [TensorType(BF16, (rows, width))] * 2, eps=1e-6), [x, n0, w1])
    g.add("out", Node.make(Op.OUTPUT, [TensorType(BF16, (rows, width))]), [n1.__class__(n1.node, 1)])
    return g


def test_calls_bind_values_and_sizes():
    plan = schedule_graph(_norm_graph(), SM90, rules=(RMSNormRule(),))
    assert [c.node for c in plan.calls] == ["n0", "n1"]
    assert sorted(plan.kernels) == ["rmsnorm_h64", "rmsnorm_residual_h64"]
    n0, n1 = plan.calls
    assert dict(n0.buffers) == {"x": BufferView("x"), "w": BufferView("w0"), "y": BufferView("n0")}
    assert dict(n0.sizes) == {"m": "nb*blk"}
    assert dict(n1.buffers) == {
        "a": BufferView("x"),
        "b": BufferView("n0"),
        "w": BufferView("w1"),
        "s": BufferView("n1"),
        "y": BufferView("n1:1"),
    }
    assert "n1: rmsnorm_residual_h64(a=x, b=n0, w=w1, s=n1, y=n1:1) [m=nb*blk]" in plan.render()


def test_equal_specs_share_one_kernel_across_graphs():
    kernels: dict = {}
    first = schedule_graph(_norm_graph(), SM90, rules=(RMSNormRule(),), kernels=kernels)
    second = schedule_graph(_norm_graph(rows="ctx"), SM90, rules=(RMSNormRule(),), kernels=kernels)
    assert first.kernels["rmsnorm_h64"] is second.kernels["rmsnorm_h64"]
    assert dict(second.calls[0].sizes) == {"m": "ctx"}


@dataclass(frozen=True)
class _FixedRows(RMSNormSpec):
    """A spec that (wrongly) fixes the row count: the plan must refuse it for a symbolic graph."""

    def params(self) -> tuple[Param, ...]:
        return tuple(
            Param(p.name, p.dtype, tuple(16 if d == "m" else d for d in p.shape), p.role) for p in super().params()
        )


class _FixedRule(RMSNormRule):
    def spec_of(self, subject):
        spec = super().spec_of(subject)
        return None if spec is None else _FixedRows(hidden=spec.hidden, eps=spec.eps, residual=spec.residual)

    def apply(self, subject, target, knobs=None):
        kernel = super().apply(subject, target, knobs)
        spec = self.spec_of(subject)
        return (
            None
            if kernel is None
            else kernel.__class__(kernel.name, kernel.func, kernel.reference, kernel.rule, kernel.knobs, spec)
        )


def test_kernel_fixing_a_symbolic_dim_is_refused():
    with pytest.raises(
        KernelPlanError,
        match="n0: kernel rmsnorm_h64 parameter x fixes a dim to 16; the graph value x has nb\\*blk there",
    ):
        schedule_graph(_norm_graph(), SM90, rules=(_FixedRule(),))


def test_dtype_mismatch_is_refused():
    g = Graph("propose", {})
    x = g.add("x", Node.make(Op.INPUT, [TensorType("float32", ("m", 64))]))
    w = g.add("w", Node.make(Op.WEIGHT, [TensorType(BF16, (64,))], decl="w"))
    g.add("n", Node.make(Op.RMSNORM, [TensorType(BF16, ("m", 64))], eps=1e-6), [x, w])
    with pytest.raises(KernelPlanError, match="parameter x is bfloat16, the graph value x is float32"):
        schedule_graph(g, SM90, rules=(RMSNormRule(),))
