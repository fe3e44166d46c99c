"""Run a phase's kernel plan on the CPU: every call is the llvm build of its kernel's unscheduled PrimFunc.

This checks everything between the graph and the GPU schedules — which kernel each node gets, how its
parameters bind graph values (views included), how its sizes bind the dims — against the numpy
interpreter, on a machine without a GPU. Only the CUDA schedules' index math is left to the GPU tests.
"""

from __future__ import annotations

from collections.abc import Mapping

import ml_dtypes
import numpy as np

from dflash_compiler.ir.graph import Graph, eval_dim
from dflash_compiler.ir.weights import WeightCache
from dflash_compiler.kernel_plan import KernelPlan
from dflash_compiler.launch_plan import phase_plan
from dflash_compiler.plans import numpy_dtype


def run_plan_on_cpu(
    graph: Graph,
    plan: KernelPlan,
    inputs: Mapping[str, np.ndarray],
    weights: WeightCache,
    state: dict[str, np.ndarray],
    dims: Mapping[str, int],
    values_out: dict[str, np.ndarray] | None = None,
) -> dict[str, np.ndarray]:
    """The phase's OUTPUT values; `state` (the KV cache, stored in its graph dtype) is updated in place.

    With `values_out`, every value's buffer is left there by name (for node-by-node comparisons).
    """
    import tvm
    from kernel_harness import _llvm_build

    launch = phase_plan(graph, plan)
    values: dict[str, np.ndarray] = {}
    for name, slot in launch.values.items():
        shape = tuple(eval_dim(d, dims) for d in slot.shape)
        if slot.kind == "input":
            values[name] = np.ascontiguousarray(np.asarray(inputs[name]).astype(numpy_dtype(slot.dtype)))
        elif slot.kind == "weight":
            values[name] = np.ascontiguousarray(
                weights.get(graph.node(name).attr("decl")).astype(numpy_dtype(slot.dtype))
            )
        elif slot.kind == "state":
            values[name] = state[name]
        elif slot.kind in ("scratch", "output"):
            values[name] = np.zeros(shape, numpy_dtype(slot.dtype))
    dev = tvm.cpu()
    for call in plan.calls:
        kernel = plan.kernels[call.kernel]
        sizes = {var: eval_dim(expr, dims) for var, expr in call.sizes}
        tensors, views = [], {}
        for param, binding in call.buffers:
            base = values[launch.resolve(binding.value)]
            view = base[binding.index] if binding.index else base
            views[param] = (view, binding)
            tensors.append(tvm.runtime.tensor(np.ascontiguousarray(view), dev))
        for p in kernel.spec.params():
            shape = tuple(sizes[d] if isinstance(d, str) else d for d in p.shape)
            got = views[p.name][0].shape
            assert got == shape, f"{call.node}: {p.name} bound to {got}, the kernel expects {shape}"
        _llvm_build(kernel.spec)[kernel.name](*tensors)
        for (param, (view, _)), tensor in zip(views.items(), tensors, strict=True):
            if next(p for p in kernel.spec.params() if p.name == param).written:
                view[...] = tensor.numpy()
    if values_out is not None:
        values_out.update(values)
    return {name: values[launch.resolve(value)] for name, value in launch.outputs}


class PlanDrafter:
    """The kernel plans behind the drafter API, run on the CPU: the page allocator and step inputs of the
    runtime, a bf16 KV cache, and every call an llvm build of its kernel (see `run_plan_on_cpu`)."""

    def __init__(self, program, plans, tensors, num_pages: int, max_seq_len: int) -> None:
        from dflash_compiler.graph_runner import GraphDrafter

        self._graph = GraphDrafter(program, tensors, num_pages, max_seq_len)  # owns pages, weights, cfg
        self.program, self.plans = program, plans
        self.kv = {"kv_cache": self._graph.kv.astype(ml_dtypes.bfloat16)}

    def __getattr__(self, name: str):  # create / free / rollback / length
        return getattr(self._graph, name)

    def append_context(self, seq_ids, taps, positions) -> None:
        from dflash_compiler.runtime.steps import context_step

        step = context_step(self._graph.pages, seq_ids, positions)
        rows = np.concatenate([np.asarray(t, np.float32) for t in taps])
        inputs = {"taps": rows, "ctx_positions": step.positions, "ctx_slots": step.slots}
        dims = {"ctx": len(step.slots), "pages": self._graph.pages.num_pages}
        run_plan_on_cpu(
            self.program.append_context, self.plans["append_context"], inputs, self._graph.weights, self.kv, dims
        )

    def propose(self, seq_ids, anchors):
        from dflash_compiler.graph_runner import Drafts
        from dflash_compiler.runtime.steps import propose_step

        block = self._graph.cfg.block_size
        step = propose_step(self._graph.pages, seq_ids, block)
        inputs = {
            "anchors": np.asarray(anchors, np.int32),
            "blk_positions": step.positions,
            "block_table": step.block_table,
            "cache_lens": step.cache_lens,
        }
        dims = {
            "nb": len(seq_ids),
            "blk": block,
            "pages": self._graph.pages.num_pages,
            "maxp": step.block_table.shape[1],
        }
        out = run_plan_on_cpu(self.program.propose, self.plans["propose"], inputs, self._graph.weights, self.kv, dims)
        conf = out.get("confidences")
        shape = (len(seq_ids), block - 1)
        return Drafts(np.asarray(out["tokens"]).reshape(shape), None if conf is None else conf.reshape(shape))
