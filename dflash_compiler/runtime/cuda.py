"""The CUDA driver through cuda-python: a context, device memory, a loaded cubin and kernel launches.

Launches are driven by the kernel table (`codegen.KernelLaunch`): pointer parameters come from a map of
buffer name → device address, scalar parameters and launch extents are the table's expressions evaluated
over the symbolic sizes. Nothing here imports TVM or torch; numpy is only used for host copies.
"""

from __future__ import annotations

import contextlib
import ctypes
import math
import threading
from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

import numpy as np

from dflash_compiler.cluster import non_portable
from dflash_compiler.errors import DFlashError
from dflash_compiler.runtime.expr import evaluate

if TYPE_CHECKING:
    from dflash_compiler.codegen import KernelLaunch


class CudaError(DFlashError):
    """A CUDA driver call failed; the message names the call and the driver's error string."""


_SCALAR_TYPES: dict[str, type[ctypes._SimpleCData[Any]]] = {
    "int32": ctypes.c_int32,
    "int64": ctypes.c_int64,
    "uint32": ctypes.c_uint32,
    "float32": ctypes.c_float,
    "float64": ctypes.c_double,
}
_STATIC_SMEM_LIMIT = 48 * 1024


def _driver() -> Any:
    from cuda.bindings import driver

    return driver


def check(result: Any, what: str) -> Any:
    """The value(s) of a cuda-python call that returns `(err, *values)`; CudaError when err is not success."""
    values = result if isinstance(result, tuple) else (result,)
    err = values[0]
    if int(err) != 0:
        _, text = _driver().cuGetErrorString(err)
        detail = text.decode() if isinstance(text, bytes) else str(text)
        raise CudaError(f"{what} failed: {err!r} ({detail})")
    if len(values) == 1:
        return None
    return values[1] if len(values) == 2 else values[1:]


class Device:
    """The primary context of one GPU, made current on the calling thread."""

    def __init__(self, ordinal: int = 0) -> None:
        cu = _driver()
        check(cu.cuInit(0), "cuInit")
        self.handle = check(cu.cuDeviceGet(ordinal), f"cuDeviceGet({ordinal})")
        self.context = check(cu.cuDevicePrimaryCtxRetain(self.handle), "cuDevicePrimaryCtxRetain")
        check(cu.cuCtxSetCurrent(self.context), "cuCtxSetCurrent")

    @property
    def compute_capability(self) -> tuple[int, int]:
        cu = _driver()
        attr = cu.CUdevice_attribute
        major = check(cu.cuDeviceGetAttribute(attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, self.handle), "cc")
        minor = check(cu.cuDeviceGetAttribute(attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, self.handle), "cc")
        return int(major), int(minor)

    @property
    def name(self) -> str:
        raw = check(_driver().cuDeviceGetName(256, self.handle), "cuDeviceGetName")
        return bytes(raw).split(b"\0", 1)[0].decode()

    def alloc(self, nbytes: int) -> int:
        return int(check(_driver().cuMemAlloc(max(int(nbytes), 1)), f"cuMemAlloc({nbytes})"))

    def free(self, pointer: int) -> None:
        check(_driver().cuMemFree(pointer), "cuMemFree")

    def upload(self, array: np.ndarray, pointer: int | None = None, stream: Stream | None = None) -> int:
        """Copy a host array to the device (a new allocation unless `pointer` is given); returns the address.

        With a stream the copy is ordered in it (and complete when this returns), so kernels queued on a
        non-blocking stream after it see the data.
        """
        host = np.ascontiguousarray(array)
        target = self.alloc(host.nbytes) if pointer is None else pointer
        if host.nbytes:
            cu = _driver()
            if stream is None:
                check(cu.cuMemcpyHtoD(target, host.ctypes.data, host.nbytes), "cuMemcpyHtoD")
            else:
                check(cu.cuMemcpyHtoDAsync(target, host.ctypes.data, host.nbytes, stream.handle), "cuMemcpyHtoDAsync")
                stream.synchronize()
        return target

    def download(self, pointer: int, shape: tuple[int, ...], dtype: Any, stream: Stream | None = None) -> np.ndarray:
        out = np.empty(shape, dtype)
        if out.nbytes:
            cu = _driver()
            if stream is None:
                check(cu.cuMemcpyDtoH(out.ctypes.data, pointer, out.nbytes), "cuMemcpyDtoH")
            else:
                check(cu.cuMemcpyDtoHAsync(out.ctypes.data, pointer, out.nbytes, stream.handle), "cuMemcpyDtoHAsync")
                stream.synchronize()
        return out

    def memset_async(self, pointer: int, nbytes: int, stream: Stream) -> None:
        check(_driver().cuMemsetD8Async(pointer, 0, nbytes, stream.handle), "cuMemsetD8Async")

    def zero(self, pointer: int, nbytes: int) -> None:
        check(_driver().cuMemsetD8(pointer, 0, nbytes), "cuMemsetD8")

    def copy(self, dst: int, src: int, nbytes: int, stream: Any = 0) -> None:
        check(_driver().cuMemcpyDtoDAsync(dst, src, nbytes, stream), "cuMemcpyDtoDAsync")

    def synchronize(self) -> None:
        check(_driver().cuCtxSynchronize(), "cuCtxSynchronize")


