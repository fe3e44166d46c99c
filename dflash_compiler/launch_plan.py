"""The launch plan of one phase: where every value lives and which kernels run in which order.

This is what the runtime executes, so it is plain data (pydantic, in the manifest) and holds no model
code. Every value of the phase graph is one of:

* ``input``   a buffer the runtime fills before the call (taps, positions, page slots, block tables);
* ``weight``  a tensor of ``weights.safetensors`` under the WEIGHT node's name;
* ``state``   the paged KV cache;
* ``scratch`` a range of the phase's arena at the memory plan's offset;
* ``output``  a buffer of its own that the caller reads after the call (the values OUTPUT nodes return);
* ``alias``   another value's buffer (a KV write updates the cache in place; an OUTPUT names its input).

Shapes keep the graph's symbolic dims (``nb*blk``); the runtime allocates at the dims' maxima, which the
memory plan records, and evaluates sizes per call.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict

from dflash_compiler.ir.graph import Graph, Ref
from dflash_compiler.ir.ops import CACHE_WRITES, Op
from dflash_compiler.kernel_plan import KernelPlan
from dflash_compiler.plans import MemoryPlan

ValueKind = Literal["input", "weight", "state", "scratch", "output", "alias"]


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class ValueSlot(_Frozen):
    kind: ValueKind
    dtype: str
    shape: tuple[int | str, ...]
    offset: int | None = None  # scratch: byte offset in the arena
    alias: str | None = None  # alias: the value whose buffer this is


class BufferBinding(_Frozen):
    param: str
    value: str
    index: tuple[int, ...] = ()  # leading indices: the binding is the sub-tensor value[index...]


class CallRecord(_Frozen):
    node: str
    kernel: str  # a host function of the kernel table
    buffers: tuple[BufferBinding, ...]
    sizes: tuple[tuple[str, str], ...]  # kernel size variable -> expression over the phase dims


class PhasePlan(_Frozen):
    name: str
    dims: tuple[str, ...]
    dim_maxima: tuple[tuple[str, int], ...]  # what buffers are allocated for
    arena_bytes: int
    values: dict[str, ValueSlot]
    inputs: tuple[str, ...]
    outputs: tuple[tuple[str, str], ...]  # OUTPUT node -> the value it returns
    calls: tuple[CallRecord, ...]

    def resolve(self, value: str) -> str:
        """The value that owns the buffer behind `value` (follows aliases)."""
        seen = set()
        while self.values[value].kind == "alias":
            if value in seen:
                raise ValueError(f"{self.name}: alias cycle at {value}")
            seen.add(value)
            value = self.values[value].alias or ""
        return value


def phase_plan(graph: Graph, plan: KernelPlan) -> PhasePlan:
    """The launch plan of an optimized, memory-planned phase graph and its kernel plan."""
    memory = graph.meta["memory"]
    if not isinstance(memory, MemoryPlan):
        raise TypeError(f"{graph.name}: the graph has no memory plan; run plan_memory first")
    scratch = {Ref(b.node, b.port): b.offset for b in memory.buffers}
    values: dict[str, ValueSlot] = {}
    inputs, outputs = [], []
    for name in graph.topo():
        node = graph.node(name)
        args = graph.inputs(name)
        for port, ttype in enumerate(node.outputs):
            ref = Ref(name, port)
            kind: ValueKind
            offset = alias = None
            if node.op is Op.INPUT:
                kind = "input"
                inputs.append(name)
            elif node.op is Op.WEIGHT:
                kind = "weight"
            elif node.op is Op.STATE:
                kind = "state"
            elif node.op in (*CACHE_WRITES, Op.OUTPUT):
                kind, alias = "alias", args[0].render()
                if node.op is Op.OUTPUT:
                    outputs.append((name, args[0].render()))
            elif ref in scratch:
                kind, offset = "scratch", scratch[ref]
            else:
                kind = "output"
            values[ref.render()] = ValueSlot(
                kind=kind, dtype=ttype.dtype, shape=ttype.shape, offset=offset, alias=alias
            )
    calls = tuple(
        CallRecord(
            node=call.node,
            kernel=call.kernel,
            buffers=tuple(BufferBinding(param=p, value=v.value, index=v.index) for p, v in call.buffers),
            sizes=call.sizes,
        )
        for call in plan.calls
    )
    return PhasePlan(
        name=graph.name,
        dims=tuple(graph.dims),
        dim_maxima=memory.bindings,
        arena_bytes=memory.arena_bytes,
        values=values,
        inputs=tuple(inputs),
        outputs=tuple(outputs),
        calls=calls,
    )
