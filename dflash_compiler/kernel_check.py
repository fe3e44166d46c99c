"""Check built kernels on a GPU against their specs' numpy references, and time them.

The build box (TVM, no GPU) writes a *check bundle*: the cubin, the kernel table, the kernel specs and the
size cases to run. The GPU box (no TVM) loads it; for every case the spec samples inputs, the kernels run
from the table, and every written parameter is compared with the spec's numpy reference. The same run
times each kernel with CUDA events and measures the device-to-device copy bandwidth, the yardstick of a
memory-bound kernel. Only numpy, ml_dtypes, pydantic and cuda-python are needed on the GPU box.
"""

from __future__ import annotations

import json
import pickle
import shutil
import statistics
import tempfile
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from dflash_compiler.codegen import HostFunction
from dflash_compiler.ir.graph import eval_dim
from dflash_compiler.plans import dtype_bytes
from dflash_compiler.runtime.cuda import CudaGraph, Device, EventTimer, Module, Stream
from dflash_compiler.runtime.expr import evaluate
from dflash_compiler.schedules.base import KernelSpec
from dflash_compiler.schedules.check import max_relative_error, mismatches

_FILES = ("kernels.cubin", "kernels.cu", "table.json", "specs.pkl", "cases.json")


@dataclass(frozen=True)
class CheckCase:
    """One kernel at one set of sizes, with a label saying where the sizes come from."""

    kernel: str
    sizes: Mapping[str, int]
    label: str = ""


@dataclass
class CheckBundle:
    arch: str
    cubin: bytes
    functions: dict[str, HostFunction]
    specs: dict[str, KernelSpec]
    cases: list[CheckCase]


@dataclass
class CheckResult:
    case: CheckCase
    problems: list[str]
    max_rel_error: float
    median_us: float = float("nan")
    bytes_moved: int = 0
    samples_us: list[float] = field(default_factory=list)

    @property
    def gbps(self) -> float:
        return self.bytes_moved / (self.median_us * 1e-6) / 1e9 if self.median_us > 0 else float("nan")


# ------------------------------------------------------------------------------------------ build side


def cases_from_plans(plans: Iterable[object], dims: Sequence[tuple[str, Mapping[str, int]]]) -> list[CheckCase]:
    """Every distinct (kernel, sizes) the plans' calls take at each labelled binding of the phase dims."""
    seen: dict[tuple[str, tuple[tuple[str, int], ...]], CheckCase] = {}
    for plan in plans:
        for call in plan.calls:  # type: ignore[attr-defined]
            for label, binding in dims:
                sizes = {var: eval_dim(expr, binding) for var, expr in call.sizes}
                if any(v <= 0 for v in sizes.values()):
                    continue  # a binding for the other phase (no context rows in a propose step)
                key = (call.kernel, tuple(sorted(sizes.items())))
                seen.setdefault(key, CheckCase(call.kernel, sizes, label))
    return list(seen.values())


def write_bundle(
    directory: Path, arch: str, cubin: bytes, cuda: object, specs: Mapping[str, KernelSpec], cases: Sequence[CheckCase]
) -> Path:
    """Write a check bundle (temp dir, then rename: never half-written)."""
    directory = Path(directory)
    directory.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{directory.name}.", dir=directory.parent))
    try:
        (tmp / "kernels.cubin").write_bytes(cubin)
        (tmp / "kernels.cu").write_text(cuda.source)  # type: ignore[attr-defined]
        table = {name: fn.model_dump(mode="json") for name, fn in cuda.functions.items()}  # type: ignore[attr-defined]
        (tmp / "table.json").write_text(json.dumps({"arch": arch, "functions": table}, indent=1, sort_keys=True))
        (tmp / "specs.pkl").write_bytes(pickle.dumps(dict(specs)))
        payload = [{"kernel": c.kernel, "sizes": dict(c.sizes), "label": c.label} for c in cases]
        (tmp / "cases.json").write_text(json.dumps(payload, indent=1))
        if directory.exists():
            shutil.rmtree(directory)
        tmp.rename(directory)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return directory


def load_bundle(directory: Path) -> CheckBundle:
    directory = Path(directory)
    missing = [f for f in _FILES if not (directory / f).is_file()]
    if missing:
        raise FileNotFoundError(f"{directory}: not a kernel check bundle, missing {', '.join(missing)}")
    table = json.loads((directory / "table.json").read_text())
    functions = {name: HostFunction.model_validate(fn) for name, fn in table["functions"].items()}
    specs = pickle.loads((directory / "specs.pkl").read_bytes())  # written by write_bundle on the build box
    cases = [
        CheckCase(c["kernel"], c["sizes"], c.get("label", ""))
        for c in json.loads((directory / "cases.json").read_text())
    ]
    return CheckBundle(table["arch"], (directory / "kernels.cubin").read_bytes(), functions, specs, cases)