class EventTimer:
    """Milliseconds between two CUDA events on a stream (the figure benchmarks quote)."""

    def __init__(self, stream: Any = 0) -> None:
        cu = _driver()
        self.stream = stream
        self.start = check(cu.cuEventCreate(0), "cuEventCreate")
        self.stop = check(cu.cuEventCreate(0), "cuEventCreate")

    def __enter__(self) -> EventTimer:
        check(_driver().cuEventRecord(self.start, self.stream), "cuEventRecord")
        return self

    def __exit__(self, *exc: object) -> None:
        check(_driver().cuEventRecord(self.stop, self.stream), "cuEventRecord")

    def elapsed_ms(self) -> float:
        cu = _driver()
        check(cu.cuEventSynchronize(self.stop), "cuEventSynchronize")
        return float(check(cu.cuEventElapsedTime(self.start, self.stop), "cuEventElapsedTime"))


class HostGate:
    """Holds a stream until the host lets it go: `held(stream)` queues a wait on a word of mapped host memory,
    and the work queued inside the `with` starts on the GPU only once it exits. Benchmarks queue a whole timed
    step behind it, events included, so the host's time to submit the step (Python, a graph launch, their
    jitter) is never counted as GPU time.

    A gate left shut would stall its stream for good, so each hold opens by itself after `watchdog_s`, and then
    the `with` raises: the work inside waited on the gated stream (a synchronisation, a capture), and what was
    timed is not the GPU's time. `close()` (or leaving `with HostGate() as gate`) frees the word.
    """

    def __init__(self, watchdog_s: float = 5.0) -> None:
        cu = _driver()
        self.watchdog_s = watchdog_s
        self._host = check(cu.cuMemHostAlloc(4, cu.CU_MEMHOSTALLOC_DEVICEMAP), "cuMemHostAlloc")
        self._word = ctypes.c_uint32.from_address(int(self._host))
        self._word.value = 0
        self._device = check(cu.cuMemHostGetDevicePointer(self._host, 0), "cuMemHostGetDevicePointer")
        self._round = 0

    def __enter__(self) -> HostGate:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        if self._host is not None:
            check(_driver().cuMemFreeHost(self._host), "cuMemFreeHost")
            self._host = None

    def _open(self, round_: int) -> None:
        self._word.value = max(self._word.value, round_)

    @contextlib.contextmanager
    def held(self, stream: Any) -> Iterator[None]:
        cu = _driver()
        self._round += 1
        round_ = self._round
        geq = cu.CUstreamWaitValue_flags.CU_STREAM_WAIT_VALUE_GEQ
        check(cu.cuStreamWaitValue32(stream, self._device, round_, geq), "cuStreamWaitValue32")
        watchdog = threading.Timer(self.watchdog_s, self._open, (round_,))
        watchdog.start()
        try:
            yield
        finally:
            watchdog.cancel()
            opened_early = self._word.value >= round_
            self._open(round_)
        if opened_early:
            raise CudaError(
                f"the host gate opened after its {self.watchdog_s} s watchdog: the work queued behind it waited on "
                "the gated stream (a synchronisation or a capture inside the hold), so it was not timed as GPU "
                "work. Fix: warm up (capture, first launches) before holding the stream, and synchronise after"
            )


