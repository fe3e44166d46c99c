"""Execute one phase's launch plan: buffers, pointers, sizes, launches, and CUDA graphs of them.

Generic by design: it reads the manifest's launch plan and kernel table and knows nothing about the
model. Buffers are allocated once at the dims' maxima (the memory plan's bindings); a call binds the
actual dims, from which every kernel's sizes, launch extents and scalar arguments follow.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from dflash_compiler.codegen import HostFunction, KernelLaunch
from dflash_compiler.ir.graph import eval_dim
from dflash_compiler.launch_plan import BufferBinding, PhasePlan
from dflash_compiler.plans import dtype_bytes
from dflash_compiler.runtime.cuda import CudaError, CudaGraph, Device, Module, Stream
from dflash_compiler.runtime.expr import evaluate


@dataclass(frozen=True)
class PreparedLaunch:
    launch: KernelLaunch
    pointers: Mapping[str, int]
    env: Mapping[str, int]
    node: str  # the graph node the launch computes (a node may launch several kernels)


class PhaseExecutor:
    """One phase's buffers on the device and its launch sequence for given dims."""

    def __init__(
        self,
        device: Device,
        module: Module,
        plan: PhasePlan,
        kernels: Mapping[str, HostFunction],
        external: Mapping[str, int],
    ) -> None:
        """`external` gives the address of every weight and state value (they are not the phase's to own)."""
        self.device, self.module, self.plan, self.kernels = device, module, plan, kernels
        self.maxima = dict(plan.dim_maxima)
        self._owned: list[int] = []
        self.arena = self._alloc(plan.arena_bytes)
        self.base: dict[str, int] = {}
        for name, slot in plan.values.items():
            if slot.kind in ("weight", "state"):
                if name not in external:
                    raise CudaError(f"{plan.name}: no device buffer given for {slot.kind} {name}")
                self.base[name] = external[name]
            elif slot.kind == "scratch":
                self.base[name] = self.arena + int(slot.offset or 0)
            elif slot.kind in ("input", "output"):
                self.base[name] = self._alloc(self.max_bytes(name))
        # zero-filled: a kernel may keep counts there that it returns to zero itself (linear_wgmma.last_store_macro)
        self.workspaces = {
            (fn.name, ws.name): self._alloc_zeroed(self._workspace_bytes(fn.name, ws.shape, ws.dtype))
            for fn in kernels.values()
            for ws in fn.workspaces
        }
        self._prepared: dict[tuple[tuple[str, int], ...], list[PreparedLaunch]] = {}

    # buffers ------------------------------------------------------------------------------------
    def _alloc(self, nbytes: int) -> int:
        pointer = self.device.alloc(nbytes)
        self._owned.append(pointer)
        return pointer

    def _alloc_zeroed(self, nbytes: int) -> int:
        pointer = self._alloc(nbytes)
        self.device.zero(pointer, nbytes)
        return pointer

    def shape(self, value: str, dims: Mapping[str, int]) -> tuple[int, ...]:
        return tuple(eval_dim(d, dims) for d in self.plan.values[value].shape)

    def max_bytes(self, value: str) -> int:
        slot = self.plan.values[value]
        return math.prod(self.shape(value, self.maxima)) * dtype_bytes(slot.dtype)

    def _workspace_bytes(self, kernel: str, shape: tuple[str, ...], dtype: str) -> int:
        """Workspace size at the largest sizes any call of `kernel` takes."""
        most = 0
        for call in self.plan.calls:
            if call.kernel == kernel:
                sizes = {var: eval_dim(expr, self.maxima) for var, expr in call.sizes}
                most = max(most, math.prod(evaluate(d, sizes) for d in shape))
        return most * dtype_bytes(dtype)

    def address(self, binding: BufferBinding, dims: Mapping[str, int]) -> int:
        owner = self.plan.resolve(binding.value)
        pointer = self.base[owner]
        if binding.index:
            shape = self.shape(owner, dims)
            inner = math.prod(shape[len(binding.index) :])
            flat = 0
            for i, (idx, extent) in enumerate(zip(binding.index, shape, strict=False)):
                if not 0 <= idx < extent:
                    raise CudaError(f"{binding.value}[{binding.index}]: index {i} out of range {extent}")
                flat = flat * extent + idx
            pointer += flat * inner * dtype_bytes(self.plan.values[owner].dtype)
        return pointer

    # host <-> device ----------------------------------------------------------------------------
    def write_input(self, name: str, array: np.ndarray, stream: Stream | None = None) -> None:
        slot = self.plan.values[name]
        host = np.ascontiguousarray(array)
        if host.nbytes > self.max_bytes(name):
            raise CudaError(f"{self.plan.name}: input {name} of {host.nbytes} B exceeds its {self.max_bytes(name)} B")
        if host.dtype.itemsize != dtype_bytes(slot.dtype):
            raise CudaError(f"{self.plan.name}: input {name} is {slot.dtype}, got an array of {host.dtype}")
        self.device.upload(host, self.base[name], stream)

    def read_value(self, name: str, dims: Mapping[str, int], dtype: Any, stream: Stream | None = None) -> np.ndarray:
        return self.device.download(self.base[self.plan.resolve(name)], self.shape(name, dims), dtype, stream)

    # launches -----------------------------------------------------------------------------------
    def prepared(self, dims: Mapping[str, int]) -> list[PreparedLaunch]:
        """The launch sequence for `dims` (computed once per distinct dims)."""
        key = tuple(sorted(dims.items()))
        if key not in self._prepared:
            out = []
            for call in self.plan.calls:
                fn = self.kernels[call.kernel]
                env = {var: eval_dim(expr, dims) for var, expr in call.sizes}
                pointers = {b.param: self.address(b, dims) for b in call.buffers}
                pointers.update({ws: p for (k, ws), p in self.workspaces.items() if k == fn.name})
                out += [PreparedLaunch(launch, pointers, env, call.node) for launch in fn.launches(env)]
            self._prepared[key] = out
        return self._prepared[key]

    def record(self, dims: Mapping[str, int], handle: Any) -> None:
        """Launch the sequence for `dims` on stream `handle` (a capture records it into a graph)."""
        for p in self.prepared(dims):
            self.module.launch(p.launch, p.pointers, p.env, handle)

    def run(self, dims: Mapping[str, int], stream: Stream | None = None) -> None:
        self.record(dims, 0 if stream is None else stream.handle)

    def close(self) -> None:
        for pointer in self._owned:
            self.device.free(pointer)
        self._owned.clear()


class GraphCache:
    """CUDA graphs of phase launch sequences run back to back, captured on first use of each combination of
    phases and dims and replayed after. A chain of several phases is one graph: its first kernel follows the
    previous phase's last one on the GPU (as a dependent launch where the module launches so) with no host
    step or graph boundary between them."""

    def __init__(self) -> None:
        self._graphs: dict[tuple[tuple[int, tuple[tuple[str, int], ...]], ...], CudaGraph] = {}

    def run(self, chain: Sequence[tuple[PhaseExecutor, Mapping[str, int]]], stream: Stream) -> None:
        # keyed by the executors themselves: two drafters' phases of one name own different buffers
        key = tuple((id(phase), tuple(sorted(dims.items()))) for phase, dims in chain)
        if key not in self._graphs:

            def record(handle: Any) -> None:
                for phase, dims in chain:
                    phase.record(dims, handle)

            self._graphs[key] = CudaGraph(stream, record)
        self._graphs[key].launch(stream)

    def __len__(self) -> int:
        """Graphs captured so far."""
        return len(self._graphs)

    def close(self) -> None:
        for graph in self._graphs.values():
            graph.destroy()
        self._graphs.clear()