# -------------------------------------------------------------------------------------------- GPU side


def copy_bandwidth(device: Device, nbytes: int = 1 << 30, repeats: int = 20) -> float:
    """Device-to-device copy bandwidth in bytes/s (bytes read + bytes written, median of `repeats`)."""
    src, dst = device.alloc(nbytes), device.alloc(nbytes)
    try:
        device.copy(dst, src, nbytes)
        times = []
        for _ in range(repeats):
            with EventTimer() as timer:
                device.copy(dst, src, nbytes)
            times.append(timer.elapsed_ms())
        return 2 * nbytes / (statistics.median(times) * 1e-3)
    finally:
        device.free(src)
        device.free(dst)


def run_case(
    device: Device,
    module: Module,
    function: HostFunction,
    spec: KernelSpec,
    case: CheckCase,
    repeats: int = 30,
    seed: int = 0,
) -> CheckResult:
    """Sample, launch every kernel of the function, compare with numpy; then time `repeats` launches."""
    sizes = dict(case.sizes)
    arrays = spec.sample(np.random.default_rng(seed), sizes)
    pointers = {name: device.upload(a) for name, a in arrays.items()}
    for ws in function.workspaces:
        count = int(np.prod([evaluate(d, sizes) for d in ws.shape]))
        pointers[ws.name] = device.alloc(count * dtype_bytes(ws.dtype))
        device.zero(pointers[ws.name], count * dtype_bytes(ws.dtype))  # as the runtime's (executor.py)
    try:

        def launch_all(stream: object = 0) -> None:
            for launch in function.launches(sizes):
                module.launch(launch, pointers, sizes, stream)

        launch_all()
        device.synchronize()
        got = {
            p.name: device.download(pointers[p.name], arrays[p.name].shape, arrays[p.name].dtype)
            for p in spec.params()
            if p.written
        }
        ref = spec.reference({k: v.copy() for k, v in arrays.items()})
        result = CheckResult(case, mismatches(spec, got, ref, arrays), max_relative_error(spec, got, ref))
        if repeats:
            result.samples_us = time_launches(device, launch_all, repeats)
            result.median_us = statistics.median(result.samples_us)
            result.bytes_moved = bytes_moved(spec, sizes, arrays)
        return result
    finally:
        for pointer in pointers.values():
            device.free(pointer)


def time_launches(
    device: Device, record: Callable[[Any], None], repeats: int, flush_bytes: int = 256 << 20
) -> list[float]:
    """µs of one launch sequence (captured in a CUDA graph), cold: the L2 is flushed before each replay.

    Each replay is queued behind a memset of `flush_bytes` (several times any L2), so the timed work
    starts from DRAM and the host's launch latency hides behind the memset.
    """
    stream = Stream()
    graph = CudaGraph(stream, record)
    flush = device.alloc(flush_bytes)
    try:
        graph.launch(stream)  # warm: module load, first-touch
        samples = []
        for _ in range(repeats):
            device.memset_async(flush, flush_bytes, stream)
            with EventTimer(stream.handle) as timer:
                graph.launch(stream)
            samples.append(timer.elapsed_ms() * 1e3)
        return samples
    finally:
        stream.synchronize()
        device.free(flush)
        graph.destroy()
        stream.destroy()


def bytes_moved(spec: KernelSpec, sizes: Mapping[str, int], arrays: Mapping[str, np.ndarray]) -> int:
    """DRAM bytes one call must move at least: the spec's own figure, else every parameter once."""
    own = getattr(spec, "bytes_moved", None)
    if callable(own):
        return int(own(sizes))
    return int(sum(a.nbytes for a in arrays.values()))


def run_bundle(
    bundle: CheckBundle, repeats: int = 30, only: Iterable[str] = ()
) -> tuple[list[CheckResult], float, str]:
    """Every case of the bundle on GPU 0: (results, copy bandwidth bytes/s, device name)."""
    device = Device()
    module = Module(bundle.cubin)
    wanted = set(only)
    results = []
    for case in bundle.cases:
        if wanted and case.kernel not in wanted:
            continue
        spec = bundle.specs[case.kernel]
        results.append(run_case(device, module, bundle.functions[case.kernel], spec, case, repeats))
    return results, copy_bandwidth(device), device.name