class Module:
    """A cubin loaded into the current context; launches kernels described by the kernel table.

    With `dependent_launch`, every launch carries the programmatic-stream-serialization attribute: the
    kernel may start before the previous kernel on the stream has finished, which is safe only for kernels
    that wait for their inputs (`dflash_compiler.dependent_launch`; every kernel the compiler emits does),
    and a grid of one wave or less claims the shared memory that spreads it over the SMs (`placement.py`),
    unless it runs in clusters. A kernel of clusters larger than portable is opted in to them (cluster.py).
    """

    def __init__(self, cubin: bytes, dependent_launch: bool = False) -> None:
        self.dependent_launch = dependent_launch
        self._launch_attrs = [_dependent_attribute()] if dependent_launch else []
        # a dependent grid of one wave or less is spread over the SMs (placement.py)
        self._sm = _sm_limits() if dependent_launch else None
        self._spread: dict[tuple[str, int, int, int], int] = {}
        self._image = np.frombuffer(cubin, np.uint8).copy()  # the driver reads it during load only; keep it anyway
        self.handle = check(_driver().cuModuleLoadData(self._image.ctypes.data), "cuModuleLoadData")
        self._functions: dict[str, Any] = {}
        self._smem_raised: dict[str, int] = {}
        self._non_portable: set[str] = set()

    def function(self, name: str) -> Any:
        if name not in self._functions:
            self._functions[name] = check(
                _driver().cuModuleGetFunction(self.handle, name.encode()), f"cuModuleGetFunction({name!r})"
            )
        return self._functions[name]

    def launch(
        self, launch: KernelLaunch, pointers: Mapping[str, int], env: Mapping[str, int], stream: Any = 0
    ) -> None:
        """One `cuLaunchKernel` of `launch`; `pointers` maps every pointer source to a device address."""
        cu = _driver()
        holders: list[ctypes._SimpleCData[Any]] = []
        for p in launch.params:
            if p.kind == "ptr":
                if p.source not in pointers:
                    raise CudaError(f"{launch.name}: no device buffer for parameter {p.name} (source {p.source!r})")
                holders.append(ctypes.c_uint64(int(pointers[p.source])))
            else:
                holders.append(_SCALAR_TYPES[p.dtype](evaluate(p.source, env)))
        argv = (ctypes.c_void_p * len(holders))(*[ctypes.addressof(h) for h in holders])
        grid, block, smem = launch.launch_dims(env)
        if 0 in grid:
            return  # nothing to do for zero rows
        func = self.function(launch.name)
        self.allow_shared(func, launch.name, smem)
        if non_portable(launch.cluster):
            self._allow_non_portable(func, launch.name)
        # the driver places a clustered grid cluster by cluster: spreading one block per SM would only leave
        # fewer clusters room (an H100 holds 7 of 16 blocks that way against 14 at two per SM)
        if self.dependent_launch and math.prod(launch.cluster) == 1:
            smem = self._spread_shared(func, launch.name, math.prod(grid), math.prod(block), smem)
        what = f"launch of {launch.name} (grid {grid}, block {block}, smem {smem})"
        if not self.dependent_launch:
            check(cu.cuLaunchKernel(func, *grid, *block, smem, stream, ctypes.addressof(argv), 0), what)
            return
        config = cu.CUlaunchConfig()
        config.gridDimX, config.gridDimY, config.gridDimZ = grid
        config.blockDimX, config.blockDimY, config.blockDimZ = block
        config.sharedMemBytes = smem
        config.hStream = stream
        config.attrs = self._launch_attrs
        config.numAttrs = len(self._launch_attrs)
        check(cu.cuLaunchKernelEx(config, func, ctypes.addressof(argv), 0), what)

    def allow_shared(self, func: Any, name: str, smem: int) -> None:
        """Opt `func` in to `smem` bytes of dynamic shared memory where that is past the default limit."""
        if smem > _STATIC_SMEM_LIMIT and self._smem_raised.get(name, 0) < smem:
            attr = _driver().CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
            check(_driver().cuFuncSetAttribute(func, attr, smem), f"cuFuncSetAttribute({name}, {smem} B)")
            self._smem_raised[name] = smem

    def _allow_non_portable(self, func: Any, name: str) -> None:
        """Opt `func` in to clusters of more than 8 blocks (cluster.py); a device without them refuses here."""
        if name not in self._non_portable:
            attr = _driver().CUfunction_attribute.CU_FUNC_ATTRIBUTE_NON_PORTABLE_CLUSTER_SIZE_ALLOWED
            check(_driver().cuFuncSetAttribute(func, attr, 1), f"cuFuncSetAttribute({name}, non-portable cluster size)")
            self._non_portable.add(name)

    def _spread_shared(self, func: Any, name: str, blocks: int, threads: int, smem: int) -> int:
        """The dynamic shared memory to launch `name` with as a dependent (placement.py), checked against the
        driver's occupancy calculator."""
        from dflash_compiler.runtime.placement import spread_dynamic_shared

        key = (name, blocks, threads, smem)
        if key not in self._spread:
            assert self._sm is not None
            cu = _driver()
            occupancy = cu.cuOccupancyMaxActiveBlocksPerMultiprocessor
            per_sm = int(check(occupancy(func, threads, smem), f"occupancy of {name}"))
            static_attr = cu.CUfunction_attribute.CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES
            static = int(check(cu.cuFuncGetAttribute(static_attr, func), f"static shared memory of {name}"))
            padded = spread_dynamic_shared(blocks, per_sm, static, smem, self._sm)
            if padded != smem:
                self.allow_shared(func, name, padded)
                share, got = self._sm.fair_share(blocks), int(check(occupancy(func, threads, padded), name))
                if got != share:
                    raise CudaError(
                        f"{name}: {padded} B of dynamic shared memory were to let {share} of its {blocks} blocks "
                        f"share an SM; the driver's occupancy calculator says {got}"
                    )
            self._spread[key] = padded
        return self._spread[key]


def _sm_limits() -> Any:
    """The current device's SM count and shared-memory limits (placement.SmLimits)."""
    from dflash_compiler.runtime.placement import SmLimits

    cu = _driver()
    attr = cu.CUdevice_attribute
    device = check(cu.cuCtxGetDevice(), "cuCtxGetDevice")

    def get(which: Any) -> int:
        return int(check(cu.cuDeviceGetAttribute(which, device), f"cuDeviceGetAttribute({which})"))

    return SmLimits(
        count=get(attr.CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT),
        shared_per_sm=get(attr.CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_MULTIPROCESSOR),
        reserved_per_block=get(attr.CU_DEVICE_ATTRIBUTE_RESERVED_SHARED_MEMORY_PER_BLOCK),
        max_dynamic_per_block=get(attr.CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN),
    )


def _dependent_attribute() -> Any:
    """The launch attribute that lets a kernel start before the previous one on its stream has finished."""
    cu = _driver()
    attr = cu.CUlaunchAttribute()
    attr.id = cu.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
    attr.value.programmaticStreamSerializationAllowed = 1
    return attr


class Stream:
    """A non-blocking stream (CUDA graphs are captured from one; the legacy default stream cannot be)."""

    def __init__(self) -> None:
        cu = _driver()
        self.handle = check(cu.cuStreamCreate(cu.CUstream_flags.CU_STREAM_NON_BLOCKING), "cuStreamCreate")

    def synchronize(self) -> None:
        check(_driver().cuStreamSynchronize(self.handle), "cuStreamSynchronize")

    def destroy(self) -> None:
        check(_driver().cuStreamDestroy(self.handle), "cuStreamDestroy")


class CudaGraph:
    """A launch sequence captured once from a stream and replayed with one `cuGraphLaunch`.

    Kernel arguments are captured by value, so what changes between replays must live in device buffers
    the kernels read (lengths, positions, page tables), not in scalar arguments.
    """

    def __init__(self, stream: Stream, record: Callable[[Any], None]) -> None:
        cu = _driver()
        check(
            cu.cuStreamBeginCapture(stream.handle, cu.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_THREAD_LOCAL),
            "cuStreamBeginCapture",
        )
        try:
            record(stream.handle)
        finally:
            graph = check(cu.cuStreamEndCapture(stream.handle), "cuStreamEndCapture")
        self._graph = graph
        self.handle = check(cu.cuGraphInstantiate(graph, 0), "cuGraphInstantiate")

    def launch(self, stream: Stream) -> None:
        check(_driver().cuGraphLaunch(self.handle, stream.handle), "cuGraphLaunch")

    def destroy(self) -> None:
        cu = _driver()
        check(cu.cuGraphExecDestroy(self.handle), "cuGraphExecDestroy")
        check(cu.cuGraphDestroy(self._graph), "cuGraphDestroy")
